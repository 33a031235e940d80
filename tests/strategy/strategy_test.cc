// Strategies: configuration and errors, Run (results, parallel replicas on persistent threads,
// the first error propagated and the other replicas released, timeouts, mismatched calls),
// ReplicaContext::AllReduce against a reference element by element (every CrossDeviceOps, 1..8
// local replicas, odd sizes, several and mixed dtypes, every op; then 2-3 workers x 1-3 replicas
// as threads over loopback TCP), Strategy::Reduce, CreateVariable and BroadcastFromChief.
//
// One file: the sections test the one Strategy class of collectives/strategy.h and share the
// worker helpers of strategy_test_util.h and the reference input Input() of the AllReduce cases.
#include "collectives/strategy.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "src/core/kernels.h"
#include "tests/strategy/strategy_test_util.h"
#include "tests/time_scale.h"

namespace collectives::strategy {
namespace {

using namespace std::chrono_literals;
using testing::BitEqual;
using testing::ExpectError;
using testing::ExpectErrorPtr;
using testing::RunWorkers;
using testing::RunWorkersCatching;

constexpr CrossDeviceOps kR2O = CrossDeviceOps::kReductionToOneDevice;
constexpr CrossDeviceOps kHC = CrossDeviceOps::kHierarchicalCopy;

// ---- Configuration -----------------------------------------------------------------------------

TEST(StrategyConfigTest, DefaultAndOneDevice) {
  DefaultStrategy d;
  EXPECT_EQ(d.name(), "default");
  EXPECT_EQ(d.NumReplicasInSync(), 1);
  EXPECT_EQ(d.num_workers(), 1);
  EXPECT_EQ(d.worker_index(), 0);
  EXPECT_TRUE(d.IsChief());
  EXPECT_EQ(d.communication(), nullptr);
  EXPECT_EQ(d.devices(), std::vector<Device>{Device::Cpu()});
  OneDeviceStrategy one;
  EXPECT_EQ(one.name(), "one_device");
  EXPECT_EQ(one.NumReplicasInSync(), 1);
  ExpectError(ErrorCode::kNotSupported, {"OneDeviceStrategy", "cuda:0", "MirroredStrategy"},
              [] { OneDeviceStrategy gpu(Device::Cuda(0)); });
}

TEST(StrategyConfigTest, Mirrored) {
  MirroredStrategy m({.num_replicas = 3});
  EXPECT_EQ(m.name(), "mirrored");
  EXPECT_EQ(m.NumReplicasInSync(), 3);
  EXPECT_EQ(m.num_local_replicas(), 3);
  EXPECT_EQ(m.cross_device_ops(), kHC);  // kAuto on CPU replicas
  MirroredStrategy by_devices({.devices = {Device::Cpu(), Device::Cpu()},
                               .cross_device_ops = kR2O});
  EXPECT_EQ(by_devices.num_local_replicas(), 2);
  EXPECT_EQ(by_devices.cross_device_ops(), kR2O);
  MirroredStrategy defaulted;
  EXPECT_EQ(defaulted.num_local_replicas(), 1);
  ExpectError(ErrorCode::kNotSupported, {"nccl needs CUDA devices"}, [] {
    MirroredStrategy s({.num_replicas = 2, .cross_device_ops = CrossDeviceOps::kNccl});
  });
  ExpectError(ErrorCode::kInvalidArgument, {"cuda:1", "either all CPU or all CUDA"}, [] {
    MirroredStrategy s({.devices = {Device::Cpu(), Device::Cuda(1)}});
  });
  ExpectError(ErrorCode::kInvalidArgument, {"-2 local replicas"},
              [] { MirroredStrategy s({.num_replicas = -2}); });
  ExpectError(ErrorCode::kInvalidArgument, {"timeout"},
              [] { MirroredStrategy s({.num_replicas = 2, .timeout = 0ms}); });
}

TEST(StrategyConfigTest, CrossDeviceOpsNames) {
  for (CrossDeviceOps ops : {CrossDeviceOps::kAuto, kR2O, kHC, CrossDeviceOps::kNccl}) {
    EXPECT_EQ(ParseCrossDeviceOps(ToString(ops)), ops);
  }
  EXPECT_EQ(ParseCrossDeviceOps("HierarchicalCopyAllReduce"), kHC);
  EXPECT_EQ(ParseCrossDeviceOps("ReductionToOneDevice"), kR2O);
  EXPECT_EQ(ParseCrossDeviceOps("NcclAllReduce"), CrossDeviceOps::kNccl);
  ExpectError(ErrorCode::kInvalidArgument, {"'ring'"}, [] { ParseCrossDeviceOps("ring"); });
}

TEST(StrategyConfigTest, MultiWorkerLayoutAndChief) {
  RunWorkers(3, 2, kHC, [](Strategy& s, int rank) {
    EXPECT_EQ(s.name(), "multi_worker_mirrored");
    EXPECT_EQ(s.num_workers(), 3);
    EXPECT_EQ(s.worker_index(), rank);
    EXPECT_EQ(s.NumReplicasInSync(), 6);
    EXPECT_EQ(s.IsChief(), rank == 0);
    ASSERT_NE(s.communication(), nullptr);
    EXPECT_EQ(s.communication()->size(), 3);
    auto ids = s.Run([](ReplicaContext& ctx) { return ctx.replica_id_in_sync_group(); });
    EXPECT_EQ(ids, (std::vector<int>{2 * rank, 2 * rank + 1}));
  });
}

TEST(StrategyConfigTest, TfConfigChiefIsRankZeroAndChief) {
  // TF_CONFIG with a "chief" task: the chief is rank 0 and IsChief; worker 0 is rank 1.
  const auto tf_config = [](const char* type) {
    return std::string(R"({"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},)") +
           R"( "task": {"type": ")" + type + R"(", "index": 0}})";
  };
  auto store = CreateMemoryStore();
  std::vector<int> chief(2, -1);
  std::vector<std::thread> threads;
  for (const char* type : {"chief", "worker"}) {
    threads.emplace_back([&, type] {
      try {
        MultiWorkerOptions options;
        options.cluster = ClusterSpec::FromTfConfig(tf_config(type));
        options.store = store;
        options.communication.timeout = 20s;
        MultiWorkerMirroredStrategy s(options);
        chief[s.worker_index()] = s.IsChief() ? 1 : 0;
        EXPECT_EQ(s.worker_index(), std::string(type) == "chief" ? 0 : 1);
        s.Barrier();
      } catch (const std::exception& e) {
        ADD_FAILURE() << type << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(chief, (std::vector<int>{1, 0}));
}

// TensorFlow's layout rules: every refusal names the TF_CONFIG field and the rule; a layout that
// fits passes.
TEST(StrategyConfigTest, ClusterLayoutsThatDoNotFitTheStrategyAreRefused) {
  const auto spec = [](const std::string& cluster, const std::string& type) {
    return ClusterSpec::FromTfConfig(R"({"cluster": {)" + cluster + R"(}, "task": {"type": ")" +
                                     type + R"(", "index": 0}})");
  };
  const std::string training = R"("chief": ["c:1"], "worker": ["w:2"])";
  const std::string with_evaluator = training + R"(, "evaluator": ["e:3"])";
  const std::string with_ps = training + R"(, "ps": ["p:4"])";
  const auto refused = [&](const ClusterSpec& s, const char* strategy,
                           std::vector<std::string> parts) {
    SCOPED_TRACE(strategy);
    try {
      CheckClusterLayout(s, strategy);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      for (const std::string& part : parts) EXPECT_NE(e.message().find(part), std::string::npos)
          << e.message() << " lacks " << part;
    }
  };
  EXPECT_NO_THROW(CheckClusterLayout(spec(with_evaluator, "worker"), "multi_worker_mirrored"));
  EXPECT_NO_THROW(CheckClusterLayout(spec(with_evaluator, "evaluator"), "one_device"));
  EXPECT_NO_THROW(CheckClusterLayout(spec(with_ps, "ps"), "parameter_server"));
  EXPECT_NO_THROW(CheckClusterLayout(spec(with_ps, "chief"), "parameter_server"));
  refused(spec(with_ps, "worker"), "multi_worker_mirrored", {"'cluster.ps'", "ParameterServer"});
  refused(spec(with_ps, "ps"), "multi_worker_mirrored", {"'task.type' = 'ps'"});
  refused(spec(with_evaluator, "evaluator"), "multi_worker_mirrored",
          {"'task.type' = 'evaluator'", "not part of the training collective"});
  refused(spec(training, "chief"), "parameter_server", {"'cluster.ps'", "parameter server"});
  refused(spec(R"("worker": ["w:2"], "ps": ["p:4"])", "worker"), "parameter_server",
          {"'cluster.chief'", "coordinator"});
  refused(spec(R"("chief": ["c:1"], "ps": ["p:4"])", "ps"), "parameter_server",
          {"'cluster.worker'"});
  refused(ClusterSpec(), "parameter_server", {"'cluster'"});
  refused(spec(training, "worker"), "mirrored", {"'cluster'", "2 chief and worker tasks"});
  refused(spec(with_ps, "ps"), "central_storage", {"'task.type' = 'ps'"});
  refused(ClusterSpec(), "tpu", {"unknown strategy 'tpu'"});
  // MultiWorkerMirroredStrategy checks its own cluster before it connects to anyone.
  MultiWorkerOptions options;
  options.cluster = spec(with_evaluator, "evaluator");
  ExpectError(ErrorCode::kInvalidArgument, {"not part of the training collective"},
              [&] { MultiWorkerMirroredStrategy s(options); });
}

// ---- Run ---------------------------------------------------------------------------------------

TEST(StrategyRunTest, OneResultPerReplica) {
  MirroredStrategy s({.num_replicas = 4});
  auto out = s.Run([](ReplicaContext& ctx) {
    EXPECT_EQ(ctx.num_replicas_in_sync(), 4);
    EXPECT_EQ(ctx.replica_id_in_sync_group(), ctx.local_replica_id());
    return 10 * ctx.local_replica_id();
  });
  EXPECT_EQ(out, (std::vector<int>{0, 10, 20, 30}));
  // vector<bool> results: every replica writes its own slot.
  auto odd = s.Run([](ReplicaContext& ctx) { return ctx.local_replica_id() % 2 == 1; });
  EXPECT_EQ(odd, (std::vector<bool>{false, true, false, true}));
  // void functions
  std::atomic<int> calls{0};
  s.Run([&](ReplicaContext&) { ++calls; });
  EXPECT_EQ(calls.load(), 4);
}

TEST(StrategyRunTest, ReplicasRunInParallelOnPersistentThreads) {
  constexpr int kN = 6;
  MirroredStrategy s({.num_replicas = kN});
  std::vector<std::thread::id> first(kN), second(kN);
  for (auto* ids : {&first, &second}) {
    // Every replica waits until all have started: run one after another, this would never end
    // (it gives up after 10 s and fails instead).
    std::atomic<int> arrived{0};
    auto met = s.Run([&](ReplicaContext& ctx) {
      (*ids)[ctx.local_replica_id()] = std::this_thread::get_id();
      ++arrived;
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (arrived.load() < kN && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
      return arrived.load() == kN;
    });
    EXPECT_EQ(met, std::vector<bool>(kN, true));
  }
  EXPECT_EQ(first[0], std::this_thread::get_id());  // replica 0 on the caller's thread
  EXPECT_EQ(first, second);                          // the same threads every step
  EXPECT_EQ(std::set<std::thread::id>(first.begin(), first.end()).size(), size_t{kN});
}

TEST(StrategyRunTest, FirstErrorComesBackAndBlockedReplicasAreReleased) {
  for (CrossDeviceOps ops : {kR2O, kHC}) {
    MirroredStrategy s({.num_replicas = 4, .cross_device_ops = ops});  // default timeout: 300 s
    std::mutex mu;
    std::vector<std::string> others;
    const auto start = std::chrono::steady_clock::now();
    ExpectError(ErrorCode::kInvalidUsage, {"boom from replica 2"}, [&] {
      s.Run([&](ReplicaContext& ctx) {
        if (ctx.local_replica_id() == 2) {
          std::this_thread::sleep_for(20ms);  // the others are blocked in AllReduce by now
          throw Error(ErrorCode::kInvalidUsage, "boom from replica 2");
        }
        float x = 1;
        try {
          ctx.AllReduce(ReduceOp::kSum, {Tensor{&x, 1}});
        } catch (const Error& e) {
          std::lock_guard<std::mutex> lock(mu);
          others.push_back(e.what());
          throw;
        }
      });
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, test_time::Scaled(5s));
    ASSERT_EQ(others.size(), 3u);
    for (const std::string& what : others) {
      EXPECT_NE(what.find("[aborted]"), std::string::npos) << what;
      EXPECT_NE(what.find("all_reduce #1 aborted because replica 2 failed"), std::string::npos)
          << what;
      EXPECT_NE(what.find("boom from replica 2"), std::string::npos) << what;
    }
    // Sticky: the strategy stays broken with the same error.
    ExpectError(ErrorCode::kInvalidUsage, {"boom from replica 2"},
                [&] { s.Run([](ReplicaContext&) {}); });
  }
}

TEST(StrategyRunTest, NonLibraryExceptionsPropagateUnchanged) {
  MirroredStrategy s({.num_replicas = 2});
  EXPECT_THROW(s.Run([](ReplicaContext& ctx) {
    if (ctx.local_replica_id() == 1) throw std::out_of_range("mine");
  }),
               std::out_of_range);
  // With one replica nothing is left half done: the strategy stays usable.
  DefaultStrategy d;
  EXPECT_THROW(d.Run([](ReplicaContext&) { throw std::out_of_range("x"); }), std::out_of_range);
  EXPECT_EQ(d.Run([](ReplicaContext&) { return 5; }), std::vector<int>{5});
}

TEST(StrategyRunTest, AReplicaThatIsLateTimesOut) {
  MirroredStrategy s({.num_replicas = 3, .timeout = 100ms});
  // Replicas 0 and 1 that have come out of the all-reduce (the first with its timeout, which it
  // records as the group's error before it throws; the other with that or the abort it wakes to).
  std::atomic<int> gave_up{0};
  const auto start = std::chrono::steady_clock::now();
  ExpectError(ErrorCode::kTimeout, {"timed out after 100 ms in all_reduce #1", "replica 2"}, [&] {
    s.Run([&](ReplicaContext& ctx) {
      if (ctx.local_replica_id() == 2) {
        // Skips the collective, and is slow: returns only once the others gave up (had it
        // returned first, they would raise kMismatch at once instead of waiting).
        const auto cap = std::chrono::steady_clock::now() + 10s;
        while (gave_up < 2 && std::chrono::steady_clock::now() < cap) {
          std::this_thread::sleep_for(1ms);
        }
        return;
      }
      double v = 1;
      try {
        ctx.AllReduce(ReduceOp::kSum, {Tensor{&v, 1, DataType::kFloat64}});
      } catch (...) {
        ++gave_up;
        throw;
      }
    });
  });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 100ms);
  EXPECT_LT(took, test_time::Scaled(10s));  // replica 2 waits 10 s at most
}

TEST(StrategyRunTest, AReplicaThatSkipsACallFailsAtOnce) {
  MirroredStrategy s({.num_replicas = 3});  // default timeout: 300 s
  const auto start = std::chrono::steady_clock::now();
  ExpectError(ErrorCode::kMismatch,
              {"all_reduce #2 can never complete", "replica 1 returned from its function"}, [&] {
                s.Run([&](ReplicaContext& ctx) {
                  ctx.AllReduce(ReduceOp::kSum, 1.0);
                  if (ctx.local_replica_id() == 1) return;
                  ctx.AllReduce(ReduceOp::kSum, 1.0);
                });
              });
  EXPECT_LT(std::chrono::steady_clock::now() - start, test_time::Scaled(5s));
}

TEST(StrategyRunTest, ReplicasThatDisagreeOnACallGetMismatch) {
  {
    MirroredStrategy s({.num_replicas = 2});
    ExpectError(ErrorCode::kMismatch, {"all_reduce #1", "sum", "max"}, [&] {
      s.Run([&](ReplicaContext& ctx) {
        ctx.AllReduce(ctx.local_replica_id() == 0 ? ReduceOp::kSum : ReduceOp::kMax, 1.0);
      });
    });
  }
  {
    MirroredStrategy s({.num_replicas = 3});
    ExpectError(ErrorCode::kMismatch, {"tensor 1 has 4 x f32 on replica 0 but 5 x f32 on replica 2"},
                [&] {
                  s.Run([&](ReplicaContext& ctx) {
                    std::vector<float> a(3), b(ctx.local_replica_id() == 2 ? 5 : 4);
                    ctx.AllReduce(ReduceOp::kSum, {Tensor{a.data(), a.size()},
                                                   Tensor{b.data(), b.size()}});
                  });
                });
  }
  {
    MirroredStrategy s({.num_replicas = 2});
    std::vector<float> shared(4);
    ExpectError(ErrorCode::kInvalidArgument, {"the same buffer"}, [&] {
      s.Run([&](ReplicaContext& ctx) {
        ctx.AllReduce(ReduceOp::kSum, {Tensor{shared.data(), shared.size()}});
      });
    });
  }
}

// Buffers shared other than as one tensor index on two replicas: lists that name each other's
// buffers ({a, b} and {b, a}: every element would be summed twice, 21 instead of 11), views that
// overlap, a buffer twice in one replica's list. Were they run, two threads would write the same
// memory, with nothing said.
TEST(StrategyRunTest, BuffersThatShareMemoryAnyWayAreRefused) {
  for (CrossDeviceOps ops : {kR2O, kHC}) {
    SCOPED_TRACE(ToString(ops));
    std::vector<float> a(4, 1.0f), b(4, 10.0f), wide(6, 1.0f), own0(8), own1(8);
    // A failed Run breaks a strategy of several replicas: a fresh one per case.
    const auto refused = [ops](std::initializer_list<const char*> fragments,
                               const std::function<std::vector<Tensor>(int)>& list) {
      MirroredStrategy s({.num_replicas = 2, .cross_device_ops = ops});
      ExpectError(ErrorCode::kInvalidArgument, fragments, [&] {
        s.Run([&](ReplicaContext& ctx) {
          ctx.AllReduce(ReduceOp::kSum, list(ctx.local_replica_id()));
        });
      });
    };
    // Which pair is named depends on which buffer lies lower in memory.
    refused({"replica 0's tensor ", "and replica 1's tensor ", "share memory"}, [&](int r) {
      return std::vector<Tensor>{Tensor{r == 0 ? a.data() : b.data(), 4},
                                 Tensor{r == 0 ? b.data() : a.data(), 4}};
    });
    refused({"replica 0's tensor 0 and replica 1's tensor 0 share memory"}, [&](int r) {
      return std::vector<Tensor>{Tensor{wide.data() + r, 4}};
    });
    refused({"replica 1's tensor 0 and replica 1's tensor 1 share memory"}, [&](int r) {
      float* own = r == 0 ? own0.data() : own1.data();
      return std::vector<Tensor>{Tensor{own, 4}, Tensor{own + (r == 1 ? 2 : 4), 4}};
    });
    for (float v : a) EXPECT_EQ(v, 1.0f);
    for (float v : b) EXPECT_EQ(v, 10.0f);
    for (float v : wide) EXPECT_EQ(v, 1.0f);
  }
}

// milliseconds::max() is "never time out"; doubled for a Step it wrapped to -2 ms, and the first
// replica to reach a Step timed out at once ("timed out after -2 ms").
TEST(StrategyRunTest, ATimeoutOfMillisecondsMaxNeverTimesOut) {
  for (CrossDeviceOps ops : {kR2O, kHC}) {
    SCOPED_TRACE(ToString(ops));
    MirroredStrategy s(
        {.num_replicas = 2, .cross_device_ops = ops, .timeout = std::chrono::milliseconds::max()});
    std::vector<std::vector<float>> buffers(2, std::vector<float>(1 << 16, 1.0f));
    s.Run([&](ReplicaContext& ctx) {
      if (ctx.local_replica_id() == 1) std::this_thread::sleep_for(20ms);
      std::vector<float>& mine = buffers[size_t(ctx.local_replica_id())];
      ctx.AllReduce(ReduceOp::kSum, {Tensor{mine.data(), mine.size()}});
    });
    for (const auto& buffer : buffers) {
      for (float v : buffer) ASSERT_EQ(v, 2.0f);
    }
  }
}

// Forwards to a real communicator, each all-reduce issued `delay` late: a slow link.
class SlowCommunication final : public CollectiveCommunication {
 public:
  SlowCommunication(std::unique_ptr<CollectiveCommunication> inner, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), delay_(delay) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Implementation implementation() const override { return inner_->implementation(); }
  std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv,
                                       ReduceOp op) override {
    std::this_thread::sleep_for(delay_);
    return inner_->AllReduceAsync(send, recv, op);
  }
  std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv, int root) override {
    return inner_->BroadcastAsync(send, recv, root);
  }
  std::shared_ptr<Work> AllGatherAsync(const Tensor& send, const Tensor& recv) override {
    return inner_->AllGatherAsync(send, recv);
  }
  std::shared_ptr<Work> ReduceScatterAsync(const Tensor& send, const Tensor& recv,
                                           ReduceOp op) override {
    return inner_->ReduceScatterAsync(send, recv, op);
  }
  std::shared_ptr<Work> BarrierAsync() override { return inner_->BarrierAsync(); }
  void Abort() override { inner_->Abort(); }
  void SetTimeout(std::chrono::milliseconds timeout) override { inner_->SetTimeout(timeout); }

