// Page table of the C++ core: per-instance stacks of free frames. A page is named by (instance, frame); each shard
// keeps its frames in token order, which is everything a view or a routing table exposes. The reference's logical
// page ids (control_plane/page_table.py) never reach any output, so they are not kept here; the frame stacks follow
// the reference exactly: the lowest frame comes first on a fresh instance, frees go back in reverse (LIFO reuse).
#pragma once
#include <cstdint>
#include <vector>

namespace nanocp::sched {

class PageTable {
 public:
  PageTable(int num_instances, int32_t frames_per_instance) : free_(num_instances) {
    for (auto& stack : free_) {
      stack.resize(frames_per_instance);
      for (int32_t f = 0; f < frames_per_instance; ++f) stack[f] = frames_per_instance - 1 - f;
    }
  }

  int32_t free_frames(int instance) const { return int32_t(free_[instance].size()); }

  // Append n frames of `instance` to `frames`; the caller checked there is room.
  void alloc(int instance, int64_t n, std::vector<int32_t>& frames) {
    auto& stack = free_[instance];
    frames.insert(frames.end(), stack.rbegin(), stack.rbegin() + n);
    stack.resize(stack.size() - size_t(n));
  }

  // Return a shard's frames, last first (the reference frees in reverse token order).
  void free(int instance, const std::vector<int32_t>& frames) {
    free_[instance].insert(free_[instance].end(), frames.rbegin(), frames.rend());
  }

  const std::vector<int32_t>& free_stack(int instance) const { return free_[instance]; }

 private:
  std::vector<std::vector<int32_t>> free_;  // per instance: free frames, next to allocate at the back
};

}  // namespace nanocp::sched
