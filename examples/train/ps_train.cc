// The training demo's ParameterServerStrategy mode: see ps_train.h.
//
// Every task registers the same two functions, by name, before it does anything else (the C++
// form of tf.function dispatch: a closure cannot travel, a name and serialised arguments can):
//
//   "train"       the per-worker dataset: loads the training set, makes the model's workspace.
//                 Its arguments (key=value lines) come from the coordinator: data folder, limit,
//                 batch, seed, model.
//   "train_step"  one step on one batch: arguments "EPOCH STEP"; reads every variable from the
//                 parameter servers, computes the gradient of the batch's mean loss, pushes it
//                 (the parameter servers apply Adam), returns "LOSS_SUM CORRECT COUNT".
//
// The batch of (epoch, step) is a function of those two numbers and the seed: the examples in
// an order shuffled from (seed, epoch), cut into batches. So a step that is run again on another
// worker, because its first worker died, trains on the same examples, and a training of E epochs
// sees every example E times, whichever workers run the steps.
//
// The coordinator schedules the steps of an epoch (or of each --save-every-steps slice of it),
// fetches their results in order for the progress line, joins, then evaluates the current
// variables on the test set itself and saves a checkpoint. Training is asynchronous: a worker
// reads whatever the parameter servers hold when its step starts.
#include "examples/train/ps_train.h"

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "collectives/parameter_server.h"
#include "examples/train/fashion_mnist.h"
#include "examples/train/model.h"

namespace train {
namespace {

namespace co = collectives;
namespace st = collectives::strategy;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::chrono::milliseconds Milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// ---- What travels: the functions' arguments and results, as text -------------------------------

std::string EncodeStep(int64_t epoch, size_t step) {
  return std::to_string(epoch) + " " + std::to_string(step);
}

std::pair<int64_t, size_t> DecodeStep(const std::string& args) {
  std::istringstream in(args);
  int64_t epoch = -1;
  size_t step = 0;
  if (!(in >> epoch >> step) || epoch < 0) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    "train_step: arguments '" + args + "' are not 'EPOCH STEP'");
  }
  return {epoch, step};
}

std::string EncodeStats(const BatchStats& stats) {
  char text[96];
  std::snprintf(text, sizeof text, "%.17g %zu %zu", stats.loss_sum, stats.correct, stats.count);
  return text;
}

BatchStats DecodeStats(const std::string& result) {
  std::istringstream in(result);
  BatchStats stats;
  if (!(in >> stats.loss_sum >> stats.correct >> stats.count)) {
    throw co::Error(co::ErrorCode::kInternal,
                    "train_step: result '" + result + "' is not 'LOSS_SUM CORRECT COUNT'");
  }
  return stats;
}

// The per-worker dataset's arguments: what the coordinator decides about the data.
struct DataArgs {
  std::string data_dir;
  size_t train_limit = 0;
  size_t batch = 0;
  uint64_t seed = 0;
  std::string model;
};

std::string EncodeDataArgs(const DataArgs& a) {
  return "data_dir=" + a.data_dir + "\ntrain_limit=" + std::to_string(a.train_limit) +
         "\nbatch=" + std::to_string(a.batch) + "\nseed=" + std::to_string(a.seed) +
         "\nmodel=" + a.model + "\n";
}

DataArgs DecodeDataArgs(const std::string& text) {
  std::map<std::string, std::string> fields;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) fields[line.substr(0, eq)] = line.substr(eq + 1);
  }
  for (const char* key : {"data_dir", "train_limit", "batch", "seed", "model"}) {
    if (fields.count(key) == 0) {
      throw co::Error(co::ErrorCode::kInvalidArgument,
                      std::string("dataset 'train': the arguments lack ") + key);
    }
  }
  DataArgs a;
  a.data_dir = fields["data_dir"];
  a.train_limit = std::stoull(fields["train_limit"]);
  a.batch = std::stoull(fields["batch"]);
  a.seed = std::stoull(fields["seed"]);
  a.model = fields["model"];
  return a;
}

// ---- The data order -----------------------------------------------------------------------------