 private:
  std::unique_ptr<CollectiveCommunication> inner_;
  const std::chrono::milliseconds delay_;
};

// Two local replicas and a communicator whose every all-reduce takes 40 ms, within the 100 ms
// timeout, and a list the packer cuts into 8 buckets (9 collectives with the lists' check):
// replica 0's cross-worker step takes about 360 ms. Replica 1 waits for it and raises no
// kTimeout: every collective keeps its deadline, so the strategy must not break.
TEST(StrategyRunTest, ManyBucketsEachWithinTheTimeoutAreNotATimeout) {
  for (CrossDeviceOps ops : {kR2O, kHC}) {
    SCOPED_TRACE(ToString(ops));
    StrategyImpl::Config config;
    config.name = "slow";
    config.devices.assign(2, Device::Cpu());
    config.cross_device_ops = ops;
    config.timeout = 100ms;
    config.bytes_per_pack = 64;
    ClusterSpec one;
    one.rank = 0;
    one.world_size = 1;
    CommunicationOptions options;
    options.timeout = 100ms;
    config.comm = std::make_unique<SlowCommunication>(CreateCommunication(one, options), 40ms);
    class SlowStrategy : public Strategy {
     public:
      explicit SlowStrategy(StrategyImpl::Config config)
          : Strategy(std::make_unique<StrategyImpl>(std::move(config))) {}
    } s(std::move(config));
    std::vector<std::vector<float>> buffers(2, std::vector<float>(128, 0.0f));
    s.Run([&](ReplicaContext& ctx) {
      std::vector<float>& mine = buffers[size_t(ctx.local_replica_id())];
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = float(i + ctx.local_replica_id());
      std::vector<Tensor> list;  // 8 tensors of 16 floats: one 64-byte bucket each
      for (size_t k = 0; k < 8; ++k) list.push_back(Tensor{mine.data() + 16 * k, 16});
      ctx.AllReduce(ReduceOp::kSum, list);
    });
    for (const auto& buffer : buffers) {
      for (size_t i = 0; i < buffer.size(); ++i) ASSERT_EQ(buffer[i], float(2 * i + 1)) << i;
    }
  }
}

TEST(StrategyRunTest, CrossReplicaCallsInsideRunAreRefused) {
  MirroredStrategy s({.num_replicas = 2});
  ExpectError(ErrorCode::kInvalidUsage, {"called from inside Run"}, [&] {
    s.Run([&](ReplicaContext&) { s.Run([](ReplicaContext&) {}); });
  });
  MirroredStrategy t({.num_replicas = 1});
  ExpectError(ErrorCode::kInvalidUsage, {"Strategy::CreateVariable is a cross-replica call"}, [&] {
    t.Run([&](ReplicaContext&) { t.CreateVariable("v", {1}, Zeros()); });
  });
  ExpectError(ErrorCode::kInvalidUsage, {"Strategy::Reduce"}, [&] {
    t.Run([&](ReplicaContext&) { t.Reduce(ReduceOp::kSum, PerReplica<double>{1.0}); });
  });
}

TEST(StrategyRunTest, UnsupportedTensorsAreRefused) {
  MirroredStrategy s({.num_replicas = 2});
  ExpectError(ErrorCode::kNotSupported, {"all_reduce #1: tensor 0 is on cuda:0"}, [&] {
    s.Run([&](ReplicaContext& ctx) {
      float x = 0;
      ctx.AllReduce(ReduceOp::kSum, {Tensor{&x, 1, DataType::kFloat32, Device::Cuda(0)}});
    });
  });
  DefaultStrategy d;
  ExpectError(ErrorCode::kInvalidArgument, {"null data"}, [&] {
    d.Run([&](ReplicaContext& ctx) { ctx.AllReduce(ReduceOp::kSum, {Tensor{nullptr, 3}}); });
  });
}

// ---- AllReduce, local replicas -----------------------------------------------------------------

// A value of replica r, tensor j, element i: not integers, so sums round, and the order of the
// additions shows in the bits.
double Input(int r, size_t j, size_t i) {
  return std::sin(static_cast<double>(r * 7919 + static_cast<int>(j) * 104729) + 0.37 * i) *
         (1.0 + static_cast<double>(r));
}

struct Lists {
  // data[r][j]: replica r's tensor j, as bytes.
  std::vector<std::vector<std::vector<unsigned char>>> data;
  std::vector<DataType> dtypes;
  std::vector<size_t> counts;

