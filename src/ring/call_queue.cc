// The call queue of a RING or AUTO communicator (see call_queue.h).
#include "src/ring/call_queue.h"

#include <exception>
#include <string>
#include <utility>

namespace collectives::ring {
namespace {
// How long the woken progress thread leaves a queued call to a waiter that may run it itself.
constexpr std::chrono::microseconds kWaiterGrace{20};
constexpr int kWaiterGracePolls = 8;
// A lone call on an idle queue wakes no thread (see Submit) while calls come faster than one
// per kPollTick: the progress thread then looks at the queue every tick instead of sleeping
// until notified, and so takes a call that no one waits on within a tick. A tick with no new
// call sends it back to sleep, and the next Submit wakes it. Either way it wakes at most once
// per call and at most once per tick: a wake-up per call costs most where calls are frequent
// and small, a tick where they are rare (one per training step).
constexpr std::chrono::microseconds kPollTick{1000};
}  // namespace

Error Stopped(const Error& broken, const core::CallTag& tag, const char* what) {
  std::string message = broken.message();
  message += " (";
  message += tag.ToString();
  message += ' ';
  message += what;
  message += ')';
  return Error(broken.code(), message);
}

CallQueue::CallQueue(int rank, std::chrono::microseconds handoff_spin,
                     std::chrono::microseconds yield, Runner run, Breaker on_break)
    : rank_(rank),
      handoff_spin_(handoff_spin),
      yield_(yield),
      run_(std::move(run)),
      on_break_(std::move(on_break)) {
  thread_ = std::thread([this] { Run(); });
}

CallQueue::~CallQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // A waiter may still be running a call it took (RunOnWaiter): the calls use the
  // communicator's members, which go after this.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return helpers_ == 0; });
}

bool CallQueue::Enter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return false;
  ++helpers_;
  return true;
}

void CallQueue::Leave() {
  // Only the destructor waits for the helpers, and waking the progress thread for nothing
  // costs a context switch. Notified under the lock: once the destructor sees no helper it
  // destroys cv_.
  std::lock_guard<std::mutex> lock(mu_);
  --helpers_;
  if (stopping_ && helpers_ == 0) cv_.notify_all();
}

void CallQueue::RunOnWaiter(core::WorkState& work) {
  Call call;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || queue_.empty() || queue_.front().work.get() != &work) return;
    call = std::move(queue_.front());
    queue_.pop_front();
    queued_.fetch_sub(1, std::memory_order_release);
    busy_ = true;
  }
  const std::optional<Error> failure = RunCall(call);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    wake = !queue_.empty() || stopping_;
  }
  if (wake) cv_.notify_all();
  call.work->Complete(failure);
}

void CallQueue::Run() {
  const auto ready = [this] {
    return (stopping_ && queue_.empty()) || (!queue_.empty() && !busy_);
  };
  for (;;) {
    Call call;
    {
      // Poll briefly before sleeping: the next call of a training step usually follows at once.
      core::SpinUntil(handoff_spin_, [this] {
        return queued_.load(std::memory_order_acquire) > 0 ||
               stopping_.load(std::memory_order_relaxed);
      });
      std::unique_lock<std::mutex> lock(mu_);
      for (bool waited_for_waiter = false;; waited_for_waiter = true) {
        while (!ready()) {
          if (std::chrono::steady_clock::now() - last_submit_ < kPollTick) {
            cv_.wait_for(lock, kPollTick);
          } else {
            asleep_ = true;
            cv_.wait(lock, ready);
            asleep_ = false;
          }
        }
        if (queue_.empty()) return;  // stopping, and every queued call has run
        if (waited_for_waiter || stopping_ || queue_.size() > 1) break;
        // A caller that waits at once runs the call itself (RunOnWaiter), with no hand-off to
        // this thread and back: it gets a moment to come before this thread takes a lone call
        // (a queue of several runs at once: their callers are not waiting on the first).
        lock.unlock();
        core::YieldUntil(kWaiterGrace, kWaiterGracePolls,
                         [this] { return queued_.load(std::memory_order_acquire) == 0; });
        lock.lock();
      }
      call = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_release);
      busy_ = true;
    }
    const std::optional<Error> failure = RunCall(call);
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    call.work->Complete(failure);
  }
}

