// The acceptance test of the strategy layer: k = 10 training steps of a small MLP (20-16-3, ReLU,
// softmax cross-entropy on the logits, plain loops, seeded synthetic data, global batch 24) give
// the same weights with OneDeviceStrategy, with MirroredStrategy on 2, 3 and 4 local replicas
// (both CrossDeviceOps), and with MultiWorkerMirroredStrategy on 2 workers x 2 replicas (workers
// as threads over loopback TCP), for Adam and for SGD with momentum.
//
// "The same": every element within a relative 1e-5 of OneDevice's, |a - b| <= 1e-5 * max(|a|, |b|)
// + 1e-7 (the absolute 1e-7 covers elements near zero). They cannot be equal bit for bit: the
// gradient of the global batch is summed in a different order when it is split over replicas.
// Within one run, every copy on every replica of every worker must be identical bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "collectives/strategy.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

using testing::BitEqual;
using testing::RunWorkers;

constexpr size_t kIn = 20, kHidden = 16, kOut = 3;
constexpr size_t kExamples = 250;  // 10 full batches of 24, and a remainder that is dropped
constexpr size_t kGlobalBatch = 24;
constexpr int kSteps = 10;

// Synthetic data: x uniform in [-1, 1), the label the argmax of a fixed random linear teacher.
struct Data {
  std::vector<float> x;  // kExamples x kIn
  std::vector<int> y;
  Data() {
    std::mt19937_64 rng(2024);
    const auto uniform = [&] { return static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-52 - 1.0); };
    std::vector<float> teacher(kIn * kOut);
    for (float& t : teacher) t = uniform();
    x.resize(kExamples * kIn);
    for (float& v : x) v = uniform();
    for (size_t i = 0; i < kExamples; ++i) {
      float best = -1e30f;
      int label = 0;
      for (size_t o = 0; o < kOut; ++o) {
        float z = 0;
        for (size_t d = 0; d < kIn; ++d) z += x[i * kIn + d] * teacher[d * kOut + o];
        if (z > best) {
          best = z;
          label = static_cast<int>(o);
        }
      }
      y.push_back(label);
    }
  }
};

struct Mlp {
  MirroredVariable* w1;  // kIn x kHidden
  MirroredVariable* b1;
  MirroredVariable* w2;  // kHidden x kOut
  MirroredVariable* b2;

  explicit Mlp(Strategy& s) {
    w1 = &s.CreateVariable("hidden/kernel", {kIn, kHidden}, GlorotUniform(kIn, kHidden, 1));
    b1 = &s.CreateVariable("hidden/bias", {kHidden}, Constant(0.01f));
    w2 = &s.CreateVariable("logits/kernel", {kHidden, kOut}, GlorotUniform(kHidden, kOut, 2));
    b2 = &s.CreateVariable("logits/bias", {kOut}, Zeros());
  }
  std::vector<MirroredVariable*> variables() const { return {w1, b1, w2, b2}; }

  // Forward and backward over `batch` on replica r's copy; gradients of
  // sum(loss_i) / global_batch (accumulated in double, returned as float); returns the replica's
  // share of the mean loss.
  double Gradients(const Data& data, const std::vector<size_t>& batch, int r,
                   std::vector<std::vector<float>>& grads) const {
    const float* W1 = w1->data(r);
    const float* B1 = b1->data(r);
    const float* W2 = w2->data(r);
    const float* B2 = b2->data(r);
    std::vector<double> g1(kIn * kHidden, 0), gb1(kHidden, 0), g2(kHidden * kOut, 0), gb2(kOut, 0);
    std::vector<float> losses;
    const double scale = 1.0 / kGlobalBatch;
    for (size_t i : batch) {
      const float* x = &data.x[i * kIn];
      float h[kHidden], z[kOut];
      for (size_t j = 0; j < kHidden; ++j) {
        float a = B1[j];
        for (size_t d = 0; d < kIn; ++d) a += x[d] * W1[d * kHidden + j];
        h[j] = std::max(a, 0.0f);
      }
      float zmax = -1e30f;
      for (size_t o = 0; o < kOut; ++o) {
        float a = B2[o];
        for (size_t j = 0; j < kHidden; ++j) a += h[j] * W2[j * kOut + o];
        z[o] = a;
        zmax = std::max(zmax, a);
      }
      double sum = 0;
      for (size_t o = 0; o < kOut; ++o) sum += std::exp(static_cast<double>(z[o] - zmax));
      const int label = data.y[i];
      losses.push_back(static_cast<float>(std::log(sum) - (z[label] - zmax)));
      double dz[kOut];
      for (size_t o = 0; o < kOut; ++o) {
        const double p = std::exp(static_cast<double>(z[o] - zmax)) / sum;
        dz[o] = (p - (static_cast<int>(o) == label ? 1.0 : 0.0)) * scale;
        gb2[o] += dz[o];
      }
      for (size_t j = 0; j < kHidden; ++j) {
        double dh = 0;
        for (size_t o = 0; o < kOut; ++o) {
          g2[j * kOut + o] += h[j] * dz[o];
          dh += W2[j * kOut + o] * dz[o];
        }
        if (h[j] <= 0.0f) continue;  // ReLU
        gb1[j] += dh;
        for (size_t d = 0; d < kIn; ++d) g1[d * kHidden + j] += x[d] * dh;
      }
    }
    grads.assign(4, {});
    const auto to_float = [](const std::vector<double>& v) {
      return std::vector<float>(v.begin(), v.end());
    };
    grads[0] = to_float(g1);
    grads[1] = to_float(gb1);
    grads[2] = to_float(g2);
    grads[3] = to_float(gb2);
    return ComputeAverageLoss(losses, kGlobalBatch);
  }
};

