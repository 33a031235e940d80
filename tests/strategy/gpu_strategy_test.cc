// GPU replicas of MirroredStrategy and MultiWorkerMirroredStrategy: variables in device memory,
// cross_device_ops kNccl (one NCCL communicator per replica inside the process), optimizers on
// device variables, and the refusals where CUDA or NCCL is missing. Results are checked against
// references the test computes on the host itself.
//
// Needs CUDA and NCCL with at least two devices: on a machine without them the tests skip (the
// refusal test runs there instead); their "fake_nccl:" entries run them against the CPU
// stand-in of tests/nccl/fake, four devices.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/errors.h"
#include "collectives/strategy.h"
#include "tests/strategy/strategy_test_util.h"

#if COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#endif

namespace collectives::strategy {
namespace {

using testing::ExpectError;
using testing::RunWorkers;

// The visible CUDA devices when CUDA and NCCL are usable, else 0 (and the reason).
int UsableDevices(std::string* why) {
#if COLLECTIVES_WITH_NCCL
  const nccl::NcclApi* api = nccl::TryLoadNccl(why);
  return api == nullptr ? 0 : api->device_count;
#else
  *why = "built without NCCL";
  return 0;
#endif
}

#define REQUIRE_GPUS(n)                                                                         \
  do {                                                                                          \
    std::string why;                                                                            \
    const int have = UsableDevices(&why);                                                       \
    if (have < (n)) {                                                                           \
      if (std::getenv("COLLECTIVES_REQUIRE_GPU") != nullptr) {                                  \
        FAIL() << "COLLECTIVES_REQUIRE_GPU is set, and " << have << " usable devices: " << why; \
      }                                                                                         \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices and NCCL: " << why;                     \
    }                                                                                           \
  } while (0)

#if COLLECTIVES_WITH_NCCL
// Device memory the test owns, filled from and read back to the host through the runtime.
class DeviceFloats {
 public:
  DeviceFloats(int device, const std::vector<float>& values)
      : device_(device), count_(values.size()) {
    const nccl::NcclApi& api = nccl::LoadCudart();
    EXPECT_EQ(api.cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(api.cudaMalloc(&data_, values.size() * sizeof(float)), cudaSuccess);
    EXPECT_EQ(
        api.cudaMemcpy(data_, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice),
        cudaSuccess);
  }
  ~DeviceFloats() {
    const nccl::NcclApi& api = nccl::LoadCudart();
    api.cudaSetDevice(device_);
    api.cudaFree(data_);
  }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  Tensor tensor() const { return Tensor{data_, count_, DataType::kFloat32, Device::Cuda(device_)}; }
  std::vector<float> Read() const {
    const nccl::NcclApi& api = nccl::LoadCudart();
    std::vector<float> out(count_);
    api.cudaSetDevice(device_);
    EXPECT_EQ(api.cudaMemcpy(out.data(), data_, count_ * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  int device_;
  size_t count_;
  void* data_ = nullptr;
};
#endif

TEST(GpuStrategyTest, WithoutCudaAskingForGpuReplicasIsNotSupportedAndSaysWhy) {
  std::string why;
  if (UsableDevices(&why) > 0) GTEST_SKIP() << "CUDA and NCCL are usable here: nothing to refuse";
  ExpectError(ErrorCode::kNotSupported, {"CUDA is not available"}, [] { ParseDevices("gpu"); });
  ExpectError(ErrorCode::kNotSupported, {"MirroredStrategy"}, [] {
    MirroredOptions options;
    options.devices = {Device::Cuda(0), Device::Cuda(1)};
    MirroredStrategy strategy(options);
  });
}

TEST(GpuStrategyTest, DevicesAndCrossDeviceOpsAreCheckedBeforeAnythingRuns) {
  ExpectError(ErrorCode::kNotSupported, {"nccl needs CUDA devices"}, [] {
    MirroredStrategy strategy({.num_replicas = 2, .cross_device_ops = CrossDeviceOps::kNccl});
  });
  ExpectError(ErrorCode::kInvalidArgument, {"named twice"}, [] { ParseDevices("cuda:0,cuda:0"); });
  ExpectError(ErrorCode::kInvalidArgument, {"either all CPU or all CUDA"},
              [] { ParseDevices("cpu,cuda:0"); });
  ExpectError(ErrorCode::kInvalidArgument, {"'tpu:0' is not a device"},
              [] { ParseDevices("tpu:0"); });
  EXPECT_EQ(ParseDevices("cpu,cpu").size(), 2u);
}

#if COLLECTIVES_WITH_NCCL

std::vector<Device> FirstDevices(int n, int first = 0) {
  std::vector<Device> out;
  for (int i = 0; i < n; ++i) out.push_back(Device::Cuda(first + i));
  return out;
}

// Replica r's value at element i: small integers and halves, so that every sum is exact.
float Input(int replica, size_t i) {
  return static_cast<float>(replica + 1) * 0.5f + static_cast<float>(i % 97);
}

TEST(GpuStrategyTest, GpuMeansOneReplicaPerVisibleDevice) {
  REQUIRE_GPUS(2);
  std::string why;
  const int visible = UsableDevices(&why);
  const std::vector<Device> devices = ParseDevices("gpu");
  EXPECT_EQ(devices, FirstDevices(visible));
  EXPECT_EQ(ParseDevices("cuda:1,cuda:0"), (std::vector<Device>{Device::Cuda(1), Device::Cuda(0)}));
  ExpectError(ErrorCode::kInvalidArgument, {"does not exist"},
              [&] { ParseDevices("cuda:" + std::to_string(visible)); });
  ExpectError(ErrorCode::kNotSupported, {"reads every replica's memory from the host"}, [] {
    MirroredStrategy strategy(
        {.devices = FirstDevices(2), .cross_device_ops = CrossDeviceOps::kHierarchicalCopy});
  });
}

// Every replica all-reduces a device tensor, a host tensor and a scalar; every replica gets the
// host reference, for 2, 3 and 4 replicas and kSum, kAvg, kMax.
TEST(GpuStrategyTest, NcclAllReduceOfDeviceAndHostTensorsMatchesTheHostReference) {
  REQUIRE_GPUS(2);
  std::string why;
  const int visible = std::min(UsableDevices(&why), 4);
  constexpr size_t kCount = 1000;
  for (int n = 2; n <= visible; ++n) {
    MirroredStrategy strategy({.devices = FirstDevices(n), .timeout = std::chrono::seconds(20)});
    ASSERT_EQ(strategy.cross_device_ops(), CrossDeviceOps::kNccl);
    ASSERT_EQ(strategy.NumReplicasInSync(), n);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      std::vector<float> expected(kCount);
      for (size_t i = 0; i < kCount; ++i) {
        double acc = op == ReduceOp::kMax ? -1e30 : 0.0;
        for (int r = 0; r < n; ++r) {
          acc = op == ReduceOp::kMax ? std::max(acc, double{Input(r, i)}) : acc + Input(r, i);
        }
        expected[i] = static_cast<float>(op == ReduceOp::kAvg ? acc / n : acc);
      }
      const PerReplica<std::vector<std::vector<float>>> got =
          strategy.Run([&](ReplicaContext& ctx) {
            const int r = ctx.local_replica_id();
            std::vector<float> values(kCount);
            for (size_t i = 0; i < kCount; ++i) values[i] = Input(r, i);
            DeviceFloats on_device(r, values);
            std::vector<float> host = values;
            ctx.AllReduce(op, {on_device.tensor(), Tensor{host.data(), host.size()}});
            const double scalar = ctx.AllReduce(op, static_cast<double>(r + 1));
            return std::vector<std::vector<float>>{
                on_device.Read(), host, {static_cast<float>(scalar)}};
          });
      double scalar = op == ReduceOp::kMax ? n : n * (n + 1) / 2.0;
      if (op == ReduceOp::kAvg) scalar /= n;
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < kCount; ++i) {
          ASSERT_NEAR(got[r][0][i], expected[i], 1e-5f)
              << n << " replicas, " << ToString(op) << ", replica " << r << " element " << i;
          ASSERT_NEAR(got[r][1][i], expected[i], 1e-5f) << "host tensor, replica " << r;
        }
        EXPECT_NEAR(got[r][2][0], scalar, 1e-6) << ToString(op) << ", replica " << r;
      }
    }
  }
}

// Variables live in each replica's device memory; SGD and Adam applied to device gradients keep
// them identical and equal to the update computed here on the host.
TEST(GpuStrategyTest, MirroredVariablesOnDevicesFollowTheHostReferenceUpdate) {
  REQUIRE_GPUS(2);
  std::string why;
  const int n = std::min(UsableDevices(&why), 4);
  MirroredStrategy strategy({.devices = FirstDevices(n), .timeout = std::chrono::seconds(20)});
  constexpr size_t kCount = 300;
  MirroredVariable& w = strategy.CreateVariable("w", {kCount}, GlorotUniform(kCount, 1, 7));
  MirroredVariable& u = strategy.CreateVariable("u", {kCount}, Constant(0.5f));
  std::vector<float> init(kCount);
  GlorotUniform(kCount, 1, 7)(init);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(w.tensor(r).device, Device::Cuda(r));
    EXPECT_EQ(w.Read(r), init) << "replica " << r;
  }
  ExpectError(ErrorCode::kInvalidUsage, {"use tensor(), Read() or Write()"}, [&] { w.value(0); });

  Sgd sgd(strategy, {.learning_rate = 0.1f, .momentum = 0.5f});
  Adam adam(strategy, {.learning_rate = 0.01f});
  // Replica r's gradient at step s, element i.
  const auto grad = [](int r, int s, size_t i) {
    return 0.25f * static_cast<float>(r + 1) - 0.01f * static_cast<float>((i + s) % 13);
  };
  std::vector<double> ref_w(init.begin(), init.end()), velocity(kCount, 0.0);
  std::vector<double> ref_u(kCount, 0.5), m(kCount, 0.0), v(kCount, 0.0);
  constexpr int kSteps = 4;
  for (int s = 0; s < kSteps; ++s) {
    strategy.Run([&](ReplicaContext& ctx) {
      const int r = ctx.local_replica_id();
      std::vector<float> g(kCount);
      for (size_t i = 0; i < kCount; ++i) g[i] = grad(r, s, i);
      DeviceFloats gw(r, g), gu(r, g);
      sgd.ApplyGradients(ctx, {&w}, std::vector<Tensor>{gw.tensor()});
      adam.ApplyGradients(ctx, {&u}, std::vector<Tensor>{gu.tensor()});
    });
    const double t = s + 1;
    const double lr_t = 0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
    for (size_t i = 0; i < kCount; ++i) {
      double sum = 0;
      for (int r = 0; r < n; ++r) sum += grad(r, s, i);
      velocity[i] = 0.5 * velocity[i] - 0.1 * sum;
      ref_w[i] += velocity[i];
      m[i] = 0.9 * m[i] + 0.1 * sum;
      v[i] = 0.999 * v[i] + 0.001 * sum * sum;
      ref_u[i] -= lr_t * m[i] / (std::sqrt(v[i]) + 1e-7);
    }
  }
  const std::vector<float> first = w.Read(0);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(w.Read(r), first) << "replica " << r << "'s copy differs from replica 0's";
    EXPECT_EQ(u.Read(r), u.Read(0)) << "replica " << r;
  }
  const std::vector<float> got_u = u.Read(0);
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_NEAR(first[i], ref_w[i], 1e-4) << "SGD, element " << i;
    ASSERT_NEAR(got_u[i], ref_u[i], 1e-4) << "Adam, element " << i;
  }
  EXPECT_EQ(sgd.iterations(), kSteps);
  // Assign writes every device copy.
  const std::vector<float> twos(kCount, 2.0f);
  w.Assign(twos);
  for (int r = 0; r < n; ++r) EXPECT_EQ(w.Read(r), twos);
}

// A GPU replica that fails after an NCCL all-reduce releases the other, which waits for it at
// the next one: Run rethrows the original error at once, never waiting for the timeout, and the
// strategy stays broken.
TEST(GpuStrategyTest, AReplicaThatFailsReleasesTheOthersAtOnce) {
  REQUIRE_GPUS(2);
  MirroredStrategy strategy({.devices = FirstDevices(2), .timeout = std::chrono::seconds(20)});
  const auto start = std::chrono::steady_clock::now();
  try {
    strategy.Run([&](ReplicaContext& ctx) {
      std::vector<float> values(64, 1.0f);
      DeviceFloats t(ctx.local_replica_id(), values);
      ctx.AllReduce(ReduceOp::kSum, {t.tensor()});  // every replica, once
      if (ctx.local_replica_id() == 1) throw std::runtime_error("replica 1 gives up");
      ctx.AllReduce(ReduceOp::kSum, {t.tensor()});  // replica 0 waits for it here
    });
    ADD_FAILURE() << "expected Run to rethrow replica 1's error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "replica 1 gives up");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_THROW(strategy.Run([](ReplicaContext&) {}), std::runtime_error);
}

// Two workers (threads, over loopback TCP) of two GPU replicas each, on devices of their own:
// NCCL inside each worker, host copies between them; every replica gets the sum of all four.
TEST(GpuStrategyTest, MultiWorkerGpuReplicasReduceAcrossWorkers) {
  REQUIRE_GPUS(4);
  constexpr size_t kCount = 513;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    RunWorkers(
        2, 2, CrossDeviceOps::kAuto,
        [&](Strategy& strategy, int worker) {
          ASSERT_EQ(strategy.cross_device_ops(), CrossDeviceOps::kNccl);
          ASSERT_EQ(strategy.NumReplicasInSync(), 4);
          MirroredVariable& w = strategy.CreateVariable("w", {kCount}, Constant(1.5f));
          for (int r = 0; r < 2; ++r) {
            EXPECT_EQ(w.tensor(r).device, Device::Cuda(2 * worker + r));
            EXPECT_EQ(w.Read(r), std::vector<float>(kCount, 1.5f));
          }
          const auto got = strategy.Run([&](ReplicaContext& ctx) {
            const int g = ctx.replica_id_in_sync_group();
            std::vector<float> values(kCount);
            for (size_t i = 0; i < kCount; ++i) values[i] = Input(g, i);
            DeviceFloats t(strategy.devices()[ctx.local_replica_id()].index, values);
            ctx.AllReduce(op, {t.tensor()});
            return t.Read();
          });
          for (int r = 0; r < 2; ++r) {
            for (size_t i = 0; i < kCount; ++i) {
              double sum = 0;
              for (int g = 0; g < 4; ++g) sum += Input(g, i);
              if (op == ReduceOp::kAvg) sum /= 4;
              ASSERT_NEAR(got[r][i], sum, 1e-5) << "worker " << worker << " replica " << r;
            }
          }
        },
        [](MultiWorkerOptions& options) {
          const int first = 2 * options.cluster->rank;
          options.local_devices = FirstDevices(2, first);
        });
  }
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace
}  // namespace collectives::strategy
