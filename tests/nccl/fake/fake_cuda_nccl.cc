// A TEST DOUBLE, NOT CUDA AND NOT NCCL: a CPU stand-in for the few functions of libcudart and
// libnccl that src/nccl/nccl_loader.h lists, so that tests/nccl/nccl_test.cc's GPU tests run on
// a machine without a GPU (the build places this library as libcudart.so.13 and libnccl.so.2 in
// its own folder, and ctest's "fake_nccl:" entries put that folder on LD_LIBRARY_PATH; the
// loader's dlopen of either name then returns this one library).
//
// What it checks: our backend's logic against CUDA's and NCCL's documented contracts: argument
// checks, the order of work on streams, events, Work's completion and timeouts, the
// non-blocking communicator protocol (ncclInProgress, ncclCommGetAsyncError), abort, finalize
// and destroy. What it proves nothing about: real NCCL (its algorithms, transports, kernels,
// their bugs), a real GPU, or speed. Results are computed on the CPU in rank order, so floating
// results may differ from NCCL's in the last bits.
//
// The model, one process with the ranks as threads:
//  - Devices: COLLECTIVES_FAKE_CUDA_DEVICES of them (default 4,
//    so that tests run up to four ranks); the current device is per
//    thread and starts at 0, as the runtime's.
//  - Device memory is host memory from the fake cudaMalloc, filled with 0xff bytes (a NaN in
//    every floating type) so that a read of unwritten memory shows; cudaPointerGetAttributes
//    reports cudaMemoryTypeDevice for it and cudaMemoryTypeUnregistered (cudaSuccess, device
//    cudaInvalidDeviceId, as CUDA 11+) for any other pointer. cudaFree synchronises the
//    allocation's device first (CUDA "may perform implicit synchronization"; it does).
//  - Streams: each runs its work in order on a worker thread of its own; calls enqueue and
//    return at once. A blocking stream (cudaStreamDefault) and the legacy default stream
//    (stream 0, per device) are ordered with each other as CUDA orders them: work on the legacy
//    stream waits for the work queued before it on every blocking stream of its device, and
//    work on a blocking stream waits for the work queued before it on the legacy stream.
//    cudaMemcpy and cudaMemset run on the legacy stream with CUDA's host synchronisation:
//    host-to-device from pageable memory synchronises the stream, stages the source and
//    returns before the copy lands; device-to-host returns when the copy is done;
//    device-to-device and memset do not wait. Events mark a point on a stream:
//    cudaEventQuery is cudaErrorNotReady until the stream has passed it.
//  - A "kernel" (a collective) whose buffers are not memory of its device faults as a GPU
//    does: the device gets the sticky error cudaErrorIllegalAddress, which every later call on
//    that device returns, and the communicator's asynchronous error becomes
//    ncclUnhandledCudaError.
//  - NCCL: ncclGetUniqueId makes a fresh id; ncclCommInitRankConfig rendezvouses the ranks of
//    one id within the process (two ranks on one device: ncclInvalidUsage, as NCCL's
//    "Duplicate GPU detected"). A non-blocking communicator (config.blocking = 0) returns
//    ncclInProgress from its init, and from its first collective, until
//    ncclCommGetAsyncError, polled at least 1 ms later, reports ncclSuccess; a call made while
//    the state is ncclInProgress is a contract violation. NCCL connects the ranks at the first
//    collective, exchanging with the peers on the CPU ("non-blocking is on the CPU side ...
//    may include creating connections with other peers, and could therefore lead to hangs",
//    NCCL's maintainers): so the first collective of a rank is accepted only once every rank
//    has issued its first (ncclInProgress until then; a blocking communicator's call blocks).
//    Collectives check their arguments (datatype, op, root, stream) as NCCL does, a refusal
//    setting the asynchronous error of a non-blocking communicator, and enqueue on the stream;
//    when run, each waits for every rank of the communicator to reach the same call (the n-th
//    call of each rank meet), then the last to arrive computes every rank's result.
//    ncclReduce writes the root's recv only.
//  - Point to point: ncclSend and ncclRecv queue on the calling thread's group (one of their own
//    outside ncclGroupStart/ncclGroupEnd); ncclGroupEnd checks each communicator's operations as
//    a collective's, then puts them on its stream as one "kernel". The first group of a rank
//    that names a peer connects the two: it is accepted (ncclInProgress until then on a
//    non-blocking communicator, as the first collective) once that peer has issued a group
//    naming this rank; a rank's sends and receives with itself need no connection. When run,
//    the kernel posts all its sends, then takes each receive's send from the FIFO of sends
//    from that peer to this rank (sends and receives pair in issue order, as NCCL's), copies
//    it and marks the send consumed; it completes once its own sends are consumed too, so a
//    send waits for its receive (NCCL's rendezvous for large messages). A receive whose send
//    has another count or datatype is a contract violation (NCCL: undefined) and hangs.
//    Collectives inside a group are not modelled (a contract violation).
//    ncclCommAbort wakes this rank's waiting and queued calls (they return at once, their
//    output undefined), withdrawing its sends not yet received; peers keep waiting, as on a
//    GPU. ncclCommFinalize reports ncclSuccess
//    once every call of this rank has run; ncclCommDestroy waits for that too.
//  - Where real NCCL or CUDA would be undefined (a communicator used after ncclCommAbort or
//    ncclCommDestroy, a call while the state is ncclInProgress, ranks that disagree on a call,
//    an unknown stream or event), the fake prints "fake_cuda_nccl: CONTRACT VIOLATION: ..." to
//    stderr and returns an error (ranks that disagree hang, as they typically do on NCCL). With
//    COLLECTIVES_FAKE_NCCL_STRICT=1 a violation aborts the process instead.
// Fault injection, for tests that need the fake (they find it with dlsym on the loaded
// libnccl.so.2 and skip elsewhere): collectivesFakeNcclFailNext(function, result, message) makes
// the next call of that NCCL function (ncclGetUniqueId or ncclCommInitRankConfig) return
// `result` at once, with `message` as NCCL's last error.
//  - Pinned host memory: cudaHostAlloc returns page-locked host memory (tracked; cudaFreeHost
//    synchronises every device first, as the runtime's implicit synchronisation). cudaMemcpyAsync
//    between device memory and pinned memory queues the copy on the stream and returns at once;
//    with a pageable host side it behaves as CUDA's does (device-to-host returns once the copy is
//    done, host-to-device stages the source first). cudaStreamWaitEvent makes a stream's later
//    work wait for an event recorded on another stream (of any device); cudaEventSynchronize
//    waits for it on the host.
//  - Copy accounting, for tests that must show what crossed between host and device:
//    collectivesFakeCudaCopyStats(stats) fills uint64_t[6] with the bytes copied between host
//    and device, the largest single copy, the number of copies, the cudaMemcpyAsync calls whose
//    host side was pageable, and the pinned bytes allocated now and at their peak;
//    collectivesFakeCudaResetCopyStats() zeroes the first four and sets the peak to what is
//    allocated now; collectivesFakeCudaCopyOrder(out, capacity) gives, per stream, the order of
//    its cudaMemcpyAsync calls ('i' to the host, 'o' to the device), which shows whether a
//    segment's copy in is issued before the previous segment's copy out.
//  - cuBLAS: cublasCreate_v2, cublasSetStream_v2, cublasSgemm_v2 and cublasDestroy_v2, for the
//    training demo's GPU replicas (the last section; the build also names this library
//    libcublas.so.13).
// Not modelled: per-thread default streams, managed memory, peer access, groups
// of collectives or of several streams, fp8 types (refused with ncclInvalidArgument),
// ncclCommSplit and the rest.
//
// One file: it is one shared library whose NCCL half runs on the CUDA half's state: collectives
// enqueue on the runtime's streams under its mutex and fault into its sticky device errors (Rt()).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "src/core/half.h"

// The opaque handle types of cuda_runtime_api.h and nccl.h, defined here.
struct CUstream_st;
struct CUevent_st;
struct ncclComm;

namespace {

using Clock = std::chrono::steady_clock;

[[gnu::format(printf, 1, 2)]] void Violation(const char* format, ...) {
  char text[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof(text), format, args);
  va_end(args);
  std::fprintf(stderr, "fake_cuda_nccl: CONTRACT VIOLATION: %s\n", text);
  std::fflush(stderr);
  const char* strict = std::getenv("COLLECTIVES_FAKE_NCCL_STRICT");
  if (strict != nullptr && std::string(strict) == "1") std::abort();
}

// ---------------------------------------------------------------------------------------------
// CUDA runtime state.
// ---------------------------------------------------------------------------------------------

struct Op {
  uint64_t ticket = 0;
  // (stream, ticket): this op runs once each of those streams has completed that ticket.
  std::vector<std::pair<std::shared_ptr<CUstream_st>, uint64_t>> deps;
  std::function<void()> fn;  // may be empty (a marker)
};

}  // namespace

struct CUstream_st {
  int device = 0;
  bool blocking = true;    // synchronises with the legacy default stream
  bool legacy = false;     // the legacy default stream of `device`
  std::deque<Op> queue;    // guarded by Runtime::mu
  uint64_t enqueued = 0;   // last ticket issued; guarded by Runtime::mu
  uint64_t completed = 0;  // last ticket run; guarded by Runtime::mu
  bool destroyed = false;  // guarded by Runtime::mu
};