// Every example index once, in the order of epoch `epoch`: Fisher-Yates from
// std::mt19937_64(seed + epoch), written out so that every task computes the same order whatever
// its standard library's std::shuffle does.
std::vector<size_t> EpochOrder(size_t count, uint64_t seed, int64_t epoch) {
  std::vector<size_t> order(count);
  for (size_t i = 0; i < count; ++i) order[i] = i;
  std::mt19937_64 rng(seed + static_cast<uint64_t>(epoch));
  for (size_t i = count; i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
  return order;
}

size_t StepsPerEpoch(size_t count, size_t batch) { return (count + batch - 1) / batch; }

// ---- The worker's side --------------------------------------------------------------------------

// The per-worker dataset: this worker's copy of the training set and its scratch space. Steps on
// one worker run one at a time, so one workspace serves them all.
struct WorkerData {
  DataArgs args;
  ImageDataset train_set;
  std::unique_ptr<Model> model;
  std::unique_ptr<Workspace> workspace;
  std::vector<std::string> names;  // the variables, in the model's order
  int64_t order_epoch = -1;
  std::vector<size_t> order;

  // The examples of step `step` of epoch `epoch`; empty past the epoch's end.
  std::vector<size_t> Batch(int64_t epoch, size_t step) {
    if (epoch != order_epoch) {
      order = EpochOrder(train_set.count, args.seed, epoch);
      order_epoch = epoch;
    }
    const size_t begin = std::min(train_set.count, step * args.batch);
    const size_t end = std::min(train_set.count, begin + args.batch);
    return {order.begin() + static_cast<std::ptrdiff_t>(begin),
            order.begin() + static_cast<std::ptrdiff_t>(end)};
  }
};

int g_throttle_ms = 0;

std::shared_ptr<void> MakeWorkerData(st::WorkerContext& ctx, const std::string& text) {
  auto data = std::make_shared<WorkerData>();
  data->args = DecodeDataArgs(text);
  data->train_set = LoadFashionMnist(data->args.data_dir, "train", data->args.train_limit);
  data->model = MakeModel(data->args.model);
  data->workspace = data->model->MakeWorkspace(data->args.batch);
  for (size_t p = 0; p < data->model->num_parameters(); ++p) {
    data->names.push_back(data->model->ParameterName(p));
  }
  // The coordinator's variables must be this model's: a worker built from other sources fails
  // here, by name, instead of computing garbage.
  const std::vector<st::PsVariable>& vars = ctx.variables();
  for (size_t p = 0; p < data->names.size(); ++p) {
    const auto it = std::find_if(vars.begin(), vars.end(),
                                 [&](const st::PsVariable& v) { return v.name == data->names[p]; });
    if (it == vars.end() || it->count != data->model->ParameterCount(p)) {
      throw co::Error(co::ErrorCode::kMismatch,
                      "worker " + std::to_string(ctx.worker_index()) + ": model " +
                          data->args.model + " has " + data->names[p] + " of " +
                          std::to_string(data->model->ParameterCount(p)) +
                          " floats; the coordinator's variables do not");
    }
  }
  return data;
}

std::string TrainStep(st::WorkerContext& ctx, const std::string& args) {
  WorkerData& data = ctx.PerWorker<WorkerData>("train");
  const auto [epoch, step] = DecodeStep(args);
  const std::vector<size_t> batch = data.Batch(epoch, step);
  if (batch.empty()) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    "train_step: step " + std::to_string(step) + " is past the end of epoch " +
                        std::to_string(epoch + 1));
  }
  Workspace& ws = *data.workspace;
  data.train_set.Gather(batch, ws.x(), ws.labels());
  const std::vector<std::vector<float>> values = ctx.Read(data.names);
  const std::vector<std::span<const float>> weights = WeightsOf(values);
  // The gradient of this batch's mean loss: the batch is the whole of this update.
  const BatchStats stats =
      ws.LossAndGradients(weights, batch.size(), 1.0f / static_cast<float>(batch.size()));
  std::vector<std::pair<std::string, std::span<const float>>> gradients;
  for (size_t p = 0; p < data.names.size(); ++p) {
    gradients.emplace_back(data.names[p], ws.gradients()[p]);
  }
  ctx.PushGradients(gradients);
  if (g_throttle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(g_throttle_ms));
  return EncodeStats(stats);
}

void RegisterFunctions() {
  st::RegisterDatasetFunction("train", MakeWorkerData);
  st::RegisterFunction("train_step", TrainStep);
}

// ---- The coordinator's side ---------------------------------------------------------------------

// Running sums of a stretch of steps.
struct Totals {
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
  void Add(const BatchStats& s) {
    loss_sum += s.loss_sum;
    correct += static_cast<double>(s.correct);
    count += static_cast<double>(s.count);
  }
  double loss() const { return loss_sum / std::max(count, 1.0); }
  double accuracy() const { return correct / std::max(count, 1.0); }
};

// The test set as the model takes it, gathered once.
struct TestSet {
  std::vector<float> x;
  std::vector<int32_t> y;
  size_t count = 0;
};

TestSet GatherTestSet(const ImageDataset& data) {
  TestSet t;
  t.count = data.count;
  t.x.resize(data.count * data.features());
  t.y.resize(data.count);
  data.GatherRange(0, data.count, t.x.data(), t.y.data());
  return t;
}

// Loss and accuracy of the variables as the parameter servers hold them now.
Totals Evaluate(st::ParameterServerStrategy& strategy, const Model& model, Workspace& ws,
                const TestSet& test) {
  std::vector<std::vector<float>> values;
  for (size_t p = 0; p < model.num_parameters(); ++p) {
    values.push_back(strategy.Read(model.ParameterName(p)));
  }
  const std::vector<std::span<const float>> weights = WeightsOf(values);
  Totals totals;
  totals.Add(ws.Evaluate(weights, test.x.data(), test.y.data(), test.count));
  return totals;
}

void SaveWeights(st::ParameterServerStrategy& strategy, const Model& model,
                 const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (size_t p = 0; p < model.num_parameters(); ++p) {
    const std::vector<float> value = strategy.Read(model.ParameterName(p));
    out.write(reinterpret_cast<const char*>(value.data()),
              static_cast<std::streamsize>(value.size() * sizeof(float)));
  }
  out.close();
  if (!out) throw std::runtime_error("cannot write weights to " + path);
}

// "dense/kernel 4 shards (ps 0, 1, 0, 1), dense/bias on ps 0, ..."
std::string DescribePlacement(const std::vector<st::PsVariable>& vars) {
  std::string out;
  for (const st::PsVariable& v : vars) {
    if (!out.empty()) out += ", ";
    out += v.name;
    if (v.shards.size() == 1) {
      out += " on ps " + std::to_string(v.shards[0].ps_index);
      continue;
    }
    out += " in " + std::to_string(v.shards.size()) + " shards (ps";
    for (size_t s = 0; s < v.shards.size(); ++s) {
      out += (s == 0 ? " " : ", ") + std::to_string(v.shards[s].ps_index);
    }
    out += ")";
  }
  return out;
}

void Say(const char* format, ...) __attribute__((format(printf, 1, 2)));
void Say(const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vprintf(format, args);
  va_end(args);
  std::fflush(stdout);
}

// Whether step `done` (1-based) of `total` prints a progress line: every quarter of the epoch.
bool IsReportStep(size_t done, size_t total) {
  return done == total || done * 4 / total != (done - 1) * 4 / total;
}

