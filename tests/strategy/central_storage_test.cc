// CentralStorageStrategy: one copy of every variable, shared by the local replicas; gradients
// summed onto replica 0 and the update applied once; the same training as MirroredStrategy's.
//
// The reference for training is a plain single-threaded computation written here (softmax
// regression, the gradient of the whole global batch in one loop, SGD with momentum and Adam by
// Keras' formulas), independent of the library's kernels and optimizers. "Agree": every element
// within |a - b| <= 1e-5 * max(|a|, |b|) + 1e-7, as in equivalence_test.cc. Against
// MirroredStrategy on the same replicas the weights are identical bit for bit: both sum the
// gradients in replica order and run the same update on the same values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/strategy.h"
#include "tests/scoped_env.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

namespace fs = std::filesystem;
using collectives::testing::ScopedEnv;
using testing::BitEqual;
using testing::ExpectError;

constexpr size_t kIn = 12, kOut = 4;
constexpr size_t kExamples = 24 * 12;
constexpr size_t kGlobalBatch = 24;  // divisible by 1, 2, 3 and 4 replicas
constexpr int kSteps = 12;

// x uniform in [-1, 1), the label the argmax of a fixed random linear teacher.
struct Data {
  std::vector<float> x;  // kExamples x kIn
  std::vector<int> y;
  Data() {
    std::mt19937_64 rng(7);
    const auto uniform = [&] {
      return static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-52 - 1.0);
    };
    std::vector<float> teacher(kIn * kOut);
    for (float& t : teacher) t = uniform();
    x.resize(kExamples * kIn);
    for (float& v : x) v = uniform();
    for (size_t i = 0; i < kExamples; ++i) {
      size_t best = 0;
      float best_z = -1e30f;
      for (size_t o = 0; o < kOut; ++o) {
        float z = 0;
        for (size_t d = 0; d < kIn; ++d) z += x[i * kIn + d] * teacher[d * kOut + o];
        if (z > best_z) {
          best_z = z;
          best = o;
        }
      }
      y.push_back(static_cast<int>(best));
    }
  }
};

const Data& TheData() {
  static const Data data;
  return data;
}

// Initial weights, the same for every run: w in [-0.5, 0.5), b = 0.
std::vector<float> InitialKernel() {
  std::vector<float> w(kIn * kOut);
  std::mt19937_64 rng(11);
  for (float& v : w) v = static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-53 - 0.5);
  return w;
}

// Softmax regression: adds to (gw, gb) the gradient of sum over `examples` of the cross-entropy,
// divided by the global batch. Accumulates in double.
void AddGradients(const float* w, const float* b, const std::vector<size_t>& examples,
                  std::vector<double>& gw, std::vector<double>& gb) {
  const Data& data = TheData();
  for (size_t i : examples) {
    const float* x = &data.x[i * kIn];
    double z[kOut];
    double zmax = -1e300;
    for (size_t o = 0; o < kOut; ++o) {
      double a = b[o];
      for (size_t d = 0; d < kIn; ++d) a += static_cast<double>(x[d]) * w[d * kOut + o];
      z[o] = a;
      zmax = std::max(zmax, a);
    }
    double sum = 0;
    for (size_t o = 0; o < kOut; ++o) sum += std::exp(z[o] - zmax);
    for (size_t o = 0; o < kOut; ++o) {
      const double p = std::exp(z[o] - zmax) / sum;
      const double dz = (p - (static_cast<int>(o) == data.y[i] ? 1.0 : 0.0)) / kGlobalBatch;
      gb[o] += dz;
      for (size_t d = 0; d < kIn; ++d) gw[d * kOut + o] += x[d] * dz;
    }
  }
}

enum class Opt { kSgdMomentum, kAdam };

// The weights (kernel, bias) and the optimizer's slots after training.
struct Weights {
  std::vector<std::vector<float>> tensors;
};

