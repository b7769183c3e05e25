// LowerPool: one helper thread that takes chunks of a lowering pass (SchedulerCore::lower_all) next to the caller.
//
// The caller wakes the helper when a step begins (step() runs for tens of microseconds, enough for a sleeping thread
// to be scheduled), the helper then spins for a short while waiting for the lowering's chunks. The caller never waits
// for the helper to arrive: it takes chunks itself until none is left, so a late or busy helper only costs the
// parallelism. Chunks are claimed from one 64-bit counter (job id << 32 | next chunk), so a helper that reads the
// counter across two jobs can never run a chunk of the wrong job.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace nanocp::sched {

class LowerPool {
 public:
  LowerPool() : thread_([this] { loop(); }) {}
  LowerPool(const LowerPool&) = delete;
  LowerPool& operator=(const LowerPool&) = delete;
  ~LowerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    stopping_.store(true, std::memory_order_release);
    cv_.notify_one();
    thread_.join();
  }

  // A lowering is coming: the helper leaves its sleep and spins for up to kSpin.
  void wake() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++wake_seq_;
    }
    cv_.notify_one();
  }

  // fn(chunk) for every chunk in [0, chunks), on the caller and the helper; returns when all are done and rethrows
  // the first exception a chunk raised.
  void run(uint32_t chunks, const std::function<void(uint32_t)>& fn) {
    const uint64_t id = ++job_id_counter_;
    job_fn_.store(&fn, std::memory_order_relaxed);
    job_chunks_.store(chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    job_id_.store(id, std::memory_order_relaxed);
    next_.store(id << 32, std::memory_order_release);  // publishes the job
    work();
    while (done_.load(std::memory_order_acquire) < chunks) cpu_relax();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static constexpr auto kSpin = std::chrono::milliseconds(2);

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // Claim and run chunks of the current job until none is left.
  void work() {
    for (;;) {
      const uint64_t claim = next_.fetch_add(1, std::memory_order_acq_rel);
      const uint64_t id = claim >> 32;
      const uint32_t chunk = uint32_t(claim & 0xffffffffu);
      if (id != job_id_.load(std::memory_order_acquire) || chunk >= job_chunks_.load(std::memory_order_acquire))
        return;
      try {
        (*job_fn_.load(std::memory_order_acquire))(chunk);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void loop() {
    uint64_t seen_wake = 0, seen_next = next_.load();
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || wake_seq_ != seen_wake; });
        if (stop_) return;
        seen_wake = wake_seq_;
      }
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (!stopping_.load(std::memory_order_acquire)) {
        const uint64_t next = next_.load(std::memory_order_acquire);
        if ((next >> 32) != (seen_next >> 32)) {  // a new job
          seen_next = next;
          work();
          break;
        }
        if (std::chrono::steady_clock::now() > until) break;
        for (int k = 0; k < 16; ++k) cpu_relax();
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t wake_seq_ = 0;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};
  uint64_t job_id_counter_ = 0;                      // caller only
  std::atomic<uint64_t> job_id_{0};                  // the current job
  std::atomic<uint64_t> next_{0};                    // job id << 32 | next chunk to claim
  std::atomic<uint32_t> job_chunks_{0};
  std::atomic<const std::function<void(uint32_t)>*> job_fn_{nullptr};
  std::atomic<uint32_t> done_{0};
  std::mutex error_mu_;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts after every member above is constructed
};

}  // namespace nanocp::sched