int RunCoordinator(const ParameterServerTrainOptions& o, st::ParameterServerOptions ps_options) {
  // The coordinator reads the training set for its size and shape only; the workers train on it.
  const ImageDataset train_set = LoadFashionMnist(o.data_dir, "train", o.train_limit);
  if (o.batch == 0 || o.batch > train_set.count) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    "--global-batch " + std::to_string(o.batch) + " is not between 1 and the " +
                        std::to_string(train_set.count) + " training examples");
  }
  const ImageDataset test_data = LoadFashionMnist(o.data_dir, "t10k", o.test_limit);
  const TestSet test = GatherTestSet(test_data);
  const std::unique_ptr<Model> model = MakeModel(o.model);
  const std::unique_ptr<Workspace> eval_ws = model->MakeWorkspace(256);
  const size_t steps = o.max_steps_per_epoch > 0
                           ? std::min(o.max_steps_per_epoch, StepsPerEpoch(train_set.count, o.batch))
                           : StepsPerEpoch(train_set.count, o.batch);
  Say("data: Fashion-MNIST from %s: %zu training, %zu test examples of %zux%zu\n",
      o.data_dir.c_str(), train_set.count, test.count, train_set.rows, train_set.cols);

  ps_options.partitioner = st::Partitioner::MaxShardBytes(o.max_shard_bytes);
  // Every step pushes every variable, so a shard's update count is the run's step count and the
  // cosine reaches 0 at the run's last step, as the synchronous demo's does (a step run again
  // after its worker was lost pushes twice and moves the curve one update on).
  const auto decay_steps = static_cast<int64_t>(steps) * o.epochs;
  ps_options.optimizer = st::PsOptimizer::Adam(
      {.learning_rate = o.learning_rate},
      o.learning_rate_decay == "cosine" && decay_steps > 0
          ? st::PsLearningRateSchedule::CosineDecay(decay_steps)
          : st::PsLearningRateSchedule::Constant());
  st::ParameterServerStrategy strategy(ps_options);
  Say("strategy: %s, %d worker%s, %d parameter server%s; variables over %zu bytes in shards\n",
      strategy.name().c_str(), strategy.num_workers(), strategy.num_workers() == 1 ? "" : "s",
      strategy.num_ps(), strategy.num_ps() == 1 ? "" : "s", o.max_shard_bytes);

  // The variables, created here and placed on the parameter servers.
  for (size_t p = 0; p < model->num_parameters(); ++p) {
    const size_t p_index = p;
    strategy.CreateVariable(model->ParameterName(p), model->ParameterShape(p),
                            [&, p_index](std::span<float> value) {
                              model->InitialValue(p_index, o.seed, value);
                            });
  }
  Say("variables: %s\n", DescribePlacement(strategy.variables()).c_str());
  Say("model: %s, %zu parameters; Adam at the parameter servers, learning rate %g%s; %zu "
      "examples per step, %zu steps per epoch\n",
      model->Describe().c_str(), model->TotalParameterCount(),
      static_cast<double>(o.learning_rate),
      ps_options.optimizer.schedule.decay == "cosine" ? " with cosine decay to 0 over the run" : "",
      o.batch, steps);

  st::TrainingState start;
  if (!o.checkpoint_dir.empty()) {
    const std::optional<st::TrainingState> restored = strategy.RestoreCheckpoint(o.checkpoint_dir);
    if (!restored) {
      Say("checkpoint: none in %s; starting fresh\n", o.checkpoint_dir.c_str());
    } else {
      start = *restored;
      Say("restored from checkpoint: epoch %" PRId64 ", step %" PRId64
          " (%s; optimizer iterations %" PRId64 ")\n",
          start.epoch + 1, start.step, o.checkpoint_dir.c_str(), strategy.iterations());
    }
    if (start.step >= static_cast<int64_t>(steps)) start = {start.epoch + 1, 0};
  }

  st::ClusterCoordinator coordinator(strategy);
  coordinator.CreatePerWorkerDataset(
      "train", EncodeDataArgs({o.data_dir, o.train_limit, o.batch, o.seed, o.model}));

  double train_seconds = 0;
  double train_samples = 0;
  int64_t rescheduled = 0;
  for (int64_t epoch = start.epoch; epoch < o.epochs; ++epoch) {
    Say("Epoch %" PRId64 "/%d\n", epoch + 1, o.epochs);
    const size_t first_step = epoch == start.epoch ? static_cast<size_t>(start.step) : 0;
    Totals running;
    const Clock::time_point epoch_start = Clock::now();
    const size_t slice = o.save_every_steps > 0 ? static_cast<size_t>(o.save_every_steps) : steps;
    for (size_t begin = first_step; begin < steps;) {
      const size_t end = std::min(steps, begin + slice);
      std::vector<st::RemoteValue> results;
      results.reserve(end - begin);
      for (size_t step = begin; step < end; ++step) {
        results.push_back(coordinator.Schedule("train_step", EncodeStep(epoch, step)));
      }
      for (size_t i = 0; i < results.size(); ++i) {
        running.Add(DecodeStats(results[i].Fetch()));
        const size_t done = begin + i + 1;
        if (!o.quiet_progress && done < steps && IsReportStep(done, steps)) {
          Say("%5zu/%zu - %.1fs - loss: %.4f - accuracy: %.4f\n", done, steps,
              Seconds(Clock::now() - epoch_start), running.loss(), running.accuracy());
        }
      }
      coordinator.Join();
      begin = end;
      if (!o.checkpoint_dir.empty() && begin < steps) {
        strategy.SaveCheckpoint(o.checkpoint_dir, {epoch, static_cast<int64_t>(begin)});
      }
    }
    const double epoch_seconds = Seconds(Clock::now() - epoch_start);
    const double epoch_samples = running.count;
    train_seconds += epoch_seconds;
    train_samples += epoch_samples;
    const Totals val = Evaluate(strategy, *model, *eval_ws, test);
    Say("%5zu/%zu - %.1fs - loss: %.4f - accuracy: %.4f - val_loss: %.4f - val_accuracy: %.4f - "
        "%.0f samples/s\n",
        steps, steps, epoch_seconds, running.loss(), running.accuracy(), val.loss(),
        val.accuracy(), epoch_seconds > 0 ? epoch_samples / epoch_seconds : 0.0);
    if (coordinator.rescheduled_steps() != rescheduled) {
      rescheduled = coordinator.rescheduled_steps();
      Say("workers: %d of %d available; %" PRId64 " steps of lost workers run again elsewhere\n",
          coordinator.num_available_workers(), strategy.num_workers(), rescheduled);
    }
    if (!o.checkpoint_dir.empty()) strategy.SaveCheckpoint(o.checkpoint_dir, {epoch + 1, 0});
  }

  Say("workers: %d of %d available at the end; %" PRId64 " steps of lost workers run again "
      "elsewhere\n",
      coordinator.num_available_workers(), strategy.num_workers(),
      coordinator.rescheduled_steps());
  const Totals test_totals = Evaluate(strategy, *model, *eval_ws, test);
  Say("test loss: %.4f - test accuracy: %.4f (%.0f examples)\n", test_totals.loss(),
      test_totals.accuracy(), test_totals.count);
  if (train_seconds > 0) {
    Say("throughput: %.0f samples/s (strategy parameter_server, %d worker%s x %d ps, %zu examples "
        "per step, %.0f samples in %.2fs)\n",
        train_samples / train_seconds, strategy.num_workers(),
        strategy.num_workers() == 1 ? "" : "s", strategy.num_ps(), o.batch, train_samples,
        train_seconds);
  }
  if (!o.save_weights.empty()) {
    SaveWeights(strategy, *model, o.save_weights);
    Say("weights: written to %s\n", o.save_weights.c_str());
  }
  // As Keras' BackupAndRestore: a finished training leaves no backup to resume.
  if (!o.checkpoint_dir.empty()) std::filesystem::remove(o.checkpoint_dir + "/checkpoint");
  coordinator.StopServers();
  return 0;
}

}  // namespace

int TrainParameterServer(const ParameterServerTrainOptions& o) {
  std::string role = "coordinator";
  try {
    Eigen::setNbThreads(1);
    st::ParameterServerOptions ps_options;
    ps_options.cluster = co::ClusterSpec::FromEnvironment();
    const co::ClusterSpec& spec = *ps_options.cluster;
    if (spec.task_type != "chief") role = spec.task_type + " " + std::to_string(spec.task_index);
    st::CheckClusterLayout(spec, "parameter_server");
    ps_options.ps_addresses = spec.cluster.at("ps");
    ps_options.worker_addresses = spec.cluster.at("worker");
    ps_options.request_timeout = Milliseconds(o.timeout_s);
    ps_options.ps_timeout = Milliseconds(o.ps_timeout_s);
    // Every task registers the same functions, by name, before it serves or schedules.
    RegisterFunctions();
    g_throttle_ms = o.throttle_ms;
    if (spec.task_type == "worker" || spec.task_type == "ps") {
      st::RunServer(ps_options);
      return 0;
    }
    if (spec.task_type != "chief") {
      throw co::Error(co::ErrorCode::kInvalidArgument,
                      "TF_CONFIG task type '" + spec.task_type +
                          "': --strategy parameter_server runs a 'chief' (the coordinator), "
                          "'worker' and 'ps' tasks");
    }
    return RunCoordinator(o, std::move(ps_options));
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train: %s: error: %s\n", role.c_str(), e.what());
    return 1;
  }
}

}  // namespace train
