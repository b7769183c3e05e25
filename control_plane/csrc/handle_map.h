// HandleMap: request handle (any int64) -> request slot, an open-addressing table with linear probing and
// backward-shift deletion. One flat array of (handle, slot) pairs: a lookup is one or two cache lines where
// std::unordered_map chases a node per entry (finishes and admissions look handles up every step).
#pragma once
#include <cstdint>
#include <vector>

namespace nanocp::sched {

class HandleMap {
 public:
  HandleMap() { entries_.assign(kMinCapacity, Entry{}); }

  size_t size() const { return size_; }

  int32_t find(int64_t handle) const {  // -1 if absent
    for (size_t k = home(handle);; k = (k + 1) & mask()) {
      const Entry& e = entries_[k];
      if (e.slot < 0) return -1;
      if (e.handle == handle) return e.slot;
    }
  }

  void insert(int64_t handle, int32_t slot) {  // the handle must be absent
    if (2 * (size_ + 1) > entries_.size()) grow();
    place(handle, slot);
    ++size_;
  }

  void erase(int64_t handle) {
    size_t hole = home(handle);
    for (;; hole = (hole + 1) & mask()) {
      if (entries_[hole].slot < 0) return;  // absent
      if (entries_[hole].handle == handle) break;
    }
    // Backward shift: pull later entries of the probe run into the hole when their home allows it.
    for (size_t k = (hole + 1) & mask(); entries_[k].slot >= 0; k = (k + 1) & mask()) {
      const size_t want = home(entries_[k].handle);
      if (((k - want) & mask()) >= ((k - hole) & mask())) {
        entries_[hole] = entries_[k];
        hole = k;
      }
    }
    entries_[hole] = Entry{};
    --size_;
  }

 private:
  struct Entry {
    int64_t handle = 0;
    int32_t slot = -1;  // -1: empty
  };
  static constexpr size_t kMinCapacity = 64;

  size_t mask() const { return entries_.size() - 1; }
  size_t home(int64_t handle) const {  // Fibonacci hashing: consecutive handles spread over the table
    return size_t((uint64_t(handle) * 0x9E3779B97F4A7C15ull) >> 32) & mask();
  }
  void place(int64_t handle, int32_t slot) {
    size_t k = home(handle);
    while (entries_[k].slot >= 0) k = (k + 1) & mask();
    entries_[k] = Entry{handle, slot};
  }
  void grow() {
    std::vector<Entry> old(entries_.size() * 2, Entry{});
    old.swap(entries_);
    for (const Entry& e : old)
      if (e.slot >= 0) place(e.handle, e.slot);
  }

  std::vector<Entry> entries_;  // capacity: a power of two, at most half full
  size_t size_ = 0;
};

}  // namespace nanocp::sched