// The plain computation: one thread, the whole global batch of each step (examples
// [s * B, (s + 1) * B)) in one loop, the update written out.
Weights TrainPlain(Opt opt) {
  std::vector<float> w = InitialKernel(), b(kOut, 0.0f);
  std::vector<float> mw(w.size(), 0), vw(w.size(), 0), mb(kOut, 0), vb(kOut, 0);
  for (int step = 0; step < kSteps; ++step) {
    std::vector<size_t> batch;
    for (size_t i = 0; i < kGlobalBatch; ++i) batch.push_back(step * kGlobalBatch + i);
    std::vector<double> gw(w.size(), 0), gb(kOut, 0);
    AddGradients(w.data(), b.data(), batch, gw, gb);
    const auto update = [&](std::vector<float>& p, const std::vector<double>& g,
                            std::vector<float>& m, std::vector<float>& v) {
      for (size_t i = 0; i < p.size(); ++i) {
        const float gi = static_cast<float>(g[i]);
        if (opt == Opt::kSgdMomentum) {  // Keras SGD, momentum 0.9, lr 0.1
          m[i] = 0.9f * m[i] - 0.1f * gi;
          p[i] += m[i];
        } else {  // Keras Adam, lr 0.01
          const double t = step + 1;
          const double lr_t = 0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
          m[i] = 0.9f * m[i] + 0.1f * gi;
          v[i] = 0.999f * v[i] + 0.001f * gi * gi;
          p[i] -= static_cast<float>(lr_t * m[i] / (std::sqrt(static_cast<double>(v[i])) + 1e-7));
        }
      }
    };
    update(w, gw, mw, vw);
    update(b, gb, mb, vb);
  }
  if (opt == Opt::kSgdMomentum) return {{w, b, mw, mb}};
  return {{w, b, mw, vw, mb, vb}};
}

std::unique_ptr<Optimizer> MakeOptimizer(Strategy& s, Opt opt) {
  if (opt == Opt::kAdam) return std::make_unique<Adam>(s, AdamOptions{.learning_rate = 0.01f});
  return std::make_unique<Sgd>(s, SgdOptions{.learning_rate = 0.1f, .momentum = 0.9f});
}

struct Model {
  MirroredVariable* w;
  MirroredVariable* b;
  explicit Model(Strategy& s) {
    const std::vector<float> init = InitialKernel();
    w = &s.CreateVariable("dense/kernel", {kIn, kOut}, [init](std::span<float> value) {
      std::copy(init.begin(), init.end(), value.begin());
    });
    b = &s.CreateVariable("dense/bias", {kOut}, Zeros());
  }
  std::vector<MirroredVariable*> variables() const { return {w, b}; }
};

// Runs steps [first, last) of the training on `s`, each replica on its share of the global batch,
// with user code written for any strategy (its own value(local_replica_id()), ApplyGradients).
void RunSteps(Strategy& s, Model& model, Optimizer& opt, int first, int last) {
  DistributedDataset data(s, kExamples, {.global_batch_size = kGlobalBatch});
  const std::vector<MirroredVariable*> vars = model.variables();
  for (int step = first; step < last; ++step) {
    s.Run([&](ReplicaContext& ctx) {
      const int r = ctx.local_replica_id();
      std::vector<double> gw(kIn * kOut, 0), gb(kOut, 0);
      AddGradients(model.w->data(r), model.b->data(r),
                   data.ReplicaBatch(0, static_cast<size_t>(step), r), gw, gb);
      std::vector<float> fw(gw.begin(), gw.end()), fb(gb.begin(), gb.end());
      opt.ApplyGradients(ctx, vars, {fw, fb});
    });
  }
}

Weights Collect(const Model& model, const Optimizer& opt) {
  Weights out;
  for (MirroredVariable* v : model.variables())
    out.tensors.emplace_back(v->value(0).begin(), v->value(0).end());
  for (const Optimizer::Slot& slot : opt.SaveSlots()) out.tensors.push_back(slot.value);
  return out;
}

Weights TrainOn(Strategy& s, Opt which) {
  Model model(s);
  std::unique_ptr<Optimizer> opt = MakeOptimizer(s, which);
  RunSteps(s, model, *opt, 0, kSteps);
  EXPECT_EQ(opt->iterations(), kSteps);
  return Collect(model, *opt);
}

