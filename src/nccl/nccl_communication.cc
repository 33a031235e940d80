// The NCCL implementation of CollectiveCommunication (see nccl_communication.h).
#include "src/nccl/nccl_communication.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "src/core/algorithm_names.h"
#include "src/core/arguments.h"
#include "src/core/internal_communication.h"
#include "src/nccl/nccl_loader.h"

namespace collectives::nccl {
namespace {

using Clock = std::chrono::steady_clock;

// How often a waiter asks NCCL for asynchronous errors and checks its deadline, and how long it
// sleeps between event polls once the first millisecond has passed (before that it yields, so
// that small collectives complete with low latency).
constexpr auto kCheckEvery = std::chrono::milliseconds(1);
constexpr auto kSpinFor = std::chrono::milliseconds(1);
constexpr auto kSleepFor = std::chrono::microseconds(50);

std::string Ms(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

// NCCL's text for `result`, with NCCL's last message when there is one. ncclGetLastError ignores
// its argument: it returns the last message of the whole process, which may come from another
// communicator or an earlier failure, so it is labelled as such. `comm` may be null (NCCL's
// documentation: the argument "is currently unused and can be set to NULL"): a failure before
// there is a communicator (ncclGetUniqueId, an init refused at once) has its reason there too.
std::string NcclText(const NcclApi& api, ncclResult_t result, ncclComm_t comm) {
  std::string out = api.ncclGetErrorString(result);
  const char* last = api.ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') {
    out += " (NCCL's last message (may be unrelated): ";
    out += last;
    out += ")";
  }
  return out;
}

Error CudaError(const NcclApi& api, const std::string& where, const char* call,
                cudaError_t status) {
  return Error(ErrorCode::kSystem,
               where + ": " + call + " failed: " + api.cudaGetErrorString(status));
}

std::string PointerText(const void* pointer) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", pointer);
  return text;
}

// The CUDA event recorded after one collective. Held by its Work and by the communicator's list
// of calls in flight, and destroyed with the last of them, on the communicator's device.
class Event {
 public:
  Event(const NcclApi& api, int device, cudaEvent_t event)
      : api_(api), device_(device), event_(event) {}
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    api_.cudaSetDevice(device_);
    api_.cudaEventDestroy(event_);
  }

  cudaError_t Query() const { return api_.cudaEventQuery(event_); }

 private:
  const NcclApi& api_;
  const int device_;
  const cudaEvent_t event_;
};

// State shared by a communicator and its Work handles (a handle may outlive the communicator;
// the NCCL communicator is released when the last of them goes).
// Thread-safety: mu guards everything below it and every NCCL call that takes `comm`.
class Shared {
 public:
  Shared(const NcclApi& api_in, int rank_in, int device_in, std::chrono::milliseconds timeout)
      : api(api_in), rank(rank_in), device(device_in), finalize_timeout(timeout) {}
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;

  ~Shared() {
    api.cudaSetDevice(device);
    if (comm != nullptr && !aborted) {
      // Flush what was issued, bounded by the timeout, then free; abort if that fails.
      ncclResult_t state = api.ncclCommFinalize(comm);
      const auto deadline = Clock::now() + finalize_timeout;
      while (state == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(kSleepFor);
        ncclResult_t async = ncclSuccess;
        state = api.ncclCommGetAsyncError(comm, &async);
        if (state == ncclSuccess) state = async;
      }
      if (state == ncclSuccess) {
        api.ncclCommDestroy(comm);
      } else {
        api.ncclCommAbort(comm);
      }
    }
    if (barrier_buffer != nullptr) api.cudaFree(barrier_buffer);
    if (own_stream && stream != nullptr) api.cudaStreamDestroy(stream);
  }

  // Under mu. Makes `error` the communicator's sticky error unless it already has one, aborts
  // the NCCL communicator (once), and returns the sticky error. broken_flag is set before
  // ncclCommAbort runs, so an event seen complete while the flag is clear completed by itself,
  // not because the abort cut its collective short (see NcclWork::FinishCompleted).
  Error BreakLocked(const Error& error) {
    if (!broken) {
      broken = error;
      broken_flag.store(true, std::memory_order_release);
    }
    if (comm != nullptr && !aborted) {
      aborted = true;
      api.ncclCommAbort(comm);
    }
    return *broken;
  }

  // Under mu. The sticky error, or NCCL's asynchronous error (which then breaks the
  // communicator), or nothing.
  std::optional<Error> CheckLocked(const std::string& where) {
    if (broken) return broken;
    ncclResult_t async = ncclSuccess;
    const ncclResult_t result = api.ncclCommGetAsyncError(comm, &async);
    if (result != ncclSuccess) async = result;
    if (async == ncclSuccess || async == ncclInProgress) return std::nullopt;
    return BreakLocked(
        Error(ToErrorCode(async), where + ": NCCL reported " + NcclText(api, async, comm)));
  }

  // Under mu. Forgets the calls in flight that completed, and breaks the communicator with
  // Error(kTimeout) when the oldest one still running has run longer than its timeout.
  // A call's time counts from when it starts running, not from its issue: the stream runs the
  // calls one after another, and one queued behind a long call must not time out while it
  // waits. The library cannot see a call start, only its predecessor's event complete, and
  // only when it looks (each poll of a Wait, Done's checks, each issue). So a call's clock
  // starts when it is first seen to be the oldest call in flight: at its issue when nothing
  // runs before it, else when its predecessor is first seen complete. It never starts early;
  // it may start late when nobody looks, which only lengthens that deadline.
  std::optional<Error> ProgressLocked(Clock::time_point now) {
    while (!in_flight.empty()) {
      InFlight& oldest = in_flight.front();
      if (!oldest.started) oldest.started = now;
      const cudaError_t status = oldest.event->Query();
      if (status == cudaSuccess) {
        in_flight.pop_front();
        continue;
      }
      if (status != cudaErrorNotReady) {
        return BreakLocked(CudaError(api, oldest.where, "cudaEventQuery", status));
      }
      if (now - *oldest.started >= oldest.timeout) {
        return BreakLocked(Error(ErrorCode::kTimeout,
                                 oldest.where + ": did not complete within " + Ms(oldest.timeout) +
                                     " of starting; the NCCL communicator was aborted"));
      }
      break;
    }
    return std::nullopt;
  }