enum class Opt { kAdam, kSgdMomentum };

struct Result {
  std::vector<std::vector<float>> weights;  // replica 0's, per variable
  std::vector<double> losses;               // per step, the mean loss of the global batch
};

// Trains kSteps steps on `s`; checks that every local copy equals replica 0's bit for bit.
Result Train(Strategy& s, Opt which) {
  static const Data data;
  Mlp mlp(s);
  std::unique_ptr<Optimizer> opt;
  if (which == Opt::kAdam) {
    opt = std::make_unique<Adam>(s, AdamOptions{.learning_rate = 0.01f});
  } else {
    opt = std::make_unique<Sgd>(s, SgdOptions{.learning_rate = 0.1f, .momentum = 0.9f});
  }
  DistributedDataset dataset(s, kExamples,
                             {.global_batch_size = kGlobalBatch, .drop_remainder = true,
                              .shuffle = true, .seed = 3});
  EXPECT_EQ(dataset.steps_per_epoch(), static_cast<size_t>(kSteps));
  Result result;
  const std::vector<MirroredVariable*> vars = mlp.variables();
  for (int step = 0; step < kSteps; ++step) {
    PerReplica<double> shares = s.Run([&](ReplicaContext& ctx) {
      const int r = ctx.local_replica_id();
      const std::vector<size_t> batch = dataset.ReplicaBatch(0, static_cast<size_t>(step), r);
      std::vector<std::vector<float>> grads;
      const double share = mlp.Gradients(data, batch, r, grads);
      opt->ApplyGradients(ctx, vars, {grads[0], grads[1], grads[2], grads[3]});
      return share;
    });
    result.losses.push_back(s.Reduce(ReduceOp::kSum, shares));
  }
  for (MirroredVariable* v : vars) {
    for (int r = 1; r < s.num_local_replicas(); ++r) {
      EXPECT_TRUE(BitEqual(v->value(r), v->value(0))) << v->name() << " replica " << r;
    }
    result.weights.emplace_back(v->value(0).begin(), v->value(0).end());
  }
  for (const auto& slot : opt->SaveSlots()) result.weights.push_back(slot.value);
  return result;
}

// Every element within relative 1e-5 (+ absolute 1e-7) of the reference; returns the largest
// fraction of that tolerance used by any element, recorded as a test property so that the
// margin left shows in the test's results.
double ExpectEquivalent(const Result& got, const Result& want, const std::string& what) {
  double worst = 0;
  EXPECT_EQ(got.weights.size(), want.weights.size()) << what;
  for (size_t t = 0; t < std::min(got.weights.size(), want.weights.size()); ++t) {
    EXPECT_EQ(got.weights[t].size(), want.weights[t].size());
    for (size_t i = 0; i < std::min(got.weights[t].size(), want.weights[t].size()); ++i) {
      const double a = got.weights[t][i], b = want.weights[t][i];
      const double scale = std::max(std::abs(a), std::abs(b));
      EXPECT_LE(std::abs(a - b), 1e-5 * scale + 1e-7) << what << ": tensor " << t << "[" << i << "]";
      worst = std::max(worst, std::abs(a - b) / (1e-5 * scale + 1e-7));
    }
  }
  for (size_t k = 0; k < want.losses.size(); ++k) {
    EXPECT_NEAR(got.losses[k], want.losses[k], 1e-5 * std::abs(want.losses[k])) << what << " step " << k;
  }
  return worst;
}

class EquivalenceTest : public ::testing::TestWithParam<Opt> {};

TEST_P(EquivalenceTest, MirroredAndMultiWorkerMatchOneDevice) {
  const Opt which = GetParam();
  OneDeviceStrategy one;
  const Result reference = Train(one, which);
  EXPECT_LT(reference.losses.back(), reference.losses.front());  // it does learn

  for (int n : {2, 3, 4}) {
    for (CrossDeviceOps ops : {CrossDeviceOps::kReductionToOneDevice, CrossDeviceOps::kHierarchicalCopy}) {
      const std::string what = "mirrored " + std::to_string(n) + " " + ToString(ops);
      MirroredStrategy s({.num_replicas = n, .cross_device_ops = ops});
      const double used = ExpectEquivalent(Train(s, which), reference, what);
      RecordProperty(what + " tolerance used", std::to_string(used));
    }
  }
  for (CrossDeviceOps ops : {CrossDeviceOps::kReductionToOneDevice, CrossDeviceOps::kHierarchicalCopy}) {
    std::vector<Result> per_worker(2);
    RunWorkers(2, 2, ops, [&](Strategy& s, int rank) { per_worker[rank] = Train(s, which); });
    const std::string what = std::string("multi-worker 2x2 ") + ToString(ops);
    const double used = ExpectEquivalent(per_worker[0], reference, what);
    RecordProperty(what + " tolerance used", std::to_string(used));
    ASSERT_EQ(per_worker[0].weights.size(), per_worker[1].weights.size());
    for (size_t t = 0; t < per_worker[0].weights.size(); ++t) {
      EXPECT_TRUE(BitEqual(per_worker[0].weights[t], per_worker[1].weights[t]))
          << what << ": tensor " << t << " differs between the workers";
    }
    EXPECT_EQ(per_worker[0].losses, per_worker[1].losses);
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, EquivalenceTest,
                         ::testing::Values(Opt::kAdam, Opt::kSgdMomentum),
                         [](const ::testing::TestParamInfo<Opt>& p) {
                           return p.param == Opt::kAdam ? "Adam" : "SgdMomentum";
                         });

}  // namespace
}  // namespace collectives::strategy
