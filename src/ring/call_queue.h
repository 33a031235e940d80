// The calls of a RING or AUTO communicator in issue order: the queue, the progress thread that
// runs it, the blocking fast path (a blocking call runs on its caller's thread when nothing is
// queued or running, and so does an async call waited on at once), the sequence numbers, and the
// communicator's first error (sticky). What a
// call does, and how it drives the fabric, is the communicator's (RingCommunication): the queue
// hands each call's body to its Runner on the thread that holds the fabric.
//
// Thread-safety: every public method may be called from any thread. One call runs at a time
// (busy_), on the progress thread or on a caller in RunBlocking; the Runner is called on that
// thread, the Breaker on whichever thread breaks the communicator first.
#ifndef COLLECTIVES_SRC_RING_CALL_QUEUE_H_
#define COLLECTIVES_SRC_RING_CALL_QUEUE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "collectives/communication.h"
#include "collectives/errors.h"
#include "src/core/call.h"
#include "src/core/internal_communication.h"
#include "src/core/work.h"
#include "src/ring/algorithms.h"

namespace collectives::ring {

// `broken`, the error that broke the communicator, as the error of a call it stopped: "rank 0:
// the communicator was aborted by its caller (#3 all_reduce(f32, sum, count=7) did not run)".
Error Stopped(const Error& broken, const core::CallTag& tag, const char* what);

// A validated call, ready to run: what every rank must agree on, and what to run.
struct PreparedCall {
  core::CallDescriptor descriptor;
  std::function<void(Context&)> body;
  core::Gate go = {};  // where set, the call runs only if go() says so (core::Gate)
  // false: a point-to-point call (a send or a receive), which only two ranks issue: it takes no
  // number of the collective sequence and runs as core::kPointToPointCall.
  bool collective = true;
};

class CallQueue final : private core::WorkHelper {
 public:
  using Body = std::function<void(Context&)>;
  // Runs `body` as call `tag` within `timeout` on the calling thread, which holds the fabric;
  // returns its failure, if any.
  using Runner = std::function<std::optional<Error>(const core::CallTag& tag, const Body& body,
                                                    std::chrono::milliseconds timeout)>;
  // Breaks whatever a running call waits on (the planner, the fabric) with `first`, the
  // communicator's first error, so that peers learn of it.
  using Breaker = std::function<void(const Error& first)>;

  // `handoff_spin`: how long a thread handing a call over polls for the other side (a waiter in
  // Work::Wait, the idle progress thread watching the queue); `yield`, the waiters' yield budget.
  // Starts the progress thread.
  CallQueue(int rank, std::chrono::microseconds handoff_spin, std::chrono::microseconds yield,
            Runner run, Breaker on_break);
  // Runs every queued call, then stops the progress thread.
  ~CallQueue();
  CallQueue(const CallQueue&) = delete;
  CallQueue& operator=(const CallQueue&) = delete;

  // Queues a call that may take `timeout`; returns its Work. The call starts when its caller
  // waits for it, or within a poll tick of the progress thread (Run), whichever comes first.
  std::shared_ptr<Work> Submit(PreparedCall prepared, std::chrono::milliseconds timeout);
  // Runs a call on the caller's thread when nothing is queued or running (no hand-off to the
  // progress thread and back: that is most of the cost of a small collective); else queues
  // it and waits. Throws the call's Error.
  void RunBlocking(PreparedCall prepared, std::chrono::milliseconds timeout);
  // Records the first error (sticky) and calls the Breaker with it. Returns the first error;
  // sets `*first` to whether that is `error`.
  Error Break(const Error& error, bool* first = nullptr);
  // The first error, if the communicator is broken.
  std::optional<Error> broken() const;

 private:
  struct Call {
    PreparedCall prepared;
    std::shared_ptr<core::WorkState> work;
    std::chrono::milliseconds timeout;  // the communicator's when the call was issued
  };

  // The progress thread: runs queued calls in order until the destructor stops it. While calls
  // come faster than its timer it looks at the queue on that timer rather than sleeping until
  // woken, so that a Submit need not wake it (a wake-up per small call costs more than the call).
  void Run();
  // core::WorkHelper: a thread waiting on a Work runs its call itself when the call is next in
  // the queue and nothing runs (an async call waited on at once), as RunBlocking would have.
  bool Enter() override;
  void RunOnWaiter(core::WorkState& work) override;
  void Leave() override;
  // Runs `call`, taken from the queue by this thread (busy_ set): its gate, its number, its
  // body. Returns its failure, if any; an exception of the gate's breaks the communicator with it.
  std::optional<Error> RunCall(const Call& call);
  // The tag `prepared` runs as: the next number of the sequence for a collective (taken),
  // core::kPointToPointCall for a point-to-point call. Called with mu_ held.
  core::CallTag TakeTag(const PreparedCall& prepared);

  const int rank_;
  const std::chrono::microseconds handoff_spin_;
  const std::chrono::microseconds yield_;
  const Runner run_;
  const Breaker on_break_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Call> queue_;  // guarded by mu_
  uint64_t next_seq_ = 0;   // guarded by mu_
  // Written under mu_; atomic so that the idle progress thread's spin sees the destructor.
  std::atomic<bool> stopping_{false};
  bool busy_ = false;  // guarded by mu_; a thread is running a call on the fabric
  // Guarded by mu_: the progress thread sleeps until notified (a Submit must wake it), and the
  // time of the last Submit (it polls the queue while calls keep coming; see Run).
  bool asleep_ = false;
  std::chrono::steady_clock::time_point last_submit_{};
  int helpers_ = 0;              // guarded by mu_; waiters between Enter and Leave
  std::optional<Error> broken_;  // guarded by mu_; the first error, sticky
  std::atomic<size_t> queued_{0};
  std::thread thread_;
};

}  // namespace collectives::ring

#endif  // COLLECTIVES_SRC_RING_CALL_QUEUE_H_
