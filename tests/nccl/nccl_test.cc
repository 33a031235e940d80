// Tests of the NCCL implementation. The GPU tests skip, saying why, where NCCL or a CUDA device
// is not usable (the loader's reason); the others run everywhere: asking for NCCL where it
// cannot run raises Error(kNotSupported), in a build without NCCL as in one without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/types.h"

#if defined(COLLECTIVES_WITH_NCCL)
#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#endif

namespace collectives {
namespace {

CommunicationOptions NcclOptionsFor(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  CommunicationOptions options;
  options.implementation = Implementation::kNccl;
  options.timeout = timeout;
  return options;
}

// Runs without a GPU: on a machine (or a build) that cannot run NCCL, the factory raises
// Error(kNotSupported) naming NCCL, at once (no hang, no crash).
TEST(NcclUnavailableTest, CreatingAnNcclCommunicatorRaisesNotSupported) {
#if defined(COLLECTIVES_WITH_NCCL)
  std::string reason;
  if (nccl::TryLoadNccl(&reason) != nullptr) {
    GTEST_SKIP() << "NCCL and a GPU are usable here: nothing to refuse";
  }
  std::cout << "loader's reason: " << reason << "\n";
#endif
  ClusterSpec spec;  // one rank
  const auto start = std::chrono::steady_clock::now();
  try {
    CreateCommunication(spec, CreateMemoryStore(), NcclOptionsFor());
    FAIL() << "expected Error(kNotSupported)";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotSupported) << e.what();
    EXPECT_NE(e.message().find("NCCL"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // Twice: the loader's failure is cached, and says the same.
  EXPECT_THROW(CreateCommunication(spec, CreateMemoryStore(), NcclOptionsFor()), Error);
}

#if defined(COLLECTIVES_WITH_NCCL)

// Pure mappings: no GPU needed.
TEST(NcclMappingTest, ResultCodesMapToErrorCodes) {
  EXPECT_EQ(nccl::ToErrorCode(ncclInvalidArgument), ErrorCode::kInvalidArgument);
  EXPECT_EQ(nccl::ToErrorCode(ncclInvalidUsage), ErrorCode::kInvalidUsage);
  EXPECT_EQ(nccl::ToErrorCode(ncclRemoteError), ErrorCode::kPeerLost);
  EXPECT_EQ(nccl::ToErrorCode(ncclSystemError), ErrorCode::kSystem);
  EXPECT_EQ(nccl::ToErrorCode(ncclUnhandledCudaError), ErrorCode::kSystem);
  EXPECT_EQ(nccl::ToErrorCode(ncclInternalError), ErrorCode::kInternal);
}

TEST(NcclMappingTest, DataTypesAndOpsMap) {
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kFloat32), ncclFloat32);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kFloat64), ncclFloat64);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kFloat16), ncclFloat16);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kBFloat16), ncclBfloat16);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kInt8), ncclInt8);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kUInt8), ncclUint8);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kInt32), ncclInt32);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kInt64), ncclInt64);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kSum), ncclSum);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kProd), ncclProd);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kMin), ncclMin);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kMax), ncclMax);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kAvg), ncclAvg);
}

TEST(NcclMappingTest, UniqueIdRoundTripsThroughHex) {
  ncclUniqueId id;
  for (size_t i = 0; i < sizeof(id.internal); ++i) id.internal[i] = static_cast<char>(i * 37);
  const std::string text = nccl::EncodeUniqueId(id);
  EXPECT_EQ(text.size(), 2 * sizeof(id.internal));
  const ncclUniqueId back = nccl::DecodeUniqueId(text);
  EXPECT_TRUE(
      std::equal(std::begin(id.internal), std::end(id.internal), std::begin(back.internal)));
  EXPECT_THROW(nccl::DecodeUniqueId("abc"), Error);
  EXPECT_THROW(nccl::DecodeUniqueId(std::string(text.size(), 'z')), Error);
}

// ---- GPU tests: skipped without NCCL and a device. ----

#define COLLECTIVES_REQUIRE_GPU(min_devices)                                                \
  std::string gpu_reason;                                                                   \
  const nccl::NcclApi* api_ptr = nccl::TryLoadNccl(&gpu_reason);                            \
  if (api_ptr == nullptr) GTEST_SKIP() << gpu_reason;                                       \
  if (api_ptr->device_count < (min_devices)) {                                              \
    GTEST_SKIP() << "needs " << (min_devices) << " CUDA devices, " << api_ptr->device_count \
                 << " visible (NCCL does not allow two ranks on one GPU)";                  \
  }                                                                                         \
  const nccl::NcclApi& api = *api_ptr

template <typename T>
DataType DataTypeOf() {
  if constexpr (std::is_same_v<T, float>) return DataType::kFloat32;
  if constexpr (std::is_same_v<T, double>) return DataType::kFloat64;
  if constexpr (std::is_same_v<T, int32_t>) return DataType::kInt32;
}

void CheckCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw Error(ErrorCode::kSystem, std::string(what) + " failed");
}

// A device buffer of `count` T on `device`, freed with the object.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer(const nccl::NcclApi& api, int device, size_t count)
      : api_(api), device_(device), count_(count) {
    CheckCuda(api_.cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(api_.cudaMalloc(&data_, std::max<size_t>(count_, 1) * sizeof(T)), "cudaMalloc");
  }
  ~DeviceBuffer() { api_.cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void Upload(const std::vector<T>& host) {
    CheckCuda(api_.cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(api_.cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              "cudaMemcpy");
  }
  std::vector<T> Download() const {
    std::vector<T> host(count_);
    CheckCuda(api_.cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(api_.cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost),
              "cudaMemcpy");
    return host;
  }
  Tensor tensor() const { return Tensor{data_, count_, DataTypeOf<T>(), Device::Cuda(device_)}; }

 private:
  const nccl::NcclApi& api_;
  const int device_;
  const size_t count_;
  void* data_ = nullptr;
};

// Rank r's input: small values so that products and sums stay exact.
template <typename T>
std::vector<T> Input(int rank, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i)
    v[i] = static_cast<T>(1 + (i * 7 + static_cast<size_t>(rank) * 3) % 5);
  return v;
}

template <typename T>
T Reduce(ReduceOp op, const std::vector<T>& values) {
  T acc = values[0];
  for (size_t i = 1; i < values.size(); ++i) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc = acc + values[i];
        break;
      case ReduceOp::kProd:
        acc = acc * values[i];
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, values[i]);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, values[i]);
        break;
    }
  }
  if (op == ReduceOp::kAvg) acc = static_cast<T>(acc / static_cast<T>(values.size()));
  return acc;
}

template <typename T>
void ExpectNear(T expected, T got, const std::string& where) {
  if constexpr (std::is_floating_point_v<T>) {
    EXPECT_NEAR(expected, got, std::abs(expected) * 1e-5 + 1e-6) << where;
  } else {
    EXPECT_EQ(expected, got) << where;
  }
}

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kAvg};

// Runs `size` ranks as threads, rank r on device r, each with its own NCCL communicator.
void RunNcclRanks(int size, const std::function<void(CollectiveCommunication&)>& body) {
  auto store = CreateMemoryStore();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        nccl::NcclOptions nccl_options;
        nccl_options.device = rank;
        auto comm = nccl::CreateNcclCommunication(rank, size, store, "test/nccl/0",
                                                  NcclOptionsFor(), nccl_options);
        body(*comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

// Every collective, every op, checked element by element against a host reference.
template <typename T>
void CheckAllCollectives(const nccl::NcclApi& api, CollectiveCommunication& comm) {
  const int size = comm.size();
  const int rank = comm.rank();
  const int device = rank;
  const size_t count = 1000;
  for (ReduceOp op : kOps) {
    const std::string where = std::string(ToString(DataTypeOf<T>())) + " " + ToString(op);
    // AllReduce, out of place then in place.
    DeviceBuffer<T> send(api, device, count), recv(api, device, count);
    send.Upload(Input<T>(rank, count));
    comm.AllReduce(send.tensor(), recv.tensor(), op);
    std::vector<T> got = recv.Download();
    for (size_t i = 0; i < count; ++i) {
      std::vector<T> column;
      for (int r = 0; r < size; ++r) column.push_back(Input<T>(r, count)[i]);
      ExpectNear(Reduce(op, column), got[i],
                 "all_reduce " + where + " [" + std::to_string(i) + "]");
    }
    comm.AllReduce(send.tensor(), op);
    got = send.Download();
    for (size_t i = 0; i < count; ++i) {
      std::vector<T> column;
      for (int r = 0; r < size; ++r) column.push_back(Input<T>(r, count)[i]);
      ExpectNear(Reduce(op, column), got[i], "in-place all_reduce " + where);
    }
    // ReduceScatter: send has size * count elements.
    DeviceBuffer<T> whole(api, device, count * static_cast<size_t>(size));
    whole.Upload(Input<T>(rank, count * static_cast<size_t>(size)));
    DeviceBuffer<T> block(api, device, count);
    comm.ReduceScatter(whole.tensor(), block.tensor(), op);
    got = block.Download();
    for (size_t i = 0; i < count; ++i) {
      const size_t at = static_cast<size_t>(rank) * count + i;
      std::vector<T> column;
      for (int r = 0; r < size; ++r) {
        column.push_back(Input<T>(r, count * static_cast<size_t>(size))[at]);
      }
      ExpectNear(Reduce(op, column), got[i], "reduce_scatter " + where);
    }
  }
  // Broadcast from each root.
  for (int root = 0; root < size; ++root) {
    DeviceBuffer<T> send(api, device, count), recv(api, device, count);
    send.Upload(Input<T>(rank, count));
    comm.Broadcast(send.tensor(), recv.tensor(), root);
    const std::vector<T> got = recv.Download();
    const std::vector<T> expected = Input<T>(root, count);
    for (size_t i = 0; i < count; ++i) ExpectNear(expected[i], got[i], "broadcast");
  }
  // AllGather.
  DeviceBuffer<T> part(api, device, count);
  part.Upload(Input<T>(rank, count));
  DeviceBuffer<T> all(api, device, count * static_cast<size_t>(size));
  comm.AllGather(part.tensor(), all.tensor());
  const std::vector<T> got = all.Download();
  for (int r = 0; r < size; ++r) {
    const std::vector<T> expected = Input<T>(r, count);
    for (size_t i = 0; i < count; ++i) {
      ExpectNear(expected[i], got[static_cast<size_t>(r) * count + i], "all_gather");
    }
  }
  comm.Barrier();
}

TEST(NcclGpuTest, OneRankEveryCollective) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    EXPECT_EQ(comm.implementation(), Implementation::kNccl);
    CheckAllCollectives<float>(api, comm);
    CheckAllCollectives<double>(api, comm);
    CheckAllCollectives<int32_t>(api, comm);
  });
}

