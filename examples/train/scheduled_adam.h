// An Adam whose learning rate follows a schedule, for the training demo (train.cc), and the
// demo's schedules. Header-only: the arithmetic is strategy::Adam's.
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

// Keras' Adam with a learning-rate schedule: strategy::Adam with
// AdamOptions::learning_rate_schedule, so a constant schedule gives the same weights bit for bit
// and its checkpoints are Adam's (name "Adam", slots "m" and "v"). The schedule is a function
// of the step count alone, so a run resumed from a checkpoint continues it where it stopped.
class ScheduledAdam final : public collectives::strategy::Adam {
 public:
  using Schedule = std::function<double(int64_t iterations)>;
  ScheduledAdam(collectives::strategy::Strategy& strategy,
                collectives::strategy::AdamOptions options, Schedule schedule)
      : Adam(strategy, WithSchedule(std::move(options), std::move(schedule))) {}

 private:
  static collectives::strategy::AdamOptions WithSchedule(
      collectives::strategy::AdamOptions options, Schedule schedule) {
    options.learning_rate_schedule = std::move(schedule);
    return options;
  }
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