  // One issued call not yet seen complete.
  struct InFlight {
    std::shared_ptr<const Event> event;
    std::string where;
    std::chrono::milliseconds timeout;
    std::optional<Clock::time_point> started;  // when it was first seen the oldest in flight
  };

  const NcclApi& api;
  const int rank;
  const int device;
  const std::chrono::milliseconds finalize_timeout;

  // Set by Abort before it waits for mu: an Issue that holds mu while NCCL accepts a call polls
  // it and aborts in Abort's stead.
  std::atomic<bool> abort_requested{false};

  std::mutex mu;
  ncclComm_t comm = nullptr;             // guarded by mu; set once at creation
  cudaStream_t stream = nullptr;         // set once at creation
  bool own_stream = false;               // set once at creation
  void* barrier_buffer = nullptr;        // one int32 on the device; set once at creation
  std::optional<Error> broken;           // guarded by mu
  bool aborted = false;                  // guarded by mu: comm was aborted and must not be used
  std::atomic<bool> broken_flag{false};  // broken, readable without mu
  std::deque<InFlight> in_flight;        // guarded by mu; in issue order
};

// `error` as the error of the call `where` names ("rank 0: all_reduce #3 (f32, sum, count=7)"):
// as it is when it is that call's own (it begins with `where`), else with the call and `what`
// became of it appended: "rank 0: the communicator was aborted by its caller (all_reduce #3
// (f32, sum, count=7) was in flight)". A caller waiting on several Works learns which is which.
Error ForCall(const Error& error, const std::string& where, const char* what) {
  if (error.message().compare(0, where.size(), where) == 0) return error;
  const size_t colon = where.find(": ");
  std::string message = error.message();
  message += " (";
  message += colon == std::string::npos ? where : where.substr(colon + 2);
  message += ' ';
  message += what;
  message += ')';
  return Error(error.code(), message);
}

// One issued collective: completes when the CUDA event recorded after it has.
// Thread-safety: Wait and Done from any thread; concurrent Waits take turns.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Shared> shared, std::shared_ptr<const Event> event, std::string where)
      : shared_(std::move(shared)), event_(std::move(event)), where_(std::move(where)) {}
  // A work that failed before it was issued.
  explicit NcclWork(const Error& error) : error_(error) { done_.store(true); }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  void Wait() override {
    std::lock_guard<std::mutex> lock(wait_mu_);
    if (!done_.load(std::memory_order_acquire)) Poll();
    if (error_) throw *error_;
  }

  bool Done() const override {
    if (done_.load(std::memory_order_acquire)) return true;
    if (shared_->broken_flag.load(std::memory_order_acquire)) return true;
    const NcclApi& api = shared_->api;
    // Completed or failed either way: Wait reports which.
    if (api.cudaSetDevice(shared_->device) != cudaSuccess) return true;
    if (event_->Query() != cudaErrorNotReady) return true;
    // Still running: look for a dead peer and a passed deadline as Wait's loop does, so that a
    // caller that only polls Done (coll_work_test) sees them too. At most every kCheckEvery,
    // and only when the mutex is free: Done does not wait for an Issue or another Wait.
    const Clock::time_point now = Clock::now();
    const Clock::rep now_ticks = now.time_since_epoch().count();
    if (now_ticks < next_check_.load(std::memory_order_relaxed)) return false;
    std::unique_lock<std::mutex> shared_lock(shared_->mu, std::try_to_lock);
    if (!shared_lock.owns_lock()) return false;
    next_check_.store(now_ticks + std::chrono::duration_cast<Clock::duration>(kCheckEvery).count(),
                      std::memory_order_relaxed);
    // Either breaks the communicator, which the next Wait raises.
    return shared_->CheckLocked(where_).has_value() || shared_->ProgressLocked(now).has_value();
  }

 private:
  // Under wait_mu_, not done_: polls the event until the collective completes or fails.
  void Poll() {
    const NcclApi& api = shared_->api;
    // Else the runtime makes device 0 current on a thread that never chose one.
    const cudaError_t set = api.cudaSetDevice(shared_->device);
    if (set != cudaSuccess) {
      std::lock_guard<std::mutex> shared_lock(shared_->mu);
      Finish(shared_->BreakLocked(CudaError(api, where_, "cudaSetDevice", set)));
      return;
    }
    const auto start = Clock::now();
    const auto spin_until = start + kSpinFor;
    auto next_check = start + kCheckEvery;
    while (true) {
      const cudaError_t status = event_->Query();
      if (status == cudaSuccess) {
        FinishCompleted();
        return;
      }
      const auto now = Clock::now();
      // A communicator broken meanwhile (Abort, or Done's check) is reported at once.
      if (status != cudaErrorNotReady || now >= next_check ||
          shared_->broken_flag.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> shared_lock(shared_->mu);
        if (status != cudaErrorNotReady) {
          Finish(shared_->BreakLocked(CudaError(api, where_, "cudaEventQuery", status)));
          return;
        }
        std::optional<Error> error = shared_->CheckLocked(where_);
        if (!error) error = shared_->ProgressLocked(now);
        if (error) {
          Finish(error);
          return;
        }
        next_check = now + kCheckEvery;
      }
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(kSleepFor);
      }
    }
  }

  // Under wait_mu_: the event completed. On a broken communicator that is not success: after
  // ncclCommAbort, NCCL's kernels return early and the events after them complete over partial
  // data. The flag is set before the abort runs, so while it is clear the completion is real.
  // (A call that had completed before the break, unwaited, raises the error too: the two cannot
  // be told apart once the flag is set.)
  void FinishCompleted() {
    if (!shared_->broken_flag.load(std::memory_order_acquire)) {
      Finish(std::nullopt);
      return;
    }
    std::lock_guard<std::mutex> shared_lock(shared_->mu);
    Finish(shared_->broken);
  }

  // Under wait_mu_.
  void Finish(const std::optional<Error>& error) {
    if (error) error_ = ForCall(*error, where_, "was in flight");
    done_.store(true, std::memory_order_release);
  }

  const std::shared_ptr<Shared> shared_;      // null for a work that failed before it was issued
  const std::shared_ptr<const Event> event_;  // null with shared_
  const std::string where_;
  std::mutex wait_mu_;
  std::atomic<bool> done_{false};
  std::optional<Error> error_;  // guarded by wait_mu_; written before done_ is set
  mutable std::atomic<Clock::rep> next_check_{0};  // Done's next check, in clock ticks
};