// Slots come in the strategy's variable order, each variable's slots together: reorders the plain
// computation's {w, b, slots of w..., slots of b...} the same way already, so a plain comparison.
void ExpectAgree(const Weights& got, const Weights& want, const std::string& what) {
  ASSERT_EQ(got.tensors.size(), want.tensors.size()) << what;
  for (size_t t = 0; t < got.tensors.size(); ++t) {
    ASSERT_EQ(got.tensors[t].size(), want.tensors[t].size()) << what << " tensor " << t;
    for (size_t i = 0; i < got.tensors[t].size(); ++i) {
      const double a = got.tensors[t][i], c = want.tensors[t][i];
      EXPECT_LE(std::abs(a - c), 1e-5 * std::max(std::abs(a), std::abs(c)) + 1e-7)
          << what << ": tensor " << t << "[" << i << "]: " << a << " vs " << c;
    }
  }
}

TEST(CentralStorageTest, OneCopySharedByEveryReplica) {
  CentralStorageStrategy s({.num_replicas = 3});
  EXPECT_EQ(s.name(), "central_storage");
  EXPECT_EQ(s.NumReplicasInSync(), 3);
  EXPECT_EQ(s.num_local_replicas(), 3);
  EXPECT_EQ(s.num_workers(), 1);
  EXPECT_TRUE(s.IsChief());
  EXPECT_EQ(s.devices().size(), 3u);
  EXPECT_EQ(s.communication(), nullptr);
  EXPECT_EQ(s.cross_device_ops(), CrossDeviceOps::kReductionToOneDevice);
  MirroredVariable& w = s.CreateVariable("w", {1000}, Constant(2.0f));
  EXPECT_EQ(w.placement(), MirroredVariable::Placement::kCentral);
  EXPECT_EQ(w.num_copies(), 1);
  EXPECT_EQ(w.num_local_replicas(), 3);
  EXPECT_EQ(w.value(0).data(), w.value(1).data());
  EXPECT_EQ(w.value(0).data(), w.value(2).data());
  EXPECT_EQ(w.tensor(2).data, w.data(0));
  EXPECT_EQ(w.value(2)[999], 2.0f);
  // Inside Run every replica's view is the one copy.
  const PerReplica<const float*> seen =
      s.Run([&](ReplicaContext& ctx) -> const float* { return w.data(ctx.local_replica_id()); });
  for (const float* p : seen) EXPECT_EQ(p, w.data(0));
  w.Assign(std::vector<float>(1000, 5.0f));
  EXPECT_EQ(w.value(1)[0], 5.0f);
  ExpectError(ErrorCode::kInvalidArgument, {"no local replica 3"}, [&] { w.value(3); });

  // MirroredStrategy keeps one copy per replica (the contrast the check above relies on).
  MirroredStrategy m({.num_replicas = 3});
  MirroredVariable& mw = m.CreateVariable("w", {1000}, Constant(2.0f));
  EXPECT_EQ(mw.num_copies(), 3);
  EXPECT_NE(mw.value(0).data(), mw.value(1).data());

  CentralStorageStrategy by_devices({.devices = {Device::Cpu(), Device::Cpu()}});
  EXPECT_EQ(by_devices.NumReplicasInSync(), 2);
  CentralStorageStrategy one;
  EXPECT_EQ(one.NumReplicasInSync(), 1);
}

// An optimizer that records where its update runs: plain SGD, lr 1.
class RecordingSgd : public Optimizer {
 public:
  explicit RecordingSgd(Strategy& s) : Optimizer(s, "RecordingSgd", {"momentum"}) {}
  std::atomic<int> updates{0};
  std::mutex mu;
  std::vector<std::thread::id> threads;
  std::atomic<bool> fail{false};

 private:
  void Update(std::span<float> variable, std::span<const float> gradient,
              std::span<std::span<float>> slots, int64_t /*step*/) override {
    ++updates;
    {
      std::lock_guard<std::mutex> lock(mu);
      threads.push_back(std::this_thread::get_id());
    }
    // Slow enough that a replica that did not wait would read the old value.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (fail) throw Error(ErrorCode::kInternal, "the update failed");
    for (size_t i = 0; i < variable.size(); ++i) {
      slots[0][i] += 1.0f;
      variable[i] -= gradient[i];
    }
  }
};

