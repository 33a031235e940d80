// The C API (include/collectives/c_api.h) over the C++ API.
//
// Every entry point runs its body inside Guard(), which turns any exception into a status and a
// thread-local message: collectives::Error into its own code (the enums have equal values,
// checked below), std::bad_alloc into COLL_SYSTEM, anything else into COLL_INTERNAL. Arguments
// the C++ layer cannot see (NULL comm or out pointers, enum values outside their range, counts
// whose byte size overflows) are checked here and raised as Error(kInvalidArgument) naming the
// function and the argument (and the rank, once the communicator is known), so one path reports
// every failure.
//
// Thread-safety: as c_api.h says; the only state of this file is the per-thread last error.
#include "collectives/c_api.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/packing.h"
#include "collectives/types.h"
#include "src/c_api/c_api_internal.h"
#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#endif

// The opaque handles of c_api.h: the C++ communicator and the options that only the C API uses;
// the C++ handle of an asynchronous collective.
struct coll_comm {
  std::unique_ptr<collectives::CollectiveCommunication> impl;
  size_t bytes_per_pack = 0;  // coll_options.bytes_per_pack
};

struct coll_work {
  std::shared_ptr<collectives::Work> impl;
};

namespace collectives::c_api {
namespace {

// The C enums mirror the C++ ones value for value; adding a value on one side fails here.
#define COLLECTIVES_SAME_VALUE(c_value, cpp_value) \
  static_assert(static_cast<int>(c_value) == static_cast<int>(cpp_value), #c_value)
COLLECTIVES_SAME_VALUE(COLL_INVALID_ARGUMENT, ErrorCode::kInvalidArgument);
COLLECTIVES_SAME_VALUE(COLL_INVALID_USAGE, ErrorCode::kInvalidUsage);
COLLECTIVES_SAME_VALUE(COLL_SYSTEM, ErrorCode::kSystem);
COLLECTIVES_SAME_VALUE(COLL_PEER_LOST, ErrorCode::kPeerLost);
COLLECTIVES_SAME_VALUE(COLL_MISMATCH, ErrorCode::kMismatch);
COLLECTIVES_SAME_VALUE(COLL_TIMEOUT, ErrorCode::kTimeout);
COLLECTIVES_SAME_VALUE(COLL_UNAUTHENTICATED, ErrorCode::kUnauthenticated);
COLLECTIVES_SAME_VALUE(COLL_ABORTED, ErrorCode::kAborted);
COLLECTIVES_SAME_VALUE(COLL_NOT_SUPPORTED, ErrorCode::kNotSupported);
COLLECTIVES_SAME_VALUE(COLL_INTERNAL, ErrorCode::kInternal);
constexpr int kFirstError = COLL_INVALID_ARGUMENT;
constexpr int kLastError = COLL_INTERNAL;

COLLECTIVES_SAME_VALUE(COLL_FLOAT32, DataType::kFloat32);
COLLECTIVES_SAME_VALUE(COLL_FLOAT64, DataType::kFloat64);
COLLECTIVES_SAME_VALUE(COLL_FLOAT16, DataType::kFloat16);
COLLECTIVES_SAME_VALUE(COLL_BFLOAT16, DataType::kBFloat16);
COLLECTIVES_SAME_VALUE(COLL_INT8, DataType::kInt8);
COLLECTIVES_SAME_VALUE(COLL_UINT8, DataType::kUInt8);
COLLECTIVES_SAME_VALUE(COLL_INT32, DataType::kInt32);
COLLECTIVES_SAME_VALUE(COLL_INT64, DataType::kInt64);
static_assert(kNumDataTypes == COLL_INT64 + 1, "a DataType is missing from coll_dtype");

COLLECTIVES_SAME_VALUE(COLL_SUM, ReduceOp::kSum);
COLLECTIVES_SAME_VALUE(COLL_PROD, ReduceOp::kProd);
COLLECTIVES_SAME_VALUE(COLL_MIN, ReduceOp::kMin);
COLLECTIVES_SAME_VALUE(COLL_MAX, ReduceOp::kMax);
COLLECTIVES_SAME_VALUE(COLL_AVG, ReduceOp::kAvg);
static_assert(kNumReduceOps == COLL_AVG + 1, "a ReduceOp is missing from coll_op");

COLLECTIVES_SAME_VALUE(COLL_IMPLEMENTATION_RING, Implementation::kRing);
COLLECTIVES_SAME_VALUE(COLL_IMPLEMENTATION_NCCL, Implementation::kNccl);
COLLECTIVES_SAME_VALUE(COLL_IMPLEMENTATION_AUTO, Implementation::kAuto);
#undef COLLECTIVES_SAME_VALUE

// The size of the first version of coll_options. When a field is appended, read it only where
// options->struct_size >= offsetof(coll_options, field) + sizeof(field), and update the assert.
constexpr size_t kOptionsV1Size = offsetof(coll_options, job_token) + sizeof(const char*);
static_assert(kOptionsV1Size == sizeof(coll_options),
              "coll_options grew: read the new fields only when struct_size covers them");

thread_local std::string t_last_error;

// Records the message of a failure, "<function>: <message><detail>"; never throws (a failed
// allocation leaves a short message that fits the string's inline buffer). The parts are views,
// and joined here, inside the try: a caller that built the text itself (in Guard's catch
// handlers, which are noexcept) would end the process on a bad_alloc.
void SetLastError(const char* function, std::string_view message,
                  std::string_view detail = {}) noexcept {
  try {
    t_last_error.assign(function);
    t_last_error.append(": ");
    t_last_error.append(message);
    t_last_error.append(detail);
  } catch (...) {
    t_last_error.clear();
    t_last_error = "out of memory";
  }
}

coll_status StatusOf(ErrorCode code) {
  const int value = static_cast<int>(code);
  return value >= kFirstError && value <= kLastError ? static_cast<coll_status>(value)
                                                     : COLL_INTERNAL;
}

// Runs `body`; returns COLL_OK, or the status of what it threw with the message recorded.
template <typename Body>
coll_status Guard(const char* function, Body&& body) noexcept {
  try {
    body();
    return COLL_OK;
  } catch (const Error& e) {
    SetLastError(function, e.message());
    return StatusOf(e.code());
  } catch (const std::bad_alloc&) {
    SetLastError(function, "out of memory");
    return COLL_SYSTEM;
  } catch (const std::exception& e) {
    SetLastError(function, "unexpected exception: ", e.what());
    return COLL_INTERNAL;
  } catch (...) {
    SetLastError(function, "unexpected exception of unknown type");
    return COLL_INTERNAL;
  }
}

// A bad argument found by this file's own checks. Inside a collective, where the communicator
// is known, Issue gives it the rank (NamingRank), as the C++ layer's messages have it.
class ArgumentError : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void InvalidArgument(const std::string& message) {
  throw ArgumentError(ErrorCode::kInvalidArgument, message);
}

template <typename T>
T& NotNull(T* pointer, const char* name) {
  if (pointer == nullptr) InvalidArgument(std::string(name) + " is NULL");
  return *pointer;
}

CollectiveCommunication& CommOf(const coll_comm* comm) {
  CollectiveCommunication* impl = NotNull(comm, "comm").impl.get();
  if (impl == nullptr) InvalidArgument("comm has no communicator (internal state lost)");
  return *impl;
}

DataType DataTypeOf(coll_dtype dtype) {
  const int value = static_cast<int>(dtype);
  if (value < 0 || value >= kNumDataTypes) {
    InvalidArgument("dtype " + std::to_string(value) + " is not a coll_dtype (valid: 0.." +
                    std::to_string(kNumDataTypes - 1) + ")");
  }
  return static_cast<DataType>(value);
}

ReduceOp ReduceOpOf(coll_op op) {
  const int value = static_cast<int>(op);
  if (value < 0 || value >= kNumReduceOps) {
    InvalidArgument("op " + std::to_string(value) + " is not a coll_op (valid: 0.." +
                    std::to_string(kNumReduceOps - 1) + ")");
  }
  return static_cast<ReduceOp>(value);
}

// A CPU tensor over a caller's buffer; checks that its byte size fits size_t.
// Where `data` lives: cuda:N for memory of CUDA device N, as the CUDA runtime reports it where
// one is usable (libcudart and a device: see src/nccl/nccl_loader.h); the host otherwise, managed
// memory included (the host reaches it directly).
Device DeviceOf(const void* data) {
#ifdef COLLECTIVES_WITH_NCCL
  if (data == nullptr) return Device::Cpu();
  const nccl::NcclApi* api = nccl::TryLoadCudart();
  if (api == nullptr) return Device::Cpu();
  cudaPointerAttributes attributes{};
  if (api->cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    api->cudaGetLastError();  // not left for the caller's next CUDA call
    return Device::Cpu();
  }
  if (attributes.type == cudaMemoryTypeDevice) return Device::Cuda(attributes.device);
#else
  (void)data;
#endif
  return Device::Cpu();
}

Tensor TensorOf(const char* name, const void* data, size_t count, DataType dtype) {
  if (count > SIZE_MAX / SizeOf(dtype)) {
    InvalidArgument(std::string(name) + " has " + std::to_string(count) + " elements of " +
                    ToString(dtype) + ": more bytes than size_t holds");
  }
  return Tensor{const_cast<void*>(data), count, dtype, DeviceOf(data)};
}

// count * size(), checked.
size_t TimesSize(const char* name, size_t count, int size) {
  if (size > 0 && count > SIZE_MAX / size_t(size)) {
    InvalidArgument(std::string(name) + " = " + std::to_string(count) + " times the size " +
                    std::to_string(size) + " overflows size_t");
  }
  return count * size_t(size);
}

Work& WorkOf(const coll_work* work) {
  Work* impl = NotNull(work, "work").impl.get();
  if (impl == nullptr) InvalidArgument("work has no collective (internal state lost)");
  return *impl;
}

// Runs `body`, which checks the arguments of a call on `c`; an ArgumentError of those checks
// is raised again as "rank R: <message>" (the C++ layer's errors name the rank already).
template <typename Body>
auto NamingRank(const CollectiveCommunication& c, Body&& body) {
  try {
    return body();
  } catch (const ArgumentError& e) {
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(c.rank()) + ": " + e.message());
  }
}

// How a collective is issued: the blocking function, or its _async form.
enum class Mode { kBlocking, kAsync };

// The shared body of a collective's blocking and asynchronous entry points. `issue(c, async)`
// checks the arguments and builds the tensors, then runs the blocking call (returning null) or
// queues the asynchronous one (returning its handle). An asynchronous call clears *work first
// and allocates its coll_work before the collective is queued, so a queued collective always
// has a handle to wait on.
template <typename IssueBody>
coll_status Issue(const char* function, Mode mode, coll_comm* comm, coll_work** work,
                  IssueBody&& issue) noexcept {
  return Guard(function, [&] {
    if (mode == Mode::kBlocking) {
      CollectiveCommunication& c = CommOf(comm);
      NamingRank(c, [&] { issue(c, false); });
      return;
    }
    coll_work*& result = NotNull(work, "work");
    result = nullptr;
    auto handle = std::make_unique<coll_work>();
    CollectiveCommunication& c = CommOf(comm);
    handle->impl = NamingRank(c, [&] { return issue(c, true); });
    result = handle.release();
  });
}

coll_status AllReduce(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                      void* recvbuff, size_t count, coll_dtype dtype, coll_op op,
                      coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const ReduceOp reduce = ReduceOpOf(op);
    const Tensor send = TensorOf("sendbuff", sendbuff, count, type);
    const Tensor recv = TensorOf("recvbuff", recvbuff, count, type);
    if (async) return c.AllReduceAsync(send, recv, reduce);
    c.AllReduce(send, recv, reduce);
    return std::shared_ptr<Work>();
  });
}

