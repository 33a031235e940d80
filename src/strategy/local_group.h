// The local replicas of one worker: the threads that run the function given to Strategy::Run,
// and the rendezvous at which they meet inside a cross-replica call.
//
// A group of N replicas owns N-1 persistent threads (replica 0 runs on the caller's thread), so a
// training step costs two thread hand-offs, not N-1 thread creations. Inside a cross-replica call
// the replicas meet at a generation-counted barrier (one mutex, one condition variable; no
// spinning: on hosts with fewer cores than replicas a spinning waiter steals the core the late
// replica needs).
//
// Failure: the first error of any replica (an exception escaping its function, a timeout, a
// mismatch found at a rendezvous) is recorded, and the group is aborted: every replica waiting in
// the group, and every later arrival, throws Error(kAborted) naming the replica that failed. Run
// rethrows the first error, the original one with its ErrorCode, once every replica has returned.
// The abort is sticky: a group that failed stays failed (the strategy owning it is broken, like a
// communicator after its first failure).
//
// Thread-safety: Run is called from one thread (the strategy's owner), never concurrently with
// itself. Enter, Step, Published and Fail are called by the replicas of the running Run, each
// with its own replica index.
#ifndef COLLECTIVES_SRC_STRATEGY_LOCAL_GROUP_H_
#define COLLECTIVES_SRC_STRATEGY_LOCAL_GROUP_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/types.h"

namespace collectives::strategy::internal {

// What `error` says: its what(), or that it is not a std::exception.
std::string WhatOf(const std::exception_ptr& error);

class LocalGroup {
 public:
  // `timeout`: how long a replica waits for the others to arrive at a call. `who` prefixes every
  // message ("worker 1 " with several workers, "" with one).
  LocalGroup(int size, std::chrono::milliseconds timeout, std::string who);
  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int size() const { return size_; }

  // Called once, from the failing replica's thread and outside the group's lock, when the first
  // failure is recorded, with the reason the other replicas' kAborted give ("worker 1 replica 1
  // failed: <its error>"): the strategy aborts its communicator there with that reason, so that
  // replica 0, which may be blocked in a cross-worker collective, and the other workers are
  // released at once and learn why. Set it before the first Run.
  void SetFailureHook(std::function<void(const std::string& reason)> hook) {
    failure_hook_ = std::move(hook);
  }

  // Runs body(r) for every r in [0, size()), in parallel: r = 0 on the calling thread, the others
  // on the group's threads. Returns when every replica has returned; then rethrows the first
  // failure, if any. Throws the recorded failure at once if the group has already failed.
  void Run(const std::function<void(int)>& body);

  // A cross-replica call as the replicas name it; all replicas must agree on it.
  struct Call {
    const char* name = "";  // "all_reduce"
    uint64_t seq = 0;       // 1 for the replica's first call of any kind, 2 for the next, ...
    ReduceOp op = ReduceOp::kSum;
  };
  // "all_reduce #3".
  static std::string Describe(const Call& call);

  // Arrival at a cross-replica call: publishes a copy of `tensors` (descriptors only), waits up to
  // the timeout for every replica to arrive, then checks that every replica arrived at the same
  // call (name, seq, op) with the same list (count and dtype of every tensor) and distinct
  // buffers. Throws kTimeout, kMismatch (different calls, or a replica that returned from its
  // function without making this call), kInvalidArgument (lists that differ, shared buffers) or
  // kAborted, after recording the failure.
  void Enter(int replica, const Call& call, const std::vector<Tensor>& tensors);
  // The list replica `replica` published at the current call. Valid from Enter's return until
  // the replicas pass the last Step of the call.
  const std::vector<Tensor>& Published(int replica) const { return slots_[replica].tensors; }
  // How long a Step waits: twice the timeout, or, where replica 0 runs the cross-worker
  // collectives (each bounded by the communicator's timeout), until replica 0 finishes or fails.
  enum class StepWait { kTwiceTheTimeout, kForReplicaZerosCollectives };
  // A barrier between the phases of a call every replica has entered. `phase` names what the
  // replicas wait for, for the messages (see local_group.cc for the deadlines).
  void Step(int replica, const Call& call, const char* phase,
            StepWait wait = StepWait::kTwiceTheTimeout);

  // Records `error` as the group's failure if it is the first, and aborts the group. Returns
  // nothing; the caller goes on to throw its own error.
  void Fail(int replica, std::exception_ptr error);

 private:
  struct Slot {
    Call call;
    std::vector<Tensor> tensors;
  };

  void WorkerLoop(int replica);
  void RunReplica(int replica);
  // The barrier shared by Enter and Step; `lock` holds mu_. Throws after recording the failure.
  void Arrive(std::unique_lock<std::mutex>& lock, int replica, const Call& call,
              const char* phase, std::chrono::milliseconds deadline);
  // Under mu_: records the first failure; true if this call recorded it.
  bool RecordLocked(int replica, std::exception_ptr error);
  // Calls failure_hook_ (without mu_ held) with abort_reason_, swallowing what it throws.
  void RunFailureHook();
  [[noreturn]] void ThrowAbortedLocked(int replica, const Call& call) const;
  std::string ReplicaName(int replica) const;
  std::string CheckSlots() const;

  const int size_;
  const std::chrono::milliseconds timeout_;
  const std::string who_;
  std::function<void(const std::string&)> failure_hook_;

  std::mutex mu_;
  std::condition_variable barrier_cv_;  // waiters at Enter / Step
  std::condition_variable work_cv_;     // the group's threads wait for a Run here
  std::condition_variable done_cv_;     // Run waits for the group's threads here

  // Run state (guarded by mu_).
  const std::function<void(int)>* body_ = nullptr;
  uint64_t job_ = 0;       // incremented by every Run
  int finished_ = 0;       // group threads done with the current job
  bool stop_ = false;
  std::vector<char> returned_;  // replica r has returned from body in the current Run

  // Barrier state (guarded by mu_).
  uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<char> present_;  // replica r has arrived at the current generation

  // Failure state (guarded by mu_).
  std::exception_ptr first_error_;
  std::string abort_reason_;  // "replica 0 failed: [peer lost] ..."

  // Published lists: slot r is written by replica r in Enter under mu_, and read by every
  // replica after the barrier until the last Step of the call.
  std::vector<Slot> slots_;

  std::vector<std::thread> threads_;
};

}  // namespace collectives::strategy::internal

#endif  // COLLECTIVES_SRC_STRATEGY_LOCAL_GROUP_H_
