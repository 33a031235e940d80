// LocalGroup: the persistent replica threads of one worker and their rendezvous.
//
// The barrier. Every arrival increments `arrived_` and marks itself in `present_`; the last one
// resets both, increments `generation_` and wakes the others, who wait for the generation to
// change. While waiting, a replica also wakes (and gives up) when:
//   - the group has failed (first_error_ set): it throws kAborted naming the replica that failed;
//   - a replica that has not arrived has already returned from its function in this Run: the
//     call can never complete, so it throws kMismatch at once instead of waiting out the timeout;
//   - its deadline passes: it throws kTimeout naming the replicas that did not arrive.
// In the last two cases the waiter records its own error as the group's failure first, so that
// the error Run rethrows is the original one, not the kAborted of a replica it woke.
//
// Deadlines. Enter waits `timeout_`: it waits for the other replicas' user code to reach the
// call, which may be arbitrarily late. Step waits twice as long: it separates the phases of a
// call that every replica has entered, which local copies and reductions bound; the longer
// deadline lets an error of the replica that is late (which names its cause) come first, and a
// replica that gave up in the middle of a call could otherwise free buffers that another
// replica is still reading. A phase in which replica 0 runs the cross-worker all-reduce has no
// deadline of its own: the packer issues one collective per bucket, each bounded by the
// communicator's timeout, so a long list may take many timeouts while never stalling; replica 0
// either finishes or fails, and its failure wakes the others.
#include "src/strategy/local_group.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>

#include "collectives/errors.h"
#include "src/core/arguments.h"

namespace collectives::strategy::internal {
std::string WhatOf(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

namespace {

// now + d, without overflowing for very long timeouts.
std::chrono::steady_clock::time_point DeadlineAfter(std::chrono::milliseconds d) {
  return std::chrono::steady_clock::now() + std::min(d, core::kMaxTimeout);
}

}  // namespace

LocalGroup::LocalGroup(int size, std::chrono::milliseconds timeout, std::string who)
    : size_(size),
      timeout_(timeout),
      who_(std::move(who)),
      returned_(static_cast<size_t>(size), 0),
      present_(static_cast<size_t>(size), 0),
      slots_(static_cast<size_t>(size)) {
  if (size < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                who_ + "local group of " + std::to_string(size) + " replicas (need at least 1)");
  }
  try {
    threads_.reserve(static_cast<size_t>(size - 1));
    for (int r = 1; r < size; ++r) threads_.emplace_back([this, r] { WorkerLoop(r); });
  } catch (const std::system_error& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    throw Error(ErrorCode::kSystem, who_ + "cannot start the threads of " +
                                        std::to_string(size) + " local replicas: " + e.what());
  }
}

LocalGroup::~LocalGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

std::string LocalGroup::Describe(const Call& call) {
  return std::string(call.name) + " #" + std::to_string(call.seq);
}

std::string LocalGroup::ReplicaName(int replica) const {
  return who_ + "replica " + std::to_string(replica);
}

void LocalGroup::Run(const std::function<void(int)>& body) {
  std::unique_lock<std::mutex> lock(mu_);
  if (first_error_) {
    std::exception_ptr error = first_error_;
    lock.unlock();
    std::rethrow_exception(error);
  }
  body_ = &body;
  std::fill(returned_.begin(), returned_.end(), 0);
  finished_ = 0;
  ++job_;
  lock.unlock();
  work_cv_.notify_all();

  RunReplica(0);

  lock.lock();
  done_cv_.wait(lock, [&] { return finished_ == size_ - 1; });
  body_ = nullptr;
  if (first_error_) {
    std::exception_ptr error = first_error_;
    lock.unlock();
    std::rethrow_exception(error);
  }
}

void LocalGroup::WorkerLoop(int replica) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || job_ != seen; });
      if (stop_) return;
      seen = job_;
    }
    RunReplica(replica);
  }
}

