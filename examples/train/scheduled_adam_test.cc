// Tests of the demo's ScheduledAdam (scheduled_adam.h) on a OneDeviceStrategy: a constant
// schedule gives strategy::Adam's weights bit for bit, the schedule sees the iterations before
// each update, a rate of 0 leaves the weights alone; and the cosine schedule's values.
#include "examples/train/scheduled_adam.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace train {
namespace {

namespace st = collectives::strategy;

// Gradient number `step` of a 5-element variable: varied signs and sizes, no zeros.
std::vector<float> Gradient(int step) {
  std::vector<float> g(5);
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = std::sin(0.7f * static_cast<float>(step) + static_cast<float>(i)) + 0.05f;
  }
  return g;
}

// Runs `steps` updates of `optimizer` on `variable` with Gradient(0), Gradient(1), ...
void Train(st::Strategy& strategy, st::Optimizer& optimizer, st::MirroredVariable& variable,
           int steps) {
  for (int step = 0; step < steps; ++step) {
    strategy.Run([&](st::ReplicaContext& ctx) {
      std::vector<float> g = Gradient(step);
      optimizer.ApplyGradients(ctx, {&variable}, {std::span<float>(g)});
    });
  }
}

TEST(ScheduledAdamTest, AConstantScheduleIsAdamBitForBit) {
  constexpr float kRate = 1e-2f;
  st::OneDeviceStrategy plain_strategy, scheduled_strategy;
  st::MirroredVariable& plain = plain_strategy.CreateVariable("w", {5}, st::GlorotUniform(5, 1, 3));
  st::MirroredVariable& scheduled =
      scheduled_strategy.CreateVariable("w", {5}, st::GlorotUniform(5, 1, 3));
  const std::vector<float> initial(plain.value(0).begin(), plain.value(0).end());
  st::Adam adam(plain_strategy, {.learning_rate = kRate});
  ScheduledAdam scheduled_adam(scheduled_strategy, {.learning_rate = kRate},
                               [](int64_t) { return static_cast<double>(kRate); });
  EXPECT_EQ(scheduled_adam.name(), "Adam");
  EXPECT_EQ(scheduled_adam.slot_names(), adam.slot_names());
  Train(plain_strategy, adam, plain, 20);
  Train(scheduled_strategy, scheduled_adam, scheduled, 20);
  const std::vector<float> a(plain.value(0).begin(), plain.value(0).end());
  const std::vector<float> b(scheduled.value(0).begin(), scheduled.value(0).end());
  EXPECT_NE(a, initial);
  EXPECT_EQ(a, b);
  EXPECT_EQ(scheduled_adam.iterations(), 20);
}

// The schedule is asked for the rate at iterations 0, 1, 2, ... (Keras evaluates a
// LearningRateSchedule at optimizer.iterations before the update); a rate of 0 from iteration 5
// on freezes the weights there.
TEST(ScheduledAdamTest, TheScheduleSeesTheIterationsAndItsRateIsApplied) {
  st::OneDeviceStrategy strategy;
  st::MirroredVariable& w = strategy.CreateVariable("w", {5}, st::GlorotUniform(5, 1, 4));
  std::vector<int64_t> seen;
  ScheduledAdam adam(strategy, {}, [&seen](int64_t iterations) {
    seen.push_back(iterations);
    return iterations < 5 ? 1e-2 : 0.0;
  });
  Train(strategy, adam, w, 5);
  const std::vector<float> after_five(w.value(0).begin(), w.value(0).end());
  Train(strategy, adam, w, 3);
  EXPECT_EQ(std::vector<float>(w.value(0).begin(), w.value(0).end()), after_five);
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(ScheduledAdamTest, CosineDecayFallsFromTheRateToZero) {
  EXPECT_DOUBLE_EQ(LearningRate("cosine", 1e-3, 100, 0), 1e-3);
  EXPECT_NEAR(LearningRate("cosine", 1e-3, 100, 50), 5e-4, 1e-15);
  EXPECT_NEAR(LearningRate("cosine", 1e-3, 100, 25), 1e-3 * (1 + std::sqrt(0.5)) / 2, 1e-15);
  EXPECT_NEAR(LearningRate("cosine", 1e-3, 100, 100), 0.0, 1e-15);
  EXPECT_NEAR(LearningRate("cosine", 1e-3, 100, 150), 0.0, 1e-15);  // stays at the end
  EXPECT_DOUBLE_EQ(LearningRate("none", 1e-3, 100, 50), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRate("cosine", 1e-3, 0, 7), 1e-3);  // --epochs 0: nothing to decay
}

}  // namespace
}  // namespace train
