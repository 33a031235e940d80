// train: the training demo. Fashion-MNIST with an MLP (784-256-256-10, ReLU, logits; the default)
// or the Keras guide's convolutional network (--model cnn; model.h), Adam with a cosine-decaying
// learning rate, sparse categorical cross-entropy from logits, written as a custom training loop
// over the strategy layer, so that the same program runs on one device, on several local
// replicas, and on several workers:
//
//   train --strategy default
//   train --strategy mirrored --replicas 4 --cross-device hierarchical_copy
//   train --strategy central_storage --replicas 4
//   RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 train --strategy multi_worker &
//   RANK=1 WORLD_SIZE=2 MASTER_PORT=29500 train --strategy multi_worker
//   mpirun -np 2 train --strategy multi_worker --replicas 2
//   TF_CONFIG='{"cluster":{"worker":["h0:p","h1:p"]},"task":{"type":"worker","index":0}}' train ...
//   scripts/train.sh --strategy parameter_server --workers 2 --ps 2   (asynchronous: ps_train.h)
//
// One step, on every replica (Strategy::Run): gather the replica's share of the global batch
// (DistributedDataset), forward, per-example losses, backward of their sum scaled by 1 / global
// batch (what ComputeAverageLoss computes, so that gradients summed over replicas are those of
// the global batch's mean loss), then Adam::ApplyGradients, which sums the gradients over every
// replica of every worker and applies the same update to every copy.
//
// Output (the chief only; other workers print nothing but errors), as Keras prints it: per epoch
// a progress bar with the running loss and accuracy over every replica, the validation loss and
// accuracy on the test set at the epoch's end, the epoch's time and samples per second; at the
// end the test accuracy and the throughput. With --checkpoint-dir, Keras' BackupAndRestore:
// resume from the backup at the start, save at every epoch's end (and every
// --save-every-steps steps), delete it when training ends. With --export-checkpoints DIR the
// chief also saves into DIR, kept, for a sidecar evaluator: `train --evaluator
// --export-checkpoints DIR` (evaluator.h; scripts/train.sh --workers N --evaluator).
//
// Exit status: 0 on success; 1 on any error (the message names the worker); 2 on a bad command
// line.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <Eigen/Core>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/launch_help.h"
#include "bench/seconds_flag.h"
#include "collectives/collectives.h"
#include "collectives/strategy.h"
#include "examples/train/evaluator.h"
#include "examples/train/fashion_mnist.h"
#include "examples/train/gpu_mlp.h"
#include "examples/train/model.h"
#include "examples/train/ps_train.h"
#include "examples/train/scheduled_adam.h"

namespace {

namespace co = collectives;
namespace st = collectives::strategy;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string model = "mlp";
  std::string strategy = "default";
  int replicas = 0;
  std::string communication = "auto";
  std::string cross_device = "auto";
  // cpu: replicas are threads computing with Eigen; gpu: one replica per CUDA device (gpu_mlp.h).
  std::string device = "cpu";
  // The global batch is the same whatever the number of replicas, so that every strategy takes
  // the same steps (64: the batch at which both models reach their accuracy in 5 epochs);
  // --batch-per-replica B makes it B x replicas in sync instead.
  size_t global_batch = 64;
  size_t batch_per_replica = 0;
  int epochs = 5;
  float learning_rate = 1e-3f;
  std::string learning_rate_decay = "cosine";
  uint64_t seed = 42;
  std::string checkpoint_dir;
  int64_t save_every_steps = 0;
  size_t train_limit = 0;
  size_t test_limit = 0;
  size_t max_steps_per_epoch = 0;
  std::string data_dir = train::kDefaultDataDir;
  std::string save_weights;
  bool quiet_progress = false;
  double timeout_s = 300;
  int throttle_ms = 0;
  // Sidecar evaluation (evaluator.h).
  std::string export_dir;
  int64_t export_every_steps = 0;
  bool evaluator = false;
  std::string eval_log;
  int64_t eval_max = 0;
  double eval_idle_timeout_s = 0;
};

// A CLI11 check for a count option (a size_t): digits only. CLI11 converts "-1" to a size_t as
// 2^64 - 1, which ran on to "cannot create std::vector larger than max_size()" for a global batch.
CLI::Validator Count() {
  return CLI::Validator(
      [](std::string& text) {
        const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
          return std::isdigit(static_cast<unsigned char>(c));
        });
        return digits ? std::string() : "'" + text + "' is not a count (0, 1, 2, ...)";
      },
      "COUNT");
}