class NcclCommunication final : public core::InternalCommunication {
 public:
  NcclCommunication(std::shared_ptr<Shared> shared, int size, std::shared_ptr<Store> store,
                    std::chrono::milliseconds timeout)
      : shared_(std::move(shared)),
        rank_(shared_->rank),
        size_(size),
        store_(std::move(store)),
        timeout_ms_(timeout.count()) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Implementation implementation() const override { return Implementation::kNccl; }
  std::string AllReduceAlgorithm(size_t) const override {
    return std::string(core::algorithm::kNccl);  // NCCL picks its own
  }

  std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv,
                                       ReduceOp op) override {
    constexpr const char* kName = "all_reduce";
    CheckTensor(kName, "send", send);
    CheckTensor(kName, "recv", recv);
    CheckSameType(kName, send, recv);
    CheckOp(kName, op);
    if (send.count != recv.count) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(kName) + "send has " + std::to_string(send.count) +
                      " elements but recv has " + std::to_string(recv.count));
    }
    core::CheckBuffersApart(rank_, kName, send, recv, reinterpret_cast<uintptr_t>(recv.data),
                            "recv.data");
    return Issue(
        kName, Detail(recv.dtype, ToString(op), recv.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return api.ncclAllReduce(send.data, recv.data, recv.count, ToNcclDataType(recv.dtype),
                                   ToNcclRedOp(op), comm, stream);
        },
        &send, &recv);
  }

  std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv, int root) override {
    constexpr const char* kName = "broadcast";
    CheckRank(kName, "root", root);
    CheckTensor(kName, "recv", recv);
    const void* source = recv.data;  // read by NCCL on the root only
    if (rank_ == root) {
      CheckTensor(kName, "send", send);
      CheckSameType(kName, send, recv);
      if (send.count != recv.count) {
        throw Error(ErrorCode::kInvalidArgument,
                    Where(kName) + "the root's send has " + std::to_string(send.count) +
                        " elements but recv has " + std::to_string(recv.count));
      }
      core::CheckBuffersApart(rank_, kName, send, recv, reinterpret_cast<uintptr_t>(recv.data),
                              "recv.data");
      source = send.data;
    }
    return Issue(
        kName, Detail(recv.dtype, "root=" + std::to_string(root), recv.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return api.ncclBroadcast(source, recv.data, recv.count, ToNcclDataType(recv.dtype), root,
                                   comm, stream);
        },
        rank_ == root ? &send : nullptr, &recv);
  }

  std::shared_ptr<Work> AllGatherAsync(const Tensor& send, const Tensor& recv) override {
    constexpr const char* kName = "all_gather";
    CheckTensor(kName, "send", send);
    CheckTensor(kName, "recv", recv);
    CheckSameType(kName, send, recv);
    if (send.count > SIZE_MAX / static_cast<size_t>(size_) ||
        recv.count != send.count * static_cast<size_t>(size_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(kName) + "recv must have size x send.count = " + std::to_string(size_) +
                      " x " + std::to_string(send.count) + " elements, got " +
                      std::to_string(recv.count));
    }
    core::CheckBuffersApart(rank_, kName, send, recv,
                            reinterpret_cast<uintptr_t>(recv.data) + size_t(rank_) * send.bytes(),
                            "recv.data + rank * send.count elements");
    return Issue(
        kName, Detail(send.dtype, "", send.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return api.ncclAllGather(send.data, recv.data, send.count, ToNcclDataType(send.dtype),
                                   comm, stream);
        },
        &send, &recv);
  }

  std::shared_ptr<Work> ReduceScatterAsync(const Tensor& send, const Tensor& recv,
                                           ReduceOp op) override {
    constexpr const char* kName = "reduce_scatter";
    CheckTensor(kName, "send", send);
    CheckTensor(kName, "recv", recv);
    CheckSameType(kName, send, recv);
    CheckOp(kName, op);
    if (recv.count > SIZE_MAX / static_cast<size_t>(size_) ||
        send.count != recv.count * static_cast<size_t>(size_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(kName) + "send must have size x recv.count = " + std::to_string(size_) +
                      " x " + std::to_string(recv.count) + " elements, got " +
                      std::to_string(send.count));
    }
    core::CheckBuffersApart(rank_, kName, send, recv,
                            reinterpret_cast<uintptr_t>(recv.data) - size_t(rank_) * recv.bytes(),
                            "recv.data - rank * recv.count elements");
    return Issue(
        kName, Detail(recv.dtype, ToString(op), recv.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return api.ncclReduceScatter(send.data, recv.data, recv.count, ToNcclDataType(recv.dtype),
                                       ToNcclRedOp(op), comm, stream);
        },
        &send, &recv);
  }

  // An all-reduce of one int32 on the device.
  std::shared_ptr<Work> BarrierAsync() override {
    void* buffer = shared_->barrier_buffer;
    return Issue("barrier", "", [buffer](const NcclApi& api, ncclComm_t comm, cudaStream_t s) {
      return api.ncclAllReduce(buffer, buffer, 1, ncclInt32, ncclSum, comm, s);
    });
  }

  // ncclReduce; recv is passed to NCCL on the root only (null elsewhere: never written).
  std::shared_ptr<Work> ReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op,
                                    int root) override {
    constexpr const char* kName = "reduce";
    CheckRank(kName, "root", root);
    CheckTensor(kName, "send", send);
    CheckOp(kName, op);
    void* target = nullptr;
    if (rank_ == root) {
      CheckTensor(kName, "recv", recv);
      CheckSameType(kName, send, recv);
      if (send.count != recv.count) {
        throw Error(ErrorCode::kInvalidArgument,
                    Where(kName) + "send has " + std::to_string(send.count) +
                        " elements but the root's recv has " + std::to_string(recv.count));
      }
      core::CheckBuffersApart(rank_, kName, send, recv, reinterpret_cast<uintptr_t>(recv.data),
                              "recv.data");
      target = recv.data;
    }
    return Issue(
        kName,
        Detail(send.dtype, std::string(ToString(op)) + ", root=" + std::to_string(root),
               send.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return api.ncclReduce(send.data, target, send.count, ToNcclDataType(send.dtype),
                                ToNcclRedOp(op), root, comm, stream);
        },
        &send, rank_ == root ? &recv : nullptr);
  }

  // One group: every rank sends its block to the root, which receives block r from rank r
  // (from itself too, unless in place).
  std::shared_ptr<Work> GatherAsync(const Tensor& send, const Tensor& recv, int root) override {
    constexpr const char* kName = "gather";
    CheckRank(kName, "root", root);
    CheckTensor(kName, "send", send);
    bool in_place = false;
    if (rank_ == root) {
      CheckTensor(kName, "recv", recv);
      CheckSameType(kName, send, recv);
      if (send.count > SIZE_MAX / static_cast<size_t>(size_) ||
          recv.count != send.count * static_cast<size_t>(size_)) {
        throw Error(ErrorCode::kInvalidArgument,
                    Where(kName) + "the root's recv must have size x send.count = " +
                        std::to_string(size_) + " x " + std::to_string(send.count) +
                        " elements, got " + std::to_string(recv.count));
      }
      const uintptr_t own = reinterpret_cast<uintptr_t>(recv.data) + size_t(root) * send.bytes();
      core::CheckBuffersApart(rank_, kName, send, recv, own,
                              "recv.data + root * send.count elements");
      in_place = reinterpret_cast<uintptr_t>(send.data) == own;
    }
    const size_t count = send.count;
    const size_t bytes = send.bytes();
    const ncclDataType_t type = ToNcclDataType(send.dtype);
    return Issue(
        kName, Detail(send.dtype, "root=" + std::to_string(root), count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return Grouped(api, [&]() -> ncclResult_t {
            if (count == 0) return ncclSuccess;
            if (rank_ == root) {
              for (int r = 0; r < size_; ++r) {
                if (r == root && in_place) continue;
                void* block = static_cast<char*>(recv.data) + size_t(r) * bytes;
                if (ncclResult_t result = api.ncclRecv(block, count, type, r, comm, stream);
                    result != ncclSuccess) {
                  return result;
                }
              }
              if (in_place) return ncclSuccess;
            }
            return api.ncclSend(send.data, count, type, root, comm, stream);
          });
        },
        &send, rank_ == root ? &recv : nullptr);
  }

  // One group: the root sends block r to rank r (to itself too, unless in place); every rank
  // receives its block from the root.
  std::shared_ptr<Work> ScatterAsync(const Tensor& send, const Tensor& recv, int root) override {
    constexpr const char* kName = "scatter";
    CheckRank(kName, "root", root);
    CheckTensor(kName, "recv", recv);
    bool in_place = false;
    if (rank_ == root) {
      CheckTensor(kName, "send", send);
      CheckSameType(kName, send, recv);
      if (recv.count > SIZE_MAX / static_cast<size_t>(size_) ||
          send.count != recv.count * static_cast<size_t>(size_)) {
        throw Error(ErrorCode::kInvalidArgument,
                    Where(kName) + "the root's send must have size x recv.count = " +
                        std::to_string(size_) + " x " + std::to_string(recv.count) +
                        " elements, got " + std::to_string(send.count));
      }
      const uintptr_t own = reinterpret_cast<uintptr_t>(recv.data) - size_t(root) * recv.bytes();
      core::CheckBuffersApart(rank_, kName, send, recv, own,
                              "recv.data - root * recv.count elements");
      in_place = reinterpret_cast<uintptr_t>(send.data) == own;
    }
    const size_t count = recv.count;
    const size_t bytes = recv.bytes();
    const ncclDataType_t type = ToNcclDataType(recv.dtype);
    return Issue(
        kName, Detail(recv.dtype, "root=" + std::to_string(root), count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return Grouped(api, [&]() -> ncclResult_t {
            if (count == 0) return ncclSuccess;
            if (rank_ == root) {
              for (int r = 0; r < size_; ++r) {
                if (r == root && in_place) continue;
                const void* block = static_cast<const char*>(send.data) + size_t(r) * bytes;
                if (ncclResult_t result = api.ncclSend(block, count, type, r, comm, stream);
                    result != ncclSuccess) {
                  return result;
                }
              }
              if (in_place) return ncclSuccess;
            }
            return api.ncclRecv(recv.data, count, type, root, comm, stream);
          });
        },
        rank_ == root ? &send : nullptr, &recv);
  }

  // One group of a send and a receive per rank (itself included), as nccl-tests' alltoall and
  // PyTorch's all_to_all; a block of 0 elements is neither sent nor received.
  std::shared_ptr<Work> AllToAllAsync(const Tensor& send, const Tensor& recv,
                                      const std::vector<size_t>& send_counts,
                                      const std::vector<size_t>& recv_counts) override {
    constexpr const char* kName = "all_to_all";
    CheckTensor(kName, "send", send);
    CheckTensor(kName, "recv", recv);
    CheckSameType(kName, send, recv);
    const size_t n = static_cast<size_t>(size_);
    std::vector<size_t> sends = send_counts;
    std::vector<size_t> recvs = recv_counts;
    if (sends.empty() && recvs.empty()) {
      if (send.count != recv.count || send.count % n != 0) {
        throw Error(ErrorCode::kInvalidArgument,
                    Where(kName) +
                        "with equal blocks send and recv must have the same count, a "
                        "multiple of the size " +
                        std::to_string(size_) + ", got " + std::to_string(send.count) + " and " +
                        std::to_string(recv.count));
      }
      sends.assign(n, send.count / n);
      recvs.assign(n, send.count / n);
    } else {
      CheckCounts(kName, "send_counts", sends, send.count);
      CheckCounts(kName, "recv_counts", recvs, recv.count);
    }
    CheckApart(kName, send, recv);
    const size_t elem = SizeOf(send.dtype);
    const ncclDataType_t type = ToNcclDataType(send.dtype);
    std::string detail = "send_counts=" + CountsText(sends) + ", recv_counts=" + CountsText(recvs);
    return Issue(
        kName, Detail(send.dtype, detail, send.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return Grouped(api, [&]() -> ncclResult_t {
            size_t send_offset = 0;
            size_t recv_offset = 0;
            for (int r = 0; r < size_; ++r) {
              const size_t out = sends[size_t(r)];
              const size_t in = recvs[size_t(r)];
              if (out > 0) {
                const void* block = static_cast<const char*>(send.data) + send_offset * elem;
                if (ncclResult_t result = api.ncclSend(block, out, type, r, comm, stream);
                    result != ncclSuccess) {
                  return result;
                }
              }
              if (in > 0) {
                void* block = static_cast<char*>(recv.data) + recv_offset * elem;
                if (ncclResult_t result = api.ncclRecv(block, in, type, r, comm, stream);
                    result != ncclSuccess) {
                  return result;
                }
              }
              send_offset += out;
              recv_offset += in;
            }
            return ncclSuccess;
          });
        },
        &send, &recv);
  }

  // ncclSend in a group of its own; the tag is named in messages only (see the header).
  std::shared_ptr<Work> SendAsync(const Tensor& tensor, int peer, int64_t tag) override {
    constexpr const char* kName = "send";
    CheckPeer(kName, peer);
    CheckTensor(kName, "tensor", tensor);
    return Issue(
        kName, Detail(tensor.dtype, PeerText(peer, tag), tensor.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return Grouped(api, [&]() -> ncclResult_t {
            if (tensor.count == 0) return ncclSuccess;
            return api.ncclSend(tensor.data, tensor.count, ToNcclDataType(tensor.dtype), peer, comm,
                                stream);
          });
        },
        &tensor, nullptr);
  }

  std::shared_ptr<Work> RecvAsync(const Tensor& tensor, int peer, int64_t tag) override {
    constexpr const char* kName = "recv";
    CheckPeer(kName, peer);
    CheckTensor(kName, "tensor", tensor);
    return Issue(
        kName, Detail(tensor.dtype, PeerText(peer, tag), tensor.count),
        [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
          return Grouped(api, [&]() -> ncclResult_t {
            if (tensor.count == 0) return ncclSuccess;
            return api.ncclRecv(tensor.data, tensor.count, ToNcclDataType(tensor.dtype), peer, comm,
                                stream);
          });
        },
        nullptr, &tensor);
  }

  void Abort() override {
    // Before taking mu: an Issue may hold it for up to its timeout while NCCL accepts a call;
    // it polls this flag and aborts in our stead (ncclCommAbort must not run beside another
    // call on the communicator).
    shared_->abort_requested.store(true, std::memory_order_release);
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->BreakLocked(AbortedError());
  }

  void SetTimeout(std::chrono::milliseconds timeout) override {
    timeout_ms_.store(
        core::CheckTimeout("rank " + std::to_string(rank_) + ": SetTimeout", timeout).count());
  }

  // core::InternalCommunication: no gated calls and no calls in pieces (Error(kNotSupported));
  // checked_as changes nothing, NCCL checking nothing across ranks; Abort(reason) is Abort().
  using InternalCommunication::AllReduce;
  using InternalCommunication::Broadcast;
  bool RunsGatedCalls() const override { return false; }
  std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op,
                                       const core::CallOptions& options) override {
    if (options.gate) throw NeedsRing("gated calls");
    return AllReduceAsync(send, recv, op);
  }
  void AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op,
                 const core::CallOptions& options) override {
    AllReduceAsync(send, recv, op, options)->Wait();
  }
  std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv, int root,
                                       const core::CallOptions& options) override {
    if (options.gate) throw NeedsRing("gated calls");
    return BroadcastAsync(send, recv, root);
  }
  void Broadcast(const Tensor& send, const Tensor& recv, int root,
                 const core::CallOptions& options) override {
    BroadcastAsync(send, recv, root, options)->Wait();
  }
  std::shared_ptr<Work> AllReduceAsync(const std::vector<Tensor>&, ReduceOp,
                                       const core::CallOptions&) override {
    throw NeedsRing("calls in pieces");
  }
  void AllReduce(const std::vector<Tensor>&, ReduceOp, const core::CallOptions&) override {
    throw NeedsRing("calls in pieces");
  }
  std::shared_ptr<Work> BroadcastAsync(const std::vector<Tensor>&, int,
                                       const core::CallOptions&) override {
    throw NeedsRing("calls in pieces");
  }
  void Broadcast(const std::vector<Tensor>&, int, const core::CallOptions&) override {
    throw NeedsRing("calls in pieces");
  }
  void Abort(const Error&) override { Abort(); }

 private:
  using IssueFn = std::function<ncclResult_t(const NcclApi&, ncclComm_t, cudaStream_t)>;

  // Error(kNotSupported): "rank R: <what> need RING or AUTO, not nccl".
  Error NeedsRing(const char* what) const {
    return Error(ErrorCode::kNotSupported, "rank " + std::to_string(rank_) + ": " + what +
                                               " need RING or AUTO, not " +
                                               ToString(implementation()));
  }

  std::string Where(const char* collective) const {
    return core::ArgumentPrefix(rank_, collective);
  }

  Error AbortedError() const {
    return Error(ErrorCode::kAborted,
                 "rank " + std::to_string(rank_) + ": the communicator was aborted by its caller");
  }

  static std::string Detail(DataType dtype, const std::string& extra, size_t count) {
    std::string out = ToString(dtype);
    if (!extra.empty()) {
      out += ", ";
      out += extra;
    }
    out += ", count=";
    out += std::to_string(count);
    return out;
  }

  void CheckTensor(const char* collective, const char* name, const Tensor& t) const {
    if (t.device.kind != Device::Kind::kCuda) {
      throw Error(ErrorCode::kInvalidArgument, core::TensorPrefix(rank_, collective, name) +
                                                   "is on " + t.device.ToString() +
                                                   "; NCCL takes CUDA tensors only");
    }
    if (t.device.index != shared_->device) {
      throw Error(ErrorCode::kInvalidArgument,
                  core::TensorPrefix(rank_, collective, name) + "is on " +
                      t.device.ToString() + " but this communicator uses cuda:" +
                      std::to_string(shared_->device));
    }
    core::CheckTensorData(rank_, collective, name, t);
    CheckDeviceMemory(collective, name, t);
  }

  // Whether t's first and last bytes are memory of this communicator's device, or managed
  // memory (which the device reaches): a tensor marked CUDA may still hold a host pointer.
  // NCCL does not check pointers (unless NCCL_CHECK_POINTERS=1): its kernel would fault and
  // take the CUDA context down; and a refusal would break the communicator (see Issue). So a
  // wrong pointer is a clean Error(kInvalidArgument) here, before NCCL sees it.
  void CheckDeviceMemory(const char* collective, const char* name, const Tensor& t) const {
    if (t.count == 0) return;
    const NcclApi& api = shared_->api;
    // The runtime would otherwise make device 0 current on a thread that never chose one.
    const cudaError_t set = api.cudaSetDevice(shared_->device);
    if (set != cudaSuccess) throw CudaError(api, Where(collective), "cudaSetDevice", set);
    const auto first = reinterpret_cast<uintptr_t>(t.data);
    const uintptr_t last = first + (t.bytes() - 1);
    if (last < first) {
      throw Error(ErrorCode::kInvalidArgument,
                  core::TensorPrefix(rank_, collective, name) + "wraps around the address space");
    }
    for (const uintptr_t address : {first, last}) {
      const void* pointer = reinterpret_cast<const void*>(address);
      cudaPointerAttributes attributes{};
      const cudaError_t status = api.cudaPointerGetAttributes(&attributes, pointer);
      std::string problem;
      if (status != cudaSuccess) {
        api.cudaGetLastError();  // clear it, so that later calls do not report it
        problem = std::string("is not CUDA memory (cudaPointerGetAttributes: ") +
                  api.cudaGetErrorString(status) + ")";
      } else if (attributes.type == cudaMemoryTypeUnregistered) {
        problem = "is not CUDA memory (pageable host memory, or no allocation)";
      } else if (attributes.type == cudaMemoryTypeHost) {
        problem = "is pinned host memory, not device memory";
      } else if (attributes.type == cudaMemoryTypeDevice && attributes.device != shared_->device) {
        problem = "is memory of cuda:" + std::to_string(attributes.device) +
                  " but this communicator uses cuda:" + std::to_string(shared_->device);
      }
      if (!problem.empty()) {
        const std::string which = address == first
                                      ? "data " + PointerText(t.data)
                                      : "the last byte of its " + std::to_string(t.count) +
                                            " elements (data " + PointerText(t.data) + ")";
        throw Error(ErrorCode::kInvalidArgument,
                    core::TensorPrefix(rank_, collective, name) + which + " " + problem);
      }
    }
  }

  // Error(kInvalidArgument) unless `value` (the argument `name`: a root, a peer) is a rank.
  void CheckRank(const char* collective, const char* name, int value) const {
    if (value < 0 || value >= size_) {
      throw Error(ErrorCode::kInvalidArgument, Where(collective) + name + " " +
                                                   std::to_string(value) + " is outside [0, " +
                                                   std::to_string(size_) + ")");
    }
  }

  // A peer of a send or a receive: another rank. One to itself would wait for its partner,
  // which the stream runs only after it.
  void CheckPeer(const char* collective, int peer) const {
    CheckRank(collective, "peer", peer);
    if (peer == rank_) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(collective) + "peer " + std::to_string(peer) +
                      " is this rank: its partner would be queued behind it on the stream");
    }
  }

  // An all-to-all's count vector: size() entries summing to `total`.
  void CheckCounts(const char* collective, const char* name, const std::vector<size_t>& counts,
                   size_t total) const {
    if (counts.size() != static_cast<size_t>(size_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(collective) + name + " has " + std::to_string(counts.size()) +
                      " entries, not one per rank (" + std::to_string(size_) +
                      "); both vectors empty means equal blocks");
    }
    size_t sum = 0;
    for (const size_t count : counts) {
      if (count > SIZE_MAX - sum) {
        throw Error(ErrorCode::kInvalidArgument,
                    Where(collective) + name + " sums to more than size_t holds");
      }
      sum += count;
    }
    const char* tensor = std::strcmp(name, "send_counts") == 0 ? "send" : "recv";
    if (sum != total) {
      throw Error(ErrorCode::kInvalidArgument, Where(collective) + name + " sums to " +
                                                   std::to_string(sum) + " but " + tensor +
                                                   " has " + std::to_string(total) + " elements");
    }
  }

  // Error(kInvalidArgument) when the bytes of send and recv overlap: the call has no in-place
  // form (a block received could land on one not yet sent).
  void CheckApart(const char* collective, const Tensor& send, const Tensor& recv) const {
    const uintptr_t s = reinterpret_cast<uintptr_t>(send.data);
    const uintptr_t r = reinterpret_cast<uintptr_t>(recv.data);
    if (send.bytes() == 0 || recv.bytes() == 0) return;
    if (s - r < recv.bytes() || r - s < send.bytes()) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(collective) + "send (data " + PointerText(send.data) + ", " +
                      std::to_string(send.bytes()) + " bytes) and recv (data " +
                      PointerText(recv.data) + ", " + std::to_string(recv.bytes()) +
                      " bytes) overlap; they must lie apart");
    }
  }

  static std::string CountsText(const std::vector<size_t>& counts) {
    std::string out = "[";
    for (size_t i = 0; i < counts.size(); ++i) {
      if (i > 0) out += ",";
      out += std::to_string(counts[i]);
    }
    return out + "]";
  }

  static std::string PeerText(int peer, int64_t tag) {
    return "peer=" + std::to_string(peer) + ", tag=" + std::to_string(tag);
  }

  // body() between ncclGroupStart and ncclGroupEnd, so that NCCL launches its sends and
  // receives together (else a send could wait for a receive queued behind it). The group is
  // closed even when body() fails, and the first failure is returned; ncclGroupEnd's result
  // (ncclInProgress on a non-blocking communicator while NCCL connects) otherwise.
  static ncclResult_t Grouped(const NcclApi& api, const std::function<ncclResult_t()>& body) {
    if (ncclResult_t result = api.ncclGroupStart(); result != ncclSuccess) return result;
    const ncclResult_t inner = body();
    const ncclResult_t end = api.ncclGroupEnd();
    return inner != ncclSuccess ? inner : end;
  }

  void CheckSameType(const char* collective, const Tensor& send, const Tensor& recv) const {
    core::CheckSameDtype(Where(collective), send, recv);
  }

  void CheckOp(const char* collective, ReduceOp op) const {
    core::CheckReduceOp(Where(collective), op);
  }

  // Issues one collective on the stream, in the order calls enter (under shared_->mu), and
  // records the event its Work waits on. `send` and `recv` (null where the call has none) are
  // only described in the message of a refusal.
  std::shared_ptr<Work> Issue(const char* collective, const std::string& detail, const IssueFn& fn,
                              const Tensor* send = nullptr, const Tensor* recv = nullptr) {
    const NcclApi& api = shared_->api;
    const std::chrono::milliseconds timeout(timeout_ms_.load());
    std::lock_guard<std::mutex> lock(shared_->mu);
    std::string where =
        "rank " + std::to_string(rank_) + ": " + collective + " #" + std::to_string(next_seq_++);
    if (!detail.empty()) where += " (" + detail + ")";
    if (shared_->broken) {
      return std::make_shared<NcclWork>(ForCall(*shared_->broken, where, "was not issued"));
    }
    if (shared_->abort_requested.load(std::memory_order_acquire)) {
      return std::make_shared<NcclWork>(
          ForCall(shared_->BreakLocked(AbortedError()), where, "was not issued"));
    }

    const auto deadline = Clock::now() + timeout;
    cudaError_t status = api.cudaSetDevice(shared_->device);
    if (status != cudaSuccess) {
      return std::make_shared<NcclWork>(
          shared_->BreakLocked(CudaError(api, where, "cudaSetDevice", status)));
    }
    ncclResult_t result = fn(api, shared_->comm, shared_->stream);
    // A non-blocking communicator may still be enqueuing: wait for that (bounded), or for an
    // Abort, which cannot take mu meanwhile and leaves the aborting to this loop.
    while (result == ncclInProgress) {
      if (shared_->abort_requested.load(std::memory_order_acquire)) {
        return std::make_shared<NcclWork>(shared_->BreakLocked(AbortedError()));
      }
      if (Clock::now() >= deadline) {
        return std::make_shared<NcclWork>(shared_->BreakLocked(
            Error(ErrorCode::kTimeout, where + ": NCCL did not accept the call within " +
                                           Ms(timeout) + "; the NCCL communicator was aborted")));
      }
      std::this_thread::sleep_for(kSleepFor);
      ncclResult_t async = ncclSuccess;
      result = api.ncclCommGetAsyncError(shared_->comm, &async);
      if (result == ncclSuccess) result = async;
    }
    if (result != ncclSuccess) {
      // Every refusal breaks the communicator, invalid arguments included: a failed enqueue
      // sets an asynchronous error on a non-blocking communicator (ncclEnqueueCheck calls
      // ncclCommSetAsyncError), after which NCCL refuses everything.
      std::string arguments;
      if (send != nullptr) arguments += "send data " + PointerText(send->data);
      if (recv != nullptr) {
        if (!arguments.empty()) arguments += ", ";
        arguments += "recv data " + PointerText(recv->data);
      }
      if (!arguments.empty()) arguments = " of " + arguments;
      return std::make_shared<NcclWork>(shared_->BreakLocked(
          Error(ToErrorCode(result), where + ": NCCL refused the call" + arguments + ": " +
                                         NcclText(api, result, shared_->comm) +
                                         "; a refusal leaves an NCCL communicator unusable, "
                                         "and it was aborted")));
    }
    cudaEvent_t event = nullptr;
    status = api.cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (status != cudaSuccess) {
      return std::make_shared<NcclWork>(
          shared_->BreakLocked(CudaError(api, where, "cudaEventCreateWithFlags", status)));
    }
    auto owned = std::make_shared<const Event>(api, shared_->device, event);
    status = api.cudaEventRecord(event, shared_->stream);
    if (status != cudaSuccess) {
      return std::make_shared<NcclWork>(
          shared_->BreakLocked(CudaError(api, where, "cudaEventRecord", status)));
    }
    // Forget the calls that completed (and time out a stuck one), then queue this one; its
    // clock starts now if nothing runs before it (see Shared::ProgressLocked).
    const auto now = Clock::now();
    if (std::optional<Error> error = shared_->ProgressLocked(now)) {
      return std::make_shared<NcclWork>(*error);
    }
    std::optional<Clock::time_point> started;
    if (shared_->in_flight.empty()) started = now;
    shared_->in_flight.push_back(Shared::InFlight{owned, where, timeout, started});
    return std::make_shared<NcclWork>(shared_, std::move(owned), std::move(where));
  }

  const std::shared_ptr<Shared> shared_;
  const int rank_;
  const int size_;
  const std::shared_ptr<Store> store_;  // kept alive: rank 0 may host it
  std::atomic<int64_t> timeout_ms_;
  uint64_t next_seq_ = 0;  // guarded by shared_->mu
};

}  // namespace