TEST(NcclGpuTest, TwoRanksAsThreadsEveryCollective) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    CheckAllCollectives<float>(api, comm);
    CheckAllCollectives<double>(api, comm);
    CheckAllCollectives<int32_t>(api, comm);
  });
}

TEST(NcclGpuTest, ThroughTheFactory) {
  COLLECTIVES_REQUIRE_GPU(1);
  ClusterSpec spec;
  auto comm = CreateCommunication(spec, CreateMemoryStore(), NcclOptionsFor());
  EXPECT_EQ(comm->implementation(), Implementation::kNccl);
  DeviceBuffer<float> buffer(api, 0, 16);
  buffer.Upload(std::vector<float>(16, 2.0f));
  comm->AllReduce(buffer.tensor(), ReduceOp::kSum);
  for (float v : buffer.Download()) EXPECT_EQ(v, 2.0f);
  comm->Barrier();
}

TEST(NcclGpuTest, CpuTensorIsAnInvalidArgument) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    std::vector<float> host(8, 1.0f);
    const Tensor cpu{host.data(), host.size(), DataType::kFloat32, Device::Cpu()};
    try {
      comm.AllReduce(cpu, ReduceOp::kSum);
      ADD_FAILURE() << "expected Error(kInvalidArgument)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("rank 0"), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("all_reduce"), std::string::npos) << e.what();
    }
    // The communicator still works afterwards.
    DeviceBuffer<float> buffer(api, 0, 8);
    buffer.Upload(host);
    comm.AllReduce(buffer.tensor(), ReduceOp::kSum);
    for (float v : buffer.Download()) EXPECT_EQ(v, 1.0f);
  });
}

TEST(NcclGpuTest, BadSizesAndTypesAreInvalidArguments) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> a(api, 0, 8), b(api, 0, 4);
    DeviceBuffer<int32_t> c(api, 0, 8);
    auto expect_invalid = [](const std::function<void()>& call) {
      try {
        call();
        ADD_FAILURE() << "expected Error(kInvalidArgument)";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      }
    };
    expect_invalid([&] { comm.AllReduce(a.tensor(), b.tensor(), ReduceOp::kSum); });
    expect_invalid([&] { comm.AllReduce(a.tensor(), c.tensor(), ReduceOp::kSum); });
    expect_invalid([&] { comm.AllGather(a.tensor(), b.tensor()); });
    expect_invalid([&] { comm.Broadcast(a.tensor(), 1); });
    Tensor wrong_device = a.tensor();
    wrong_device.device = Device::Cuda(7);
    expect_invalid([&] { comm.AllReduce(wrong_device, ReduceOp::kSum); });
  });
}

TEST(NcclGpuTest, AbortBreaksTheCommunicator) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, 0, 8);
    comm.Abort();
    comm.Abort();  // idempotent
    try {
      comm.AllReduce(buffer.tensor(), ReduceOp::kSum);
      ADD_FAILURE() << "expected Error(kAborted)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    }
  });
}

TEST(NcclGpuTest, AsyncWorksCompleteInOrder) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, 0, 1 << 20);
    buffer.Upload(std::vector<float>(1 << 20, 3.0f));
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 8; ++i)
      works.push_back(comm.AllReduceAsync(buffer.tensor(), buffer.tensor(), ReduceOp::kMax));
    for (auto& w : works) w->Wait();
    for (auto& w : works) EXPECT_TRUE(w->Done());
    EXPECT_EQ(buffer.Download()[12345], 3.0f);
  });
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace
}  // namespace collectives