// A CLI11 check for a learning rate: a finite number >= 0 (0 leaves the weights as they are).
// Without it "nan", "-1" and "1e39" (infinity as a float) trained on to NaN weights or away from
// the minimum without an error.
CLI::Validator FiniteNonNegative() {
  return CLI::Validator(
      [](std::string& text) {
        const std::optional<double> value = co::bench::WholeNumber(text);
        return value && *value >= 0 && *value <= std::numeric_limits<float>::max()
                   ? std::string()  // false for NaN
                   : "'" + text + "' is not a finite number >= 0";
      },
      "NUMBER >= 0");
}

// A CLI11 check for --timeout, the benchmarks' (seconds_flag.h).
CLI::Validator TimeoutSeconds() {
  return CLI::Validator([](std::string& text) { return co::bench::CheckTimeoutSeconds(text); },
                        "SECONDS");
}

// "worker 1" in error messages: this process's rank as soon as it is known.
std::string g_worker = "worker 0";

// Only the chief prints; every other worker is silent but for errors.
bool g_chief = true;
__attribute__((format(printf, 1, 2))) void Say(const char* format, ...) {
  if (!g_chief) return;
  va_list args;
  va_start(args, format);
  std::vprintf(format, args);
  va_end(args);
  std::fflush(stdout);
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// --device gpu: `replicas` CUDA devices (0: every visible one), starting at `first` and wrapping
// around the visible ones (workers of one host share them).
std::vector<co::Device> GpuDevices(int replicas, int first) {
  const std::vector<co::Device> visible = st::ParseDevices("gpu");  // kNotSupported without CUDA
  const int count = static_cast<int>(visible.size());
  if (replicas > count) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    "--device gpu --replicas " + std::to_string(replicas) + ": only " +
                        std::to_string(count) + " CUDA devices are visible");
  }
  std::vector<co::Device> out;
  for (int i = 0; i < (replicas == 0 ? count : replicas); ++i) {
    out.push_back(visible[static_cast<size_t>((first + i) % count)]);
  }
  return out;
}

std::unique_ptr<st::Strategy> MakeStrategy(const Options& o) {
  const auto timeout = co::bench::TimeoutFromSeconds(o.timeout_s);  // at most a year
  const st::CrossDeviceOps cross_device = st::ParseCrossDeviceOps(o.cross_device);
  const bool gpu = o.device == "gpu";
  if (gpu && o.strategy != "mirrored" && o.strategy != "multi_worker") {
    throw co::Error(co::ErrorCode::kNotSupported,
                    "--device gpu needs --strategy mirrored or multi_worker (GPU replicas); " +
                        o.strategy + " runs on the CPU");
  }
  if ((o.strategy == "default" || o.strategy == "one_device") && o.replicas > 1) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    "--replicas " + std::to_string(o.replicas) + " needs --strategy mirrored, " +
                        "central_storage or multi_worker (" + o.strategy + " has one replica)");
  }
  if (o.strategy == "default") return std::make_unique<st::DefaultStrategy>();
  if (o.strategy == "one_device") return std::make_unique<st::OneDeviceStrategy>();
  if (o.strategy == "mirrored") {
    st::MirroredOptions options;
    options.num_replicas = o.replicas;
    if (gpu) options.devices = GpuDevices(o.replicas, 0);
    options.cross_device_ops = cross_device;
    options.timeout = timeout;
    return std::make_unique<st::MirroredStrategy>(options);
  }
  if (o.strategy == "central_storage") {
    if (cross_device != st::CrossDeviceOps::kAuto) {
      throw co::Error(co::ErrorCode::kInvalidArgument,
                      "--cross-device " + o.cross_device +
                          " does not apply to central_storage: it sums onto replica 0");
    }
    st::CentralStorageOptions options;
    options.num_replicas = o.replicas;
    options.timeout = timeout;
    return std::make_unique<st::CentralStorageStrategy>(options);
  }
  // multi_worker: the cluster from TF_CONFIG, RANK/WORLD_SIZE/MASTER_*, or mpirun's variables.
  const co::ClusterSpec cluster = co::ClusterSpec::FromEnvironment();
  g_worker = "worker " + std::to_string(cluster.rank);
  st::MultiWorkerOptions options;
  options.cluster = cluster;
  options.num_local_replicas = std::max(1, o.replicas);
  if (gpu) {
    const int per_worker = std::max(1, o.replicas);
    options.local_devices = GpuDevices(per_worker, cluster.rank * per_worker);
  }
  options.cross_device_ops = cross_device;
  options.communication.implementation = co::ParseImplementation(o.communication);
  options.communication.timeout = timeout;
  return std::make_unique<st::MultiWorkerMirroredStrategy>(std::move(options));
}

// Running sums of one replica over the steps of an epoch.
struct Totals {
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
};

// What one local replica owns: scratch for forward and backward (host memory, or buffers on its
// CUDA device), and its running sums.
struct Replica {
  Replica(const train::Model& model, size_t max_batch, const co::Device& device)
      : weights(model.num_parameters()), device_weights(model.num_parameters()) {
    if (device.kind == co::Device::Kind::kCuda) {
      gpu =
          std::make_unique<train::GpuMlp>(train::GpuMlp::WidthsOf(model), device.index, max_batch);
    } else {
      workspace = model.MakeWorkspace(max_batch);
    }
  }
  std::unique_ptr<train::Workspace> workspace;  // CPU replicas
  std::unique_ptr<train::GpuMlp> gpu;           // GPU replicas
  std::vector<std::span<const float>> weights;
  std::vector<const float*> device_weights;
  Totals totals;
  float* x() { return gpu ? gpu->x() : workspace->x(); }
  int32_t* labels() { return gpu ? gpu->labels() : workspace->labels(); }
  size_t max_batch() const { return gpu ? gpu->max_batch() : workspace->max_batch(); }
  train::BatchStats Forward(size_t n) {
    return gpu ? gpu->Forward(device_weights, n) : workspace->Forward(weights, n);
  }
};

// Points `replica.weights` at its copy of every variable (cheap; done per step so that nothing
// depends on a copy's storage never moving): host spans, or device pointers on a GPU replica.
void BindParams(Replica& replica, const std::vector<st::MirroredVariable*>& vars, int local) {
  for (size_t p = 0; p < vars.size(); ++p) {
    if (replica.gpu) {
      replica.device_weights[p] = static_cast<const float*>(vars[p]->tensor(local).data);
    } else {
      replica.weights[p] = vars[p]->value(local);
    }
  }
}

// Sums of loss, correct and count over every replica of every worker. Collective.
Totals ReduceTotals(st::Strategy& strategy, const st::PerReplica<Totals>& totals) {
  st::PerReplica<double> loss, correct, count;
  for (const Totals& t : totals) {
    loss.push_back(t.loss_sum);
    correct.push_back(t.correct);
    count.push_back(t.count);
  }
  return {strategy.Reduce(co::ReduceOp::kSum, loss), strategy.Reduce(co::ReduceOp::kSum, correct),
          strategy.Reduce(co::ReduceOp::kSum, count)};
}

// Loss and accuracy of the model on `data`: every worker takes a contiguous shard, splits it over
// its local replicas, each evaluates its part with its own copy of the weights (all copies are
// equal). Collective.
Totals Evaluate(st::Strategy& strategy, std::vector<Replica>& replicas,
                const std::vector<st::MirroredVariable*>& vars, const train::ImageDataset& data) {
  const size_t workers = static_cast<size_t>(strategy.num_workers());
  const size_t worker = static_cast<size_t>(strategy.worker_index());
  const size_t begin = data.count * worker / workers;
  const size_t end = data.count * (worker + 1) / workers;
  const size_t locals = replicas.size();
  const st::PerReplica<Totals> totals = strategy.Run([&](st::ReplicaContext& ctx) {
    const auto local = static_cast<size_t>(ctx.local_replica_id());
    Replica& replica = replicas[local];
    BindParams(replica, vars, ctx.local_replica_id());
    Totals sums;
    const size_t first = begin + (end - begin) * local / locals;
    const size_t last = begin + (end - begin) * (local + 1) / locals;
    for (size_t i = first; i < last; i += replica.max_batch()) {
      const size_t n = std::min(replica.max_batch(), last - i);
      data.GatherRange(i, n, replica.x(), replica.labels());
      const train::BatchStats stats = replica.Forward(n);
      sums.loss_sum += stats.loss_sum;
      sums.correct += static_cast<double>(stats.correct);
      sums.count += static_cast<double>(stats.count);
    }
    return sums;
  });
  return ReduceTotals(strategy, totals);
}

// A 52-bit hash of this replica's copy of every variable: equal on every replica when the copies
// are bit-identical.
double WeightsHash(const std::vector<st::MirroredVariable*>& vars, int local) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const st::MirroredVariable* v : vars) {
    const std::vector<float> value = v->Read(local);  // a copy: the value may be device memory
    const auto bytes = std::as_bytes(std::span<const float>(value));
    for (std::byte b : bytes) h = (h ^ static_cast<uint8_t>(b)) * 1099511628211ull;
  }
  return static_cast<double>(h & ((uint64_t{1} << 52) - 1));
}

// Keras' progress bar: "117/235 [==============>...............] - ETA: 1s - loss: ... ". In
// place on a terminal; when stdout is not one, a line at every quarter of the epoch, so that logs
// stay short. Only the chief shows one. Under mpirun, lines too: Open MPI gives every rank a
// pseudo-terminal whatever mpirun's own output is, so isatty says yes even when that output goes
// to a file or a pipe, where the bar would pile up as one line of carriage returns.
class ProgressBar {
 public:
  ProgressBar(size_t total, bool enabled, bool quiet)
      : total_(total),
        enabled_(enabled),
        quiet_(quiet),
        tty_(::isatty(STDOUT_FILENO) == 1 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) {}

  // After step `done` (1-based) of the epoch, with the running metrics.
  void Update(size_t done, double elapsed_s, size_t steps_run, double loss, double accuracy) {
    if (!enabled_ || quiet_) return;
    const size_t quarter = done * 4 / total_;
    if (!tty_ && (quarter == last_quarter_ || done >= total_)) return;
    last_quarter_ = quarter;
    const double per_step = steps_run > 0 ? elapsed_s / static_cast<double>(steps_run) : 0.0;
    char line[256];
    std::snprintf(line, sizeof line, "%s - ETA: %.0fs - loss: %.4f - accuracy: %.4f",
                  Bar(done).c_str(), per_step * static_cast<double>(total_ - done), loss, accuracy);
    Print(line, /*final=*/false);
  }

  // The epoch's summary line.
  void Finish(size_t done, double elapsed_s, size_t steps_run, double loss, double accuracy,
              double val_loss, double val_accuracy, double samples_per_s) {
    if (!enabled_) return;
    const double ms_per_step =
        steps_run > 0 ? 1000.0 * elapsed_s / static_cast<double>(steps_run) : 0.0;
    char line[384];
    std::snprintf(line, sizeof line,
                  "%s - %.0fs %.0fms/step - loss: %.4f - accuracy: %.4f - val_loss: %.4f - "
                  "val_accuracy: %.4f - %.0f samples/s",
                  Bar(done).c_str(), elapsed_s, ms_per_step, loss, accuracy, val_loss, val_accuracy,
                  samples_per_s);
    Print(line, /*final=*/true);
  }

 private:
  std::string Bar(size_t done) const {
    constexpr size_t kWidth = 30;
    const size_t digits = std::to_string(total_).size();
    std::string s = std::to_string(done);
    s.insert(0, digits > s.size() ? digits - s.size() : 0, ' ');
    s += "/" + std::to_string(total_) + " [";
    const size_t filled = total_ > 0 ? kWidth * done / total_ : kWidth;
    if (filled >= kWidth) {
      s.append(kWidth, '=');
    } else {
      s.append(filled, '=');
      s += '>';
      s.append(kWidth - filled - 1, '.');
    }
    return s + "]";
  }

  void Print(const std::string& line, bool final) {
    if (tty_) {
      std::string padded = line;
      if (padded.size() < last_length_) padded.append(last_length_ - padded.size(), ' ');
      std::printf("\r%s%s", padded.c_str(), final ? "\n" : "");
      last_length_ = final ? 0 : line.size();
    } else {
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
  }

  size_t total_;
  bool enabled_;
  bool quiet_;
  bool tty_;
  size_t last_quarter_ = 0;
  size_t last_length_ = 0;
};

// Whether step `done` (1-based) of `total` reduces the running metrics: every ~2% of the epoch,
// at every quarter, and at the end. Depends only on (done, total), so every worker reduces at
// the same steps.
bool IsReportStep(size_t done, size_t total) {
  const size_t every = std::max<size_t>(1, total / 50);
  return done % every == 0 || done == total || done * 4 / total != (done - 1) * 4 / total;
}

// Raw little-endian floats of every variable (replica 0's copy), in creation order.
void SaveWeights(const std::string& path, const std::vector<st::MirroredVariable*>& vars) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (const st::MirroredVariable* v : vars) {
    const std::vector<float> value = v->Read(0);
    out.write(reinterpret_cast<const char*>(value.data()),
              static_cast<std::streamsize>(value.size() * sizeof(float)));
  }
  out.close();
  if (!out) throw std::runtime_error("cannot write weights to " + path);
}

std::string Describe(const st::Strategy& s) {
  char text[256];
  std::snprintf(text, sizeof text, "%s, %d replica%s in sync (%d local x %d worker%s)",
                s.name().c_str(), s.NumReplicasInSync(), s.NumReplicasInSync() == 1 ? "" : "s",
                s.num_local_replicas(), s.num_workers(), s.num_workers() == 1 ? "" : "s");
  std::string out = text;
  if (s.num_local_replicas() > 1) {
    out += std::string(", cross-device ops ") + st::ToString(s.cross_device_ops());
  }
  if (s.communication() != nullptr) {
    out += std::string(", communication ") + co::ToString(s.communication()->implementation());
  }
  return out;
}

