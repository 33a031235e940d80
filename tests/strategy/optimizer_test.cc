// Optimizers on mirrored variables: SGD (plain, momentum, Nesterov) and Adam against a plain
// scalar reference of Keras' formulas for a few steps, on one device, on local replicas with
// both CrossDeviceOps, and on 2 workers x 2 replicas; variable and slot copies bit-identical on
// every replica of every worker; lazily created slots; SaveSlots / RestoreSlots; errors.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/strategy.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

using testing::BitEqual;
using testing::ExpectError;
using testing::RunWorkers;

constexpr int kSteps = 5;
const std::vector<size_t> kCounts = {5, 2};  // variables "w" and "b"

// Replica g's gradient of variable j, element k, at step t: dyadic fractions, so that the sum
// over any number of replicas in any order is exact and the reference can use it directly.
float Gradient(int g, size_t j, size_t k, int t) {
  return 0.125f * static_cast<float>((static_cast<int>(k) - 2 + static_cast<int>(j)) * (t + 1)) *
         static_cast<float>(g + 1) + (k == 1 ? 0.5f : 0.0f);
}
float SummedGradient(int replicas, size_t j, size_t k, int t) {
  double sum = 0;
  for (int g = 0; g < replicas; ++g) sum += Gradient(g, j, k, t);
  return static_cast<float>(sum);
}
float Initial(size_t j, size_t k) { return 0.5f - 0.25f * static_cast<float>(k) + j; }

// The reference: one scalar loop per optimizer, written from the formulas in strategy.h.
struct Reference {
  std::vector<std::vector<float>> w, s1, s2;
  Reference() {
    for (size_t j = 0; j < kCounts.size(); ++j) {
      w.emplace_back(kCounts[j]);
      for (size_t k = 0; k < kCounts[j]; ++k) w[j][k] = Initial(j, k);
      s1.emplace_back(kCounts[j], 0.0f);
      s2.emplace_back(kCounts[j], 0.0f);
    }
  }
  void Sgd(const SgdOptions& o, int replicas) {
    for (int t = 0; t < kSteps; ++t) {
      for (size_t j = 0; j < kCounts.size(); ++j) {
        for (size_t k = 0; k < kCounts[j]; ++k) {
          const float g = SummedGradient(replicas, j, k, t);
          if (o.momentum == 0.0f) {
            w[j][k] = w[j][k] - o.learning_rate * g;
          } else {
            float& v = s1[j][k];
            v = o.momentum * v - o.learning_rate * g;
            w[j][k] = o.nesterov ? w[j][k] + (o.momentum * v - o.learning_rate * g) : w[j][k] + v;
          }
        }
      }
    }
  }
  void Adam(const AdamOptions& o, int replicas) {
    for (int t = 0; t < kSteps; ++t) {
      const double step = t + 1;
      const float lr_t = static_cast<float>(o.learning_rate * std::sqrt(1 - std::pow(double(o.beta_2), step)) /
                                            (1 - std::pow(double(o.beta_1), step)));
      for (size_t j = 0; j < kCounts.size(); ++j) {
        for (size_t k = 0; k < kCounts[j]; ++k) {
          const float g = SummedGradient(replicas, j, k, t);
          float& m = s1[j][k];
          float& v = s2[j][k];
          m = o.beta_1 * m + (1.0f - o.beta_1) * g;
          v = o.beta_2 * v + (1.0f - o.beta_2) * g * g;
          w[j][k] = w[j][k] - lr_t * m / (std::sqrt(v) + o.epsilon);
        }
      }
    }
  }
};

// Relative 1e-6: the library and the reference compute the same float operations, but the
// compiler may contract or reorder differently in a vectorised loop.
void ExpectClose(std::span<const float> got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_NEAR(got[k], want[k], 1e-6 * std::max(std::abs(want[k]), 1e-3f)) << what << "[" << k << "]";
  }
}

using MakeOptimizer = std::function<std::unique_ptr<Optimizer>(Strategy&)>;

