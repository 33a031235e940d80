// The demo's sidecar evaluator (see evaluator.h): a local strategy holds the model's variables,
// SidecarEvaluator assigns them from each new checkpoint, and every local replica evaluates its
// share of the test set with its copy, as the training's own evaluation does.
#include "examples/train/evaluator.h"

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "collectives/errors.h"
#include "collectives/evaluator.h"
#include "examples/train/fashion_mnist.h"
#include "examples/train/model.h"

namespace train {
namespace {

namespace co = collectives;
namespace st = collectives::strategy;

struct Sums {
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
};

}  // namespace

int RunEvaluator(const EvaluatorOptions& o) {
  Eigen::setNbThreads(1);  // one core per replica
  if (o.checkpoint_dir.empty()) {
    throw co::Error(co::ErrorCode::kInvalidArgument,
                    "the evaluator needs --export-checkpoints DIR: the directory the chief "
                    "exports checkpoints into");
  }
  const ImageDataset test_set = LoadFashionMnist(o.data_dir, "t10k", o.test_limit);
  const std::unique_ptr<Model> model = MakeModel(o.model);
  std::unique_ptr<st::Strategy> strategy;
  if (o.replicas > 1) {
    strategy =
        std::make_unique<st::MirroredStrategy>(st::MirroredOptions{.num_replicas = o.replicas});
  } else {
    strategy = std::make_unique<st::DefaultStrategy>();
  }
  std::vector<st::MirroredVariable*> vars;
  for (size_t p = 0; p < model->num_parameters(); ++p) {
    vars.push_back(&strategy->CreateVariable(model->ParameterName(p), model->ParameterShape(p),
                                             st::Zeros()));  // every value comes from a checkpoint
  }
  std::vector<std::unique_ptr<Workspace>> workspaces;
  for (int r = 0; r < strategy->num_local_replicas(); ++r) {
    workspaces.push_back(model->MakeWorkspace(256));
  }

  // Loss and accuracy on the test set with the assigned variables: replica r takes the r-th
  // contiguous slice.
  const auto evaluate = [&](const st::CheckpointData&) {
    const size_t locals = workspaces.size();
    const st::PerReplica<Sums> sums = strategy->Run([&](st::ReplicaContext& ctx) {
      const auto local = static_cast<size_t>(ctx.local_replica_id());
      std::vector<std::span<const float>> weights;
      for (const st::MirroredVariable* v : vars)
        weights.push_back(v->value(ctx.local_replica_id()));
      Workspace& ws = *workspaces[local];
      Sums s;
      const size_t first = test_set.count * local / locals;
      const size_t last = test_set.count * (local + 1) / locals;
      for (size_t i = first; i < last; i += ws.max_batch()) {
        const size_t n = std::min(ws.max_batch(), last - i);
        test_set.GatherRange(i, n, ws.x(), ws.labels());
        const BatchStats stats = ws.Forward(weights, n);
        s.loss_sum += stats.loss_sum;
        s.correct += static_cast<double>(stats.correct);
        s.count += static_cast<double>(stats.count);
      }
      return s;
    });
    Sums total;
    for (const Sums& s : sums) {
      total.loss_sum += s.loss_sum;
      total.correct += s.correct;
      total.count += s.count;
    }
    const double n = std::max(total.count, 1.0);
    return st::Metrics{{"loss", total.loss_sum / n}, {"accuracy", total.correct / n}};
  };

  st::SidecarEvaluatorOptions options;
  options.checkpoint_dir = o.checkpoint_dir;
  options.log_path = o.log_path;
  options.strategy = strategy.get();
  options.max_evaluations = o.max_evaluations;
  options.idle_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(std::min(o.idle_timeout_s, 1e9) * 1000.0));
  options.on_evaluation = [&test_set](const st::Evaluation& e) {
    // The state is where training resumes: {e, 0} follows epoch e's end (1-based), {e, s} is
    // step s of epoch e + 1.
    char when[96];
    if (e.state.step == 0) {
      std::snprintf(when, sizeof when, "after epoch %lld", static_cast<long long>(e.state.epoch));
    } else {
      std::snprintf(when, sizeof when, "epoch %lld, step %lld",
                    static_cast<long long>(e.state.epoch + 1),
                    static_cast<long long>(e.state.step));
    }
    std::printf(
        "evaluator: step %lld (%s%s) - loss: %.4f - accuracy: %.4f - %zu examples in "
        "%.2fs\n",
        static_cast<long long>(e.step), when, e.final ? ", final" : "", e.metrics[0].second,
        e.metrics[1].second, test_set.count, e.eval_seconds);
    std::fflush(stdout);
  };
  options.on_skipped = [](const std::string& message) {
    std::fprintf(stderr, "evaluator: skipped: %s\n", message.c_str());
  };
  std::printf("evaluator: watching %s for checkpoints; model %s; %zu test examples; %s%s\n",
              o.checkpoint_dir.c_str(), model->Describe().c_str(), test_set.count,
              o.log_path.empty() ? "no log" : "log ", o.log_path.empty() ? "" : o.log_path.c_str());
  std::fflush(stdout);
  st::SidecarEvaluator evaluator(evaluate, options);
  const st::EvaluatorStop stop = evaluator.Run();
  const size_t made = evaluator.evaluations().size();
  std::printf("evaluator: done: %s; %zu evaluation%s\n", st::ToString(stop), made,
              made == 1 ? "" : "s");
  std::fflush(stdout);
  return stop == st::EvaluatorStop::kIdleTimeout ? 1 : 0;
}

CheckpointExporter::CheckpointExporter(st::Strategy& strategy, const st::Optimizer& optimizer,
                                       std::string directory, int64_t epochs, int64_t every_steps)
    : strategy_(strategy),
      optimizer_(optimizer),
      directory_(std::move(directory)),
      epochs_(epochs),
      every_steps_(every_steps) {
  if (strategy_.IsChief()) {
    std::error_code ignored;  // none is the usual case
    std::filesystem::remove(std::filesystem::path(directory_) / "checkpoint.final", ignored);
  }
}

void CheckpointExporter::OnStepEnd(int64_t epoch, int64_t step, int64_t steps_per_epoch) {
  if (every_steps_ > 0 && (step + 1) % every_steps_ == 0 && step + 1 < steps_per_epoch) {
    Save({epoch, step + 1}, false);
  }
}

void CheckpointExporter::OnEpochEnd(int64_t epoch) { Save({epoch + 1, 0}, epoch + 1 >= epochs_); }

void CheckpointExporter::OnTrainEnd() {
  if (!final_saved_) Save({epochs_, 0}, true);
}

void CheckpointExporter::Save(st::TrainingState state, bool final) {
  // The mark first: the evaluator that loads this checkpoint then knows it is the last.
  if (final && strategy_.IsChief()) {
    st::MarkFinalCheckpoint(directory_, {state, optimizer_.iterations()});
  }
  st::SaveCheckpoint(strategy_, &optimizer_, directory_, state);
  final_saved_ = final_saved_ || final;
}

}  // namespace train