// The tensors of a packed list (coll_*_many): buffers[i] holding counts[i] elements of `dtype`.
std::vector<Tensor> TensorsOf(void* const* buffers, const size_t* counts, size_t n,
                              DataType dtype) {
  if (n > 0) {
    NotNull(buffers, "buffers");
    NotNull(counts, "counts");
  }
  std::vector<Tensor> tensors;
  if (n > tensors.max_size()) {
    InvalidArgument("n is " + std::to_string(n) + ", more tensors than memory can list");
  }
  tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string name = "buffers[" + std::to_string(i) + "]";
    if (buffers[i] == nullptr && counts[i] > 0) {
      InvalidArgument(name + " is NULL but counts[" + std::to_string(i) + "] is " +
                      std::to_string(counts[i]));
    }
    tensors.push_back(TensorOf(name.c_str(), buffers[i], counts[i], dtype));
  }
  return tensors;
}

coll_status AllReduceMany(const char* function, Mode mode, coll_comm* comm, void* const* buffers,
                          const size_t* counts, size_t n, coll_dtype dtype, coll_op op,
                          size_t bytes_per_pack, coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const ReduceOp reduce = ReduceOpOf(op);
    const std::vector<Tensor> tensors = TensorsOf(buffers, counts, n, type);
    const size_t cap = bytes_per_pack != 0 ? bytes_per_pack : comm->bytes_per_pack;
    if (async) return packing::AllReduceAsync(c, tensors, reduce, cap);
    packing::AllReduce(c, tensors, reduce, cap);
    return std::shared_ptr<Work>();
  });
}

