// The demo's sidecar evaluator and the chief's side of it.
//
//   train --export-checkpoints DIR ...           the workers: the chief saves a checkpoint into
//                                                DIR at every epoch's end (and every
//                                                --export-every-steps steps) and names the last
//   train --evaluator --export-checkpoints DIR   the evaluator: evaluates each checkpoint of DIR
//         [--eval-log FILE] [--model M]          on the test set as it appears, prints a line and
//                                                logs a JSON line per checkpoint, and exits after
//                                                the final one
//
// The checkpoints stay (unlike --checkpoint-dir's backup, which is deleted when training ends).
// The evaluator is not part of the training collective: it only reads DIR. With TF_CONFIG its
// task type is "evaluator".
#ifndef COLLECTIVES_EXAMPLES_TRAIN_EVALUATOR_H_
#define COLLECTIVES_EXAMPLES_TRAIN_EVALUATOR_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "collectives/strategy.h"

namespace train {

struct EvaluatorOptions {
  std::string checkpoint_dir;  // where the chief exports
  std::string log_path;        // JSON lines; "" for none
  std::string model = "mlp";
  int replicas = 1;  // local replicas (MirroredStrategy) that share the test set
  std::string data_dir;
  size_t test_limit = 0;
  int64_t max_evaluations = 0;  // 0: until the final checkpoint
  double idle_timeout_s = 0;    // 0: wait for ever
};

// Runs the sidecar evaluator until the final checkpoint (exit status 0), the limit (0), or the
// idle timeout (1, saying so). Throws on errors.
int RunEvaluator(const EvaluatorOptions& options);

// The chief's side: every worker calls each method at the same point (SaveCheckpoint is
// collective); only the chief writes. Saves {epoch + 1, 0} at every epoch's end and {epoch,
// step + 1} every `every_steps` steps, into `directory`, and names the last checkpoint
// (MarkFinalCheckpoint) before saving it. The constructor removes an earlier training's mark.
class CheckpointExporter {
 public:
  CheckpointExporter(collectives::strategy::Strategy& strategy,
                     const collectives::strategy::Optimizer& optimizer, std::string directory,
                     int64_t epochs, int64_t every_steps);
  // After step `step` (0-based) of `steps_per_epoch`; the epoch's last step is left to
  // OnEpochEnd, which saves the same weights.
  void OnStepEnd(int64_t epoch, int64_t step, int64_t steps_per_epoch);
  void OnEpochEnd(int64_t epoch);
  // Saves and marks the final state when the last epoch's end did not (a training resumed
  // after its last epoch, or of 0 epochs).
  void OnTrainEnd();

 private:
  void Save(collectives::strategy::TrainingState state, bool final);
  collectives::strategy::Strategy& strategy_;
  const collectives::strategy::Optimizer& optimizer_;
  std::string directory_;
  int64_t epochs_;
  int64_t every_steps_;
  bool final_saved_ = false;
};

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_EVALUATOR_H_
