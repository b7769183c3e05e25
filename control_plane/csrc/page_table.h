// Page table of the C++ core: per-instance stacks of free frames. A page is named by (instance, frame); each shard
// keeps its frames in token order, which is everything a view or a routing table exposes. The reference's logical
// page ids (control_plane/page_table.py) never reach any output, so they are not kept here; the frame stacks follow
// the reference exactly: the lowest frame comes first on a fresh instance, frees go back in reverse (LIFO reuse).
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace nanocp::sched {

// A shard's frames in token order: a growable int32 array in 16 bytes (32-bit size and capacity), so a request's
// first shard fits the request's first cache line next to its MoE binding.
class FrameList {
 public:
  int32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int32_t* data() const { return data_.get(); }
  const int32_t* begin() const { return data_.get(); }
  const int32_t* end() const { return data_.get() + size_; }
  int32_t operator[](int32_t k) const { return data_[k]; }
  void clear() { size_ = 0; }
  // Empty; storage past `keep` frames goes back to the heap (a reused request slot would otherwise keep the largest
  // list it ever held, and the heap would grow onto fresh pages for as long as the ratchet goes on).
  void clear_and_trim(int32_t keep) {
    size_ = 0;
    if (cap_ > keep) {
      data_.reset();
      cap_ = 0;
    }
  }

  // Room for n more frames; returns where they go (the caller writes all n). The capacity grows to a power of two
  // (at least kMinCapacity) and is kept when the list is cleared: a request slot's list, reused by later requests,
  // soon holds any prompt without reallocating.
  int32_t* extend(int32_t n) {
    if (size_ + n > cap_) {
      int64_t cap = kMinCapacity;
      while (cap < int64_t(size_) + n) cap *= 2;
      cap = std::min<int64_t>(cap, INT32_MAX);
      std::unique_ptr<int32_t[]> grown(new int32_t[size_t(cap)]);
      if (size_) std::memcpy(grown.get(), data_.get(), sizeof(int32_t) * size_t(size_));
      data_ = std::move(grown);
      cap_ = int32_t(cap);
    }
    int32_t* out = data_.get() + size_;
    size_ += n;
    return out;
  }

 private:
  static constexpr int64_t kMinCapacity = 32;
  std::unique_ptr<int32_t[]> data_;
  int32_t size_ = 0, cap_ = 0;
};

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
  void alloc(int instance, int64_t n, FrameList& frames) {
    auto& stack = free_[instance];
    std::copy(stack.rbegin(), stack.rbegin() + n, frames.extend(int32_t(n)));
    stack.resize(stack.size() - size_t(n));
  }

  // Return a shard's frames, last first (the reference frees in reverse token order).
  void free(int instance, const FrameList& frames) {
    auto& stack = free_[instance];
    const size_t top = stack.size();
    stack.resize(top + size_t(frames.size()));
    std::reverse_copy(frames.begin(), frames.end(), stack.begin() + ptrdiff_t(top));
  }

  const std::vector<int32_t>& free_stack(int instance) const { return free_[instance]; }

 private:
  std::vector<std::vector<int32_t>> free_;  // per instance: free frames, next to allocate at the back
};

// Block-table store slots of one instance (reference.py SlotAllocator): the most recently freed slot first, else
// the lowest never handed out, so the slots in use stay below the instance's peak number of shards.
class SlotAllocator {
 public:
  int32_t alloc() {
    if (free_.empty()) return high_++;
    const int32_t slot = free_.back();
    free_.pop_back();
    return slot;
  }
  void release(int32_t slot) { free_.push_back(slot); }
  int32_t high() const { return high_; }
  const std::vector<int32_t>& free_list() const { return free_; }

 private:
  std::vector<int32_t> free_;
  int32_t high_ = 0;
};

}  // namespace nanocp::sched