struct CUevent_st {
  int device = 0;
  std::shared_ptr<CUstream_st> stream;  // null until recorded
  uint64_t ticket = 0;
};

namespace {

struct Allocation {
  size_t bytes;
  int device;
};

// Everything of the fake runtime, under one mutex; `progress` is notified whenever a stream
// completes an op or gets one. Never destroyed: detached stream workers may still wait on it
// while the process exits.
struct Runtime {
  std::mutex mu;
  std::condition_variable progress;
  int device_count = 4;
  std::map<uintptr_t, Allocation> allocations;                             // by base address
  std::unordered_map<CUstream_st*, std::shared_ptr<CUstream_st>> streams;  // user streams
  std::vector<std::shared_ptr<CUstream_st>> legacy;                        // per device
  std::vector<std::vector<std::shared_ptr<CUstream_st>>> device_streams;   // every live one
  std::set<CUevent_st*> events;
  std::vector<cudaError_t> sticky;  // per device: cudaErrorIllegalAddress after a fault
  std::map<uintptr_t, size_t> pinned;  // cudaHostAlloc's page-locked host memory, by base
  // What the host<->device copies moved (collectivesFakeCudaCopyStats).
  uint64_t copied_bytes = 0;
  uint64_t largest_copy = 0;
  uint64_t copies = 0;
  uint64_t async_from_pageable = 0;  // cudaMemcpyAsync calls with a pageable host side
  size_t pinned_live = 0;            // bytes of pinned memory allocated now
  size_t pinned_peak = 0;            // the most of them at any time
  // Per stream, in issue order, 'i' for each cudaMemcpyAsync to the host and 'o' for each to the
  // device (collectivesFakeCudaCopyOrder).
  std::map<const CUstream_st*, std::string> copy_order;
};

Runtime& Rt() {
  static Runtime* runtime = [] {
    auto* r = new Runtime;
    if (const char* count = std::getenv("COLLECTIVES_FAKE_CUDA_DEVICES")) {
      r->device_count = std::max(0, std::atoi(count));
    }
    r->legacy.resize(static_cast<size_t>(r->device_count));
    r->device_streams.resize(static_cast<size_t>(r->device_count));
    r->sticky.assign(static_cast<size_t>(r->device_count), cudaSuccess);
    return r;
  }();
  return *runtime;
}

thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;

cudaError_t Fail(cudaError_t error) {
  last_error = error;
  return error;
}

// Under mu: whether [pointer, pointer + bytes) lies in one pinned host allocation.
bool PinnedLocked(const void* pointer, size_t bytes) {
  Runtime& rt = Rt();
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  auto it = rt.pinned.upper_bound(address);
  if (it == rt.pinned.begin()) return false;
  --it;
  return address - it->first < it->second && bytes <= it->second - (address - it->first);
}

// Under mu: counts one host<->device copy of `bytes`.
void CountCopyLocked(size_t bytes) {
  Runtime& rt = Rt();
  rt.copied_bytes += bytes;
  rt.largest_copy = std::max<uint64_t>(rt.largest_copy, bytes);
  ++rt.copies;
}

// Under mu: the allocation holding [pointer, pointer + bytes), or null.
const Allocation* FindLocked(const void* pointer, size_t bytes, uintptr_t* base = nullptr) {
  Runtime& rt = Rt();
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  auto it = rt.allocations.upper_bound(address);
  if (it == rt.allocations.begin()) return nullptr;
  --it;
  const uintptr_t start = it->first;
  const size_t size = it->second.bytes;
  if (address - start >= size || bytes > size - (address - start)) return nullptr;
  if (base != nullptr) *base = start;
  return &it->second;
}

void WorkerLoop(std::shared_ptr<CUstream_st> stream) {
  Runtime& rt = Rt();
  std::unique_lock<std::mutex> lock(rt.mu);
  while (true) {
    rt.progress.wait(lock, [&] { return !stream->queue.empty() || stream->destroyed; });
    if (stream->queue.empty()) break;  // destroyed and drained
    Op& op = stream->queue.front();
    rt.progress.wait(lock, [&] {
      for (const auto& [other, ticket] : op.deps) {
        if (other->completed < ticket) return false;
      }
      return true;
    });
    std::function<void()> fn = std::move(op.fn);
    const uint64_t ticket = op.ticket;
    lock.unlock();
    if (fn) fn();
    lock.lock();
    stream->completed = ticket;
    stream->queue.pop_front();
    rt.progress.notify_all();
  }
  auto& list = rt.device_streams[static_cast<size_t>(stream->device)];
  list.erase(std::remove(list.begin(), list.end(), stream), list.end());
}

// Under mu: a new stream with its worker.
std::shared_ptr<CUstream_st> NewStreamLocked(int device, bool blocking, bool legacy) {
  auto stream = std::make_shared<CUstream_st>();
  stream->device = device;
  stream->blocking = blocking;
  stream->legacy = legacy;
  Rt().device_streams[static_cast<size_t>(device)].push_back(stream);
  std::thread(WorkerLoop, stream).detach();
  return stream;
}

// Under mu: the legacy default stream of `device`.
std::shared_ptr<CUstream_st> LegacyLocked(int device) {
  auto& legacy = Rt().legacy[static_cast<size_t>(device)];
  if (!legacy) legacy = NewStreamLocked(device, true, true);
  return legacy;
}

// Under mu: the stream a handle names (0 and cudaStreamLegacy: the legacy default stream of the
// current device), or null for an unknown one.
std::shared_ptr<CUstream_st> ResolveLocked(cudaStream_t handle) {
  if (handle == nullptr || handle == cudaStreamLegacy) return LegacyLocked(current_device);
  auto it = Rt().streams.find(handle);
  return it == Rt().streams.end() ? nullptr : it->second;
}

// Under mu: queues `fn` on `stream` after what CUDA orders it after; returns its ticket.
uint64_t EnqueueLocked(const std::shared_ptr<CUstream_st>& stream, std::function<void()> fn) {
  Runtime& rt = Rt();
  Op op;
  if (stream->legacy) {
    for (const auto& other : rt.device_streams[static_cast<size_t>(stream->device)]) {
      if (other != stream && other->blocking && other->enqueued > other->completed) {
        op.deps.emplace_back(other, other->enqueued);
      }
    }
  } else if (stream->blocking) {
    auto legacy = LegacyLocked(stream->device);
    if (legacy->enqueued > legacy->completed) op.deps.emplace_back(legacy, legacy->enqueued);
  }
  op.ticket = ++stream->enqueued;
  op.fn = std::move(fn);
  stream->queue.push_back(std::move(op));
  rt.progress.notify_all();
  return stream->enqueued;
}

void WaitLocked(std::unique_lock<std::mutex>& lock, const std::shared_ptr<CUstream_st>& stream,
                uint64_t ticket) {
  Rt().progress.wait(lock, [&] { return stream->completed >= ticket; });
}

// Under mu: every stream of `device` has run what was queued on it before this call.
void SynchronizeDeviceLocked(std::unique_lock<std::mutex>& lock, int device) {
  std::vector<std::pair<std::shared_ptr<CUstream_st>, uint64_t>> targets;
  for (const auto& stream : Rt().device_streams[static_cast<size_t>(device)]) {
    targets.emplace_back(stream, stream->enqueued);
  }
  for (const auto& [stream, ticket] : targets) WaitLocked(lock, stream, ticket);
}

// Under mu: the current device's sticky error, if any.
cudaError_t StickyLocked() { return Rt().sticky[static_cast<size_t>(current_device)]; }

// A device fault: the device's context is lost, as after an illegal address in a kernel.
void FaultDevice(int device, const std::string& what) {
  std::fprintf(stderr,
               "fake_cuda_nccl: a kernel on device %d touched memory that is not memory of that "
               "device (%s): cudaErrorIllegalAddress from now on\n",
               device, what.c_str());
  std::lock_guard<std::mutex> lock(Rt().mu);
  Rt().sticky[static_cast<size_t>(device)] = cudaErrorIllegalAddress;
}

// ---------------------------------------------------------------------------------------------
// Element types and reductions, as NCCL computes them: 16-bit floats round after each step;
// ncclAvg multiplies floating values by 1/n before summing and divides an integer sum by n.
// ---------------------------------------------------------------------------------------------

// The library's own conversions (src/core/half.h, header only): round to nearest even; a NaN
// keeps its top payload bits and gains the quiet bit.
float HalfToFloat(uint16_t bits) { return collectives::core::half::HalfBitsToFloat(bits); }
uint16_t FloatToHalf(float value) { return collectives::core::half::FloatToHalfBits(value); }
float BFloat16ToFloat(uint16_t bits) { return collectives::core::half::BFloat16BitsToFloat(bits); }
uint16_t FloatToBFloat16(float value) {
  return collectives::core::half::FloatToBFloat16Bits(value);
}

// Storage type S, computed as C.
template <typename S, typename C, C (*In)(S), S (*Out)(C), bool kFloating>
struct Kind {
  using Storage = S;
  using Calc = C;
  static C Load(S v) { return In(v); }
  static S Store(C v) { return Out(v); }
  static constexpr bool floating = kFloating;
};
template <typename T>
T Same(T v) {
  return v;
}
template <typename T>
using Plain = Kind<T, T, Same<T>, Same<T>, std::is_floating_point_v<T>>;
using HalfKind = Kind<uint16_t, float, HalfToFloat, FloatToHalf, true>;
using BFloat16Kind = Kind<uint16_t, float, BFloat16ToFloat, FloatToBFloat16, true>;

template <typename K>
typename K::Calc Combine(typename K::Calc a, typename K::Calc b, ncclRedOp_t op) {
  using C = typename K::Calc;
  if constexpr (K::floating) {
    switch (op) {
      case ncclProd:
        return a * b;
      case ncclMin:
        return std::min(a, b);
      case ncclMax:
        return std::max(a, b);
      default:  // sum, avg
        return a + b;
    }
  } else {  // integers wrap, as on the GPU
    using U = std::make_unsigned_t<C>;
    switch (op) {
      case ncclProd:
        return static_cast<C>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
      case ncclMin:
        return std::min(a, b);
      case ncclMax:
        return std::max(a, b);
      default:
        return static_cast<C>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    }
  }
}

// out[i] = op over r of in[r][i], i < count; ranks combined in order 0..n-1.
template <typename K>
void ReduceTyped(void* out_bytes, const std::vector<const void*>& in_bytes, size_t count,
                 ncclRedOp_t op) {
  using S = typename K::Storage;
  using C = typename K::Calc;
  const size_t n = in_bytes.size();
  auto* out = static_cast<S*>(out_bytes);
  std::vector<const S*> in(n);
  for (size_t r = 0; r < n; ++r) in[r] = static_cast<const S*>(in_bytes[r]);
  // ncclAvg on floating types: each value times 1/n (in the type), then summed.
  const C scale = K::Load(K::Store(static_cast<C>(1.0 / static_cast<double>(n))));
  auto load = [&](size_t r, size_t i) -> C {
    C v = K::Load(in[r][i]);
    if constexpr (K::floating) {
      if (op == ncclAvg) v = K::Load(K::Store(v * scale));
    }
    return v;
  };
  for (size_t i = 0; i < count; ++i) {
    C acc = load(0, i);
    for (size_t r = 1; r < n; ++r) acc = K::Load(K::Store(Combine<K>(acc, load(r, i), op)));
    if constexpr (!K::floating) {
      if (op == ncclAvg) acc = static_cast<C>(acc / static_cast<C>(n));
    }
    out[i] = K::Store(acc);
  }
}

size_t TypeSize(ncclDataType_t type) {
  switch (type) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

void Reduce(ncclDataType_t type, void* out, const std::vector<const void*>& in, size_t count,
            ncclRedOp_t op) {
  switch (type) {
    case ncclInt8:
      return ReduceTyped<Plain<int8_t>>(out, in, count, op);
    case ncclUint8:
      return ReduceTyped<Plain<uint8_t>>(out, in, count, op);
    case ncclInt32:
      return ReduceTyped<Plain<int32_t>>(out, in, count, op);
    case ncclUint32:
      return ReduceTyped<Plain<uint32_t>>(out, in, count, op);
    case ncclInt64:
      return ReduceTyped<Plain<int64_t>>(out, in, count, op);
    case ncclUint64:
      return ReduceTyped<Plain<uint64_t>>(out, in, count, op);
    case ncclFloat16:
      return ReduceTyped<HalfKind>(out, in, count, op);
    case ncclBfloat16:
      return ReduceTyped<BFloat16Kind>(out, in, count, op);
    case ncclFloat32:
      return ReduceTyped<Plain<float>>(out, in, count, op);
    case ncclFloat64:
      return ReduceTyped<Plain<double>>(out, in, count, op);
    default:
      std::abort();  // refused at the call
  }
}

// ---------------------------------------------------------------------------------------------
// NCCL state.
// ---------------------------------------------------------------------------------------------

enum class Coll { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kReduce };

const char* CollName(Coll coll) {
  switch (coll) {
    case Coll::kAllReduce:
      return "AllReduce";
    case Coll::kBroadcast:
      return "Broadcast";
    case Coll::kAllGather:
      return "AllGather";
    case Coll::kReduceScatter:
      return "ReduceScatter";
    case Coll::kReduce:
      return "Reduce";
  }
  return "?";
}

// One rank's arguments of one call (count is NCCL's: recvcount for ReduceScatter, sendcount
// for AllGather).
struct Call {
  Coll coll;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
};

std::string Describe(const Call& c) {
  char text[160];
  std::snprintf(text, sizeof(text), "%s(count=%zu, datatype=%d, op=%d, root=%d)", CollName(c.coll),
                c.count, static_cast<int>(c.type), static_cast<int>(c.op), c.root);
  return text;
}

// One ncclSend or ncclRecv of a group.
struct P2pOp {
  bool is_send;
  const void* send;  // is_send
  void* recv;        // !is_send
  size_t count;
  ncclDataType_t type;
  int peer;
  cudaStream_t stream;
};

// A send posted by a running group kernel, until a receive takes it.
struct Posted {
  const void* data;
  size_t count;
  ncclDataType_t type;
  bool consumed = false;  // guarded by Clique::mu
};

struct Slot {
  std::vector<std::optional<Call>> calls;  // by rank
  int arrived = 0;
  int left = 0;  // ranks still to leave after it is done
  bool done = false;
  bool mismatch_reported = false;
};

// The ranks of one unique id.
struct Clique {
  explicit Clique(int n) : nranks(n), members(static_cast<size_t>(n), nullptr) {}
  const int nranks;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<ncclComm*> members;  // guarded by mu; by rank, null until joined
  int joined = 0;                  // guarded by mu
  bool complete = false;           // guarded by mu
  std::atomic<int> connecting{0};  // ranks that issued their first collective
  std::map<uint64_t, Slot> slots;  // guarded by mu; by call number
  // Point to point, guarded by mu: (a, b) when rank a issued a group naming peer b (the two
  // are connected once both pairs are here); the sends posted from a to b, oldest first.
  std::set<std::pair<int, int>> p2p_wants;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Posted>>> channels;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Clique>> pending;  // by id bytes, until complete
  std::set<ncclComm*> live;
  std::set<ncclComm*> dead;  // aborted or destroyed (kept: real NCCL freed them)
  uint64_t ids = 0;
  char last_error[1024] = "";
  std::map<std::string, std::pair<ncclResult_t, std::string>> fail_next;  // by function name
};

Registry& Reg() {
  static Registry* registry = new Registry;  // never destroyed, as Runtime
  return *registry;
}

[[gnu::format(printf, 1, 2)]] void SetLastError(const char* format, ...) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::snprintf(reg.last_error, sizeof(reg.last_error), "fake NCCL: ");
  const size_t used = std::strlen(reg.last_error);
  va_list args;
  va_start(args, format);
  std::vsnprintf(reg.last_error + used, sizeof(reg.last_error) - used, format, args);
  va_end(args);
}

// The failure injected into the next call of `function`, if any (then consumed).
std::optional<ncclResult_t> Injected(const char* function) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.fail_next.find(function);
  if (it == reg.fail_next.end()) return std::nullopt;
  const ncclResult_t result = it->second.first;
  std::snprintf(reg.last_error, sizeof(reg.last_error), "%s", it->second.second.c_str());
  reg.fail_next.erase(it);
  return result;
}