std::optional<Error> CallQueue::RunCall(const Call& call) {
  // Every earlier call has completed, and this thread took busy_ after the last one gave it
  // back under mu_, so the gate sees what they wrote (the list check's answer among them). The
  // number is taken only by a call that runs, in the order they run. On a broken communicator
  // the call fails as every later call does, whatever its gate says.
  try {
    const bool run = !call.prepared.go || call.prepared.go();
    core::CallTag tag;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return Stopped(*broken_, TakeTag(call.prepared), "did not run");
      if (!run) return std::nullopt;
      tag = TakeTag(call.prepared);
    }
    return run_(tag, call.prepared.body, call.timeout);
  } catch (const Error& e) {  // from the gate, or from building an error
    return Break(e);
  } catch (const std::exception& e) {
    return Break(Error(ErrorCode::kInternal, "rank " + std::to_string(rank_) + ": " +
                                                 call.prepared.descriptor.ToString() + ": " +
                                                 e.what()));
  }
}

void CallQueue::RunBlocking(PreparedCall prepared, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (broken_) throw Stopped(*broken_, TakeTag(prepared), "did not run");
  // A gated call goes through the queue, where RunCall reads its gate.
  if (busy_ || !queue_.empty() || prepared.go) {
    lock.unlock();
    Submit(std::move(prepared), timeout)->Wait();
    return;
  }
  const core::CallTag tag = TakeTag(prepared);
  busy_ = true;
  lock.unlock();
  const std::optional<Error> failure = run_(tag, prepared.body, timeout);
  lock.lock();
  busy_ = false;
  const bool wake = !queue_.empty();
  lock.unlock();
  if (wake) cv_.notify_all();
  if (failure) throw *failure;
}

core::CallTag CallQueue::TakeTag(const PreparedCall& prepared) {
  return core::CallTag{prepared.collective ? next_seq_++ : core::kPointToPointCall,
                       prepared.descriptor};
}

Error CallQueue::Break(const Error& error, bool* first_error) {
  Error first = error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_error != nullptr) *first_error = !broken_;
    if (broken_) {
      first = *broken_;
    } else {
      broken_ = error;
    }
  }
  on_break_(first);
  return first;
}

std::optional<Error> CallQueue::broken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

std::shared_ptr<Work> CallQueue::Submit(PreparedCall prepared, std::chrono::milliseconds timeout) {
  auto work = std::make_shared<core::WorkState>(handoff_spin_, yield_);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) {
      work->Complete(Stopped(*broken_, TakeTag(prepared), "did not run"));
      return work;
    }
    // The sequence number is taken when the call runs (RunCall): calls run in the order they
    // are issued, and a gated call that does not run takes none.
    work->SetHelper(this);
    queue_.push_back(Call{std::move(prepared), work, timeout});
    queued_.fetch_add(1, std::memory_order_release);
    last_submit_ = std::chrono::steady_clock::now();
    // Waking the progress thread costs a context switch, on each rank, which where ranks
    // outnumber cores is most of a small call's time; so a lone call on an idle queue wakes it
    // only where it sleeps until woken (calls came slower than its tick). Its caller, waiting at
    // once, runs it (RunOnWaiter); otherwise the polling progress thread takes it within a tick
    // (Run). A call queued behind another is the progress thread's to run at once (its waiter
    // cannot run it), unless a running one is still to finish: that thread wakes it when it does.
    wake = asleep_ || (!busy_ && queue_.size() > 1);
  }
  if (wake) cv_.notify_one();
  return work;
}

}  // namespace collectives::ring