  Lists(int replicas, std::vector<DataType> ts, std::vector<size_t> cs, int first_replica = 0)
      : dtypes(std::move(ts)), counts(std::move(cs)) {
    data.resize(static_cast<size_t>(replicas));
    for (int r = 0; r < replicas; ++r) {
      for (size_t j = 0; j < counts.size(); ++j) {
        std::vector<unsigned char> bytes(counts[j] * SizeOf(dtypes[j]));
        for (size_t i = 0; i < counts[j]; ++i) Put(bytes.data(), dtypes[j], i,
                                                      Input(first_replica + r, j, i));
        data[r].push_back(std::move(bytes));
      }
    }
  }
  static void Put(unsigned char* p, DataType t, size_t i, double v) {
    switch (t) {
      case DataType::kFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
      case DataType::kFloat64: reinterpret_cast<double*>(p)[i] = v; break;
      case DataType::kInt32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v * 1000); break;
      default: FAIL() << "dtype not used here";
    }
  }
  std::vector<Tensor> TensorsOf(int r) {
    std::vector<Tensor> out;
    for (size_t j = 0; j < counts.size(); ++j) {
      out.push_back(Tensor{data[r][j].data(), counts[j], dtypes[j]});
    }
    return out;
  }
  // The expected result: fold in replica order with the library's kernels, then kAvg's division.
  std::vector<std::vector<unsigned char>> Reference(ReduceOp op, size_t divisor) const {
    std::vector<std::vector<unsigned char>> out = data[0];
    const ReduceOp fold = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    for (size_t j = 0; j < counts.size(); ++j) {
      if (counts[j] == 0) continue;
      for (size_t r = 1; r < data.size(); ++r) {
        core::Reduce(dtypes[j], fold, out[j].data(), out[j].data(), data[r][j].data(), counts[j]);
      }
      if (op == ReduceOp::kAvg && divisor > 1) {
        core::DivideInPlace(dtypes[j], out[j].data(), counts[j], divisor);
      }
    }
    return out;
  }
};

struct LocalCase {
  CrossDeviceOps ops;
  int replicas;
};

class StrategyLocalAllReduceTest : public ::testing::TestWithParam<LocalCase> {};

TEST_P(StrategyLocalAllReduceTest, MatchesAFoldInReplicaOrderBitForBit) {
  const LocalCase c = GetParam();
  MirroredStrategy s({.num_replicas = c.replicas, .cross_device_ops = c.ops});
  // Odd sizes: empty, one element, primes, fewer elements than replicas, not divisible by N, and
  // more than one 4 KiB block.
  const std::vector<size_t> counts = {0, 1, 7, 13, 2, 1031, 3000, 0, 5};
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
      SCOPED_TRACE(::testing::Message() << ToString(dtype) << " " << ToString(op));
      Lists lists(c.replicas, std::vector<DataType>(counts.size(), dtype), counts);
      const auto expected = lists.Reference(op, static_cast<size_t>(c.replicas));
      s.Run([&](ReplicaContext& ctx) {
        ctx.AllReduce(op, lists.TensorsOf(ctx.local_replica_id()));
      });
      for (int r = 0; r < c.replicas; ++r) {
        for (size_t j = 0; j < counts.size(); ++j) {
          ASSERT_EQ(lists.data[r][j], expected[j]) << "replica " << r << " tensor " << j;
        }
      }
    }
  }
  // Mixed dtypes in one call, and a scalar.
  Lists mixed(c.replicas, {DataType::kFloat64, DataType::kFloat32, DataType::kFloat64},
              {11, 29, 3});
  const auto expected = mixed.Reference(ReduceOp::kSum, 1);
  auto scalars = s.Run([&](ReplicaContext& ctx) {
    ctx.AllReduce(ReduceOp::kSum, mixed.TensorsOf(ctx.local_replica_id()));
    return ctx.AllReduce(ReduceOp::kAvg, static_cast<double>(ctx.local_replica_id()));
  });
  for (int r = 0; r < c.replicas; ++r) {
    for (size_t j = 0; j < 3; ++j) EXPECT_EQ(mixed.data[r][j], expected[j]);
    EXPECT_EQ(scalars[r], (c.replicas - 1) / 2.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Replicas, StrategyLocalAllReduceTest,
                         ::testing::Values(LocalCase{kR2O, 1}, LocalCase{kR2O, 2},
                                           LocalCase{kR2O, 3}, LocalCase{kR2O, 5},
                                           LocalCase{kR2O, 8}, LocalCase{kHC, 1},
                                           LocalCase{kHC, 2}, LocalCase{kHC, 3},
                                           LocalCase{kHC, 4}, LocalCase{kHC, 7},
                                           LocalCase{kHC, 8}),
                         [](const ::testing::TestParamInfo<LocalCase>& p) {
                           return std::string(p.param.ops == kR2O ? "ReductionToOneDevice"
                                                                     : "HierarchicalCopy") +
                                  "_" + std::to_string(p.param.replicas);
                         });

TEST(StrategyAllReduceTest, BothCrossDeviceOpsGiveTheSameBits) {
  const std::vector<size_t> counts = {1000, 17};
  std::vector<std::vector<std::vector<unsigned char>>> results;
  for (CrossDeviceOps ops : {kR2O, kHC}) {
    MirroredStrategy s({.num_replicas = 5, .cross_device_ops = ops});
    Lists lists(5, {DataType::kFloat32, DataType::kFloat32}, counts);
    s.Run([&](ReplicaContext& ctx) {
      ctx.AllReduce(ReduceOp::kAvg, lists.TensorsOf(ctx.local_replica_id()));
    });
    results.push_back(lists.data[3]);
  }
  EXPECT_EQ(results[0], results[1]);
}

// ---- AllReduce, several workers ----------------------------------------------------------------

struct WorkerCase {
  int workers;
  int local;
  CrossDeviceOps ops;
};

class StrategyMultiWorkerAllReduceTest : public ::testing::TestWithParam<WorkerCase> {};

TEST_P(StrategyMultiWorkerAllReduceTest, EveryReplicaOfEveryWorkerGetsTheSameExactResult) {
  const WorkerCase c = GetParam();
  const int n = c.workers * c.local;
  // Integer-valued floats: sums are exact in any order, so the reference is exact too.
  const std::vector<size_t> counts = {0, 1, 13, 1031, 3};
  const auto value = [](int g, size_t j, size_t i) {
    return static_cast<double>(static_cast<int>((g * 37 + j * 11 + i * 5) % 23) - 11);
  };
  std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(n));
  std::vector<std::vector<std::vector<double>>> results64(static_cast<size_t>(n));
  std::vector<double> scalars(static_cast<size_t>(n));
  RunWorkers(
      c.workers, c.local, c.ops,
      [&](Strategy& s, int) {
        s.Run([&](ReplicaContext& ctx) {
          const int g = ctx.replica_id_in_sync_group();
          std::vector<std::vector<float>> mine;
          std::vector<std::vector<double>> mine64;
          std::vector<Tensor> tensors, tensors64;
          for (size_t j = 0; j < counts.size(); ++j) {
            mine.emplace_back(counts[j]);
            mine64.emplace_back(counts[j]);
            for (size_t i = 0; i < counts[j]; ++i) {
              mine[j][i] = static_cast<float>(value(g, j, i));
              mine64[j][i] = value(g, j, i) + 0.5 * g;
            }
          }
          for (size_t j = 0; j < counts.size(); ++j) {
            tensors.push_back(Tensor{mine[j].data(), counts[j]});
            tensors64.push_back(Tensor{mine64[j].data(), counts[j], DataType::kFloat64});
          }
          ctx.AllReduce(ReduceOp::kSum, tensors);
          ctx.AllReduce(ReduceOp::kMax, tensors64);
          scalars[g] = ctx.AllReduce(ReduceOp::kAvg, static_cast<double>(g));
          results[g] = mine;
          results64[g] = mine64;
        });
      },
      [](MultiWorkerOptions& o) { o.communication.bytes_per_pack = 256; });  // several buckets
  for (size_t j = 0; j < counts.size(); ++j) {
    for (size_t i = 0; i < counts[j]; ++i) {
      double sum = 0, max = -1e300;
      for (int g = 0; g < n; ++g) {
        sum += value(g, j, i);
        max = std::max(max, value(g, j, i) + 0.5 * g);
      }
      for (int g = 0; g < n; ++g) {
        ASSERT_EQ(results[g][j][i], static_cast<float>(sum)) << "replica " << g << " t" << j;
        ASSERT_EQ(results64[g][j][i], max) << "replica " << g << " t" << j;
      }
    }
  }
  for (int g = 0; g < n; ++g) EXPECT_EQ(scalars[g], (n - 1) / 2.0);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, StrategyMultiWorkerAllReduceTest,
    ::testing::Values(WorkerCase{2, 1, kHC}, WorkerCase{2, 2, kHC}, WorkerCase{2, 3, kR2O},
                      WorkerCase{3, 1, kR2O}, WorkerCase{3, 2, kR2O}, WorkerCase{3, 3, kHC},
                      WorkerCase{2, 2, kR2O}, WorkerCase{3, 2, kHC}),
    [](const ::testing::TestParamInfo<WorkerCase>& p) {
      return std::to_string(p.param.workers) + "x" + std::to_string(p.param.local) + "_" +
             (p.param.ops == kR2O ? "ReductionToOneDevice" : "HierarchicalCopy");
    });

