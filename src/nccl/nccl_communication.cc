// The NCCL implementation of CollectiveCommunication (see nccl_communication.h).
#include "src/nccl/nccl_communication.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "src/core/arguments.h"
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

// NCCL's text for `result`, with the communicator's last error when there is one.
std::string NcclText(const NcclApi& api, ncclResult_t result, ncclComm_t comm) {
  std::string out = api.ncclGetErrorString(result);
  if (comm != nullptr) {
    const char* last = api.ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') {
      out += " (";
      out += last;
      out += ")";
    }
  }
  return out;
}

Error CudaError(const NcclApi& api, const std::string& where, const char* call,
                cudaError_t status) {
  return Error(ErrorCode::kSystem,
               where + ": " + call + " failed: " + api.cudaGetErrorString(status));
}

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
  // the NCCL communicator (once), and returns the sticky error.
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

  const NcclApi& api;
  const int rank;
  const int device;
  const std::chrono::milliseconds finalize_timeout;

  std::mutex mu;
  ncclComm_t comm = nullptr;             // guarded by mu; set once at creation
  cudaStream_t stream = nullptr;         // set once at creation
  bool own_stream = false;               // set once at creation
  void* barrier_buffer = nullptr;        // one int32 on the device; set once at creation
  std::optional<Error> broken;           // guarded by mu
  bool aborted = false;                  // guarded by mu: comm was aborted and must not be used
  std::atomic<bool> broken_flag{false};  // broken, readable without mu
};

// One issued collective: completes when the CUDA event recorded after it has.
// Thread-safety: Wait and Done from any thread; concurrent Waits take turns.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Shared> shared, cudaEvent_t event, std::string where,
           Clock::time_point deadline, std::chrono::milliseconds timeout)
      : shared_(std::move(shared)),
        event_(event),
        where_(std::move(where)),
        deadline_(deadline),
        timeout_(timeout) {}
  // A work that failed before it was issued.
  explicit NcclWork(const Error& error) : error_(error) { done_.store(true); }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  ~NcclWork() override {
    if (event_ != nullptr) shared_->api.cudaEventDestroy(event_);
  }

  void Wait() override {
    std::lock_guard<std::mutex> lock(wait_mu_);
    const auto spin_until = Clock::now() + kSpinFor;
    auto next_check = Clock::now() + kCheckEvery;
    while (!done_.load(std::memory_order_acquire)) {
      const cudaError_t status = shared_->api.cudaEventQuery(event_);
      if (status == cudaSuccess) {
        Finish(std::nullopt);
        break;
      }
      const auto now = Clock::now();
      if (status != cudaErrorNotReady || now >= next_check) {
        std::lock_guard<std::mutex> shared_lock(shared_->mu);
        if (status != cudaErrorNotReady) {
          Finish(shared_->BreakLocked(CudaError(shared_->api, where_, "cudaEventQuery", status)));
          break;
        }
        if (auto error = shared_->CheckLocked(where_)) {
          Finish(error);
          break;
        }
        if (now >= deadline_) {
          Finish(shared_->BreakLocked(
              Error(ErrorCode::kTimeout, where_ + ": did not complete within " + Ms(timeout_) +
                                             "; the NCCL communicator was aborted")));
          break;
        }
        next_check = now + kCheckEvery;
      }
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(kSleepFor);
      }
    }
    if (error_) throw *error_;
  }

  bool Done() const override {
    if (done_.load(std::memory_order_acquire)) return true;
    if (shared_->broken_flag.load(std::memory_order_acquire)) return true;
    return shared_->api.cudaEventQuery(event_) != cudaErrorNotReady;
  }

 private:
  // Under wait_mu_.
  void Finish(const std::optional<Error>& error) {
    error_ = error;
    done_.store(true, std::memory_order_release);
  }

  const std::shared_ptr<Shared> shared_;  // null for a work that failed before it was issued
  const cudaEvent_t event_ = nullptr;
  const std::string where_;
  const Clock::time_point deadline_{};
  const std::chrono::milliseconds timeout_{0};
  std::mutex wait_mu_;
  std::atomic<bool> done_{false};
  std::optional<Error> error_;  // guarded by wait_mu_; written before done_ is set
};