coll_status BroadcastMany(const char* function, Mode mode, coll_comm* comm, void* const* buffers,
                          const size_t* counts, size_t n, coll_dtype dtype, int root,
                          size_t bytes_per_pack, coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const std::vector<Tensor> tensors = TensorsOf(buffers, counts, n, type);
    const size_t cap = bytes_per_pack != 0 ? bytes_per_pack : comm->bytes_per_pack;
    if (async) return packing::BroadcastAsync(c, tensors, root, cap);
    packing::Broadcast(c, tensors, root, cap);
    return std::shared_ptr<Work>();
  });
}

coll_status Broadcast(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                      void* recvbuff, size_t count, coll_dtype dtype, int root,
                      coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const Tensor send = TensorOf("sendbuff", sendbuff, count, type);
    const Tensor recv = TensorOf("recvbuff", recvbuff, count, type);
    if (async) return c.BroadcastAsync(send, recv, root);
    c.Broadcast(send, recv, root);
    return std::shared_ptr<Work>();
  });
}

coll_status AllGather(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                      void* recvbuff, size_t count_per_rank, coll_dtype dtype,
                      coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const size_t total = TimesSize("count_per_rank", count_per_rank, c.size());
    const Tensor send = TensorOf("sendbuff", sendbuff, count_per_rank, type);
    const Tensor recv = TensorOf("recvbuff", recvbuff, total, type);
    if (async) return c.AllGatherAsync(send, recv);
    c.AllGather(send, recv);
    return std::shared_ptr<Work>();
  });
}