int Train(const Options& o) {
  Eigen::setNbThreads(1);  // one core per replica; the strategy runs replicas in parallel
  std::unique_ptr<st::Strategy> strategy_owner = MakeStrategy(o);
  st::Strategy& strategy = *strategy_owner;
  g_worker = "worker " + std::to_string(strategy.worker_index());
  const bool chief = strategy.IsChief();
  g_chief = chief;

  const size_t replicas_in_sync = static_cast<size_t>(strategy.NumReplicasInSync());
  const train::ImageDataset train_set = train::LoadFashionMnist(o.data_dir, "train", o.train_limit);
  // At most every training example: a step takes no more, and each replica's scratch is sized
  // for its share of the global batch (--global-batch 4294967296 failed with std::bad_alloc).
  // Compared before the product, which a huge --batch-per-replica wrapped around.
  const bool per_replica = o.batch_per_replica > 0;
  if ((!per_replica && o.global_batch > train_set.count) ||
      (per_replica && o.batch_per_replica > train_set.count / replicas_in_sync)) {
    const std::string asked =
        !per_replica ? "--global-batch " + std::to_string(o.global_batch)
                     : "--batch-per-replica " + std::to_string(o.batch_per_replica) + " x " +
                           std::to_string(replicas_in_sync) + " replicas in sync";
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    asked + " is more than the " + std::to_string(train_set.count) +
                        " training examples (a step takes at most all of them)");
  }
  const size_t global_batch = per_replica ? o.batch_per_replica * replicas_in_sync : o.global_batch;
  if (global_batch == 0 || global_batch % replicas_in_sync != 0) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    "global batch " + std::to_string(global_batch) +
                        " is not a positive multiple of the " + std::to_string(replicas_in_sync) +
                        " replicas in sync");
  }

  const train::ImageDataset test_set = train::LoadFashionMnist(o.data_dir, "t10k", o.test_limit);
  Say("data: Fashion-MNIST from %s: %zu training, %zu test examples of %zux%zu\n",
      o.data_dir.c_str(), train_set.count, test_set.count, train_set.rows, train_set.cols);
  Say("strategy: %s\n", Describe(strategy).c_str());

  // The model's variables, "inside the scope": the chief initialises, every copy receives it.
  // Kernels Glorot-uniform from the seed, biases zero (Model::InitialValue).
  const std::unique_ptr<train::Model> model_owner = train::MakeModel(o.model);
  const train::Model& model = *model_owner;
  if (model.num_inputs() != train_set.features()) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    model.Describe() + " takes " + std::to_string(model.num_inputs()) +
                        " inputs, the data has " + std::to_string(train_set.features()));
  }
  std::vector<st::MirroredVariable*> vars;
  for (size_t p = 0; p < model.num_parameters(); ++p) {
    const uint64_t seed = o.seed;
    const st::Initializer init = [&model, p, seed](std::span<float> value) {
      model.InitialValue(p, seed, value);
    };
    vars.push_back(&strategy.CreateVariable(model.ParameterName(p), model.ParameterShape(p), init));
  }

  st::DistributedDataset data(strategy, train_set.count,
                              {.global_batch_size = global_batch,
                               .drop_remainder = false,
                               .shuffle = true,
                               .seed = o.seed});
  const size_t steps = o.max_steps_per_epoch > 0
                           ? std::min(o.max_steps_per_epoch, data.steps_per_epoch())
                           : data.steps_per_epoch();
  const auto decay_steps = static_cast<int64_t>(steps) * o.epochs;
  train::ScheduledAdam adam(
      strategy, {.learning_rate = o.learning_rate}, [&o, decay_steps](int64_t iterations) {
        return train::LearningRate(o.learning_rate_decay, o.learning_rate, decay_steps, iterations);
      });
  Say("model: %s, %zu parameters; Adam, learning rate %g%s; global batch %zu "
      "(%zu per replica), %zu steps per epoch\n",
      model.Describe().c_str(), model.TotalParameterCount(), static_cast<double>(o.learning_rate),
      o.learning_rate_decay == "cosine" ? " with cosine decay to 0 over the run" : "", global_batch,
      data.per_replica_batch_size(), steps);

  std::vector<Replica> replicas;
  replicas.reserve(static_cast<size_t>(strategy.num_local_replicas()));
  for (int r = 0; r < strategy.num_local_replicas(); ++r) {
    replicas.emplace_back(model, std::max<size_t>(data.per_replica_batch_size(), 256),
                          strategy.devices()[static_cast<size_t>(r)]);
  }

  std::optional<train::CheckpointExporter> exporter;
  if (!o.export_dir.empty()) {
    exporter.emplace(strategy, adam, o.export_dir, o.epochs, o.export_every_steps);
  }
  std::optional<st::BackupAndRestore> backup;
  st::TrainingState start;
  if (!o.checkpoint_dir.empty()) {
    backup.emplace(strategy, &adam, o.checkpoint_dir,
                   st::BackupAndRestore::Options{.save_every_steps = o.save_every_steps});
    start = backup->OnTrainBegin();
    if (start == st::TrainingState{}) {
      Say("checkpoint: none in %s; starting fresh\n", o.checkpoint_dir.c_str());
    } else {
      Say("restored from checkpoint: epoch %lld, step %lld (%s; optimizer iterations %lld)\n",
          static_cast<long long>(start.epoch + 1), static_cast<long long>(start.step),
          o.checkpoint_dir.c_str(), static_cast<long long>(adam.iterations()));
    }
    if (start.step >= static_cast<int64_t>(steps)) start = {start.epoch + 1, 0};
  }

  double train_seconds = 0;
  double train_samples = 0;
  for (int64_t epoch = start.epoch; epoch < o.epochs; ++epoch) {
    Say("Epoch %lld/%d\n", static_cast<long long>(epoch + 1), o.epochs);
    const size_t first_step = epoch == start.epoch ? static_cast<size_t>(start.step) : 0;
    for (Replica& r : replicas) r.totals = {};
    ProgressBar bar(steps, chief, o.quiet_progress);
    Totals running;
    double epoch_samples = 0;
    const Clock::time_point epoch_start = Clock::now();

    for (size_t step = first_step; step < steps; ++step) {
      const size_t step_batch = data.GlobalBatchSize(step);
      const float loss_scale = 1.0f / static_cast<float>(step_batch);
      strategy.Run([&](st::ReplicaContext& ctx) {
        const int local = ctx.local_replica_id();
        Replica& replica = replicas[static_cast<size_t>(local)];
        BindParams(replica, vars, local);
        const std::vector<size_t> batch = data.ReplicaBatch(epoch, step, local);
        train_set.Gather(batch, replica.x(), replica.labels());
        train::BatchStats stats;
        if (replica.gpu) {  // gradients in device memory, reduced there by NCCL
          stats = replica.gpu->Forward(replica.device_weights, batch.size());
          replica.gpu->Backward(replica.device_weights, batch.size(), loss_scale);
          adam.ApplyGradients(ctx, vars, replica.gpu->gradients());
        } else {
          train::Workspace& ws = *replica.workspace;
          stats = ws.LossAndGradients(replica.weights, batch.size(), loss_scale);
          adam.ApplyGradients(ctx, vars, ws.gradients());
        }
        replica.totals.loss_sum += stats.loss_sum;
        replica.totals.correct += static_cast<double>(stats.correct);
        replica.totals.count += static_cast<double>(stats.count);
      });
      epoch_samples += static_cast<double>(step_batch);
      if (o.throttle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.throttle_ms));
      if (backup) backup->OnStepEnd(epoch, static_cast<int64_t>(step));
      if (exporter) {
        exporter->OnStepEnd(epoch, static_cast<int64_t>(step), static_cast<int64_t>(steps));
      }
      if (IsReportStep(step + 1, steps)) {
        st::PerReplica<Totals> sums;
        for (const Replica& r : replicas) sums.push_back(r.totals);
        running = ReduceTotals(strategy, sums);
        const double n = std::max(running.count, 1.0);
        bar.Update(step + 1, Seconds(Clock::now() - epoch_start), step + 1 - first_step,
                   running.loss_sum / n, running.correct / n);
      }
    }
    const double epoch_seconds = Seconds(Clock::now() - epoch_start);
    train_seconds += epoch_seconds;
    train_samples += epoch_samples;

    const Totals val = Evaluate(strategy, replicas, vars, test_set);
    const double n = std::max(running.count, 1.0);
    const double vn = std::max(val.count, 1.0);
    bar.Finish(steps, epoch_seconds, steps - first_step, running.loss_sum / n, running.correct / n,
               val.loss_sum / vn, val.correct / vn,
               epoch_seconds > 0 ? epoch_samples / epoch_seconds : 0.0);
    if (backup) backup->OnEpochEnd(epoch);
    if (exporter) exporter->OnEpochEnd(epoch);
  }

  // Every copy on every replica of every worker must hold the same weights, bit for bit. Checked
  // before the backup is removed, so that a failure here leaves the last epoch's checkpoint.
  const st::PerReplica<double> hashes = strategy.Run(
      [&](st::ReplicaContext& ctx) { return WeightsHash(vars, ctx.local_replica_id()); });
  if (strategy.Reduce(co::ReduceOp::kMin, hashes) != strategy.Reduce(co::ReduceOp::kMax, hashes)) {
    throw co::Error(co::ErrorCode::kInternal, "the replicas' weights differ after training");
  }
  if (replicas_in_sync > 1) Say("weights: identical on all %zu replicas\n", replicas_in_sync);
  if (exporter) exporter->OnTrainEnd();
  if (backup) backup->OnTrainEnd();

  const Totals test = Evaluate(strategy, replicas, vars, test_set);
  const double tn = std::max(test.count, 1.0);
  Say("test loss: %.4f - test accuracy: %.4f (%.0f examples)\n", test.loss_sum / tn,
      test.correct / tn, test.count);
  if (train_seconds > 0) {
    Say("throughput: %.0f samples/s (strategy %s, %d replica%s x %d worker%s, global batch %zu, "
        "%.0f samples in %.2fs)\n",
        train_samples / train_seconds, strategy.name().c_str(), strategy.num_local_replicas(),
        strategy.num_local_replicas() == 1 ? "" : "s", strategy.num_workers(),
        strategy.num_workers() == 1 ? "" : "s", global_batch, train_samples, train_seconds);
  }
  if (chief && !o.save_weights.empty()) {
    SaveWeights(o.save_weights, vars);
    Say("weights: written to %s\n", o.save_weights.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A peer that dies must surface as an error from the library, never as a silent SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);

  Options o;
  CLI::App app{"Fashion-MNIST training demo over the collectives strategy layer"};
  app.add_option("--model", o.model, "mlp (784-256-256-10) or cnn (the guide's Conv2D network)")
      ->check(CLI::IsMember(train::ModelNames()))
      ->capture_default_str();
  app.add_option("--strategy", o.strategy,
                 "default, one_device, mirrored, central_storage, multi_worker, or "
                 "parameter_server (every task of a TF_CONFIG cluster with chief, worker and ps "
                 "tasks; ps_train.h)")
      ->check(CLI::IsMember({"default", "one_device", "mirrored", "central_storage", "multi_worker",
                             "multi_worker_mirrored", "parameter_server"}))
      ->capture_default_str();
  app.add_option("--replicas", o.replicas,
                 "local replicas (threads) of mirrored, central_storage and multi_worker; "
                 "0: the strategy's default")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu: replicas are threads; gpu: one replica per CUDA device (mirrored, "
                 "multi_worker; --model mlp; cuBLAS for the matrix products)")
      ->check(CLI::IsMember({"cpu", "gpu"}))
      ->capture_default_str();
  app.add_option("--communication", o.communication, "between workers: ring, nccl or auto")
      ->check(CLI::IsMember({"ring", "nccl", "auto"}))
      ->capture_default_str();
  app.add_option("--cross-device", o.cross_device,
                 "between local replicas: auto, reduction_to_one_device, hierarchical_copy, nccl")
      ->check(CLI::IsMember({"auto", "reduction_to_one_device", "hierarchical_copy", "nccl"}))
      ->capture_default_str();
  CLI::Option* global_batch =
      app.add_option("--global-batch", o.global_batch,
                     "examples per step over all replicas, whatever their number (a multiple of "
                     "the replicas in sync)")
          ->check(Count())
          ->capture_default_str();
  app.add_option("--batch-per-replica", o.batch_per_replica,
                 "instead of --global-batch: examples per replica per step; global batch = this x "
                 "replicas in sync")
      ->check(CLI::PositiveNumber)
      ->excludes(global_batch);
  app.add_option("--epochs", o.epochs, "epochs")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--learning-rate", o.learning_rate, "Adam's learning rate")
      ->check(FiniteNonNegative())
      ->capture_default_str();
  app.add_option("--learning-rate-decay", o.learning_rate_decay,
                 "cosine: the rate falls from --learning-rate to 0 over epochs x steps (Keras' "
                 "CosineDecay); none: constant")
      ->check(CLI::IsMember({"cosine", "none"}))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "initialisation and shuffle seed")->capture_default_str();
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "back up and restore here (resume at start, save every epoch)");
  app.add_option("--save-every-steps", o.save_every_steps,
                 "with --checkpoint-dir, also save every N steps")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--train-limit", o.train_limit, "use only the first N training examples")
      ->check(Count());
  app.add_option("--test-limit", o.test_limit, "use only the first N test examples")
      ->check(Count());
  app.add_option("--max-steps-per-epoch", o.max_steps_per_epoch, "stop each epoch after N steps")
      ->check(Count());
  app.add_option("--data-dir", o.data_dir, "folder of the IDX files")->capture_default_str();
  app.add_option("--save-weights", o.save_weights,
                 "the chief writes the final weights here (raw little-endian floats)");
  app.add_flag("--quiet-progress", o.quiet_progress, "print only the per-epoch summary lines");
  app.add_option("--timeout", o.timeout_s, "seconds a replica or worker waits for its peers")
      ->check(TimeoutSeconds())
      ->capture_default_str();
  app.add_option("--throttle-ms", o.throttle_ms,
                 "sleep this long after every step: slows a demonstration down so that a worker "
                 "can be killed mid-epoch (scripts/kill-restart.sh)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--export-checkpoints", o.export_dir,
                 "the chief saves a checkpoint here at every epoch's end and names the last one, "
                 "for a sidecar evaluator (kept after training)");
  app.add_option("--export-every-steps", o.export_every_steps,
                 "with --export-checkpoints, also save every N steps")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--evaluator", o.evaluator,
               "run the sidecar evaluator: evaluate each checkpoint of --export-checkpoints on "
               "the test set as it appears, until the final one");
  app.add_option("--eval-log", o.eval_log, "the evaluator's JSON-lines log (one record per checkpoint)");
  app.add_option("--eval-max", o.eval_max, "the evaluator stops after N evaluations (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-idle-timeout", o.eval_idle_timeout_s,
                 "the evaluator gives up (exit 1) after this many seconds without a new "
                 "checkpoint (0: never)")
      ->check(CLI::NonNegativeNumber);
  app.footer(
      "Replicas: --strategy mirrored --replicas R trains R replicas (threads) in this process;\n"
      "--strategy central_storage --replicas R the same with one copy of the weights, updated\n"
      "once per step.\n" +
      collectives::bench::LaunchHelp(
          "train --strategy multi_worker",
          "  scripts/train.sh --workers N ...   (N worker processes on this host)\n"));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is a ParseError too
  }
  if (o.strategy == "multi_worker_mirrored") o.strategy = "multi_worker";
  if (o.device == "gpu" && (o.strategy == "parameter_server" || o.evaluator)) {
    std::fprintf(stderr,
                 "train: --device gpu needs --strategy mirrored or multi_worker (GPU "
                 "replicas); the parameter servers and the evaluator run on the CPU\n");
    return 2;
  }
  // Every task of the cluster runs this; its role comes from TF_CONFIG (ps_train.h). A step is
  // one worker's batch: --batch-per-replica when given, else --global-batch. The parameter
  // servers' Adam follows --learning-rate-decay over the run's steps, as the replicas' does.
  if (o.strategy == "parameter_server") {
    return train::TrainParameterServer(
        {.model = o.model,
         .batch = o.batch_per_replica > 0 ? o.batch_per_replica : o.global_batch,
         .epochs = o.epochs,
         .learning_rate = o.learning_rate,
         .learning_rate_decay = o.learning_rate_decay,
         .seed = o.seed,
         .checkpoint_dir = o.checkpoint_dir,
         .save_every_steps = o.save_every_steps,
         .train_limit = o.train_limit,
         .test_limit = o.test_limit,
         .max_steps_per_epoch = o.max_steps_per_epoch,
         .data_dir = o.data_dir,
         .save_weights = o.save_weights,
         .quiet_progress = o.quiet_progress,
         .timeout_s = o.timeout_s,
         .throttle_ms = o.throttle_ms});
  }

  try {
    // TF_CONFIG's "evaluator" task is this program's sidecar evaluator, whatever the flags say.
    if (std::getenv("TF_CONFIG") != nullptr &&
        co::ClusterSpec::FromEnvironment().task_type == "evaluator") {
      o.evaluator = true;
    }
    if (o.evaluator) {
      g_worker = "evaluator";
      return train::RunEvaluator({.checkpoint_dir = o.export_dir,
                                  .log_path = o.eval_log,
                                  .model = o.model,
                                  .replicas = std::max(1, o.replicas),
                                  .data_dir = o.data_dir,
                                  .test_limit = o.test_limit,
                                  .max_evaluations = o.eval_max,
                                  .idle_timeout_s = o.eval_idle_timeout_s});
    }
    return Train(o);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train: %s: error: %s\n", g_worker.c_str(), e.what());
    return 1;
  }
}