class NcclCommunication final : public CollectiveCommunication {
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
    return Issue(kName, Detail(recv.dtype, ToString(op), recv.count),
                 [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
                   return api.ncclAllReduce(send.data, recv.data, recv.count,
                                            ToNcclDataType(recv.dtype), ToNcclRedOp(op), comm,
                                            stream);
                 });
  }

  std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv, int root) override {
    constexpr const char* kName = "broadcast";
    if (root < 0 || root >= size_) {
      throw Error(ErrorCode::kInvalidArgument, Where(kName) + "root " + std::to_string(root) +
                                                   " is outside [0, " + std::to_string(size_) +
                                                   ")");
    }
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
      source = send.data;
    }
    return Issue(kName, Detail(recv.dtype, "root=" + std::to_string(root), recv.count),
                 [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
                   return api.ncclBroadcast(source, recv.data, recv.count,
                                            ToNcclDataType(recv.dtype), root, comm, stream);
                 });
  }

  std::shared_ptr<Work> AllGatherAsync(const Tensor& send, const Tensor& recv) override {
    constexpr const char* kName = "all_gather";
    CheckTensor(kName, "send", send);
    CheckTensor(kName, "recv", recv);
    CheckSameType(kName, send, recv);
    if (recv.count != send.count * static_cast<size_t>(size_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(kName) + "recv must have size * send.count = " +
                      std::to_string(send.count * static_cast<size_t>(size_)) + " elements, got " +
                      std::to_string(recv.count));
    }
    return Issue(kName, Detail(send.dtype, "", send.count),
                 [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
                   return api.ncclAllGather(send.data, recv.data, send.count,
                                            ToNcclDataType(send.dtype), comm, stream);
                 });
  }

  std::shared_ptr<Work> ReduceScatterAsync(const Tensor& send, const Tensor& recv,
                                           ReduceOp op) override {
    constexpr const char* kName = "reduce_scatter";
    CheckTensor(kName, "send", send);
    CheckTensor(kName, "recv", recv);
    CheckSameType(kName, send, recv);
    CheckOp(kName, op);
    if (send.count != recv.count * static_cast<size_t>(size_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  Where(kName) + "send must have size * recv.count = " +
                      std::to_string(recv.count * static_cast<size_t>(size_)) + " elements, got " +
                      std::to_string(send.count));
    }
    return Issue(kName, Detail(recv.dtype, ToString(op), recv.count),
                 [&](const NcclApi& api, ncclComm_t comm, cudaStream_t stream) {
                   return api.ncclReduceScatter(send.data, recv.data, recv.count,
                                                ToNcclDataType(recv.dtype), ToNcclRedOp(op), comm,
                                                stream);
                 });
  }

  // An all-reduce of one int32 on the device.
  std::shared_ptr<Work> BarrierAsync() override {
    void* buffer = shared_->barrier_buffer;
    return Issue("barrier", "", [buffer](const NcclApi& api, ncclComm_t comm, cudaStream_t s) {
      return api.ncclAllReduce(buffer, buffer, 1, ncclInt32, ncclSum, comm, s);
    });
  }

  void Abort() override {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->BreakLocked(Error(ErrorCode::kAborted, "rank " + std::to_string(rank_) +
                                                        ": the communicator was aborted by its "
                                                        "caller"));
  }

  void SetTimeout(std::chrono::milliseconds timeout) override {
    timeout_ms_.store(
        core::CheckTimeout("rank " + std::to_string(rank_) + ": SetTimeout", timeout).count());
  }

 private:
  using IssueFn = std::function<ncclResult_t(const NcclApi&, ncclComm_t, cudaStream_t)>;

  std::string Where(const char* collective) const {
    return core::ArgumentPrefix(rank_, collective);
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
  }

  void CheckSameType(const char* collective, const Tensor& send, const Tensor& recv) const {
    core::CheckSameDtype(Where(collective), send, recv);
  }

  void CheckOp(const char* collective, ReduceOp op) const {
    core::CheckReduceOp(Where(collective), op);
  }

  // Issues one collective on the stream, in the order calls enter (under shared_->mu), and
  // records the event its Work waits on.
  std::shared_ptr<Work> Issue(const char* collective, const std::string& detail,
                              const IssueFn& fn) {
    const NcclApi& api = shared_->api;
    const std::chrono::milliseconds timeout(timeout_ms_.load());
    std::lock_guard<std::mutex> lock(shared_->mu);
    std::string where =
        "rank " + std::to_string(rank_) + ": " + collective + " #" + std::to_string(next_seq_++);
    if (!detail.empty()) where += " (" + detail + ")";
    if (shared_->broken) return std::make_shared<NcclWork>(*shared_->broken);

    const auto deadline = Clock::now() + timeout;
    cudaError_t status = api.cudaSetDevice(shared_->device);
    if (status != cudaSuccess) {
      return std::make_shared<NcclWork>(
          shared_->BreakLocked(CudaError(api, where, "cudaSetDevice", status)));
    }
    ncclResult_t result = fn(api, shared_->comm, shared_->stream);
    // A non-blocking communicator may still be enqueuing: wait for that (bounded).
    while (result == ncclInProgress) {
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
      Error error(ToErrorCode(result),
                  where + ": NCCL refused the call: " + NcclText(api, result, shared_->comm));
      // A refused argument leaves NCCL's communicator intact; anything else breaks it.
      if (result == ncclInvalidArgument || result == ncclInvalidUsage) {
        return std::make_shared<NcclWork>(error);
      }
      return std::make_shared<NcclWork>(shared_->BreakLocked(error));
    }
    cudaEvent_t event = nullptr;
    status = api.cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (status != cudaSuccess) {
      return std::make_shared<NcclWork>(
          shared_->BreakLocked(CudaError(api, where, "cudaEventCreateWithFlags", status)));
    }
    status = api.cudaEventRecord(event, shared_->stream);
    if (status != cudaSuccess) {
      api.cudaEventDestroy(event);
      return std::make_shared<NcclWork>(
          shared_->BreakLocked(CudaError(api, where, "cudaEventRecord", status)));
    }
    return std::make_shared<NcclWork>(shared_, event, std::move(where), deadline, timeout);
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

std::unique_ptr<CollectiveCommunication> CreateNcclCommunication(int rank, int size,
                                                                 std::shared_ptr<Store> store,
                                                                 const std::string& key_prefix,
                                                                 const CommunicationOptions& given,
                                                                 const NcclOptions& nccl_options) {
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
  const auto deadline = Clock::now() + options.timeout;

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
    id = DecodeUniqueId(store->Get(key, options.timeout));
  }

  cudaError_t status = api.cudaSetDevice(device);
  if (status != cudaSuccess) throw CudaError(api, where, "cudaSetDevice", status);
  auto shared = std::make_shared<Shared>(api, rank, device, options.timeout);
  if (nccl_options.stream != nullptr) {
    shared->stream = static_cast<cudaStream_t>(nccl_options.stream);
  } else {
    status = api.cudaStreamCreateWithFlags(&shared->stream, cudaStreamNonBlocking);
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