ErrorCode ToErrorCode(ncclResult_t result) {
  switch (result) {
    case ncclInvalidArgument:
      return ErrorCode::kInvalidArgument;
    case ncclInvalidUsage:
      return ErrorCode::kInvalidUsage;
    case ncclRemoteError:
      return ErrorCode::kPeerLost;
    case ncclSystemError:
      return ErrorCode::kSystem;
    case ncclUnhandledCudaError:
      return ErrorCode::kSystem;
    case ncclInternalError:
      return ErrorCode::kInternal;
    default:
      return ErrorCode::kInternal;  // success / in progress are not errors
  }
}

ncclDataType_t ToNcclDataType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
  }
  throw Error(ErrorCode::kInvalidArgument, "unknown dtype " + std::to_string(int(dtype)));
}

ncclRedOp_t ToNcclRedOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kProd:
      return ncclProd;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kAvg:
      return ncclAvg;
  }
  throw Error(ErrorCode::kInvalidArgument, "unknown reduce op " + std::to_string(int(op)));
}

std::string EncodeUniqueId(const ncclUniqueId& id) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * sizeof(id.internal));
  for (const char c : id.internal) {
    const auto byte = static_cast<unsigned char>(c);
    out += kHex[byte >> 4];
    out += kHex[byte & 15];
  }
  return out;
}

