// The C API on CUDA device memory: a buffer the CUDA runtime reports as memory of device N is
// a cuda:N tensor, which RING and AUTO stage through pinned host memory (src/ring/staged.h) and
// NCCL takes as it is; host buffers stay host buffers. All-reduce, all-gather, reduce-scatter,
// broadcast and gather on device memory, checked element by element against a local reference on
// 1-3 ranks (threads, over loopback TCP).
//
// Needs libcudart and a device: a GPU (ctest label gpu) or the CPU stand-in of tests/nccl/fake
// ("fake_nccl:" entries). Without either it skips, or fails where COLLECTIVES_REQUIRE_GPU=1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/c_api.h"
#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/c_api/c_api_internal.h"
#include "tests/c_api/c_api_ranks.h"
#include "tests/ring/collective_checks.h"
#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#endif

namespace {

#ifdef COLLECTIVES_WITH_NCCL

using collectives::DataType;
using collectives::ReduceOp;
using collectives::SizeOf;
using collectives::testing::Expected;
using collectives::testing::InputValue;
using collectives::testing::Load;
using collectives::testing::Store;

bool GpuRequired() {
  const char* value = std::getenv("COLLECTIVES_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}

// Runs `size` ranks of `implementation` as threads, each through the C API's handle.
void RunRanks(int size, collectives::Implementation implementation,
              const std::function<void(coll_comm*, int)>& body) {
  collectives::CommunicationOptions options;
  options.implementation = implementation;
  options.timeout = std::chrono::seconds(30);
  collectives::testing::RunCApiRanks(size, options, body);
}

TEST(CApiCudaTest, DeviceBuffersAreStagedAndCheckedOnOneToThreeRanks) {
  std::string reason;
  const collectives::nccl::NcclApi* api = collectives::nccl::TryLoadCudart(&reason);
  if (api == nullptr) {
    if (GpuRequired()) GTEST_FAIL() << "COLLECTIVES_REQUIRE_GPU=1, but " << reason;
    GTEST_SKIP() << reason;
  }
  const DataType dtype = DataType::kFloat32;
  const size_t count = 3001;  // odd: several RING chunks, uneven blocks
  for (int size = 1; size <= 3; ++size) {
    SCOPED_TRACE("ranks " + std::to_string(size));
    RunRanks(size, collectives::Implementation::kRing, [&](coll_comm* comm, int rank) {
      const int device = rank % api->device_count;
      ASSERT_EQ(api->cudaSetDevice(device), cudaSuccess);
      const size_t n = size_t(size), bytes = count * SizeOf(dtype);
      void* send = nullptr;
      void* recv = nullptr;
      ASSERT_EQ(api->cudaMalloc(&send, n * bytes), cudaSuccess);
      ASSERT_EQ(api->cudaMalloc(&recv, n * bytes), cudaSuccess);
      std::vector<uint8_t> host(n * bytes);
      auto upload = [&](size_t elements) {
        ASSERT_EQ(api->cudaMemcpy(send, host.data(), elements * SizeOf(dtype),
                                  cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(api->cudaDeviceSynchronize(), cudaSuccess);
      };
      auto download = [&](size_t elements) {
        std::vector<uint8_t> out(elements * SizeOf(dtype));
        EXPECT_EQ(api->cudaMemcpy(out.data(), recv, out.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        return out;
      };
      // Wrong elements of recv after an all-gather or a gather: block r is rank r's input.
      auto gathered_wrong = [&] {
        const std::vector<uint8_t> gathered = download(n * count);
        size_t wrong = 0;
        for (size_t r = 0; r < n; ++r) {
          for (size_t i = 0; i < count; ++i) {
            wrong += Load(dtype, gathered.data(), r * count + i) !=
                     InputValue(ReduceOp::kSum, dtype, int(r), i);
          }
        }
        return wrong;
      };
      // all_reduce (avg)
      for (size_t i = 0; i < count; ++i) {
        Store(dtype, host.data(), i, InputValue(ReduceOp::kAvg, dtype, rank, i));
      }
      upload(count);
      ASSERT_EQ(coll_all_reduce(comm, send, recv, count, COLL_FLOAT32, COLL_AVG), COLL_OK)
          << coll_last_error();
      std::vector<uint8_t> got = download(count);
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        wrong += Load(dtype, got.data(), i) != Expected(ReduceOp::kAvg, dtype, size, i);
      }
      EXPECT_EQ(wrong, 0u) << "all_reduce, rank " << rank;
      // all_gather
      for (size_t i = 0; i < count; ++i) {
        Store(dtype, host.data(), i, InputValue(ReduceOp::kSum, dtype, rank, i));
      }
      upload(count);
      ASSERT_EQ(coll_all_gather(comm, send, recv, count, COLL_FLOAT32), COLL_OK)
          << coll_last_error();
      EXPECT_EQ(gathered_wrong(), 0u) << "all_gather, rank " << rank;
      // reduce_scatter (max)
      for (size_t i = 0; i < n * count; ++i) {
        Store(dtype, host.data(), i, InputValue(ReduceOp::kMax, dtype, rank, i));
      }
      upload(n * count);
      ASSERT_EQ(coll_reduce_scatter(comm, send, recv, count, COLL_FLOAT32, COLL_MAX), COLL_OK)
          << coll_last_error();
      got = download(count);
      wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        wrong += Load(dtype, got.data(), i) !=
                 Expected(ReduceOp::kMax, dtype, size, size_t(rank) * count + i);
      }
      EXPECT_EQ(wrong, 0u) << "reduce_scatter, rank " << rank;
      // broadcast from the last rank
      for (size_t i = 0; i < count; ++i) {
        Store(dtype, host.data(), i, InputValue(ReduceOp::kSum, dtype, size - 1, i));
      }
      upload(count);
      ASSERT_EQ(coll_broadcast(comm, send, recv, count, COLL_FLOAT32, size - 1), COLL_OK)
          << coll_last_error();
      got = download(count);
      wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        wrong += Load(dtype, got.data(), i) != InputValue(ReduceOp::kSum, dtype, size - 1, i);
      }
      EXPECT_EQ(wrong, 0u) << "broadcast, rank " << rank;
      // Host buffers still work beside device ones.
      std::vector<float> on_host(5, float(rank + 1));
      ASSERT_EQ(coll_all_reduce(comm, on_host.data(), on_host.data(), 5, COLL_FLOAT32, COLL_SUM),
                COLL_OK)
          << coll_last_error();
      EXPECT_EQ(on_host[4], float(size * (size + 1) / 2));
      // gather to rank 0: the rooted collectives stage device memory too.
      for (size_t i = 0; i < count; ++i) {
        Store(dtype, host.data(), i, InputValue(ReduceOp::kSum, dtype, rank, i));
      }
      upload(count);
      ASSERT_EQ(coll_gather(comm, send, recv, count, COLL_FLOAT32, 0), COLL_OK)
          << coll_last_error();
      if (rank == 0) {
        EXPECT_EQ(gathered_wrong(), 0u) << "gather, rank " << rank;
      }
      api->cudaFree(send);
      api->cudaFree(recv);
    });
  }
}

// COLL_IMPLEMENTATION_NCCL: device buffers go to NCCL (one rank per device, up to two), checked
// element by element; a host buffer is COLL_INVALID_ARGUMENT naming NCCL's reason.
TEST(CApiCudaTest, NcclTakesDeviceBuffersAndRefusesHostOnes) {
  std::string reason;
  const collectives::nccl::NcclApi* api = collectives::nccl::TryLoadNccl(&reason);
  if (api == nullptr) {
    if (GpuRequired()) GTEST_FAIL() << "COLLECTIVES_REQUIRE_GPU=1, but " << reason;
    GTEST_SKIP() << reason;
  }
  const int size = std::min(api->device_count, 2);
  const size_t count = 1009;
  RunRanks(size, collectives::Implementation::kNccl, [&](coll_comm* comm, int rank) {
    ASSERT_EQ(api->cudaSetDevice(rank), cudaSuccess);
    void* data = nullptr;
    ASSERT_EQ(api->cudaMalloc(&data, count * sizeof(float)), cudaSuccess);
    std::vector<float> host(count);
    for (size_t i = 0; i < count; ++i) host[i] = float((i + size_t(rank)) % 5);
    ASSERT_EQ(api->cudaMemcpy(data, host.data(), count * sizeof(float),
                              cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(api->cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(coll_all_reduce(comm, data, data, count, COLL_FLOAT32, COLL_SUM), COLL_OK)
        << coll_last_error();
    std::vector<float> got(count);
    EXPECT_EQ(api->cudaMemcpy(got.data(), data, count * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < size; ++r) want += float((i + size_t(r)) % 5);
      wrong += got[i] != want;
    }
    EXPECT_EQ(wrong, 0u) << "rank " << rank;
    EXPECT_EQ(coll_all_reduce(comm, host.data(), host.data(), count, COLL_FLOAT32, COLL_SUM),
              COLL_INVALID_ARGUMENT);
    EXPECT_NE(std::string(coll_last_error()).find("NCCL"), std::string::npos)
        << coll_last_error();
    api->cudaFree(data);
  });
}

#else

TEST(CApiCudaTest, DeviceBuffersAreStagedAndCheckedOnOneToThreeRanks) {
  GTEST_SKIP() << "this library is built without CUDA";
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace
