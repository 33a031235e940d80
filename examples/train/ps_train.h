// The training demo's ParameterServerStrategy mode (`train --strategy parameter_server`): one
// binary for every task of the cluster, each finding its role in TF_CONFIG:
//
//   "chief"   the coordinator: creates the model's variables on the parameter servers,
//             schedules one "train_step" per batch, evaluates on the test set at every epoch's
//             end, writes checkpoints, prints progress and samples per second;
//   "worker"  a server that runs the steps the coordinator schedules;
//   "ps"      a server that holds the variables and Adam's slots and applies the updates.
//
// scripts/train.sh --strategy parameter_server --workers N --ps M starts such a cluster on
// loopback. docs/strategy-parameter-server.md describes the strategy.
//
// Thread-safety: call TrainParameterServer from one thread, once per process.
#ifndef COLLECTIVES_EXAMPLES_TRAIN_PS_TRAIN_H_
#define COLLECTIVES_EXAMPLES_TRAIN_PS_TRAIN_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace train {

// The flags of `train` that this mode reads; the same on every task (the coordinator sends the
// workers what their datasets need, so only its flags decide the training).
struct ParameterServerTrainOptions {
  std::string model = "mlp";    // train::MakeModel's name
  size_t batch = 256;           // examples per scheduled step (one worker's batch)
  int epochs = 3;               // the training covers epochs x the training examples
  float learning_rate = 1e-3f;  // Adam's, applied by the parameter servers
  std::string learning_rate_decay = "cosine";  // "cosine": to 0 over epochs x steps; "none"
  uint64_t seed = 42;           // initial values and the shuffle of every epoch
  std::string checkpoint_dir;   // resume from it at start, save at every epoch's end
  int64_t save_every_steps = 0; // also save every N steps of an epoch
  size_t train_limit = 0;       // 0: every training example
  size_t test_limit = 0;        // 0: every test example
  size_t max_steps_per_epoch = 0;
  std::string data_dir;
  std::string save_weights;     // the coordinator writes the final weights here (raw floats)
  bool quiet_progress = false;
  double timeout_s = 30;        // a request to a server must be answered within this
  double ps_timeout_s = 5;      // a parameter server silent this long is lost (the coordinator fails)
  size_t max_shard_bytes = 256 * 1024;  // variables larger than this are cut into shards
  int throttle_ms = 0;          // a worker sleeps this long in every step (demonstrations)
};

// Runs this task's role (TF_CONFIG's task type) to the end: the coordinator trains and stops
// the servers; a worker or a parameter server serves until the coordinator stops it. Returns the
// process exit status; throws collectives::Error or std::exception on failure.
int TrainParameterServer(const ParameterServerTrainOptions& options);

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_PS_TRAIN_H_