coll_status ReduceScatter(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                          void* recvbuff, size_t recv_count, coll_dtype dtype, coll_op op,
                          coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const ReduceOp reduce = ReduceOpOf(op);
    const size_t total = TimesSize("recv_count", recv_count, c.size());
    const Tensor send = TensorOf("sendbuff", sendbuff, total, type);
    const Tensor recv = TensorOf("recvbuff", recvbuff, recv_count, type);
    if (async) return c.ReduceScatterAsync(send, recv, reduce);
    c.ReduceScatter(send, recv, reduce);
    return std::shared_ptr<Work>();
  });
}

coll_status Barrier(const char* function, Mode mode, coll_comm* comm, coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    if (async) return c.BarrierAsync();
    c.Barrier();
    return std::shared_ptr<Work>();
  });
}

// A buffer the call reads or writes only on the root: its tensor there, an empty one elsewhere
// (not read, not written, and NULL allowed whatever the count).
Tensor RootOnlyTensorOf(const CollectiveCommunication& c, int root, const char* name,
                        const void* data, size_t count, DataType dtype) {
  if (c.rank() != root) return Tensor{nullptr, 0, dtype};
  return TensorOf(name, data, count, dtype);
}

coll_status Reduce(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                   void* recvbuff, size_t count, coll_dtype dtype, coll_op op, int root,
                   coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const ReduceOp reduce = ReduceOpOf(op);
    const Tensor send = TensorOf("sendbuff", sendbuff, count, type);
    const Tensor recv = RootOnlyTensorOf(c, root, "recvbuff", recvbuff, count, type);
    if (async) return c.ReduceAsync(send, recv, reduce, root);
    c.Reduce(send, recv, reduce, root);
    return std::shared_ptr<Work>();
  });
}

coll_status Gather(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                   void* recvbuff, size_t count_per_rank, coll_dtype dtype, int root,
                   coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const size_t total = TimesSize("count_per_rank", count_per_rank, c.size());
    const Tensor send = TensorOf("sendbuff", sendbuff, count_per_rank, type);
    const Tensor recv = RootOnlyTensorOf(c, root, "recvbuff", recvbuff, total, type);
    if (async) return c.GatherAsync(send, recv, root);
    c.Gather(send, recv, root);
    return std::shared_ptr<Work>();
  });
}

coll_status Scatter(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                    void* recvbuff, size_t count_per_rank, coll_dtype dtype, int root,
                    coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    const size_t total = TimesSize("count_per_rank", count_per_rank, c.size());
    const Tensor send = RootOnlyTensorOf(c, root, "sendbuff", sendbuff, total, type);
    const Tensor recv = TensorOf("recvbuff", recvbuff, count_per_rank, type);
    if (async) return c.ScatterAsync(send, recv, root);
    c.Scatter(send, recv, root);
    return std::shared_ptr<Work>();
  });
}

// An all-to-all's count array as a vector of size() entries, and its sum, checked.
std::vector<size_t> CountsOf(const char* name, const size_t* counts, int size, size_t* total) {
  std::vector<size_t> out(counts, counts + size);
  *total = 0;
  for (const size_t count : out) {
    if (count > SIZE_MAX - *total) {
      InvalidArgument(std::string(name) + " sums to more than size_t holds");
    }
    *total += count;
  }
  return out;
}

