// The Work handle every asynchronous collective returns: completed once by the progress
// thread, waited on by any number of callers. A waiter polls for a bounded spin budget, then
// polls up to kWaitYieldPolls times with a sched_yield between polls (within the yield budget),
// before it sleeps: waking a sleeping thread costs more than a small collective.
//
// The yields matter where threads outnumber cores (no spin there): a sleeping waiter's wake-up
// takes a core from a progress thread, its own or a peer's, while a yielding one hands its core
// to them. A count of yields bounds them better than a time budget, under which every waiter
// yields to the others (see docs/tuning.md).
//
// Thread-safety: Complete is called once, by the thread that ran the collective; Wait and Done
// from any thread.
#ifndef COLLECTIVES_SRC_CORE_WORK_H_
#define COLLECTIVES_SRC_CORE_WORK_H_

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "collectives/communication.h"
#include "collectives/errors.h"

namespace collectives::core {

class WorkState;

// What may run a work's call on the thread that waits for it, rather than hand the call to
// another thread and wait (the call queue, while the call has not started): a call issued
// async and waited on at once then costs what a blocking call does.
class WorkHelper {
 public:
  virtual ~WorkHelper() = default;
  // Called with the work's lock held, so the helper is alive (it completes its works, which
  // unsets it, before it goes): true registers this thread as a helper, which keeps the helper
  // alive until Leave; false when it stops.
  virtual bool Enter() = 0;
  // Runs `work`'s call on this thread if it can right now (it has not started and nothing runs);
  // else returns at once. Between Enter and Leave.
  virtual void RunOnWaiter(WorkState& work) = 0;
  virtual void Leave() = 0;
};

class WorkState final : public Work {
 public:
  WorkState(std::chrono::microseconds spin, std::chrono::microseconds yield)
      : spin_(spin), yield_(yield) {}

  void Wait() override;
  bool Done() const override { return done_.load(std::memory_order_acquire); }

  // Marks the work complete, failed with `error` when it has one, and wakes the waiters.
  void Complete(const std::optional<Error>& error);
  // Wait offers `helper` to run the call first. Set before the work is shared; Complete unsets it.
  void SetHelper(WorkHelper* helper) { helper_ = helper; }

 private:
  const std::chrono::microseconds spin_;
  const std::chrono::microseconds yield_;
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Error> error_;  // guarded by mu_; written before done_ is set
  WorkHelper* helper_ = nullptr;  // guarded by mu_; may be null
};

// Polls `ready` for up to `spin`; true if it became ready. It does not yield: under load,
// sched_yield can hand the core to an unrelated busy process for a whole time slice, far longer
// than a small round trip, while the spin itself is bounded by the budget.
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

inline constexpr int kWaitYieldPolls = 16;

// Polls `ready` with a sched_yield between polls, at most `polls` times and for at most
// `budget`; true if it became ready. For waits on work in flight only
// (CommunicationOptions::yield_us bounds it, and 0 turns it off): a thread that yields gives its
// core to whatever else is runnable, an unrelated busy thread included.
template <typename Ready>
bool YieldUntil(std::chrono::microseconds budget, int polls, Ready&& ready) {
  if (budget.count() <= 0 || polls <= 0) return ready();
  const auto until = std::chrono::steady_clock::now() + budget;
  for (int i = 0; i < polls; ++i) {
    if (ready()) return true;
    if (std::chrono::steady_clock::now() >= until) break;
    sched_yield();
  }
  return ready();
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_WORK_H_