// Creates "w" and "b", trains kSteps steps, and checks against `reference` (which has run) and
// that every local copy is bit-identical to replica 0's. Returns replica 0's values.
std::vector<std::vector<float>> TrainAndCheck(Strategy& s, const MakeOptimizer& make,
                                             const Reference& reference,
                                             const std::vector<std::string>& slot_suffixes) {
  std::vector<MirroredVariable*> vars;
  for (size_t j = 0; j < kCounts.size(); ++j) {
    vars.push_back(&s.CreateVariable(j == 0 ? "w" : "b", {kCounts[j]}, [j](std::span<float> v) {
      for (size_t k = 0; k < v.size(); ++k) v[k] = Initial(j, k);
    }));
  }
  std::unique_ptr<Optimizer> opt = make(s);
  for (int t = 0; t < kSteps; ++t) {
    s.Run([&](ReplicaContext& ctx) {
      std::vector<std::vector<float>> grads;
      for (size_t j = 0; j < kCounts.size(); ++j) {
        grads.emplace_back(kCounts[j]);
        for (size_t k = 0; k < kCounts[j]; ++k) {
          grads[j][k] = Gradient(ctx.replica_id_in_sync_group(), j, k, t);
        }
      }
      opt->ApplyGradients(ctx, vars, {grads[0], grads[1]});
    });
  }
  EXPECT_EQ(opt->iterations(), kSteps);
  std::vector<std::vector<float>> out;
  for (size_t j = 0; j < kCounts.size(); ++j) {
    ExpectClose(vars[j]->value(0), reference.w[j], vars[j]->name().c_str());
    for (int r = 1; r < s.num_local_replicas(); ++r) {
      EXPECT_TRUE(BitEqual(vars[j]->value(r), vars[j]->value(0))) << "replica " << r;
    }
    out.emplace_back(vars[j]->value(0).begin(), vars[j]->value(0).end());
  }
  const std::vector<Optimizer::Slot> slots = opt->SaveSlots();
  std::vector<std::string> names;
  for (const auto& slot : slots) names.push_back(slot.name);
  std::vector<std::string> expected;
  for (const char* v : {"w", "b"}) {
    for (const std::string& suffix : slot_suffixes) expected.push_back(v + ("/" + suffix));
  }
  EXPECT_EQ(names, expected);
  if (!slot_suffixes.empty()) {
    ExpectClose(slots[0].value, reference.s1[0], "first slot of w");
    ExpectClose(slots[slot_suffixes.size()].value, reference.s1[1], "first slot of b");
  }
  for (const auto& slot : slots) out.push_back(slot.value);
  return out;
}

struct Layout {
  const char* name;
  std::function<std::unique_ptr<Strategy>()> make;
  int replicas;
};

std::vector<Layout> LocalLayouts() {
  return {
      {"default", [] { return std::make_unique<DefaultStrategy>(); }, 1},
      {"mirrored 3 hierarchical_copy",
       [] {
         return std::make_unique<MirroredStrategy>(MirroredOptions{
             .num_replicas = 3, .cross_device_ops = CrossDeviceOps::kHierarchicalCopy});
       },
       3},
      {"mirrored 4 reduction_to_one_device",
       [] {
         return std::make_unique<MirroredStrategy>(MirroredOptions{
             .num_replicas = 4, .cross_device_ops = CrossDeviceOps::kReductionToOneDevice});
       },
       4},
  };
}

TEST(OptimizerTest, SgdMatchesTheScalarReference) {
  const std::vector<SgdOptions> configs = {{.learning_rate = 0.1f},
                                           {.learning_rate = 0.05f, .momentum = 0.9f},
                                           {.learning_rate = 0.05f, .momentum = 0.5f, .nesterov = true}};
  for (const SgdOptions& o : configs) {
    for (const Layout& layout : LocalLayouts()) {
      SCOPED_TRACE(::testing::Message() << layout.name << " momentum " << o.momentum
                                        << " nesterov " << o.nesterov);
      Reference ref;
      ref.Sgd(o, layout.replicas);
      auto s = layout.make();
      TrainAndCheck(
          *s, [&](Strategy& st) { return std::make_unique<Sgd>(st, o); }, ref,
          o.momentum == 0.0f ? std::vector<std::string>{} : std::vector<std::string>{"momentum"});
    }
  }
}

TEST(OptimizerTest, AdamMatchesTheScalarReference) {
  const AdamOptions o{.learning_rate = 0.01f};
  for (const Layout& layout : LocalLayouts()) {
    SCOPED_TRACE(layout.name);
    Reference ref;
    ref.Adam(o, layout.replicas);
    auto s = layout.make();
    const auto out = TrainAndCheck(
        *s, [&](Strategy& st) { return std::make_unique<Adam>(st, o); }, ref, {"m", "v"});
    // v of "w" is slot 1.
    ExpectClose(out[2 + 1], ref.s2[0], "v of w");
  }
}