TEST(CentralStorageTest, SummedGradientAppliedOnceOnReplicaZero) {
  CentralStorageStrategy s({.num_replicas = 3});
  MirroredVariable& w = s.CreateVariable("w", {4}, Zeros());
  RecordingSgd opt(s);
  struct Seen {
    std::thread::id thread;
    std::vector<float> gradient, value;
    int64_t iterations;
  };
  const PerReplica<Seen> seen = s.Run([&](ReplicaContext& ctx) {
    const int r = ctx.local_replica_id();
    std::vector<float> g(4, static_cast<float>(r + 1));  // 1, 2, 3: the sum is 6
    g[3] = static_cast<float>(10 * r);                   // 0, 10, 20: the sum is 30
    opt.ApplyGradients(ctx, {&w}, {g});
    return Seen{std::this_thread::get_id(), g,
                std::vector<float>(w.value(r).begin(), w.value(r).end()), opt.iterations(ctx)};
  });
  EXPECT_EQ(opt.updates, 1);  // once, not once per replica
  ASSERT_EQ(opt.threads.size(), 1u);
  EXPECT_EQ(opt.threads[0], seen[0].thread);
  const std::vector<float> want = {-6, -6, -6, -30};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(seen[r].value, want) << "replica " << r << " read before the update";
    EXPECT_EQ(seen[r].gradient, (std::vector<float>{6, 6, 6, 30})) << "replica " << r;
    EXPECT_EQ(seen[r].iterations, 1) << "replica " << r;
  }
  EXPECT_EQ(opt.iterations(), 1);
  const std::vector<Optimizer::Slot> slots = opt.SaveSlots();
  ASSERT_EQ(slots.size(), 1u);
  EXPECT_EQ(slots[0].value, (std::vector<float>{1, 1, 1, 1}));  // one slot, updated once

  // Already-summed gradients: every replica passes them, the update happens once.
  s.Run([&](ReplicaContext& ctx) {
    const std::vector<float> g = {1, 1, 1, 1};
    opt.ApplyReducedGradients(ctx.local_replica_id(), {&w}, {g});
  });
  EXPECT_EQ(opt.updates, 2);
  EXPECT_EQ(w.value(2)[0], -7.0f);
  // Outside Run only local replica 0's call updates the central copy.
  for (int r = 0; r < 3; ++r) {
    const std::vector<float> g = {1, 1, 1, 1};
    opt.ApplyReducedGradients(r, {&w}, {g});
  }
  EXPECT_EQ(opt.updates, 3);
  EXPECT_EQ(w.value(0)[0], -8.0f);
  EXPECT_EQ(opt.iterations(), 3);
}

class CentralStorageTrainingTest : public ::testing::TestWithParam<Opt> {};

TEST_P(CentralStorageTrainingTest, AgreesWithMirroredAndAPlainComputation) {
  const Opt which = GetParam();
  const Weights plain = TrainPlain(which);
  for (int n : {1, 2, 3, 4}) {
    const std::string what = "central_storage, " + std::to_string(n) + " replicas";
    CentralStorageStrategy central({.num_replicas = n});
    const Weights got = TrainOn(central, which);
    ExpectAgree(got, plain, what + " vs the plain computation");
    MirroredStrategy mirrored({.num_replicas = n});
    const Weights reference = TrainOn(mirrored, which);
    ExpectAgree(got, reference, what + " vs mirrored");
    for (size_t t = 0; t < got.tensors.size(); ++t) {
      EXPECT_TRUE(BitEqual(got.tensors[t], reference.tensors[t])) << what << " tensor " << t;
    }
  }
  // The comparison can fail: one step fewer is far from the plain computation.
  CentralStorageStrategy s({.num_replicas = 2});
  Model model(s);
  std::unique_ptr<Optimizer> opt = MakeOptimizer(s, which);
  RunSteps(s, model, *opt, 0, kSteps - 1);
  const Weights short_run = Collect(model, *opt);
  size_t far = 0;
  for (size_t i = 0; i < plain.tensors[0].size(); ++i) {
    far += std::abs(short_run.tensors[0][i] - plain.tensors[0][i]) > 1e-4f;
  }
  EXPECT_GT(far, plain.tensors[0].size() / 2);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CentralStorageTrainingTest,
                         ::testing::Values(Opt::kSgdMomentum, Opt::kAdam),
                         [](const ::testing::TestParamInfo<Opt>& p) {
                           return p.param == Opt::kAdam ? "Adam" : "SgdMomentum";
                         });