constexpr char kIdMagic[] = "collectives-fake-nccl-id";

}  // namespace

struct ncclComm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int nranks = 0;
  int device = 0;
  bool blocking = true;
  std::mutex mu;  // serialises this handle's calls (NCCL requires the caller to)
  std::atomic<ncclResult_t> state{ncclInProgress};  // NCCL's asynchronous result
  std::atomic<bool> aborted{false};
  bool dead = false;        // guarded by mu: aborted or destroyed
  bool finalizing = false;  // guarded by mu
  bool connected = false;   // guarded by mu: the first collective was issued
  uint64_t next_call = 0;   // guarded by mu
  uint64_t issued = 0;      // guarded by mu: calls enqueued on a stream
  std::atomic<uint64_t> finished{0};
  // The first collective of a non-blocking communicator, waiting for its lazy connection.
  struct Pending {
    std::shared_ptr<CUstream_st> stream;
    std::function<void()> fn;
    Clock::time_point since;
    std::function<bool()> connected;  // under mu: the peers it needs have come
  };
  std::set<int> p2p_connected;     // guarded by mu: peers connected by an earlier group
  std::optional<Pending> pending;  // guarded by mu
};

namespace {

// Whether a handle may be used: non-null, known, and neither aborted nor destroyed.
ncclResult_t CheckComm(ncclComm* comm, const char* call) {
  if (comm == nullptr) {
    SetLastError("%s: comm argument is NULL", call);
    return ncclInvalidArgument;
  }
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  if (reg.dead.count(comm) != 0) {
    Violation("%s on a communicator after ncclCommAbort or ncclCommDestroy (freed in NCCL)", call);
    return ncclInvalidUsage;
  }
  if (reg.live.count(comm) == 0) {
    Violation("%s on an unknown communicator %p", call, static_cast<void*>(comm));
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

void MarkDead(ncclComm* comm) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.live.erase(comm);
  reg.dead.insert(comm);
}

// Whether [pointer, pointer + bytes) is memory of `device` (bytes 0: anything goes).
bool OnDevice(const void* pointer, size_t bytes, int device) {
  if (bytes == 0) return true;
  std::lock_guard<std::mutex> lock(Rt().mu);
  const Allocation* allocation = FindLocked(pointer, bytes);
  return allocation != nullptr && allocation->device == device;
}

// Runs on the stream's worker: rank comm->rank's part of call number `index`. Waits for every
// rank to arrive; the last computes every rank's output.
void RunCall(ncclComm* comm, const std::shared_ptr<Clique>& clique, uint64_t index, Call call) {
  struct Finish {
    ncclComm* comm;
    ~Finish() { comm->finished.fetch_add(1); }
  } finish{comm};
  if (comm->aborted.load()) return;  // an aborted communicator's kernels return at once
  const size_t elem = TypeSize(call.type);
  const size_t n = static_cast<size_t>(comm->nranks);
  size_t send_bytes = call.count * elem, recv_bytes = call.count * elem;
  if (call.coll == Coll::kAllGather) recv_bytes *= n;
  if (call.coll == Coll::kReduceScatter) send_bytes *= n;
  if (call.coll == Coll::kReduce && call.root != comm->rank) recv_bytes = 0;  // not used
  const bool reads_send = call.coll != Coll::kBroadcast || call.root == comm->rank;
  if ((reads_send && !OnDevice(call.send, send_bytes, comm->device)) ||
      !OnDevice(call.recv, recv_bytes, comm->device)) {
    char what[200];
    std::snprintf(what, sizeof(what), "rank %d's %s, send %p, recv %p", comm->rank,
                  Describe(call).c_str(), call.send, static_cast<void*>(call.recv));
    FaultDevice(comm->device, what);
    comm->state.store(ncclUnhandledCudaError);
    return;
  }

  std::unique_lock<std::mutex> lock(clique->mu);
  if (comm->aborted.load()) return;  // an aborted communicator's kernels return at once
  Slot& slot = clique->slots[index];
  if (slot.calls.empty()) slot.calls.resize(n);
  slot.calls[static_cast<size_t>(comm->rank)] = call;
  ++slot.arrived;
  if (slot.arrived == comm->nranks) {
    const Call& first = *slot.calls[0];
    bool agree = true;
    for (const auto& other : slot.calls) {
      agree = agree && other->coll == first.coll && other->count == first.count &&
              other->type == first.type && other->op == first.op && other->root == first.root;
    }
    if (!agree) {
      std::string all;
      for (size_t r = 0; r < n; ++r) {
        all += "; rank " + std::to_string(r) + ": " + Describe(*slot.calls[r]);
      }
      Violation("the ranks disagree on call #%llu (NCCL: undefined, typically a hang)%s",
                static_cast<unsigned long long>(index), all.c_str());
    } else {
      const size_t count = first.count;
      const size_t bytes = count * elem;
      std::vector<const void*> sends(n);
      for (size_t r = 0; r < n; ++r) sends[r] = slot.calls[r]->send;
      std::vector<unsigned char> result;
      switch (first.coll) {
        case Coll::kAllReduce:
          result.resize(bytes);
          Reduce(first.type, result.data(), sends, count, first.op);
          for (size_t r = 0; r < n; ++r) std::memcpy(slot.calls[r]->recv, result.data(), bytes);
          break;
        case Coll::kBroadcast:
          result.assign(
              static_cast<const unsigned char*>(sends[static_cast<size_t>(first.root)]),
              static_cast<const unsigned char*>(sends[static_cast<size_t>(first.root)]) + bytes);
          for (size_t r = 0; r < n; ++r) std::memcpy(slot.calls[r]->recv, result.data(), bytes);
          break;
        case Coll::kAllGather:
          result.resize(bytes * n);
          for (size_t r = 0; r < n; ++r) std::memcpy(result.data() + r * bytes, sends[r], bytes);
          for (size_t r = 0; r < n; ++r) {
            std::memcpy(slot.calls[r]->recv, result.data(), bytes * n);
          }
          break;
        case Coll::kReduceScatter:
          result.resize(bytes * n);
          Reduce(first.type, result.data(), sends, count * n, first.op);
          for (size_t r = 0; r < n; ++r) {
            std::memcpy(slot.calls[r]->recv, result.data() + r * bytes, bytes);
          }
          break;
        case Coll::kReduce:
          result.resize(bytes);
          Reduce(first.type, result.data(), sends, count, first.op);
          if (bytes > 0) {
            std::memcpy(slot.calls[static_cast<size_t>(first.root)]->recv, result.data(), bytes);
          }
          break;
      }
      slot.done = true;
      slot.left = comm->nranks;
      clique->cv.notify_all();
    }
  }
  clique->cv.wait(lock, [&] { return slot.done || comm->aborted.load(); });
  if (slot.done && --slot.left == 0) clique->slots.erase(index);
}

// Under comm->mu: the state a call may start from, or the error to return.
ncclResult_t ReadyLocked(ncclComm* comm, const char* call) {
  const ncclResult_t state = comm->state.load();
  if (state == ncclInProgress) {
    Violation(
        "%s on rank %d while its communicator is ncclInProgress (a non-blocking communicator "
        "must be polled with ncclCommGetAsyncError until ncclSuccess first)",
        call, comm->rank);
    return ncclInvalidUsage;
  }
  if (state != ncclSuccess) {
    SetLastError("%s: the communicator has an asynchronous error (%d)", call,
                 static_cast<int>(state));
    return state;
  }
  if (comm->finalizing) {
    SetLastError("%s: the communicator was finalized", call);
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

// The stream a call of `comm` names, in *target, or the error NCCL returns for it.
ncclResult_t StreamFor(ncclComm* comm, cudaStream_t stream, const char* name,
                       std::shared_ptr<CUstream_st>* target) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  const int saved = current_device;
  current_device = comm->device;  // NCCL works on the communicator's device
  *target = ResolveLocked(stream);
  current_device = saved;
  if (*target == nullptr) {
    Violation("%s: unknown stream %p", name, static_cast<void*>(stream));
    return ncclInvalidArgument;
  }
  if ((*target)->device != comm->device) {
    SetLastError("%s: the stream is on device %d, the communicator on device %d", name,
                 (*target)->device, comm->device);
    return ncclUnhandledCudaError;
  }
  if (Rt().sticky[static_cast<size_t>(comm->device)] != cudaSuccess) {
    SetLastError("%s: Cuda failure 'an illegal memory access was encountered'", name);
    return ncclUnhandledCudaError;
  }
  return ncclSuccess;
}

// The operations of the calling thread's open group (ncclGroupStart .. ncclGroupEnd).
thread_local int group_depth = 0;
thread_local std::vector<std::pair<ncclComm*, P2pOp>> group_ops;
thread_local ncclResult_t group_error = ncclSuccess;  // the first refusal inside the group

// The collectives' common path: NCCL's argument checks, then the enqueue.
ncclResult_t Collective(ncclComm_t comm, cudaStream_t stream, Call call, const char* name) {
  if (ncclResult_t r = CheckComm(comm, name); r != ncclSuccess) return r;
  if (group_depth > 0) {
    Violation("%s inside ncclGroupStart/ncclGroupEnd: groups of collectives are not modelled",
              name);
    return ncclInvalidUsage;
  }
  std::lock_guard<std::mutex> comm_lock(comm->mu);
  if (ncclResult_t r = ReadyLocked(comm, name); r != ncclSuccess) return r;
  // A refused call sets the asynchronous error of a non-blocking communicator.
  auto refuse = [&](ncclResult_t result) {
    if (!comm->blocking) comm->state.store(result);
    return result;
  };
  if (call.type < 0 || call.type >= ncclNumTypes) {
    SetLastError("%s: invalid type %d", name, static_cast<int>(call.type));
    return refuse(ncclInvalidArgument);
  }
  if (call.type == ncclFloat8e4m3 || call.type == ncclFloat8e5m2) {
    SetLastError("%s: fp8 types are not implemented by the fake", name);
    return refuse(ncclInvalidArgument);
  }
  if (call.op < 0 || call.op >= ncclNumOps) {
    SetLastError("%s: invalid reduction operation %d", name, static_cast<int>(call.op));
    return refuse(ncclInvalidArgument);
  }
  if (call.root < 0 || call.root >= comm->nranks) {
    SetLastError("%s: invalid root %d (root should be in the 0..%d range)", name, call.root,
                 comm->nranks);
    return refuse(ncclInvalidArgument);
  }
  std::shared_ptr<CUstream_st> target;
  if (ncclResult_t r = StreamFor(comm, stream, name, &target); r != ncclSuccess) {
    return refuse(r);
  }
  const uint64_t index = comm->next_call++;
  std::shared_ptr<Clique> clique = comm->clique;
  std::function<void()> fn = [comm, clique, index, call] { RunCall(comm, clique, index, call); };
  ++comm->issued;
  if (!comm->connected) {
    // NCCL connects the ranks at the first collective, which needs every peer to be there.
    comm->connected = true;
    if (++clique->connecting == comm->nranks) {
      std::lock_guard<std::mutex> lock(clique->mu);
      clique->cv.notify_all();
    }
    if (!comm->blocking) {
      comm->pending = ncclComm::Pending{target, std::move(fn), Clock::now(), [clique] {
                                          return clique->connecting.load() == clique->nranks;
                                        }};
      comm->state.store(ncclInProgress);
      return ncclInProgress;
    }
    std::unique_lock<std::mutex> lock(clique->mu);
    clique->cv.wait(lock, [&] { return clique->connecting.load() == comm->nranks; });
  }
  std::lock_guard<std::mutex> lock(Rt().mu);
  EnqueueLocked(target, std::move(fn));
  return ncclSuccess;
}

// Under comm->mu: completes what a non-blocking communicator does in the background.
void ProgressLocked(ncclComm* comm) {
  if (comm->pending && comm->pending->connected() &&
      Clock::now() - comm->pending->since >= std::chrono::milliseconds(1)) {
    {
      std::lock_guard<std::mutex> lock(Rt().mu);
      EnqueueLocked(comm->pending->stream, std::move(comm->pending->fn));
    }
    comm->pending.reset();
    ncclResult_t expected = ncclInProgress;
    comm->state.compare_exchange_strong(expected, ncclSuccess);
  }
  if (comm->finalizing && !comm->pending && comm->finished.load() == comm->issued) {
    ncclResult_t expected = ncclInProgress;
    comm->state.compare_exchange_strong(expected, ncclSuccess);
  }
}

// Marks comm aborted and wakes its waiting calls; its arrivals at unfinished calls are withdrawn
// (its kernels returned, so no peer may touch its buffers any more).
void AbortCalls(ncclComm* comm) {
  Clique& clique = *comm->clique;
  std::lock_guard<std::mutex> lock(clique.mu);
  comm->aborted.store(true);
  for (auto& [index, slot] : clique.slots) {
    auto& mine = slot.calls[static_cast<size_t>(comm->rank)];
    if (!slot.done && mine) {
      mine.reset();
      --slot.arrived;
    }
  }
  for (auto& [pair, queue] : clique.channels) {
    if (pair.first == comm->rank) queue.clear();  // its kernels returned: nothing to read
  }
  if (!clique.complete && clique.members[static_cast<size_t>(comm->rank)] == comm) {
    clique.members[static_cast<size_t>(comm->rank)] = nullptr;
    --clique.joined;
  }
  clique.cv.notify_all();
}

std::string DescribeP2p(const P2pOp& op) {
  char text[160];
  std::snprintf(text, sizeof(text), "%s(count=%zu, datatype=%d, peer=%d)",
                op.is_send ? "Send" : "Recv", op.count, static_cast<int>(op.type), op.peer);
  return text;
}

// Runs on the stream's worker: one group's sends and receives of rank comm->rank (see the file
// comment). Posts every send first, so that groups that send to each other do not deadlock.
void RunP2p(ncclComm* comm, const std::shared_ptr<Clique>& clique, std::vector<P2pOp> ops) {
  struct Finish {
    ncclComm* comm;
    ~Finish() { comm->finished.fetch_add(1); }
  } finish{comm};
  if (comm->aborted.load()) return;
  for (const P2pOp& op : ops) {
    const void* data = op.is_send ? op.send : op.recv;
    if (!OnDevice(data, op.count * TypeSize(op.type), comm->device)) {
      char what[200];
      std::snprintf(what, sizeof(what), "rank %d's %s, buffer %p", comm->rank,
                    DescribeP2p(op).c_str(), data);
      FaultDevice(comm->device, what);
      comm->state.store(ncclUnhandledCudaError);
      return;
    }
  }
  std::unique_lock<std::mutex> lock(clique->mu);
  if (comm->aborted.load()) return;
  std::vector<std::shared_ptr<Posted>> mine;
  for (const P2pOp& op : ops) {
    if (!op.is_send) continue;
    auto posted = std::make_shared<Posted>(Posted{op.send, op.count, op.type});
    clique->channels[{comm->rank, op.peer}].push_back(posted);
    mine.push_back(std::move(posted));
  }
  clique->cv.notify_all();
  for (const P2pOp& op : ops) {
    if (op.is_send) continue;
    auto& queue = clique->channels[{op.peer, comm->rank}];
    clique->cv.wait(lock, [&] { return !queue.empty() || comm->aborted.load(); });
    if (comm->aborted.load()) return;  // AbortCalls withdrew this rank's sends
    std::shared_ptr<Posted> posted = queue.front();
    queue.pop_front();
    if (posted->count != op.count || posted->type != op.type) {
      Violation(
          "rank %d's %s pairs with rank %d's Send(count=%zu, datatype=%d) (NCCL: undefined, "
          "typically a hang)",
          comm->rank, DescribeP2p(op).c_str(), op.peer, posted->count,
          static_cast<int>(posted->type));
      clique->cv.wait(lock, [&] { return comm->aborted.load(); });
      return;
    }
    if (op.count > 0) std::memcpy(op.recv, posted->data, op.count * TypeSize(op.type));
    posted->consumed = true;
    clique->cv.notify_all();
  }
  clique->cv.wait(lock, [&] {
    return comm->aborted.load() ||
           std::all_of(mine.begin(), mine.end(), [](const auto& p) { return p->consumed; });
  });
}

// Under clique->mu: whether every peer of `peers` issued a group naming `rank`.
bool PeersConnectedLocked(const Clique& clique, int rank, const std::set<int>& peers) {
  for (const int peer : peers) {
    if (clique.p2p_wants.count({peer, rank}) == 0) return false;
  }
  return true;
}

// ncclGroupEnd's work for one communicator: NCCL's checks, then one kernel on the stream.
ncclResult_t IssueP2p(ncclComm* comm, const std::vector<P2pOp>& ops) {
  const char* name = "ncclGroupEnd";
  if (ncclResult_t r = CheckComm(comm, name); r != ncclSuccess) return r;
  std::unique_lock<std::mutex> comm_lock(comm->mu);
  if (ncclResult_t r = ReadyLocked(comm, name); r != ncclSuccess) return r;
  auto refuse = [&](ncclResult_t result) {
    if (!comm->blocking) comm->state.store(result);
    return result;
  };
  for (const P2pOp& op : ops) {
    if (op.stream != ops.front().stream) {
      Violation("rank %d's group names several streams: not modelled", comm->rank);
      return refuse(ncclInvalidUsage);
    }
  }
  std::shared_ptr<CUstream_st> target;
  if (ncclResult_t r = StreamFor(comm, ops.front().stream, name, &target); r != ncclSuccess) {
    return refuse(r);
  }
  std::set<int> fresh;  // peers this group connects
  for (const P2pOp& op : ops) {
    if (op.peer != comm->rank && comm->p2p_connected.count(op.peer) == 0) fresh.insert(op.peer);
  }
  std::shared_ptr<Clique> clique = comm->clique;
  {
    std::lock_guard<std::mutex> lock(clique->mu);
    for (const P2pOp& op : ops) {
      if (op.peer != comm->rank) clique->p2p_wants.insert({comm->rank, op.peer});
    }
    clique->cv.notify_all();
  }
  comm->p2p_connected.insert(fresh.begin(), fresh.end());
  std::function<void()> fn = [comm, clique, ops] { RunP2p(comm, clique, ops); };
  ++comm->issued;
  const int rank = comm->rank;
  auto connected = [clique, rank, fresh] {
    std::lock_guard<std::mutex> lock(clique->mu);
    return PeersConnectedLocked(*clique, rank, fresh);
  };
  if (!fresh.empty()) {
    if (!comm->blocking) {
      comm->pending = ncclComm::Pending{target, std::move(fn), Clock::now(), connected};
      comm->state.store(ncclInProgress);
      return ncclInProgress;
    }
    std::unique_lock<std::mutex> lock(clique->mu);
    clique->cv.wait(
        lock, [&] { return PeersConnectedLocked(*clique, rank, fresh) || comm->aborted.load(); });
  }
  std::lock_guard<std::mutex> lock(Rt().mu);
  EnqueueLocked(target, std::move(fn));
  return ncclSuccess;
}

// Ends the calling thread's outermost group: issues each communicator's operations, in the
// order the communicators first appear. Returns the first refusal, else ncclInProgress if a
// non-blocking communicator is connecting, else ncclSuccess.
ncclResult_t FlushGroup() {
  std::vector<std::pair<ncclComm*, P2pOp>> ops = std::move(group_ops);
  group_ops.clear();
  const ncclResult_t refused = group_error;
  group_error = ncclSuccess;
  if (refused != ncclSuccess) return refused;
  std::vector<std::pair<ncclComm*, std::vector<P2pOp>>> by_comm;
  for (const auto& [comm, op] : ops) {
    auto it = std::find_if(by_comm.begin(), by_comm.end(),
                           [comm = comm](const auto& entry) { return entry.first == comm; });
    if (it == by_comm.end()) it = by_comm.insert(by_comm.end(), {comm, {}});
    it->second.push_back(op);
  }
  ncclResult_t result = ncclSuccess;
  for (const auto& [comm, list] : by_comm) {
    const ncclResult_t r = IssueP2p(comm, list);
    if (r != ncclSuccess && (result == ncclSuccess || result == ncclInProgress)) result = r;
  }
  return result;
}

// ncclSend and ncclRecv: NCCL's argument checks, then the operation joins the thread's group
// (a group of its own outside one).
ncclResult_t PointToPoint(ncclComm* comm, P2pOp op, const char* name) {
  auto fail = [&](ncclResult_t result) {
    if (group_depth > 0 && group_error == ncclSuccess) group_error = result;
    return result;
  };
  if (ncclResult_t r = CheckComm(comm, name); r != ncclSuccess) return fail(r);
  auto refuse = [&](ncclResult_t result) {
    if (!comm->blocking) comm->state.store(result);
    return fail(result);
  };
  if (op.type < 0 || op.type >= ncclNumTypes) {
    SetLastError("%s: invalid type %d", name, static_cast<int>(op.type));
    return refuse(ncclInvalidArgument);
  }
  if (op.type == ncclFloat8e4m3 || op.type == ncclFloat8e5m2) {
    SetLastError("%s: fp8 types are not implemented by the fake", name);
    return refuse(ncclInvalidArgument);
  }
  if (op.peer < 0 || op.peer >= comm->nranks) {
    SetLastError("%s: invalid peer %d (peer should be in the 0..%d range)", name, op.peer,
                 comm->nranks);
    return refuse(ncclInvalidArgument);
  }
  group_ops.emplace_back(comm, op);
  if (group_depth == 0) return FlushGroup();
  return ncclSuccess;
}

const char* CudaErrorText(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorNotSupported:
      return "operation not supported";
    default:
      return "unrecognized error code";
  }
}

// The memory of cudaMalloc and cudaHostAlloc: `bytes` rounded up to `alignment`, aligned to it,
// filled with 0xff bytes (unwritten memory reads as NaN in every floating type); nullptr for 0
// bytes. Fails with the current device's sticky error first, as every call.
cudaError_t AllocateUnwritten(size_t bytes, size_t alignment, void** memory) {
  {
    std::lock_guard<std::mutex> lock(Rt().mu);
    if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  }
  *memory = nullptr;
  if (bytes == 0) return cudaSuccess;
  const size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (rounded < bytes) return Fail(cudaErrorMemoryAllocation);
  *memory = std::aligned_alloc(alignment, rounded);
  if (*memory == nullptr) return Fail(cudaErrorMemoryAllocation);
  std::memset(*memory, 0xff, rounded);
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The CUDA runtime functions.
// ---------------------------------------------------------------------------------------------

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = Rt().device_count;
  if (*count == 0) return Fail(cudaErrorNoDevice);
  return cudaSuccess;
}

// Fake device d sits at bus d + 1 (AUTO tells a host's GPUs apart by their bus ids).
cudaError_t cudaDeviceGetPCIBusId(char* pciBusId, int len, int device) {
  if (pciBusId == nullptr || len <= 0) return Fail(cudaErrorInvalidValue);
  if (device < 0 || device >= Rt().device_count) return Fail(cudaErrorInvalidDevice);
  std::snprintf(pciBusId, size_t(len), "0000:%02x:00.0", device + 1);
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t error) { return CudaErrorText(error); }

cudaError_t cudaGetLastError(void) {
  const cudaError_t error = last_error;
  last_error = cudaSuccess;
  return error;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= Rt().device_count) return Fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  std::unique_lock<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  SynchronizeDeviceLocked(lock, current_device);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* pointer) {
  if (attributes == nullptr) return Fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  std::memset(attributes, 0, sizeof(*attributes));
  if (const Allocation* allocation = FindLocked(pointer, 1)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = allocation->device;
    attributes->devicePointer = const_cast<void*>(pointer);
    attributes->hostPointer = nullptr;
  } else {
    // CUDA 11+: a host pointer CUDA does not know is "unregistered", with cudaSuccess.
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = cudaInvalidDeviceId;
    attributes->devicePointer = nullptr;
    attributes->hostPointer = const_cast<void*>(pointer);
  }
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr || (flags & ~cudaStreamNonBlocking) != 0) {
    return Fail(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  auto created = NewStreamLocked(current_device, (flags & cudaStreamNonBlocking) == 0, false);
  Rt().streams.emplace(created.get(), created);
  *stream = created.get();
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  auto it = Rt().streams.find(stream);
  if (it == Rt().streams.end()) {
    if (stream != nullptr && stream != cudaStreamLegacy) {
      Violation("cudaStreamDestroy of an unknown stream %p", static_cast<void*>(stream));
    }
    return Fail(cudaErrorInvalidResourceHandle);
  }
  // As CUDA: returns at once; the stream finishes its work, then goes.
  it->second->destroyed = true;
  Rt().streams.erase(it);
  Rt().progress.notify_all();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  auto target = ResolveLocked(stream);
  if (target == nullptr) {
    Violation("cudaStreamSynchronize of an unknown stream %p", static_cast<void*>(stream));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  // A marker: on the legacy stream it also waits for the blocking streams before it.
  const uint64_t ticket = target->legacy ? EnqueueLocked(target, nullptr) : target->enqueued;
  WaitLocked(lock, target, ticket);
  if (cudaError_t e = Rt().sticky[static_cast<size_t>(target->device)]; e != cudaSuccess) {
    return Fail(e);
  }
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr ||
      (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess)) != 0) {
    return Fail(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  auto* created = new CUevent_st;
  created->device = current_device;
  Rt().events.insert(created);
  *event = created;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (Rt().events.erase(event) == 0) {
    Violation("cudaEventDestroy of an unknown event %p", static_cast<void*>(event));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  if (Rt().events.count(event) == 0) {
    Violation("cudaEventRecord of an unknown event %p", static_cast<void*>(event));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  auto target = ResolveLocked(stream);
  if (target == nullptr) {
    Violation("cudaEventRecord on an unknown stream %p", static_cast<void*>(stream));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  if (target->device != event->device) {  // CUDA: they must be of one device
    return Fail(cudaErrorInvalidResourceHandle);
  }
  event->stream = target;
  event->ticket = EnqueueLocked(target, nullptr);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (Rt().events.count(event) == 0) {
    Violation("cudaEventQuery of an unknown event %p", static_cast<void*>(event));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  if (event->stream == nullptr) return cudaSuccess;  // never recorded
  if (cudaError_t e = Rt().sticky[static_cast<size_t>(event->stream->device)]; e != cudaSuccess) {
    return Fail(e);
  }
  // Not an error: the last error is left alone.
  return event->stream->completed >= event->ticket ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  if (pointer == nullptr) return Fail(cudaErrorInvalidValue);
  void* memory = nullptr;
  if (cudaError_t e = AllocateUnwritten(bytes, 256, &memory); e != cudaSuccess || !memory) {
    *pointer = nullptr;
    return e;
  }
  std::lock_guard<std::mutex> lock(Rt().mu);
  Rt().allocations[reinterpret_cast<uintptr_t>(memory)] = Allocation{bytes, current_device};
  *pointer = memory;
  return cudaSuccess;
}

cudaError_t cudaFree(void* pointer) {
  if (pointer == nullptr) return cudaSuccess;
  std::unique_lock<std::mutex> lock(Rt().mu);
  auto it = Rt().allocations.find(reinterpret_cast<uintptr_t>(pointer));
  if (it == Rt().allocations.end()) return Fail(cudaErrorInvalidValue);
  // The implicit synchronisation: no queued work may touch the memory after it is freed.
  const int device = it->second.device;
  SynchronizeDeviceLocked(lock, device);
  Rt().allocations.erase(reinterpret_cast<uintptr_t>(pointer));
  std::free(pointer);
  if (cudaError_t e = Rt().sticky[static_cast<size_t>(device)]; e != cudaSuccess) return Fail(e);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  std::unique_lock<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  const bool dst_device = FindLocked(dst, bytes) != nullptr;
  const bool src_device = FindLocked(src, bytes) != nullptr;
  // A device pointer whose range runs past its allocation is no valid argument either.
  if ((!dst_device && FindLocked(dst, 1) != nullptr) ||
      (!src_device && FindLocked(src, 1) != nullptr)) {
    return Fail(cudaErrorInvalidValue);
  }
  if (kind == cudaMemcpyDefault) {
    kind = dst_device ? (src_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                      : (src_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  const bool want_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool want_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDeviceToDevice) {
    return Fail(cudaErrorInvalidMemcpyDirection);
  }
  if (want_dst != dst_device || want_src != src_device) return Fail(cudaErrorInvalidValue);
  auto legacy = LegacyLocked(current_device);
  if (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToHost) CountCopyLocked(bytes);
  switch (kind) {
    case cudaMemcpyHostToHost:
      lock.unlock();
      std::memmove(dst, src, bytes);
      return cudaSuccess;
    case cudaMemcpyHostToDevice: {
      // A stream sync, then the source is staged and the copy may land after the return.
      WaitLocked(lock, legacy, EnqueueLocked(legacy, nullptr));
      auto staged = std::make_shared<std::vector<unsigned char>>(
          static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + bytes);
      EnqueueLocked(legacy, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
      return cudaSuccess;
    }
    case cudaMemcpyDeviceToHost:
      WaitLocked(lock, legacy, EnqueueLocked(legacy, [=] { std::memcpy(dst, src, bytes); }));
      if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
      return cudaSuccess;
    default:  // device to device: no host synchronisation
      EnqueueLocked(legacy, [=] { std::memmove(dst, src, bytes); });
      return cudaSuccess;
  }
}

cudaError_t cudaMemset(void* pointer, int value, size_t bytes) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  if (bytes == 0) return cudaSuccess;
  if (FindLocked(pointer, bytes) == nullptr) return Fail(cudaErrorInvalidValue);
  EnqueueLocked(LegacyLocked(current_device), [=] { std::memset(pointer, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** pointer, size_t bytes, unsigned int flags) {
  if (pointer == nullptr ||
      (flags & ~(cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined)) != 0) {
    return Fail(cudaErrorInvalidValue);
  }
  void* memory = nullptr;
  if (cudaError_t e = AllocateUnwritten(bytes, 4096, &memory); e != cudaSuccess || !memory) {
    *pointer = nullptr;
    return e;
  }
  std::lock_guard<std::mutex> lock(Rt().mu);
  Runtime& rt = Rt();
  rt.pinned[reinterpret_cast<uintptr_t>(memory)] = bytes;
  rt.pinned_live += bytes;
  rt.pinned_peak = std::max(rt.pinned_peak, rt.pinned_live);
  *pointer = memory;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* pointer) {
  if (pointer == nullptr) return cudaSuccess;
  std::unique_lock<std::mutex> lock(Rt().mu);
  Runtime& rt = Rt();
  auto it = rt.pinned.find(reinterpret_cast<uintptr_t>(pointer));
  if (it == rt.pinned.end()) return Fail(cudaErrorInvalidValue);
  // The implicit synchronisation: no queued copy may touch the memory after it is freed.
  for (int device = 0; device < rt.device_count; ++device) SynchronizeDeviceLocked(lock, device);
  it = rt.pinned.find(reinterpret_cast<uintptr_t>(pointer));
  rt.pinned_live -= it->second;
  rt.pinned.erase(it);
  std::free(pointer);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  auto target = ResolveLocked(stream);
  if (target == nullptr) {
    Violation("cudaMemcpyAsync on an unknown stream %p", static_cast<void*>(stream));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  const bool dst_device = FindLocked(dst, bytes) != nullptr;
  const bool src_device = FindLocked(src, bytes) != nullptr;
  if ((!dst_device && FindLocked(dst, 1) != nullptr) ||
      (!src_device && FindLocked(src, 1) != nullptr)) {
    return Fail(cudaErrorInvalidValue);
  }
  if (kind == cudaMemcpyDefault) {
    kind = dst_device ? (src_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                      : (src_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDeviceToDevice) {
    return Fail(cudaErrorInvalidMemcpyDirection);
  }
  const bool want_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool want_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (want_dst != dst_device || want_src != src_device) return Fail(cudaErrorInvalidValue);
  Runtime& rt = Rt();
  if (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToHost) {
    CountCopyLocked(bytes);
    rt.copy_order[target.get()] += kind == cudaMemcpyDeviceToHost ? 'i' : 'o';
    const void* host = kind == cudaMemcpyHostToDevice ? src : dst;
    if (!PinnedLocked(host, bytes)) {
      // As CUDA: a pageable host side makes the copy synchronous in effect.
      ++rt.async_from_pageable;
      if (kind == cudaMemcpyDeviceToHost) {
        WaitLocked(lock, target, EnqueueLocked(target, [=] { std::memcpy(dst, src, bytes); }));
        return cudaSuccess;
      }
      auto staged = std::make_shared<std::vector<unsigned char>>(
          static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + bytes);
      EnqueueLocked(target, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
      return cudaSuccess;
    }
  }
  EnqueueLocked(target, [=] { std::memmove(dst, src, bytes); });
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  std::unique_lock<std::mutex> lock(Rt().mu);
  if (Rt().events.count(event) == 0) {
    Violation("cudaEventSynchronize of an unknown event %p", static_cast<void*>(event));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  if (event->stream == nullptr) return cudaSuccess;  // never recorded
  auto stream = event->stream;
  WaitLocked(lock, stream, event->ticket);
  if (cudaError_t e = Rt().sticky[static_cast<size_t>(stream->device)]; e != cudaSuccess) {
    return Fail(e);
  }
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (cudaError_t e = StickyLocked(); e != cudaSuccess) return Fail(e);
  if (flags != 0 && flags != cudaEventWaitExternal) return Fail(cudaErrorInvalidValue);
  if (Rt().events.count(event) == 0) {
    Violation("cudaStreamWaitEvent of an unknown event %p", static_cast<void*>(event));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  auto target = ResolveLocked(stream);
  if (target == nullptr) {
    Violation("cudaStreamWaitEvent on an unknown stream %p", static_cast<void*>(stream));
    return Fail(cudaErrorInvalidResourceHandle);
  }
  if (event->stream == nullptr) return cudaSuccess;  // never recorded: nothing to wait for
  // A marker on `target` that runs once the event's stream has passed the event; later work on
  // `target` waits behind it.
  const uint64_t ticket = EnqueueLocked(target, nullptr);
  target->queue.back().deps.emplace_back(event->stream, event->ticket);
  (void)ticket;
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// The NCCL functions.
// ---------------------------------------------------------------------------------------------

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) {
    SetLastError("ncclGetUniqueId: uniqueId argument is NULL");
    return ncclInvalidArgument;
  }
  if (std::optional<ncclResult_t> injected = Injected("ncclGetUniqueId")) return *injected;
  std::memset(id->internal, 0, sizeof(id->internal));
  std::memcpy(id->internal, kIdMagic, sizeof(kIdMagic));
  uint64_t serial;
  {
    std::lock_guard<std::mutex> lock(Reg().mu);
    serial = ++Reg().ids;
  }
  std::random_device random;
  const uint64_t salt = (static_cast<uint64_t>(random()) << 32) ^ random();
  std::memcpy(id->internal + 32, &serial, sizeof(serial));
  std::memcpy(id->internal + 40, &salt, sizeof(salt));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (out == nullptr) {
    SetLastError("ncclCommInitRankConfig: newcomm argument is NULL");
    return ncclInvalidArgument;
  }
  *out = nullptr;
  if (std::optional<ncclResult_t> injected = Injected("ncclCommInitRankConfig")) return *injected;
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    SetLastError("Invalid rank requested : %d/%d", rank, nranks);
    return ncclInvalidArgument;
  }
  bool blocking = true;
  if (config != nullptr) {
    if (config->magic != 0xcafebeef || config->size < offsetof(ncclConfig_t, cgaClusterSize)) {
      SetLastError(
          "ncclCommInitRankConfig: the config was not initialized with "
          "NCCL_CONFIG_INITIALIZER");
      return ncclInvalidArgument;
    }
    if (config->blocking != NCCL_CONFIG_UNDEF_INT) {
      if (config->blocking != 0 && config->blocking != 1) {
        SetLastError("ncclCommInitRankConfig: blocking is %d, not 0 or 1", config->blocking);
        return ncclInvalidArgument;
      }
      blocking = config->blocking == 1;
    }
  }
  if (std::memcmp(id.internal, kIdMagic, sizeof(kIdMagic)) != 0) {
    SetLastError(
        "ncclCommInitRankConfig: the unique id was not made by this process's "
        "ncclGetUniqueId (the fake runs every rank in one process)");
    return ncclInvalidArgument;
  }
  {
    std::lock_guard<std::mutex> lock(Rt().mu);
    if (cudaError_t e = StickyLocked(); e != cudaSuccess) return ncclUnhandledCudaError;
  }

  auto* comm = new ncclComm;
  comm->rank = rank;
  comm->nranks = nranks;
  comm->device = current_device;
  comm->blocking = blocking;
  const std::string key(id.internal, sizeof(id.internal));
  std::shared_ptr<Clique> clique;
  ncclResult_t refused = ncclSuccess;
  std::string refusal;
  {
    Registry& reg = Reg();
    std::lock_guard<std::mutex> lock(reg.mu);
    auto& slot = reg.pending[key];
    if (!slot) slot = std::make_shared<Clique>(nranks);
    clique = slot;
    std::lock_guard<std::mutex> clique_lock(clique->mu);
    if (clique->nranks != nranks) {
      refusal = "rank " + std::to_string(rank) + " says " + std::to_string(nranks) +
                " ranks, an earlier one " + std::to_string(clique->nranks);
      refused = ncclInvalidUsage;
    } else if (clique->members[static_cast<size_t>(rank)] != nullptr) {
      refusal = "rank " + std::to_string(rank) + " joined twice";
      refused = ncclInvalidUsage;
    } else {
      comm->clique = clique;
      clique->members[static_cast<size_t>(rank)] = comm;
      reg.live.insert(comm);
      if (++clique->joined == nranks) {
        // Complete: NCCL refuses two ranks on one GPU.
        ncclResult_t result = ncclSuccess;
        for (int a = 0; a < nranks && result == ncclSuccess; ++a) {
          for (int b = a + 1; b < nranks; ++b) {
            if (clique->members[static_cast<size_t>(a)]->device ==
                clique->members[static_cast<size_t>(b)]->device) {
              std::snprintf(reg.last_error, sizeof(reg.last_error),
                            "fake NCCL: Duplicate GPU detected : rank %d and rank %d both on "
                            "CUDA device %d",
                            a, b, clique->members[static_cast<size_t>(a)]->device);
              result = ncclInvalidUsage;
              break;
            }
          }
        }
        for (ncclComm* member : clique->members) member->state.store(result);
        clique->complete = true;
        reg.pending.erase(key);
        clique->cv.notify_all();
      }
    }
  }
  if (refused != ncclSuccess) {
    SetLastError("ncclCommInitRankConfig: %s", refusal.c_str());
    delete comm;
    return refused;
  }
  *out = comm;
  if (!blocking) return ncclInProgress;
  std::unique_lock<std::mutex> lock(clique->mu);
  clique->cv.wait(lock, [&] { return clique->complete || comm->aborted.load(); });
  return comm->state.load();
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (ncclResult_t r = CheckComm(comm, "ncclCommGetAsyncError"); r != ncclSuccess) return r;
  if (async_error == nullptr) {
    SetLastError("ncclCommGetAsyncError: asyncError argument is NULL");
    return ncclInvalidArgument;
  }
  std::lock_guard<std::mutex> lock(comm->mu);
  ProgressLocked(comm);
  *async_error = comm->state.load();
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (ncclResult_t r = CheckComm(comm, "ncclCommFinalize"); r != ncclSuccess) return r;
  std::unique_lock<std::mutex> lock(comm->mu);
  if (ncclResult_t r = ReadyLocked(comm, "ncclCommFinalize"); r != ncclSuccess) return r;
  comm->finalizing = true;
  comm->state.store(ncclInProgress);
  if (!comm->blocking) {
    ProgressLocked(comm);
    return comm->state.load();
  }
  while (comm->finished.load() != comm->issued) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    lock.lock();
  }
  comm->state.store(ncclSuccess);
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;  // as NCCL
  if (ncclResult_t r = CheckComm(comm, "ncclCommDestroy"); r != ncclSuccess) return r;
  std::unique_lock<std::mutex> lock(comm->mu);
  if (comm->state.load() == ncclInProgress && !comm->finalizing) {
    Violation("ncclCommDestroy on rank %d while its communicator is ncclInProgress", comm->rank);
  }
  if (comm->pending) {
    std::lock_guard<std::mutex> rt_lock(Rt().mu);
    EnqueueLocked(comm->pending->stream, std::move(comm->pending->fn));
    comm->pending.reset();
  }
  // Without a finalize first, NCCL finalizes here, blocking until the calls have run.
  while (comm->finished.load() != comm->issued) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    lock.lock();
  }
  comm->dead = true;
  MarkDead(comm);  // the object is kept, so that a later use is reported, not undefined
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;  // as NCCL
  if (ncclResult_t r = CheckComm(comm, "ncclCommAbort"); r != ncclSuccess) return r;
  std::lock_guard<std::mutex> lock(comm->mu);
  if (comm->pending) {  // never reached its stream
    comm->pending.reset();
    comm->finished.fetch_add(1);
  }
  if (comm->clique) AbortCalls(comm);
  comm->dead = true;
  MarkDead(comm);
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

// As NCCL: the last message of the whole process; `comm` is not used (it may be dead).
const char* ncclGetLastError(ncclComm_t) { return Reg().last_error; }

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return Collective(comm, stream, Call{Coll::kAllReduce, send, recv, count, type, op, 0},
                    "ncclAllReduce");
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return Collective(comm, stream, Call{Coll::kBroadcast, send, recv, count, type, ncclSum, root},
                    "ncclBroadcast");
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  return Collective(comm, stream, Call{Coll::kAllGather, send, recv, count, type, ncclSum, 0},
                    "ncclAllGather");
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return Collective(comm, stream, Call{Coll::kReduceScatter, send, recv, count, type, op, 0},
                    "ncclReduceScatter");
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return Collective(comm, stream, Call{Coll::kReduce, send, recv, count, type, op, root},
                    "ncclReduce");
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return PointToPoint(comm, P2pOp{true, send, nullptr, count, type, peer, stream}, "ncclSend");
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return PointToPoint(comm, P2pOp{false, nullptr, recv, count, type, peer, stream}, "ncclRecv");
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) {
    Violation("ncclGroupEnd without ncclGroupStart");
    return ncclInvalidUsage;
  }
  if (--group_depth > 0) return ncclSuccess;
  return FlushGroup();
}

// The fake's own entry points (see the file comment); not part of CUDA or NCCL.
void collectivesFakeCudaCopyStats(uint64_t* stats) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  const Runtime& rt = Rt();
  stats[0] = rt.copied_bytes;
  stats[1] = rt.largest_copy;
  stats[2] = rt.copies;
  stats[3] = rt.async_from_pageable;
  stats[4] = rt.pinned_live;
  stats[5] = rt.pinned_peak;
}

void collectivesFakeCudaResetCopyStats() {
  std::lock_guard<std::mutex> lock(Rt().mu);
  Runtime& rt = Rt();
  rt.copied_bytes = rt.largest_copy = rt.copies = rt.async_from_pageable = 0;
  rt.pinned_peak = rt.pinned_live;
  rt.copy_order.clear();
}

// The copy order of every stream since the last reset, one stream's after another's, separated
// by '|', into `out` (at most capacity - 1 characters and a NUL); returns the full length.
size_t collectivesFakeCudaCopyOrder(char* out, size_t capacity) {
  std::lock_guard<std::mutex> lock(Rt().mu);
  std::string all;
  for (const auto& [stream, order] : Rt().copy_order) {
    if (!all.empty()) all += '|';
    all += order;
  }
  if (capacity > 0) {
    const size_t n = std::min(capacity - 1, all.size());
    std::memcpy(out, all.data(), n);
    out[n] = '\0';
  }
  return all.size();
}

void collectivesFakeNcclFailNext(const char* function, ncclResult_t result, const char* message) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.fail_next[function] = {result, message};
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// cuBLAS: the few functions the training demo's GPU replicas use (the build also places this
// library as libcublas.so.13). A handle belongs to the device current at cublasCreate_v2 and
// issues on the stream cublasSetStream_v2 gave it (null: that device's legacy default stream).
// cublasSgemm_v2 reads alpha and beta at the call (CUBLAS_POINTER_MODE_HOST, the default),
// checks its arguments as cuBLAS does, and queues C = alpha op(A) op(B) + beta C, column-major,
// computed on the CPU with float accumulation, on the handle's stream, ordered with the other
// work there as a kernel is. A matrix that is not memory of the handle's device faults the
// device (cudaErrorIllegalAddress from then on), as the kernel would.
// ---------------------------------------------------------------------------------------------

struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;
};

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (current_device >= Rt().device_count) return CUBLAS_STATUS_NOT_INITIALIZED;
  *handle = new cublasContext{current_device, nullptr};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  {
    // cuBLAS synchronises the device before releasing the handle's resources.
    std::unique_lock<std::mutex> lock(Rt().mu);
    SynchronizeDeviceLocked(lock, handle->device);
  }
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  std::lock_guard<std::mutex> lock(Rt().mu);
  if (stream != nullptr && stream != cudaStreamLegacy) {
    auto it = Rt().streams.find(stream);
    if (it == Rt().streams.end()) {
      Violation("cublasSetStream_v2 with an unknown stream");
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (it->second->device != handle->device) return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const float* alpha,
                              const float* a, int lda, const float* b, int ldb, const float* beta,
                              float* c, int ldc) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  const auto valid_op = [](cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; };
  if (!valid_op(transa) || !valid_op(transb) || m < 0 || n < 0 || k < 0 || alpha == nullptr ||
      beta == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool ta = transa == CUBLAS_OP_T;
  const bool tb = transb == CUBLAS_OP_T;
  // Stored shapes (column-major): A is m x k (k x m when transposed), B k x n (n x k), C m x n.
  const int a_rows = ta ? k : m;
  const int a_cols = ta ? m : k;
  const int b_rows = tb ? n : k;
  const int b_cols = tb ? k : n;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float al = *alpha;
  const float be = *beta;
  const auto extent = [](int ld, int cols, int rows) {
    return cols == 0 || rows == 0 ? size_t{0}
                                  : (static_cast<size_t>(cols) - 1) * static_cast<size_t>(ld) +
                                        static_cast<size_t>(rows);
  };
  std::unique_lock<std::mutex> lock(Rt().mu);
  const int device = handle->device;
  if (Rt().sticky[static_cast<size_t>(device)] != cudaSuccess) {
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  std::shared_ptr<CUstream_st> stream;
  if (handle->stream == nullptr || handle->stream == cudaStreamLegacy) {
    stream = LegacyLocked(device);
  } else {
    auto it = Rt().streams.find(handle->stream);
    if (it == Rt().streams.end()) return CUBLAS_STATUS_INVALID_VALUE;
    stream = it->second;
  }
  const auto on_device = [&](const void* p, size_t count) {
    if (count == 0) return true;
    const Allocation* found = FindLocked(p, count * sizeof(float));
    return found != nullptr && found->device == device;
  };
  const bool ok = on_device(a, extent(lda, a_cols, a_rows)) &&
                  on_device(b, extent(ldb, b_cols, b_rows)) && on_device(c, extent(ldc, n, m));
  EnqueueLocked(stream, [=] {
    if (!ok) {
      FaultDevice(device, "cublasSgemm_v2 with a matrix outside the device's memory");
      return;
    }
    std::vector<float> column(static_cast<size_t>(m));
    for (int j = 0; j < n; ++j) {
      std::fill(column.begin(), column.end(), 0.0f);
      for (int p = 0; p < k; ++p) {
        const float bv =
            tb ? b[static_cast<size_t>(p) * ldb + j] : b[static_cast<size_t>(j) * ldb + p];
        if (ta) {
          for (int i = 0; i < m; ++i) {
            column[static_cast<size_t>(i)] += a[static_cast<size_t>(i) * lda + p] * bv;
          }
        } else {
          const float* a_col = a + static_cast<size_t>(p) * lda;
          for (int i = 0; i < m; ++i) column[static_cast<size_t>(i)] += a_col[i] * bv;
        }
      }
      float* c_col = c + static_cast<size_t>(j) * ldc;
      for (int i = 0; i < m; ++i) {
        const float prior = be == 0.0f ? 0.0f : be * c_col[i];  // beta 0: C is not read
        c_col[i] = al * column[static_cast<size_t>(i)] + prior;
      }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