TEST(OptimizerTest, CopiesStayBitIdenticalAcrossWorkers) {
  const AdamOptions adam{.learning_rate = 0.01f};
  const SgdOptions sgd{.learning_rate = 0.05f, .momentum = 0.9f, .nesterov = true};
  for (bool use_adam : {true, false}) {
    Reference ref;
    use_adam ? ref.Adam(adam, 4) : ref.Sgd(sgd, 4);
    std::vector<std::vector<std::vector<float>>> per_worker(2);
    RunWorkers(2, 2, CrossDeviceOps::kHierarchicalCopy, [&](Strategy& s, int rank) {
      per_worker[rank] = TrainAndCheck(
          s,
          [&](Strategy& st) -> std::unique_ptr<Optimizer> {
            if (use_adam) return std::make_unique<Adam>(st, adam);
            return std::make_unique<Sgd>(st, sgd);
          },
          ref, use_adam ? std::vector<std::string>{"m", "v"} : std::vector<std::string>{"momentum"});
    });
    ASSERT_EQ(per_worker[0].size(), per_worker[1].size());
    for (size_t i = 0; i < per_worker[0].size(); ++i) {
      EXPECT_TRUE(BitEqual(per_worker[0][i], per_worker[1][i])) << "tensor " << i;
    }
  }
}

TEST(OptimizerTest, SlotsAreCreatedLazilyPerVariable) {
  MirroredStrategy s({.num_replicas = 2});
  MirroredVariable& a = s.CreateVariable("a", {3}, Zeros());
  s.CreateVariable("b", {2}, Zeros());
  Adam adam(s);
  EXPECT_TRUE(adam.SaveSlots().empty());
  EXPECT_EQ(adam.iterations(), 0);
  s.Run([&](ReplicaContext& ctx) {
    std::vector<float> g = {1, 2, 3};
    adam.ApplyGradients(ctx, {&a}, {g});
    EXPECT_EQ(g, (std::vector<float>{2, 4, 6}));  // overwritten with the sum
  });
  const auto slots = adam.SaveSlots();
  ASSERT_EQ(slots.size(), 2u);
  EXPECT_EQ(slots[0].name, "a/m");
  EXPECT_EQ(slots[1].name, "a/v");
  EXPECT_EQ(adam.name(), "Adam");
  Sgd plain(s);
  EXPECT_EQ(plain.name(), "SGD");
  s.Run([&](ReplicaContext& ctx) {
    std::vector<float> g = {1, 1, 1};
    plain.ApplyGradients(ctx, {&a}, {g});
  });
  EXPECT_TRUE(plain.SaveSlots().empty());  // no momentum: no slot
  EXPECT_EQ(plain.iterations(), 1);
}