coll_status AllToAll(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                     void* recvbuff, size_t count_per_rank, const size_t* send_counts,
                     const size_t* recv_counts, coll_dtype dtype, coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const DataType type = DataTypeOf(dtype);
    std::vector<size_t> sends, recvs;
    size_t send_total = 0, recv_total = 0;
    if (send_counts == nullptr && recv_counts == nullptr) {
      send_total = recv_total = TimesSize("count_per_rank", count_per_rank, c.size());
    } else {
      if (send_counts == nullptr || recv_counts == nullptr) {
        InvalidArgument(std::string(send_counts == nullptr ? "send_counts" : "recv_counts") +
                        " is NULL but " + (send_counts == nullptr ? "recv_counts" : "send_counts") +
                        " is not: pass both (uneven blocks) or neither (equal blocks)");
      }
      if (count_per_rank != 0) {
        InvalidArgument("count_per_rank is " + std::to_string(count_per_rank) +
                        ", not 0, but send_counts and recv_counts are given");
      }
      sends = CountsOf("send_counts", send_counts, c.size(), &send_total);
      recvs = CountsOf("recv_counts", recv_counts, c.size(), &recv_total);
    }
    const Tensor send = TensorOf("sendbuff", sendbuff, send_total, type);
    const Tensor recv = TensorOf("recvbuff", recvbuff, recv_total, type);
    if (async) return c.AllToAllAsync(send, recv, sends, recvs);
    c.AllToAll(send, recv, sends, recvs);
    return std::shared_ptr<Work>();
  });
}

coll_status Send(const char* function, Mode mode, coll_comm* comm, const void* sendbuff,
                 size_t count, coll_dtype dtype, int peer, int64_t tag, coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const Tensor tensor = TensorOf("sendbuff", sendbuff, count, DataTypeOf(dtype));
    if (async) return c.SendAsync(tensor, peer, tag);
    c.Send(tensor, peer, tag);
    return std::shared_ptr<Work>();
  });
}

coll_status Recv(const char* function, Mode mode, coll_comm* comm, void* recvbuff, size_t count,
                 coll_dtype dtype, int peer, int64_t tag, coll_work** work) noexcept {
  return Issue(function, mode, comm, work, [&](CollectiveCommunication& c, bool async) {
    const Tensor tensor = TensorOf("recvbuff", recvbuff, count, DataTypeOf(dtype));
    if (async) return c.RecvAsync(tensor, peer, tag);
    c.Recv(tensor, peer, tag);
    return std::shared_ptr<Work>();
  });
}

struct CreateOptions {
  CommunicationOptions communication;
  size_t bytes_per_pack = 0;
};

// Refuses a size of the caller's coll_options that this library cannot take: below the first
// version's, or above its own (a program built against a newer header). `name` names the size in
// the message; `hint` ends the message of one too small.
void CheckOptionsSize(const char* name, size_t struct_size, const char* hint) {
  if (struct_size < kOptionsV1Size) {
    InvalidArgument(std::string(name) + " is " + std::to_string(struct_size) +
                    ", less than any coll_options (" + std::to_string(kOptionsV1Size) +
                    " bytes): " + hint);
  }
  if (struct_size > sizeof(coll_options)) {
    InvalidArgument(std::string(name) + " is " + std::to_string(struct_size) +
                    " but this library knows a coll_options of " +
                    std::to_string(sizeof(coll_options)) +
                    " bytes: the program was built against a newer c_api.h than the library");
  }
}

CreateOptions OptionsOf(const coll_options* options) {
  coll_options defaults;
  coll_options_init(&defaults);
  if (options == nullptr) options = &defaults;
  CheckOptionsSize("options->struct_size", options->struct_size,
                   "fill the options with coll_options_init first");
  CreateOptions out;
  const int implementation = static_cast<int>(options->implementation);
  if (implementation < COLL_IMPLEMENTATION_RING || implementation > COLL_IMPLEMENTATION_AUTO) {
    InvalidArgument("options->implementation " + std::to_string(implementation) +
                    " is not a coll_implementation (valid: 0..2)");
  }
  out.communication.implementation = static_cast<Implementation>(implementation);
  // NCCL takes CUDA device memory (TensorOf names it so); where NCCL is not usable it is
  // refused here, before any rendezvous, as every rank refuses it alike.
  if (out.communication.implementation == Implementation::kNccl) {
#ifdef COLLECTIVES_WITH_NCCL
    std::string reason;
    if (nccl::TryLoadNccl(&reason) == nullptr) {
      throw Error(ErrorCode::kNotSupported,
                  "options->implementation is COLL_IMPLEMENTATION_NCCL, but " + reason);
    }
#else
    throw Error(ErrorCode::kNotSupported,
                "options->implementation is COLL_IMPLEMENTATION_NCCL, but the NCCL "
                "implementation is not built into this library (configure with "
                "-DCOLLECTIVES_WITH_NCCL=ON)");
#endif
  }
  if (options->timeout_ms <= 0) {
    InvalidArgument("options->timeout_ms is " + std::to_string(options->timeout_ms) +
                    "; it must be positive");
  }
  out.communication.timeout = std::chrono::milliseconds(options->timeout_ms);
  out.communication.bytes_per_pack = options->bytes_per_pack;
  out.bytes_per_pack = options->bytes_per_pack;
  if (options->job_token != nullptr) out.communication.job_token = options->job_token;
  return out;
}

