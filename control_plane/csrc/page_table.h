// Global page table: logical page id -> (instance, frame), with per-instance free-frame stacks.
// Mirrors control_plane/page_table.py exactly: stacks pop the lowest id first on a fresh table, frees go back in
// reverse so a free right after an alloc restores the previous stacks (LIFO reuse).
#pragma once
#include <cstdint>
#include <vector>

namespace nanocp::sched {

class PageTable {
 public:
  PageTable(int num_instances, int32_t frames_per_instance)
      : free_frames_(num_instances), page_instance_(size_t(num_instances) * frames_per_instance, -1),
        page_frame_(size_t(num_instances) * frames_per_instance, -1) {
    for (auto& stack : free_frames_) {
      stack.resize(frames_per_instance);
      for (int32_t f = 0; f < frames_per_instance; ++f) stack[f] = frames_per_instance - 1 - f;
    }
    const int32_t total = int32_t(page_instance_.size());
    free_logical_.resize(total);
    for (int32_t p = 0; p < total; ++p) free_logical_[p] = total - 1 - p;
  }

  int32_t free_frames(int instance) const { return int32_t(free_frames_[instance].size()); }

  // Append n pages on `instance` to (logical, frames); the caller checked there is room.
  void alloc(int instance, int64_t n, std::vector<int32_t>& logical, std::vector<int32_t>& frames) {
    auto& stack = free_frames_[instance];
    for (int64_t k = 0; k < n; ++k) {
      const int32_t frame = stack.back();
      stack.pop_back();
      const int32_t page = free_logical_.back();
      free_logical_.pop_back();
      page_instance_[page] = instance;
      page_frame_[page] = frame;
      logical.push_back(page);
      frames.push_back(frame);
    }
  }

  // Release pages in reverse order (the reference's LIFO rule).
  void free(const std::vector<int32_t>& logical) {
    for (size_t k = logical.size(); k-- > 0;) {
      const int32_t page = logical[k];
      free_frames_[page_instance_[page]].push_back(page_frame_[page]);
      free_logical_.push_back(page);
      page_instance_[page] = -1;
      page_frame_[page] = -1;
    }
  }

  int32_t page_instance(int32_t page) const { return page_instance_[page]; }
  int32_t page_frame(int32_t page) const { return page_frame_[page]; }
  const std::vector<int32_t>& free_stack(int instance) const { return free_frames_[instance]; }
  const std::vector<int32_t>& free_logical() const { return free_logical_; }
  size_t total_pages() const { return page_instance_.size(); }

 private:
  std::vector<std::vector<int32_t>> free_frames_;  // per instance, a stack of free frames
  std::vector<int32_t> free_logical_;              // stack of free logical page ids
  std::vector<int32_t> page_instance_;             // [total pages] instance of a logical page, -1 = free
  std::vector<int32_t> page_frame_;                // [total pages] frame of a logical page, -1 = free
};

}  // namespace nanocp::sched