TEST(OptimizerTest, ApplyReducedGradientsCommunicatesNothing) {
  MirroredStrategy s({.num_replicas = 3});
  MirroredVariable& w = s.CreateVariable("w", {2}, Constant(1.0f));
  Sgd sgd(s, {.learning_rate = 0.5f});
  s.Run([&](ReplicaContext& ctx) {
    const std::vector<float> g = {2, -4};  // already summed, the same on every replica
    sgd.ApplyReducedGradients(ctx.local_replica_id(), {&w}, {g});
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(std::vector<float>(w.value(r).begin(), w.value(r).end()),
                                        (std::vector<float>{0, 3}));
}

TEST(OptimizerTest, RestoreSlotsSetsEveryCopy) {
  MirroredStrategy s({.num_replicas = 2});
  MirroredVariable& w = s.CreateVariable("w", {2}, Zeros());
  Adam adam(s, {.learning_rate = 0.1f});
  adam.RestoreSlots({{"w/m", {1, 2}}, {"w/v", {4, 9}}}, 7);
  EXPECT_EQ(adam.iterations(), 7);
  const auto slots = adam.SaveSlots();
  ASSERT_EQ(slots.size(), 2u);
  EXPECT_EQ(slots[1].value, (std::vector<float>{4, 9}));
  // The next update uses the restored state (t = 8) on both replicas alike.
  s.Run([&](ReplicaContext& ctx) {
    std::vector<float> g = {0, 0};
    adam.ApplyGradients(ctx, {&w}, {g});
  });
  EXPECT_EQ(adam.iterations(), 8);
  EXPECT_TRUE(BitEqual(w.value(0), w.value(1)));
  EXPECT_LT(w.value(0)[0], 0.0f);
  ExpectError(ErrorCode::kInvalidArgument, {"'w/x' is not a slot"},
              [&] { adam.RestoreSlots({{"w/x", {1, 2}}}, 1); });
  ExpectError(ErrorCode::kInvalidArgument, {"'w/m' has 3 values"},
              [&] { adam.RestoreSlots({{"w/m", {1, 2, 3}}, {"w/v", {1, 2}}}, 1); });
  ExpectError(ErrorCode::kInvalidArgument, {"not 'v'"}, [&] { adam.RestoreSlots({{"w/m", {1, 2}}}, 1); });
  EXPECT_EQ(adam.iterations(), 8);  // nothing changed by the failed restores
}

// Inside Run, replica 0's thread increments the count iterations() reads: the plain form is
// refused there, and each replica reads its own count with iterations(ctx), which is the same on
// every replica after the same updates, however late a replica is.
TEST(OptimizerTest, IterationsInsideRunIsEachReplicasOwnCount) {
  MirroredStrategy s({.num_replicas = 2});
  MirroredVariable& v = s.CreateVariable("v", {4}, Zeros());
  Sgd sgd(s, {.learning_rate = 0.1f});
  const PerReplica<std::pair<int64_t, int64_t>> seen = s.Run([&](ReplicaContext& ctx) {
    const int r = ctx.local_replica_id();
    const int64_t before = sgd.iterations(ctx);
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // replica 1 first
    const std::vector<float> g(4, 1.0f);
    sgd.ApplyReducedGradients(r, {&v}, {g});
    return std::make_pair(before, sgd.iterations(ctx));
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(seen[r], std::make_pair(int64_t{0}, int64_t{1})) << r;
  EXPECT_EQ(sgd.iterations(), 1);
  ExpectError(ErrorCode::kInvalidUsage, {"SGD.iterations() is a cross-replica call"}, [&] {
    s.Run([&](ReplicaContext& ctx) {
      if (ctx.local_replica_id() == 1) sgd.iterations();
    });
  });
  // A context of another strategy's replica is refused.
  MirroredStrategy other({.num_replicas = 1});
  ExpectError(ErrorCode::kInvalidArgument, {"SGD.iterations(ctx)", "not of a replica"},
              [&] { other.Run([&](ReplicaContext& ctx) { sgd.iterations(ctx); }); });
}

TEST(OptimizerTest, BadArguments) {
  MirroredStrategy s({.num_replicas = 2});
  MirroredVariable& w = s.CreateVariable("w", {2}, Zeros());
  DefaultStrategy other;
  MirroredVariable& foreign = other.CreateVariable("w", {2}, Zeros());
  Sgd sgd(s);
  ExpectError(ErrorCode::kInvalidArgument, {"replica 1", "gradient of 'w' has 3 elements"}, [&] {
    s.Run([&](ReplicaContext& ctx) {
      std::vector<float> g(ctx.local_replica_id() == 1 ? 3 : 2);
      sgd.ApplyReducedGradients(ctx.local_replica_id(), {&w}, {g});
    });
  });
  MirroredStrategy t({.num_replicas = 2});
  t.CreateVariable("w", {2}, Zeros());
  Sgd sgd_t(t);
  ExpectError(ErrorCode::kInvalidArgument, {"not a variable of this optimizer's strategy"}, [&] {
    t.Run([&](ReplicaContext& ctx) {
      std::vector<float> g(2);
      sgd_t.ApplyReducedGradients(ctx.local_replica_id(), {&foreign}, {g});
    });
  });
  ExpectError(ErrorCode::kInvalidArgument, {"momentum must be in [0, 1]"},
              [&] { Sgd bad(other, {.momentum = 1.5f}); });
  ExpectError(ErrorCode::kInvalidArgument, {"beta_1"},
              [&] { Adam bad(other, {.beta_1 = 1.0f}); });
}

}  // namespace
}  // namespace collectives::strategy
