// The Work handle every asynchronous collective returns: completed once by the progress
// thread, waited on by any number of callers. A waiter polls for a bounded spin budget before
// it sleeps, because waking a sleeping thread costs more than a small collective.
//
// Thread-safety: Complete is called once, by the thread that ran the collective; Wait and Done
// from any thread.
#ifndef COLLECTIVES_SRC_CORE_WORK_H_
#define COLLECTIVES_SRC_CORE_WORK_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "collectives/communication.h"
#include "collectives/errors.h"

namespace collectives::core {

class WorkState final : public Work {
 public:
  explicit WorkState(std::chrono::microseconds spin) : spin_(spin) {}

  void Wait() override;
  bool Done() const override { return done_.load(std::memory_order_acquire); }

  // Marks the work complete, failed with `error` when it has one, and wakes the waiters.
  void Complete(const std::optional<Error>& error);

 private:
  const std::chrono::microseconds spin_;
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Error> error_;  // guarded by mu_; written before done_ is set
};

// Polls `ready` for up to `spin`; true if it became ready. It does not yield: under load,
// sched_yield can hand the core to an unrelated busy process for a whole time slice (round trips
// went from ~9 us to 1-3 ms), while the spin itself is bounded by the budget.
template <typename Ready>
bool SpinUntil(std::chrono::microseconds spin, Ready&& ready) {
  if (spin.count() <= 0) return ready();
  const auto until = std::chrono::steady_clock::now() + spin;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) return ready();
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_WORK_H_