TEST(StrategyMultiWorkerTest, FloatSumsAreBitIdenticalEverywhere) {
  // Non-integer inputs: the order of additions differs from any simple reference, but every
  // replica of every worker must hold the same bits.
  std::vector<std::vector<float>> results(6);
  RunWorkers(2, 3, kHC, [&](Strategy& s, int) {
    s.Run([&](ReplicaContext& ctx) {
      const int g = ctx.replica_id_in_sync_group();
      std::vector<float> v(2500);
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(Input(g, 0, i));
      ctx.AllReduce(ReduceOp::kAvg, {Tensor{v.data(), v.size()}});
      results[g] = v;
    });
  });
  for (int g = 1; g < 6; ++g) EXPECT_TRUE(BitEqual(results[g], results[0])) << "replica " << g;
  double worst = 0;
  for (size_t i = 0; i < results[0].size(); ++i) {
    double mean = 0;
    for (int g = 0; g < 6; ++g) mean += static_cast<float>(Input(g, 0, i));
    worst = std::max(worst, std::abs(results[0][i] - mean / 6));
  }
  EXPECT_LT(worst, 1e-5);
}

// A replica of worker 1 that throws releases worker 0 at once, and worker 0's error names the
// cause, on RING and AUTO, with one local replica and with two (not only "the communicator was
// aborted by its caller").
TEST(StrategyMultiWorkerTest, AFailingReplicaReleasesTheOtherWorkers) {
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    for (int local = 1; local <= 2; ++local) {
      SCOPED_TRACE(std::string(ToString(impl)) + " local " + std::to_string(local));
      const auto start = std::chrono::steady_clock::now();
      auto errors = RunWorkersCatching(
          2, local, kHC,
          [&](Strategy& s, int rank) {
            s.Run([&](ReplicaContext& ctx) {
              if (rank == 1 && ctx.local_replica_id() == local - 1) {
                throw Error(ErrorCode::kInvalidArgument, "the replica gives up");
              }
              ctx.AllReduce(ReduceOp::kSum, 1.0);
            });
          },
          [&](MultiWorkerOptions& o) { o.communication.implementation = impl; });
      EXPECT_LT(std::chrono::steady_clock::now() - start,
                test_time::Scaled(10s));  // not the 20 s timeout
      ExpectErrorPtr(errors[1], ErrorCode::kInvalidArgument, {"the replica gives up"});
      const std::string cause =
          "rank 1 aborted the job: rank 1: the strategy aborted the communicator: worker 1 "
          "replica " +
          std::to_string(local - 1) + " failed: [invalid argument] the replica gives up";
      ExpectErrorPtr(errors[0], ErrorCode::kAborted, {cause.c_str()});
    }
  }
}

// Workers with different numbers of local replicas would all run (their collectives match in
// size) and average with different divisors (3 workers of 2, 1, 2 replicas: NumReplicasInSync 6,
// 3 and 6); every worker refuses it when the strategy is built, with the same list of counts.
TEST(StrategyMultiWorkerTest, WorkersWithDifferentReplicaCountsAreRefused) {
  auto errors = RunWorkersCatching(
      3, 2, kHC, [](Strategy&, int rank) { ADD_FAILURE() << "worker " << rank << " was built"; },
      [](MultiWorkerOptions& options) {
        if (options.cluster->rank == 1) options.num_local_replicas = 1;
      });
  for (int rank = 0; rank < 3; ++rank) {
    const std::string expected = "MultiWorkerMirroredStrategy: worker " + std::to_string(rank) +
                                 ": the workers run different numbers of local replicas (worker "
                                 "0: 2, worker 1: 1, worker 2: 2); every worker must run the "
                                 "same number (num_local_replicas)";
    ExpectErrorPtr(errors[rank], ErrorCode::kInvalidArgument, {expected.c_str()});
  }
}

// A worker that averages where another sums: kAvg crosses workers as a sum (divided once
// afterwards), yet its calls name kAvg, so every worker gets kMismatch naming both ops (with 2
// workers of 2 replicas and 1.0 everywhere the two would end with 1 and 4), on RING and AUTO,
// from ReplicaContext::AllReduce (a list, through the
// packer, and a scalar) and Strategy::Reduce (a value, a vector), and no cross-worker result is
// written: with one replica the tensors are untouched; with several, the local replicas' own
// reduction (2 here) may be, as after any failed cross-worker call, but never the sum of 4.
TEST(StrategyMultiWorkerTest, AWorkerThatAveragesWhereAnotherSumsGetsMismatch) {
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    for (int local = 1; local <= 2; ++local) {
      for (int call = 0; call < 4; ++call) {
        SCOPED_TRACE(std::string(ToString(impl)) + " local " + std::to_string(local) + " call " +
                     std::to_string(call));
        std::vector<std::vector<float>> values(4, std::vector<float>(3, 1.0f));
        auto errors = RunWorkersCatching(
            2, local, call % 2 == 0 ? kHC : kR2O,
            [&](Strategy& s, int rank) {
              const ReduceOp op = rank == 0 ? ReduceOp::kAvg : ReduceOp::kSum;
              if (call == 0 || call == 1) {
                s.Run([&](ReplicaContext& ctx) {
                  std::vector<float>& mine = values[size_t(ctx.replica_id_in_sync_group())];
                  if (call == 0) {
                    ctx.AllReduce(op, {Tensor{mine.data(), mine.size()}});
                  } else {
                    mine[0] = static_cast<float>(ctx.AllReduce(op, 1.0));
                  }
                });
              } else if (call == 2) {
                s.Reduce(op, PerReplica<double>(size_t(local), 1.0));
              } else {
                s.Reduce(op, PerReplica<std::vector<float>>(size_t(local), {1, 1}));
              }
            },
            [&](MultiWorkerOptions& o) { o.communication.implementation = impl; });
        for (int rank = 0; rank < 2; ++rank) {
          ExpectErrorPtr(errors[rank], ErrorCode::kMismatch, {"all_reduce(", "avg", "sum"});
        }
        for (size_t g = 0; g < values.size(); ++g) {
          for (float v : values[g]) {
            if (local == 1) {
              EXPECT_EQ(v, 1.0f) << "replica " << g;
            }
            EXPECT_NE(v, 4.0f) << "replica " << g;
          }
        }
      }
    }
  }
}

// A worker that passes nothing where another passes values: every worker gets kMismatch naming
// the counts, at once. Strategy::Reduce of empty vectors must not skip the all-reduce: that would
// leave the other worker waiting in its own until this one's strategy went away (kPeerLost) or
// the timeout.
TEST(StrategyMultiWorkerTest, AWorkerThatPassesNothingWhereAnotherPassesValuesGetsMismatch) {
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    const auto start = std::chrono::steady_clock::now();
    auto errors = RunWorkersCatching(2, 2, kHC, [&](Strategy& s, int rank) {
      if (call == 0) {
        s.Run([&](ReplicaContext& ctx) {
          std::vector<float> mine(2, 1.0f);
          std::vector<Tensor> list;
          if (rank == 1) list.push_back(Tensor{mine.data(), mine.size()});
          ctx.AllReduce(ReduceOp::kSum, list);
        });
      } else {
        const std::vector<float> v = rank == 1 ? std::vector<float>{1, 2} : std::vector<float>{};
        s.Reduce(ReduceOp::kSum, PerReplica<std::vector<float>>{v, v});
      }
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start,
              test_time::Scaled(10s));  // not the 20 s timeout
    for (int rank = 0; rank < 2; ++rank) {
      if (call == 0) {
        const std::string list = "the list of " + std::to_string(rank) + " tensors differs";
        ExpectErrorPtr(errors[rank], ErrorCode::kMismatch, {list.c_str()});
      } else {
        ExpectErrorPtr(errors[rank], ErrorCode::kMismatch, {"count=0", "count=2"});
      }
    }
  }
}

// A caller mistake in Strategy::Reduce on one worker only (values for the wrong number of
// replicas, an unknown op, vectors of different sizes): that worker throws kInvalidArgument, and
// breaks the strategy as a failed Run does, so that the other worker, waiting in its all-reduce,
// throws kAborted naming the mistake at once, on RING and AUTO, not a timeout naming the wrong
// thing. A later call on the worker that made the mistake rethrows it.
TEST(StrategyMultiWorkerTest, AReduceMistakeOnOneWorkerReachesTheOthersAtOnce) {
  const char* const mistakes[] = {"Strategy::Reduce got 1 values for 2 local replicas",
                                  "Strategy::Reduce: unknown reduce op",
                                  "replica 0's vector has 2 elements, replica 1's 1"};
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    for (int mistake = 0; mistake < 3; ++mistake) {
      SCOPED_TRACE(std::string(ToString(impl)) + " mistake " + std::to_string(mistake));
      const auto start = std::chrono::steady_clock::now();
      auto errors = RunWorkersCatching(
          2, 2, kHC,
          [&](Strategy& s, int rank) {
            const bool wrong = rank == 1;
            const auto reduce = [&] {
              if (mistake == 0) {
                s.Reduce(ReduceOp::kSum, wrong ? PerReplica<double>{1} : PerReplica<double>{1, 2});
              } else if (mistake == 1) {
                s.Reduce(wrong ? static_cast<ReduceOp>(99) : ReduceOp::kSum,
                         PerReplica<double>{1, 2});
              } else {
                const std::vector<float> two = {1, 2};
                const std::vector<float> one = {3};
                s.Reduce(ReduceOp::kSum, PerReplica<std::vector<float>>{two, wrong ? one : two});
              }
            };
            if (!wrong) {
              reduce();
              ADD_FAILURE() << "worker 0 returned from Reduce";
              return;
            }
            ExpectError(ErrorCode::kInvalidArgument, {mistakes[mistake]}, reduce);
            s.Barrier();  // rethrows the mistake: the strategy is broken
            ADD_FAILURE() << "worker 1 went on";
          },
          [&](MultiWorkerOptions& o) { o.communication.implementation = impl; });
      EXPECT_LT(std::chrono::steady_clock::now() - start,
                test_time::Scaled(10s));  // not the 20 s timeout
      ExpectErrorPtr(errors[1], ErrorCode::kInvalidArgument, {mistakes[mistake]});
      ExpectErrorPtr(errors[0], ErrorCode::kAborted,
                     {"rank 1 aborted the job", "worker 1 ", mistakes[mistake]});
    }
  }
}

// ---- Reduce, variables, broadcast --------------------------------------------------------------

TEST(StrategyReduceTest, LocalReplicas) {
  MirroredStrategy s({.num_replicas = 3});
  const PerReplica<double> v = {1.5, -2.0, 4.0};
  EXPECT_EQ(s.Reduce(ReduceOp::kSum, v), 3.5);
  EXPECT_EQ(s.Reduce(ReduceOp::kAvg, v), 3.5 / 3);
  EXPECT_EQ(s.Reduce(ReduceOp::kMax, v), 4.0);
  EXPECT_EQ(s.Reduce(ReduceOp::kMin, v), -2.0);
  const PerReplica<std::vector<float>> vectors = {{1, 2}, {3, 4}, {5, 9}};
  EXPECT_EQ(s.Reduce(ReduceOp::kSum, vectors), (std::vector<float>{9, 15}));
  EXPECT_EQ(s.Reduce(ReduceOp::kAvg, vectors), (std::vector<float>{3, 5}));
  ExpectError(ErrorCode::kInvalidArgument, {"2 values for 3 local replicas"},
              [&] { s.Reduce(ReduceOp::kSum, PerReplica<double>{1, 2}); });
  ExpectError(ErrorCode::kInvalidArgument, {"replica 2's 1"}, [&] {
    s.Reduce(ReduceOp::kSum, PerReplica<std::vector<float>>{{1, 2}, {3, 4}, {5}});
  });
  ExpectError(ErrorCode::kInvalidArgument, {"unknown reduce op"},
              [&] { s.Reduce(static_cast<ReduceOp>(99), v); });
  // With one worker a caller mistake breaks nothing: the strategy stays usable.
  EXPECT_EQ(s.Reduce(ReduceOp::kSum, v), 3.5);
}

TEST(StrategyReduceTest, AcrossWorkers) {
  RunWorkers(2, 2, kHC, [](Strategy& s, int rank) {
    // Replica g holds g + 1: 1, 2 on worker 0 and 3, 4 on worker 1.
    const PerReplica<double> v = {2.0 * rank + 1, 2.0 * rank + 2};
    EXPECT_EQ(s.Reduce(ReduceOp::kSum, v), 10.0);
    EXPECT_EQ(s.Reduce(ReduceOp::kAvg, v), 2.5);
    EXPECT_EQ(s.Reduce(ReduceOp::kMax, v), 4.0);
    EXPECT_EQ(s.Reduce(ReduceOp::kMin, v), 1.0);
    const PerReplica<std::vector<float>> vectors = {{float(rank), 1}, {2, float(-rank)}};
    EXPECT_EQ(s.Reduce(ReduceOp::kSum, vectors), (std::vector<float>{5, 1}));
    // The losses a Run returns, reduced: the mean loss of the global batch.
    auto shares = s.Run([](ReplicaContext& ctx) {
      const std::vector<float> losses = {float(ctx.replica_id_in_sync_group()), 1.0f};
      return ComputeAverageLoss(losses, 8);
    });
    EXPECT_DOUBLE_EQ(s.Reduce(ReduceOp::kSum, shares), (0 + 1 + 2 + 3 + 4.0) / 8);
  });
}

TEST(StrategyVariableTest, CopiesAreIdenticalEverywhereAndTheChiefsInitWins) {
  std::vector<std::vector<float>> seen(6);
  RunWorkers(3, 2, kR2O, [&](Strategy& s, int rank) {
    // Every worker passes a different initializer; only the chief's may count.
    MirroredVariable& w = s.CreateVariable("dense/kernel", {3, 5}, [rank](std::span<float> v) {
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(100 * rank + i) + 0.25f;
    });
    MirroredVariable& b = s.CreateVariable("dense/bias", {5}, GlorotUniform(3, 5, 11 + rank));
    MirroredVariable& empty = s.CreateVariable("empty", {0, 4}, Constant(1.0f));
    EXPECT_EQ(w.count(), 15u);
    EXPECT_EQ(w.shape(), (std::vector<size_t>{3, 5}));
    EXPECT_EQ(empty.count(), 0u);
    EXPECT_EQ(w.num_local_replicas(), 2);
    for (int r = 0; r < 2; ++r) {
      for (size_t i = 0; i < 15; ++i) EXPECT_EQ(w.value(r)[i], static_cast<float>(i) + 0.25f);
    }
    EXPECT_TRUE(BitEqual(b.value(0), b.value(1)));
    seen[2 * rank] = {b.value(0).begin(), b.value(0).end()};
    seen[2 * rank + 1] = {b.value(1).begin(), b.value(1).end()};
    EXPECT_EQ(s.variables(), (std::vector<MirroredVariable*>{&w, &b, &empty}));
    EXPECT_EQ(s.FindVariable("dense/bias"), &b);
    EXPECT_EQ(s.FindVariable("nope"), nullptr);
    ExpectError(ErrorCode::kInvalidArgument, {"'dense/bias' already exists"},
                [&] { s.CreateVariable("dense/bias", {1}, Zeros()); });
  });
  // Glorot with seed 11 (the chief's), on every copy of every worker.
  std::vector<float> glorot(5);
  GlorotUniform(3, 5, 11)(glorot);
  const float limit = std::sqrt(6.0f / 8);
  for (float x : glorot) EXPECT_LE(std::abs(x), limit);
  for (const auto& copy : seen) EXPECT_TRUE(BitEqual(copy, glorot));
}

TEST(StrategyVariableTest, WorkersThatCreateDifferentVariablesAllGetMismatchAndNoneIsCreated) {
  RunWorkers(3, 2, kHC, [](Strategy& s, int rank) {
    const std::string who = "worker " + std::to_string(rank) + " ";
    // Worker 2 names its variable differently: the counts agree, so the broadcast alone would
    // have given worker 2's 'dense/bias' the chief's 'dense/kernel'.
    const std::string name = rank == 2 ? "dense/bias" : "dense/kernel";
    const std::string named = who + "CreateVariable('" + name +
                              "'): the workers disagree on the name: worker 0 has "
                              "'dense/kernel', worker 2 has 'dense/bias' (every worker must make "
                              "the same cross-replica calls with the same arguments, in the same "
                              "order)";
    ExpectError(ErrorCode::kMismatch, {named.c_str()}, [&] {
      s.CreateVariable(name, {3, 5}, Zeros());
    });
    // Worker 1 transposes the shape.
    const std::vector<size_t> shape =
        rank == 1 ? std::vector<size_t>{5, 3} : std::vector<size_t>{3, 5};
    ExpectError(ErrorCode::kMismatch,
                {"the workers disagree on the shape: worker 0 has '[3, 5]', worker 1 has '[5, 3]'"},
                [&] { s.CreateVariable("w", shape, Zeros()); });
    // An empty initializer on one worker fails every worker, not that one alone (the others
    // would wait for it in the broadcast).
    ExpectError(
        ErrorCode::kMismatch,
        {"disagree on whether an initializer is given: worker 0 has 'yes', worker 1 has 'no'"},
        [&] { s.CreateVariable("w", {2}, rank == 1 ? Initializer{} : Zeros()); });
    EXPECT_TRUE(s.variables().empty());
    // Every worker stopped at the same point, so the strategy is still usable.
    MirroredVariable& w = s.CreateVariable("dense/kernel", {3, 5}, Constant(2.0f));
    for (int r = 0; r < 2; ++r) {
      for (float x : w.value(r)) EXPECT_EQ(x, 2.0f);
    }
    EXPECT_EQ(s.Reduce(ReduceOp::kSum, PerReplica<double>{1.0, 1.0}), 6.0);
  });
}

// The initializer runs on the chief only (one that reads pretrained weights from the chief's
// disk, say). When it throws, the chief throws its exception and every other worker an error
// that names the call and says why, instead of an abort that names neither; no variable is
// created, and every worker stopped at the same point, so the strategy is still usable.
TEST(StrategyVariableTest, AChiefWhoseInitializerFailsTellsEveryWorkerWhy) {
  const auto errors = RunWorkersCatching(3, 2, kHC, [](Strategy& s, int rank) {
    try {
      s.CreateVariable("dense/kernel", {3, 5}, [](std::span<float>) {
        throw std::runtime_error("cannot read pretrained.bin");
      });
      ADD_FAILURE() << "worker " << rank << ": CreateVariable returned";
    } catch (const Error& e) {
      EXPECT_NE(rank, 0) << e.what();
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      const std::string expected = "worker " + std::to_string(rank) +
                                   " CreateVariable('dense/kernel'): the initializer failed on "
                                   "the chief, worker 0: cannot read pretrained.bin";
      EXPECT_NE(e.message().find(expected), std::string::npos) << e.what();
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(rank, 0);
      EXPECT_STREQ(e.what(), "cannot read pretrained.bin");
    }
    EXPECT_TRUE(s.variables().empty());
    MirroredVariable& w = s.CreateVariable("dense/kernel", {3, 5}, Constant(2.0f));
    for (int r = 0; r < 2; ++r) {
      for (float x : w.value(r)) EXPECT_EQ(x, 2.0f);
    }
    EXPECT_EQ(s.Reduce(ReduceOp::kSum, PerReplica<double>{1.0, 1.0}), 6.0);
  });
  for (size_t rank = 0; rank < errors.size(); ++rank) {
    if (errors[rank]) ADD_FAILURE() << "worker " << rank << ": " << testing::Describe(errors[rank]);
  }
}

TEST(StrategyAgreementTest, EveryWorkerNamesTheFirstFieldThatDiffersFromWorkerZero) {
  using Description = StrategyImpl::Description;
  RunWorkers(4, 1, kHC, [](Strategy& s, int rank) {
    StrategyImpl& impl = s.impl();
    impl.AgreeAcrossWorkers("Probe", {});
    impl.AgreeAcrossWorkers("Probe", {{"a", "1"}, {"b", std::string(300'000, 'x')}});
    // Workers 2 and 3 differ from worker 0; the message names worker 2, on every worker.
    const std::string b = rank >= 2 ? "two" : "one";
    ExpectError(ErrorCode::kMismatch,
                {"Probe: the workers disagree on b: worker 0 has 'one', worker 2 has 'two'"}, [&] {
                  impl.AgreeAcrossWorkers("Probe", {{"a", "1"}, {"b", b}, {"c", b}});
                });
    // Values are quoted on one line, whatever they hold.
    ExpectError(ErrorCode::kMismatch, {"worker 0 has 'a\\x0ab', worker 1 has ''"}, [&] {
      impl.AgreeAcrossWorkers("Probe", {{"v", rank == 0 ? std::string("a\nb") : std::string()}});
    });
    // Different fields (another program, or another call): said, with no field named.
    const Description fields =
        rank == 3 ? Description{{"a", "1"}} : Description{{"a", "1"}, {"b", "2"}};
    ExpectError(ErrorCode::kMismatch,
                {"Probe: the workers disagree: worker 0 and worker 3 describe it with different "
                 "fields"},
                [&] { impl.AgreeAcrossWorkers("Probe", fields); });
    impl.AgreeAcrossWorkers("Probe", {{"a", "1"}});
  });
}

TEST(StrategyVariableTest, AssignAndAccess) {
  MirroredStrategy s({.num_replicas = 3});
  MirroredVariable& v = s.CreateVariable("v", {2, 2}, Constant(3.0f));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(v.value(r)[3], 3.0f);
  const std::vector<float> next = {1, 2, 3, 4};
  v.Assign(next);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(BitEqual(v.value(r), next));
    const Tensor t = v.tensor(r);
    EXPECT_EQ(t.data, v.data(r));
    EXPECT_EQ(t.count, 4u);
  }
  ExpectError(ErrorCode::kInvalidArgument, {"Assign of 3 values to 4"},
              [&] { v.Assign(std::vector<float>{1, 2, 3}); });
  ExpectError(ErrorCode::kInvalidArgument, {"no local replica 3"}, [&] { v.value(3); });
  ExpectError(ErrorCode::kInvalidArgument, {"initializer is empty"},
              [&] { s.CreateVariable("w", {1}, Initializer{}); });
}

// Assign writes every replica's copy: from one replica inside Run it would race with the others
// reading theirs, so it is refused there, as the other cross-replica calls are.
TEST(StrategyVariableTest, AssignInsideRunIsRefused) {
  MirroredStrategy s({.num_replicas = 2});
  MirroredVariable& v = s.CreateVariable("v", {4}, Zeros());
  ExpectError(ErrorCode::kInvalidUsage, {"MirroredVariable::Assign is a cross-replica call"}, [&] {
    s.Run([&](ReplicaContext& ctx) {
      if (ctx.local_replica_id() == 0) v.Assign(std::vector<float>(4, 1.0f));
    });
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(BitEqual(v.value(r), std::vector<float>(4, 0.0f)));
  MirroredStrategy t({.num_replicas = 1});  // one replica: refused all the same
  MirroredVariable& w = t.CreateVariable("w", {1}, Zeros());
  ExpectError(ErrorCode::kInvalidUsage, {"MirroredVariable::Assign"},
              [&] { t.Run([&](ReplicaContext&) { w.Assign(std::vector<float>{2.0f}); }); });
  w.Assign(std::vector<float>{3.0f});  // outside Run, and t is still usable
  EXPECT_EQ(w.value(0)[0], 3.0f);
}

TEST(StrategyBroadcastTest, FromTheChief) {
  RunWorkers(3, 1, kHC, [](Strategy& s, int rank) {
    std::vector<float> a(300, static_cast<float>(rank));
    std::vector<double> b(7, 10.0 + rank);
    s.BroadcastFromChief({Tensor{a.data(), a.size()}, Tensor{b.data(), b.size(), DataType::kFloat64}});
    EXPECT_EQ(a, std::vector<float>(300, 0.0f));
    EXPECT_EQ(b, std::vector<double>(7, 10.0));
    s.Barrier();
  });
  DefaultStrategy d;  // one worker: nothing to do
  float x = 4;
  d.BroadcastFromChief({Tensor{&x, 1}});
  d.Barrier();
  EXPECT_EQ(x, 4.0f);
}

}  // namespace
}  // namespace collectives::strategy