ncclUniqueId DecodeUniqueId(const std::string& text) {
  ncclUniqueId id;
  if (text.size() != 2 * sizeof(id.internal)) {
    throw Error(ErrorCode::kInvalidArgument,
                "an NCCL unique id has " + std::to_string(2 * sizeof(id.internal)) +
                    " hex digits, got " + std::to_string(text.size()) + " characters");
  }
  auto digit = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw Error(ErrorCode::kInvalidArgument,
                std::string("an NCCL unique id holds a non-hex character '") + c + "'");
  };
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    id.internal[i] = static_cast<char>(digit(text[2 * i]) * 16 + digit(text[2 * i + 1]));
  }
  return id;
}

void CheckNcclAlgorithm(int rank, const std::string& algorithm) {
  if (algorithm.empty()) return;
  throw Error(ErrorCode::kNotSupported,
              "rank " + std::to_string(rank) + ": CommunicationOptions::algorithm \"" + algorithm +
                  "\" cannot run on an NCCL communicator, which picks its own algorithms "
                  "(NCCL_ALGO constrains them): leave it empty");
}

std::unique_ptr<CollectiveCommunication> CreateNcclCommunication(int rank, int size,
                                                                 std::shared_ptr<Store> store,
                                                                 const std::string& key_prefix,
                                                                 const CommunicationOptions& given,
                                                                 const NcclOptions& nccl_options) {
  // Refused first: it needs no GPU, and the store is not touched.
  CheckNcclAlgorithm(rank, given.algorithm);
  const NcclApi& api = LoadNccl();  // Error(kNotSupported) without NCCL or a GPU
  const std::string where = "rank " + std::to_string(rank) + ": NCCL set-up";
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error(ErrorCode::kInvalidArgument, where + ": rank " + std::to_string(rank) +
                                                 " is outside [0, " + std::to_string(size) + ")");
  }
  if (!store) throw Error(ErrorCode::kInvalidArgument, where + ": the store is null");
  CommunicationOptions options = given;
  options.timeout = core::CheckTimeout(where, given.timeout);
  const int device = nccl_options.device >= 0 ? nccl_options.device : rank % api.device_count;
  if (device >= api.device_count) {
    throw Error(ErrorCode::kInvalidArgument, where + ": device cuda:" + std::to_string(device) +
                                                 " does not exist (" +
                                                 std::to_string(api.device_count) + " visible)");
  }
  const auto deadline = std::min(Clock::now() + options.timeout, nccl_options.setup_deadline);

  // The unique id, from rank 0 through the store.
  const std::string key = key_prefix + "/id";
  ncclUniqueId id;
  if (rank == 0) {
    const ncclResult_t result = api.ncclGetUniqueId(&id);
    if (result != ncclSuccess) {
      throw Error(ToErrorCode(result),
                  where + ": ncclGetUniqueId failed: " + NcclText(api, result, nullptr));
    }
    store->Set(key, EncodeUniqueId(id));
  } else {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    std::string text;
    try {
      text = store->Get(key, std::max(left, std::chrono::milliseconds(1)));
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kTimeout) throw;
      throw Error(ErrorCode::kTimeout, where + ": timed out after " + Ms(options.timeout) +
                                           " setting up the communicator: rank 0's NCCL unique "
                                           "id did not come (" +
                                           error.message() + ")");
    }
    try {
      id = DecodeUniqueId(text);
    } catch (const Error& error) {
      throw Error(error.code(), where + ": the store's \"" + key +
                                    "\" does not hold rank 0's NCCL unique id: " + error.message());
    }
  }

  cudaError_t status = api.cudaSetDevice(device);
  if (status != cudaSuccess) throw CudaError(api, where, "cudaSetDevice", status);
  auto shared = std::make_shared<Shared>(api, rank, device, options.timeout);
  if (nccl_options.stream != nullptr) {
    shared->stream = static_cast<cudaStream_t>(nccl_options.stream);
  } else {
    // Blocking (cudaStreamDefault): ordered with the legacy default stream, where the
    // caller's unstreamed kernels and copies run (see NcclOptions::stream).
    status = api.cudaStreamCreateWithFlags(&shared->stream, cudaStreamDefault);
    if (status != cudaSuccess) throw CudaError(api, where, "cudaStreamCreateWithFlags", status);
    shared->own_stream = true;
  }
  status = api.cudaMalloc(&shared->barrier_buffer, sizeof(int32_t));
  if (status != cudaSuccess) throw CudaError(api, where, "cudaMalloc", status);
  status = api.cudaMemset(shared->barrier_buffer, 0, sizeof(int32_t));
  if (status != cudaSuccess) throw CudaError(api, where, "cudaMemset", status);

  // Non-blocking initialisation, polled so that the timeout holds.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t state = api.ncclCommInitRankConfig(&comm, size, id, rank, &config);
  while (state == ncclInProgress) {
    if (Clock::now() >= deadline) {
      api.ncclCommAbort(comm);
      throw Error(ErrorCode::kTimeout, where + ": the NCCL communicator of " +
                                           std::to_string(size) + " ranks was not built within " +
                                           Ms(options.timeout) + " (a rank missing?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ncclResult_t async = ncclSuccess;
    state = api.ncclCommGetAsyncError(comm, &async);
    if (state == ncclSuccess) state = async;
  }
  if (state != ncclSuccess) {
    Error error(ToErrorCode(state),
                where + ": ncclCommInitRankConfig failed: " + NcclText(api, state, comm));
    if (comm != nullptr) api.ncclCommAbort(comm);
    throw error;
  }
  shared->comm = comm;
  return std::make_unique<NcclCommunication>(std::move(shared), size, std::move(store),
                                             options.timeout);
}

}  // namespace collectives::nccl