// A fresh directory per test, removed afterwards.
class CentralStorageCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("collectives_central_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }

 private:
  fs::path dir_;
};

// Saved after 5 steps, restored into a fresh strategy (central, and mirrored), 7 more steps: the
// same weights and slots as 12 uninterrupted steps, bit for bit.
TEST_F(CentralStorageCheckpointTest, SaveRestoreResumesExactly) {
  CentralStorageStrategy whole({.num_replicas = 2});
  const Weights uninterrupted = TrainOn(whole, Opt::kAdam);
  {
    CentralStorageStrategy s({.num_replicas = 2});
    Model model(s);
    Adam adam(s, {.learning_rate = 0.01f});
    RunSteps(s, model, adam, 0, 5);
    SaveCheckpoint(s, &adam, dir(), {.epoch = 0, .step = 5});
  }
  for (bool central : {true, false}) {
    std::unique_ptr<Strategy> s;
    if (central) {
      s = std::make_unique<CentralStorageStrategy>(CentralStorageOptions{.num_replicas = 2});
    } else {
      s = std::make_unique<MirroredStrategy>(MirroredOptions{.num_replicas = 2});
    }
    Model model(*s);
    Adam adam(*s, {.learning_rate = 0.01f});
    const std::optional<TrainingState> state = RestoreCheckpoint(*s, &adam, dir());
    ASSERT_TRUE(state.has_value());
    EXPECT_EQ(*state, (TrainingState{0, 5}));
    EXPECT_EQ(adam.iterations(), 5);
    RunSteps(*s, model, adam, 5, kSteps);
    const Weights resumed = Collect(model, adam);
    ASSERT_EQ(resumed.tensors.size(), uninterrupted.tensors.size());
    for (size_t t = 0; t < resumed.tensors.size(); ++t) {
      EXPECT_TRUE(BitEqual(resumed.tensors[t], uninterrupted.tensors[t]))
          << (central ? "central" : "mirrored") << " tensor " << t;
    }
  }
}

TEST_F(CentralStorageCheckpointTest, BackupAndRestoreResumesAnInterruptedTraining) {
  {
    CentralStorageStrategy s({.num_replicas = 2});
    Model model(s);
    Sgd sgd(s, {.learning_rate = 0.1f, .momentum = 0.9f});
    BackupAndRestore backup(s, &sgd, dir(), {.save_every_steps = 4});
    EXPECT_EQ(backup.OnTrainBegin(), (TrainingState{0, 0}));
    for (int step = 0; step < 6; ++step) {
      RunSteps(s, model, sgd, step, step + 1);
      backup.OnStepEnd(0, step);
    }
    // "Crash" after step 5: the backup of step 3 (saved as "next: step 4") is left.
  }
  CentralStorageStrategy s({.num_replicas = 2});
  Model model(s);
  Sgd sgd(s, {.learning_rate = 0.1f, .momentum = 0.9f});
  BackupAndRestore backup(s, &sgd, dir(), {.save_every_steps = 4});
  const TrainingState start = backup.OnTrainBegin();
  EXPECT_EQ(start, (TrainingState{0, 4}));
  RunSteps(s, model, sgd, static_cast<int>(start.step), kSteps);
  backup.OnEpochEnd(0);
  backup.OnTrainEnd();
  EXPECT_FALSE(fs::exists(fs::path(dir()) / "checkpoint"));
  ExpectAgree(Collect(model, sgd), TrainPlain(Opt::kSgdMomentum), "resumed central_storage");
}