void LocalGroup::RunReplica(int replica) {
  const std::function<void(int)>* body;
  {
    std::lock_guard<std::mutex> lock(mu_);
    body = body_;
  }
  try {
    (*body)(replica);
  } catch (...) {
    Fail(replica, std::current_exception());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    returned_[replica] = 1;
    if (replica != 0) ++finished_;
  }
  barrier_cv_.notify_all();  // a waiter for this replica can never be met now
  if (replica != 0) done_cv_.notify_one();
}

bool LocalGroup::RecordLocked(int replica, std::exception_ptr error) {
  if (first_error_) return false;
  first_error_ = std::move(error);
  abort_reason_ = ReplicaName(replica) + " failed: " + WhatOf(first_error_);
  barrier_cv_.notify_all();
  return true;
}

void LocalGroup::Fail(int replica, std::exception_ptr error) {
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = RecordLocked(replica, std::move(error));
  }
  if (first) RunFailureHook();
}

void LocalGroup::RunFailureHook() {
  if (!failure_hook_) return;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reason = abort_reason_;
  }
  try {
    failure_hook_(reason);
  } catch (...) {  // the hook only releases others; the original error is what matters
  }
}

void LocalGroup::ThrowAbortedLocked(int replica, const Call& call) const {
  throw Error(ErrorCode::kAborted,
              ReplicaName(replica) + ": " + Describe(call) + " aborted because " + abort_reason_);
}

void LocalGroup::Enter(int replica, const Call& call, const std::vector<Tensor>& tensors) {
  std::unique_lock<std::mutex> lock(mu_);
  if (first_error_) ThrowAbortedLocked(replica, call);
  Slot& slot = slots_[replica];
  slot.call = call;
  slot.tensors.assign(tensors.begin(), tensors.end());
  Arrive(lock, replica, call, nullptr, timeout_);

  // Every replica runs the same check over the same slots, so all reach the same verdict and
  // none reads another's buffers after it.
  std::string problem = CheckSlots();
  if (problem.empty()) return;
  const ErrorCode code = problem.front() == '!' ? ErrorCode::kInvalidArgument : ErrorCode::kMismatch;
  if (problem.front() == '!') problem.erase(0, 1);
  Error error(code, who_ + problem);
  const bool first = RecordLocked(replica, std::make_exception_ptr(error));
  lock.unlock();
  if (first) RunFailureHook();
  throw error;
}

void LocalGroup::Step(int replica, const Call& call, const char* phase, StepWait wait) {
  std::unique_lock<std::mutex> lock(mu_);
  if (first_error_) ThrowAbortedLocked(replica, call);
  // Doubled without overflow: milliseconds::max() means "never time out" (a year, kMaxTimeout).
  const std::chrono::milliseconds deadline = wait == StepWait::kForReplicaZerosCollectives
                                                 ? core::kMaxTimeout
                                             : timeout_ >= core::kMaxTimeout / 2 ? core::kMaxTimeout
                                                                                 : 2 * timeout_;
  Arrive(lock, replica, call, phase, deadline);
}

void LocalGroup::Arrive(std::unique_lock<std::mutex>& lock, int replica, const Call& call,
                        const char* phase, std::chrono::milliseconds deadline) {
  const uint64_t generation = generation_;
  present_[replica] = 1;
  if (++arrived_ == size_) {
    arrived_ = 0;
    std::fill(present_.begin(), present_.end(), 0);
    ++generation_;
    barrier_cv_.notify_all();
    return;
  }
  const auto until = DeadlineAfter(deadline);
  bool timed_out = false;
  for (;;) {
    if (generation_ != generation) return;
    if (first_error_) ThrowAbortedLocked(replica, call);
    // Who is missing now (not before the wait: arrivals do not wake the waiters). Names are
    // only built for a message.
    bool any_gone = false;
    for (int r = 0; r < size_; ++r) any_gone = any_gone || (!present_[r] && returned_[r]);
    if (!any_gone && !timed_out) {
      timed_out = barrier_cv_.wait_until(lock, until) == std::cv_status::timeout;
      continue;
    }
    std::string missing;
    std::string gone;
    for (int r = 0; r < size_; ++r) {
      if (present_[r]) continue;
      (missing.empty() ? missing : missing += ", ") += std::to_string(r);
      if (returned_[r]) (gone.empty() ? gone : gone += ", ") += std::to_string(r);
    }
    const std::string what = phase == nullptr ? " to call it" : std::string(" (") + phase + ")";
    const Error error =
        !gone.empty()
            ? Error(ErrorCode::kMismatch,
                    ReplicaName(replica) + ": " + Describe(call) + " can never complete: replica " +
                        gone +
                        " returned from its function without calling it (every local replica "
                        "must make the same cross-replica calls in the same order)")
            : Error(ErrorCode::kTimeout, ReplicaName(replica) + " timed out after " +
                                             std::to_string(deadline.count()) + " ms in " +
                                             Describe(call) + " waiting for replica " + missing +
                                             what);
    const bool first = RecordLocked(replica, std::make_exception_ptr(error));
    lock.unlock();
    if (first) RunFailureHook();
    throw error;
  }
}