// The shared tail of the coll_comm_create* functions: clears *out, builds the spec and the
// communicator, and hands it over.
template <typename MakeSpec>
coll_status Create(const char* function, const coll_options* options, coll_comm** out,
                   MakeSpec&& make_spec) noexcept {
  return Guard(function, [&] {
    coll_comm*& result = NotNull(out, "out");
    result = nullptr;
    const CreateOptions create = OptionsOf(options);
    const ClusterSpec spec = make_spec();
    result =
        WrapCommunication(CreateCommunication(spec, create.communication), create.bytes_per_pack);
  });
}

}  // namespace

coll_comm* WrapCommunication(std::unique_ptr<CollectiveCommunication> comm, size_t bytes_per_pack) {
  auto wrapped = std::make_unique<coll_comm>();
  wrapped->impl = std::move(comm);
  wrapped->bytes_per_pack = bytes_per_pack;
  return wrapped.release();
}

}  // namespace collectives::c_api

using collectives::c_api::AllGather;
using collectives::c_api::AllReduce;
using collectives::c_api::Barrier;
using collectives::c_api::Broadcast;
using collectives::c_api::BroadcastMany;
using collectives::c_api::CheckOptionsSize;
using collectives::c_api::CommOf;
using collectives::c_api::Create;
using collectives::c_api::DataTypeOf;
using collectives::c_api::Guard;
using collectives::c_api::InvalidArgument;
using collectives::c_api::Mode;
using collectives::c_api::NamingRank;
using collectives::c_api::NotNull;
using collectives::c_api::ReduceOpOf;
using collectives::c_api::ReduceScatter;
using collectives::c_api::TensorOf;
using collectives::c_api::TimesSize;
using collectives::c_api::WorkOf;