// A replica that fails releases the others at once (well inside their timeout), Run rethrows its
// error, and the strategy stays broken.
TEST(CentralStorageTest, FailingReplicaAbortsWithoutHanging) {
  constexpr auto kTimeout = std::chrono::seconds(20);
  {
    CentralStorageStrategy s({.num_replicas = 3, .timeout = kTimeout});
    MirroredVariable& w = s.CreateVariable("w", {4}, Zeros());
    Sgd sgd(s);
    const auto start = std::chrono::steady_clock::now();
    ExpectError(ErrorCode::kInvalidArgument, {"replica 2 gives up"}, [&] {
      s.Run([&](ReplicaContext& ctx) {
        if (ctx.local_replica_id() == 2) {
          throw Error(ErrorCode::kInvalidArgument, "replica 2 gives up");
        }
        std::vector<float> g(4, 1.0f);
        sgd.ApplyGradients(ctx, {&w}, {g});
      });
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, kTimeout / 2);
    EXPECT_EQ(w.value(0)[0], 0.0f);  // no update happened
    ExpectError(ErrorCode::kInvalidArgument, {"replica 2 gives up"},
                [&] { s.Run([](ReplicaContext&) {}); });
    ExpectError(ErrorCode::kInvalidArgument, {"replica 2 gives up"},
                [&] { w.Assign(std::vector<float>(4, 1.0f)); });
  }
  {
    // The update itself fails on replica 0: the waiting replicas are aborted.
    CentralStorageStrategy s({.num_replicas = 3, .timeout = kTimeout});
    MirroredVariable& w = s.CreateVariable("w", {4}, Zeros());
    RecordingSgd opt(s);
    opt.fail = true;
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::string> others(3);
    ExpectError(ErrorCode::kInternal, {"the update failed"}, [&] {
      s.Run([&](ReplicaContext& ctx) {
        std::vector<float> g(4, 1.0f);
        try {
          opt.ApplyGradients(ctx, {&w}, {g});
        } catch (const Error& e) {
          others[ctx.local_replica_id()] = std::string(ToString(e.code())) + ": " + e.what();
          throw;
        }
      });
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, kTimeout / 2);
    for (int r = 1; r < 3; ++r) {
      EXPECT_NE(others[r].find("aborted"), std::string::npos) << others[r];
      EXPECT_NE(others[r].find("the update failed"), std::string::npos) << others[r];
    }
  }
  {
    // A replica that returns without the update: the others learn it at once (kMismatch).
    CentralStorageStrategy s({.num_replicas = 2, .timeout = kTimeout});
    MirroredVariable& w = s.CreateVariable("w", {4}, Zeros());
    Sgd sgd(s);
    const auto start = std::chrono::steady_clock::now();
    ExpectError(ErrorCode::kMismatch, {"apply_gradients"}, [&] {
      s.Run([&](ReplicaContext& ctx) {
        if (ctx.local_replica_id() == 1) return;
        std::vector<float> g(4, 1.0f);
        sgd.ApplyGradients(ctx, {&w}, {g});
      });
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, kTimeout / 2);
  }
}

// User code written for MirroredStrategy runs unchanged: collectives of the replicas' own
// tensors, Strategy::Reduce, DistributedDataset; the central copy itself cannot be all-reduced
// (every replica would pass the same buffer) and is read-only inside Run.
TEST(CentralStorageTest, ReplicaCollectivesAndReduce) {
  CentralStorageStrategy s({.num_replicas = 4});
  const PerReplica<double> sums = s.Run([&](ReplicaContext& ctx) {
    std::vector<float> mine = {static_cast<float>(ctx.local_replica_id()), 1.0f};
    ctx.AllReduce(ReduceOp::kSum, {Tensor{mine.data(), mine.size(), DataType::kFloat32}});
    EXPECT_EQ(mine, (std::vector<float>{6, 4}));
    return ctx.AllReduce(ReduceOp::kAvg, static_cast<double>(ctx.replica_id_in_sync_group()));
  });
  for (double v : sums) EXPECT_EQ(v, 1.5);
  EXPECT_EQ(s.Reduce(ReduceOp::kSum, PerReplica<double>{1, 2, 3, 4}), 10.0);
  EXPECT_EQ(s.Reduce(ReduceOp::kAvg, PerReplica<double>{1, 2, 3, 4}), 2.5);
  DistributedDataset data(s, 100, {.global_batch_size = 20});
  EXPECT_EQ(data.per_replica_batch_size(), 5u);

  CentralStorageStrategy t({.num_replicas = 2});
  MirroredVariable& w = t.CreateVariable("w", {3}, Zeros());
  ExpectError(ErrorCode::kInvalidArgument, {"pass the same buffer"}, [&] {
    t.Run([&](ReplicaContext& ctx) {
      ctx.AllReduce(ReduceOp::kSum, {w.tensor(ctx.local_replica_id())});
    });
  });
  CentralStorageStrategy u({.num_replicas = 2});
  MirroredVariable& v = u.CreateVariable("v", {3}, Zeros());
  ExpectError(ErrorCode::kInvalidUsage, {"MirroredVariable::Assign is a cross-replica call"},
              [&] { u.Run([&](ReplicaContext&) { v.Assign(std::vector<float>(3, 1.0f)); }); });
}

TEST(CentralStorageTest, RefusesSeveralWorkers) {
  // Nothing from the test's own environment.
  ScopedEnv tf("TF_CONFIG", nullptr), rank("RANK", nullptr), size("WORLD_SIZE", nullptr),
      ompi_rank("OMPI_COMM_WORLD_RANK", nullptr), ompi_size("OMPI_COMM_WORLD_SIZE", nullptr);
  ClusterSpec two;
  two.world_size = 2;
  two.master_port = 1;
  ExpectError(ErrorCode::kInvalidArgument,
              {"CentralStorageOptions::cluster has world_size 2", "single worker"},
              [&] { CentralStorageStrategy s({.cluster = two}); });
  {
    ScopedEnv set("TF_CONFIG",
                  R"({"cluster": {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001",
                      "127.0.0.1:2002"]}, "task": {"type": "worker", "index": 0}})");
    ExpectError(ErrorCode::kInvalidArgument,
                {"TF_CONFIG field 'cluster' lists 3 training tasks", "single worker",
                 "MultiWorkerMirroredStrategy"},
                [&] { CentralStorageStrategy s; });
  }
  {
    ScopedEnv set(
        "TF_CONFIG",
        R"({"cluster": {"worker": ["127.0.0.1:2000"]}, "task": {"type": "worker", "index": 0}})");
    CentralStorageStrategy s({.num_replicas = 2});
    EXPECT_EQ(s.NumReplicasInSync(), 2);
  }
  {
    ScopedEnv set("WORLD_SIZE", "2"), set_rank("RANK", "0");
    ExpectError(ErrorCode::kInvalidArgument, {"WORLD_SIZE=2", "single worker"},
                [&] { CentralStorageStrategy s; });
  }
  {
    ScopedEnv set("WORLD_SIZE", "1"), set_rank("RANK", "0");
    CentralStorageStrategy s;
    EXPECT_EQ(s.num_workers(), 1);
  }
  {
    ScopedEnv set("OMPI_COMM_WORLD_SIZE", "4");
    ExpectError(ErrorCode::kInvalidArgument, {"OMPI_COMM_WORLD_SIZE=4", "single worker"},
                [&] { CentralStorageStrategy s; });
  }
  ExpectError(ErrorCode::kNotSupported, {"CentralStorageStrategy", "cuda:0"},
              [&] { CentralStorageStrategy s({.devices = {Device::Cuda(0)}}); });
  ExpectError(ErrorCode::kInvalidArgument, {"CentralStorageStrategy", "-1 local replicas"},
              [&] { CentralStorageStrategy s({.num_replicas = -1}); });
  ExpectError(ErrorCode::kInvalidArgument, {"CentralStorageStrategy", "timeout"},
              [&] { CentralStorageStrategy s({.timeout = std::chrono::milliseconds(0)}); });
}

}  // namespace
}  // namespace collectives::strategy