std::string LocalGroup::CheckSlots() const {
  const Slot& base = slots_[0];
  const std::string at = Describe(base.call);
  for (int r = 1; r < size_; ++r) {
    const Slot& slot = slots_[r];
    const std::string who = "replica " + std::to_string(r);
    if (std::strcmp(slot.call.name, base.call.name) != 0 || slot.call.seq != base.call.seq) {
      return "replicas called different cross-replica calls: replica 0 is at " + at + ", " +
             who + " at " + Describe(slot.call);
    }
    if (slot.call.op != base.call.op) {
      return at + ": replica 0 reduces with " + ToString(base.call.op) + ", " + who + " with " +
             ToString(slot.call.op);
    }
    if (slot.tensors.size() != base.tensors.size()) {
      return at + ": replica 0 passes " + std::to_string(base.tensors.size()) + " tensors, " +
             who + " " + std::to_string(slot.tensors.size());
    }
    for (size_t j = 0; j < base.tensors.size(); ++j) {
      const Tensor& a = base.tensors[j];
      const Tensor& b = slot.tensors[j];
      if (a.count != b.count || a.dtype != b.dtype) {
        return at + ": tensor " + std::to_string(j) + " has " + std::to_string(a.count) + " x " +
               ToString(a.dtype) + " on replica 0 but " + std::to_string(b.count) + " x " +
               ToString(b.dtype) + " on " + who;
      }
    }
  }
  // No two tensors of any replicas may share a byte: replicas write each other's buffers (a
  // buffer passed twice is reduced twice, and two threads write it at once).
  struct Range {
    uintptr_t begin;
    uintptr_t end;
    int replica;
    size_t tensor;
  };
  std::vector<Range> ranges;
  for (int r = 0; r < size_; ++r) {
    for (size_t j = 0; j < slots_[r].tensors.size(); ++j) {
      const Tensor& t = slots_[r].tensors[j];
      const auto begin = reinterpret_cast<uintptr_t>(t.data);
      if (t.bytes() > 0) ranges.push_back(Range{begin, begin + t.bytes(), r, j});
    }
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t k = 1, reach = 0; k < ranges.size(); ++k) {  // ranges[reach] ends furthest so far
    if (ranges[k].begin < ranges[reach].end) {
      Range a = ranges[reach];
      Range b = ranges[k];
      if (std::tie(b.replica, b.tensor) < std::tie(a.replica, a.tensor)) std::swap(a, b);
      if (a.tensor == b.tensor && a.begin == b.begin && a.replica != b.replica) {
        return "!" + at + ": replicas " + std::to_string(a.replica) + " and " +
               std::to_string(b.replica) + " pass the same buffer as tensor " +
               std::to_string(a.tensor) + " (every replica reduces its own copy)";
      }
      return "!" + at + ": replica " + std::to_string(a.replica) + "'s tensor " +
             std::to_string(a.tensor) + " and replica " + std::to_string(b.replica) + "'s tensor " +
             std::to_string(b.tensor) +
             " share memory (every replica reduces its own copy, and every tensor of a list is "
             "memory of its own)";
    }
    if (ranges[k].end > ranges[reach].end) reach = k;
  }
  return {};
}

}  // namespace collectives::strategy::internal