extern "C" {

// The caller's struct may be smaller than this library's (an older header): only its
// struct_size bytes are written.
coll_status coll_options_init_sized(coll_options* options, size_t struct_size) {
  return Guard("coll_options_init_sized", [&] {
    NotNull(options, "options");
    CheckOptionsSize("struct_size", struct_size,
                     "pass sizeof(coll_options), as coll_options_init does");
    coll_options o{};
    o.struct_size = struct_size;
    o.implementation = COLL_IMPLEMENTATION_AUTO;
    o.timeout_ms = 300'000;
    o.bytes_per_pack = 0;
    o.job_token = nullptr;
    std::memcpy(options, &o, struct_size);
  });
}

coll_status coll_comm_create_from_env(const coll_options* options, coll_comm** out) {
  return Create("coll_comm_create_from_env", options, out,
                [] { return collectives::ClusterSpec::FromEnvironment(); });
}

coll_status coll_comm_create(int rank, int world_size, const char* master_addr,
                             uint16_t master_port, const coll_options* options, coll_comm** out) {
  return Create("coll_comm_create", options, out, [&] {
    collectives::ClusterSpec spec;
    spec.rank = rank;
    spec.world_size = world_size;
    spec.master_addr = master_addr != nullptr ? master_addr : "127.0.0.1";
    spec.master_port = master_port;
    spec.task_index = rank;
    return spec;  // CreateCommunication validates it
  });
}

coll_status coll_comm_create_from_tf_config(const char* tf_config_json, const coll_options* options,
                                            coll_comm** out) {
  return Create("coll_comm_create_from_tf_config", options, out, [&] {
    NotNull(tf_config_json, "tf_config_json");
    return collectives::ClusterSpec::FromTfConfig(tf_config_json);
  });
}

coll_status coll_comm_destroy(coll_comm* comm) {
  return Guard("coll_comm_destroy", [&] { delete comm; });
}

coll_status coll_comm_abort(coll_comm* comm) {
  return Guard("coll_comm_abort", [&] { CommOf(comm).Abort(); });
}

coll_status coll_comm_split(coll_comm* comm, int color, int key, coll_comm** out) {
  return Guard("coll_comm_split", [&] {
    coll_comm*& result = NotNull(out, "out");
    result = nullptr;
    std::unique_ptr<collectives::CollectiveCommunication> part = CommOf(comm).Split(color, key);
    if (part != nullptr) {
      result = collectives::c_api::WrapCommunication(std::move(part), comm->bytes_per_pack);
    }
  });
}

coll_status coll_comm_set_timeout(coll_comm* comm, int64_t timeout_ms) {
  return Guard("coll_comm_set_timeout", [&] {
    collectives::CollectiveCommunication& c = CommOf(comm);
    NamingRank(c, [&] {
      if (timeout_ms <= 0) {
        InvalidArgument("timeout_ms is " + std::to_string(timeout_ms) + "; it must be positive");
      }
    });
    c.SetTimeout(std::chrono::milliseconds(timeout_ms));
  });
}

coll_status coll_comm_rank(const coll_comm* comm, int* rank) {
  return Guard("coll_comm_rank", [&] {
    int& result = NotNull(rank, "rank");
    result = CommOf(comm).rank();
  });
}

coll_status coll_comm_size(const coll_comm* comm, int* size) {
  return Guard("coll_comm_size", [&] {
    int& result = NotNull(size, "size");
    result = CommOf(comm).size();
  });
}

coll_status coll_all_reduce(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                            coll_dtype dtype, coll_op op) {
  return AllReduce("coll_all_reduce", Mode::kBlocking, comm, sendbuff, recvbuff, count, dtype, op,
                   nullptr);
}

coll_status coll_broadcast(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                           coll_dtype dtype, int root) {
  return Broadcast("coll_broadcast", Mode::kBlocking, comm, sendbuff, recvbuff, count, dtype, root,
                   nullptr);
}

coll_status coll_all_gather(coll_comm* comm, const void* sendbuff, void* recvbuff,
                            size_t count_per_rank, coll_dtype dtype) {
  return AllGather("coll_all_gather", Mode::kBlocking, comm, sendbuff, recvbuff, count_per_rank,
                   dtype, nullptr);
}

coll_status coll_reduce_scatter(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                size_t recv_count, coll_dtype dtype, coll_op op) {
  return ReduceScatter("coll_reduce_scatter", Mode::kBlocking, comm, sendbuff, recvbuff, recv_count,
                       dtype, op, nullptr);
}

coll_status coll_barrier(coll_comm* comm) {
  return Barrier("coll_barrier", Mode::kBlocking, comm, nullptr);
}

coll_status coll_all_reduce_many(coll_comm* comm, void* const* buffers, const size_t* counts,
                                 size_t n, coll_dtype dtype, coll_op op, size_t bytes_per_pack) {
  return AllReduceMany("coll_all_reduce_many", Mode::kBlocking, comm, buffers, counts, n, dtype, op,
                       bytes_per_pack, nullptr);
}

coll_status coll_all_reduce_many_async(coll_comm* comm, void* const* buffers, const size_t* counts,
                                       size_t n, coll_dtype dtype, coll_op op,
                                       size_t bytes_per_pack, coll_work** work) {
  return AllReduceMany("coll_all_reduce_many_async", Mode::kAsync, comm, buffers, counts, n, dtype,
                       op, bytes_per_pack, work);
}

coll_status coll_broadcast_many(coll_comm* comm, void* const* buffers, const size_t* counts,
                                size_t n, coll_dtype dtype, int root, size_t bytes_per_pack) {
  return BroadcastMany("coll_broadcast_many", Mode::kBlocking, comm, buffers, counts, n, dtype,
                       root, bytes_per_pack, nullptr);
}

coll_status coll_broadcast_many_async(coll_comm* comm, void* const* buffers, const size_t* counts,
                                      size_t n, coll_dtype dtype, int root, size_t bytes_per_pack,
                                      coll_work** work) {
  return BroadcastMany("coll_broadcast_many_async", Mode::kAsync, comm, buffers, counts, n, dtype,
                       root, bytes_per_pack, work);
}

coll_status coll_all_reduce_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                  size_t count, coll_dtype dtype, coll_op op, coll_work** work) {
  return AllReduce("coll_all_reduce_async", Mode::kAsync, comm, sendbuff, recvbuff, count, dtype,
                   op, work);
}

coll_status coll_broadcast_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                 size_t count, coll_dtype dtype, int root, coll_work** work) {
  return Broadcast("coll_broadcast_async", Mode::kAsync, comm, sendbuff, recvbuff, count, dtype,
                   root, work);
}

coll_status coll_all_gather_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                  size_t count_per_rank, coll_dtype dtype, coll_work** work) {
  return AllGather("coll_all_gather_async", Mode::kAsync, comm, sendbuff, recvbuff, count_per_rank,
                   dtype, work);
}

coll_status coll_reduce_scatter_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                      size_t recv_count, coll_dtype dtype, coll_op op,
                                      coll_work** work) {
  return ReduceScatter("coll_reduce_scatter_async", Mode::kAsync, comm, sendbuff, recvbuff,
                       recv_count, dtype, op, work);
}

coll_status coll_barrier_async(coll_comm* comm, coll_work** work) {
  return Barrier("coll_barrier_async", Mode::kAsync, comm, work);
}

