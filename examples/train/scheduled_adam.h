// An Adam whose learning rate follows a schedule, for the training demo (train.cc). Header-only:
// it is the demo's, not the strategy layer's, and needs the layer's Optimizer base only.
//
// Thread-safety: as collectives::strategy::Optimizer (ApplyGradients from every replica's thread;
// the schedule is called from each of them and must be a pure function).
#ifndef COLLECTIVES_EXAMPLES_TRAIN_SCHEDULED_ADAM_H_
#define COLLECTIVES_EXAMPLES_TRAIN_SCHEDULED_ADAM_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>

#include "collectives/strategy.h"

namespace train {

// Keras' Adam with a learning-rate schedule: the update of strategy::Adam (the same arithmetic,
// so a constant schedule gives the same weights bit for bit) with the learning rate
// schedule(iterations before this update), as Keras evaluates a LearningRateSchedule. Named
// "Adam" with slots "m" and "v", so that its checkpoints are Adam's; the schedule is a function
// of the step count alone, so a run resumed from a checkpoint continues it where it stopped.
class ScheduledAdam final : public collectives::strategy::Optimizer {
 public:
  using Schedule = std::function<double(int64_t iterations)>;
  ScheduledAdam(collectives::strategy::Strategy& strategy,
                collectives::strategy::AdamOptions options, Schedule schedule)
      : Optimizer(strategy, "Adam", {"m", "v"}),
        options_(options),
        schedule_(std::move(schedule)) {}

 private:
  void Update(std::span<float> variable, std::span<const float> gradient,
              std::span<std::span<float>> slots, int64_t step) override {
    const double t = static_cast<double>(step);
    const float lr_t = static_cast<float>(
        schedule_(step - 1) * std::sqrt(1.0 - std::pow(static_cast<double>(options_.beta_2), t)) /
        (1.0 - std::pow(static_cast<double>(options_.beta_1), t)));
    const float b1 = options_.beta_1;
    const float b2 = options_.beta_2;
    const float one_minus_b1 = 1.0f - b1;
    const float one_minus_b2 = 1.0f - b2;
    const float eps = options_.epsilon;
    const size_t n = variable.size();
    float* __restrict w = variable.data();
    const float* __restrict g = gradient.data();
    float* __restrict m = slots[0].data();
    float* __restrict v = slots[1].data();
    for (size_t i = 0; i < n; ++i) {
      m[i] = b1 * m[i] + one_minus_b1 * g[i];
      v[i] = b2 * v[i] + one_minus_b2 * g[i] * g[i];
      w[i] -= lr_t * m[i] / (std::sqrt(v[i]) + eps);
    }
  }

  collectives::strategy::AdamOptions options_;
  Schedule schedule_;
};

// The learning rate after `iterations` updates: constant ("none"), or Keras' CosineDecay from
// `rate` to 0 over `decay_steps` updates ("cosine"), which ends a run at a small step size.
inline double LearningRate(const std::string& decay, double rate, int64_t decay_steps,
                           int64_t iterations) {
  if (decay == "none" || decay_steps <= 0) return rate;
  const double progress =
      static_cast<double>(std::min(iterations, decay_steps)) / static_cast<double>(decay_steps);
  return rate * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_SCHEDULED_ADAM_H_