coll_status coll_reduce(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                        coll_dtype dtype, coll_op op, int root) {
  return Reduce("coll_reduce", Mode::kBlocking, comm, sendbuff, recvbuff, count, dtype, op, root,
                nullptr);
}

coll_status coll_gather(coll_comm* comm, const void* sendbuff, void* recvbuff,
                        size_t count_per_rank, coll_dtype dtype, int root) {
  return Gather("coll_gather", Mode::kBlocking, comm, sendbuff, recvbuff, count_per_rank, dtype,
                root, nullptr);
}

coll_status coll_scatter(coll_comm* comm, const void* sendbuff, void* recvbuff,
                         size_t count_per_rank, coll_dtype dtype, int root) {
  return Scatter("coll_scatter", Mode::kBlocking, comm, sendbuff, recvbuff, count_per_rank, dtype,
                 root, nullptr);
}

coll_status coll_all_to_all(coll_comm* comm, const void* sendbuff, void* recvbuff,
                            size_t count_per_rank, const size_t* send_counts,
                            const size_t* recv_counts, coll_dtype dtype) {
  return AllToAll("coll_all_to_all", Mode::kBlocking, comm, sendbuff, recvbuff, count_per_rank,
                  send_counts, recv_counts, dtype, nullptr);
}

coll_status coll_send(coll_comm* comm, const void* sendbuff, size_t count, coll_dtype dtype,
                      int peer, int64_t tag) {
  return Send("coll_send", Mode::kBlocking, comm, sendbuff, count, dtype, peer, tag, nullptr);
}

coll_status coll_recv(coll_comm* comm, void* recvbuff, size_t count, coll_dtype dtype, int peer,
                      int64_t tag) {
  return Recv("coll_recv", Mode::kBlocking, comm, recvbuff, count, dtype, peer, tag, nullptr);
}

coll_status coll_reduce_async(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                              coll_dtype dtype, coll_op op, int root, coll_work** work) {
  return Reduce("coll_reduce_async", Mode::kAsync, comm, sendbuff, recvbuff, count, dtype, op, root,
                work);
}

coll_status coll_gather_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                              size_t count_per_rank, coll_dtype dtype, int root, coll_work** work) {
  return Gather("coll_gather_async", Mode::kAsync, comm, sendbuff, recvbuff, count_per_rank, dtype,
                root, work);
}

coll_status coll_scatter_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                               size_t count_per_rank, coll_dtype dtype, int root,
                               coll_work** work) {
  return Scatter("coll_scatter_async", Mode::kAsync, comm, sendbuff, recvbuff, count_per_rank,
                 dtype, root, work);
}

coll_status coll_all_to_all_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                  size_t count_per_rank, const size_t* send_counts,
                                  const size_t* recv_counts, coll_dtype dtype, coll_work** work) {
  return AllToAll("coll_all_to_all_async", Mode::kAsync, comm, sendbuff, recvbuff, count_per_rank,
                  send_counts, recv_counts, dtype, work);
}

coll_status coll_send_async(coll_comm* comm, const void* sendbuff, size_t count, coll_dtype dtype,
                            int peer, int64_t tag, coll_work** work) {
  return Send("coll_send_async", Mode::kAsync, comm, sendbuff, count, dtype, peer, tag, work);
}

coll_status coll_recv_async(coll_comm* comm, void* recvbuff, size_t count, coll_dtype dtype,
                            int peer, int64_t tag, coll_work** work) {
  return Recv("coll_recv_async", Mode::kAsync, comm, recvbuff, count, dtype, peer, tag, work);
}

coll_status coll_work_wait(coll_work* work) {
  return Guard("coll_work_wait", [&] { WorkOf(work).Wait(); });
}

coll_status coll_work_test(coll_work* work, int* done) {
  return Guard("coll_work_test", [&] {
    int& result = NotNull(done, "done");
    result = 0;
    collectives::Work& w = WorkOf(work);
    if (!w.Done()) return;
    result = 1;
    w.Wait();  // completed: returns at once, or throws the collective's error
  });
}

coll_status coll_work_free(coll_work* work) {
  if (work == nullptr) return COLL_OK;
  const coll_status status = Guard("coll_work_free", [&] { WorkOf(work).Wait(); });
  delete work;
  return status;
}

const char* coll_last_error(void) { return collectives::c_api::t_last_error.c_str(); }

const char* coll_status_string(coll_status status) {
  const int value = static_cast<int>(status);
  if (value == COLL_OK) return "ok";
  if (value >= collectives::c_api::kFirstError && value <= collectives::c_api::kLastError) {
    return collectives::ToString(static_cast<collectives::ErrorCode>(value));
  }
  return "unknown status";
}

}  // extern "C"
