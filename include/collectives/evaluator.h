// Sidecar evaluation (TF's tf.keras.utils.SidecarEvaluator): a process beside the training that
// watches the chief's checkpoint directory, evaluates every new checkpoint on its own data, and
// logs one record per checkpoint. It is not part of the training collective: it only reads
// files, so a slow or failed evaluator never holds the workers up.
//
//   // the evaluator task (TF_CONFIG task type "evaluator"):
//   DefaultStrategy strategy;                        // any local strategy
//   ... strategy.CreateVariable(...) for every variable of the model, as the training does
//   SidecarEvaluator evaluator(
//       [&](const CheckpointData& checkpoint) {      // the variables are assigned already
//         return Metrics{{"loss", ...}, {"accuracy", ...}};
//       },
//       {.checkpoint_dir = "export", .log_path = "evaluations.jsonl", .strategy = &strategy});
//   evaluator.Run();                                 // until the final checkpoint
//
//   // the chief, at every epoch's end:
//   if (epoch + 1 == epochs) MarkFinalCheckpoint("export", {{epoch + 1, 0}, adam.iterations()});
//   SaveCheckpoint(strategy, &adam, "export", {epoch + 1, 0});
//
// A checkpoint is evaluated only when it is complete: the chief renames a fully written and
// fsynced file into place, and the reader checks its size field and checksum; a partial or
// corrupt file (copied in by hand, damaged) is reported once and skipped, and the evaluator
// waits for the next. It keeps the latest checkpoint only: when the chief saves faster than the
// evaluator evaluates, intermediate checkpoints are not evaluated (as in TensorFlow).
//
// The log is JSON lines, one object per evaluated checkpoint, appended and flushed as each
// evaluation ends:
//   {"step":470,"epoch":1,"epoch_step":0,"final":false,
//    "metrics":{"loss":0.4512,"accuracy":0.839},"eval_seconds":0.81,"time":1796680000.12}
// step: the optimizer's iterations in the checkpoint (the global step); epoch and epoch_step:
// its TrainingState (where training resumes: after epoch e's end, {e + 1, 0}); final: the
// checkpoint MarkFinalCheckpoint names; time: Unix seconds when the record was written.
// scripts/plot-evaluations.py draws it.
#ifndef COLLECTIVES_EVALUATOR_H_
#define COLLECTIVES_EVALUATOR_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives/strategy.h"

namespace collectives::strategy {

// Names the checkpoint that ends the training: writes `<directory>/checkpoint.final`
// (atomically, as checkpoints are) with its step (optimizer iterations) and state. A
// SidecarEvaluator stops after evaluating the checkpoint it names. The chief calls it just
// before its last save, so that the evaluation of that checkpoint already knows it is the final
// one (called after the save, the evaluator still stops, but may have logged it as not final).
// The directory is created if missing. Throws kInvalidArgument for a negative field, kSystem
// when the file cannot be written.
struct FinalCheckpointMark {
  TrainingState state;
  int64_t iterations = 0;
  bool operator==(const FinalCheckpointMark&) const = default;
};
void MarkFinalCheckpoint(const std::string& directory, const FinalCheckpointMark& mark);

// The mark of `directory`, or nullopt when there is none. Throws kInvalidArgument naming the
// file when it is not a mark.
std::optional<FinalCheckpointMark> ReadFinalCheckpointMark(const std::string& directory);

// Assigns every variable of `strategy` the value of the checkpoint's variable of the same name
// (on every local copy). Cross-replica context; no communication (every worker of a strategy
// with several workers calls it with the same data). Checks first and changes nothing on a
// mismatch: kInvalidArgument when a variable is missing from `data`, has another shape, or
// `data` holds a variable the strategy has not.
void AssignVariables(Strategy& strategy, const CheckpointData& data);

// An evaluation's results by name, in the order the callback gives them ("loss", "accuracy").
using Metrics = std::vector<std::pair<std::string, double>>;

struct Evaluation {
  int64_t step = 0;  // the checkpoint's optimizer iterations
  TrainingState state;
  bool final = false;  // the checkpoint the final mark names
  Metrics metrics;
  double eval_seconds = 0;  // the callback's time
};

// Why SidecarEvaluator::Run returned.
enum class EvaluatorStop {
  kFinalCheckpoint,  // it evaluated the checkpoint MarkFinalCheckpoint names
  kMaxEvaluations,   // SidecarEvaluatorOptions::max_evaluations were made
  kIdleTimeout,      // no new checkpoint for SidecarEvaluatorOptions::idle_timeout
  kStopped,          // Stop() was called
};
const char* ToString(EvaluatorStop stop);

struct SidecarEvaluatorOptions {
  // The directory the chief saves into. It need not exist yet.
  std::string checkpoint_dir;
  // The JSON-lines log; "" for none. Created if missing, appended to. When its last record is
  // the checkpoint now in the directory (an evaluator restarted after a crash), that checkpoint
  // is not evaluated again.
  std::string log_path;
  // When given, every variable of this (local) strategy is assigned the checkpoint's values
  // (AssignVariables) before the callback runs. Default: none; the callback reads the values.
  Strategy* strategy = nullptr;
  // How often the directory is looked at when nothing new is there. Default 200 ms: a
  // checkpoint every few seconds is seen at once, and a stat() five times a second costs nothing.
  std::chrono::milliseconds poll_interval{200};
  // Stop after this many evaluations; 0: no limit.
  int64_t max_evaluations = 0;
  // Stop when no new checkpoint has appeared for this long (since the start or the last
  // evaluation); 0: wait for ever (until the final checkpoint, the limit, or Stop()).
  std::chrono::milliseconds idle_timeout{0};
  // Called after each evaluation, once its record is in the log (to print it, say). Default: none.
  std::function<void(const Evaluation&)> on_evaluation{};
  // Called once for each partial or corrupt checkpoint file (or one that cannot be read), with
  // the error's message naming the file and what is wrong. Default: a line on stderr.
  std::function<void(const std::string&)> on_skipped{};
};

// The evaluator. Run() on one thread; Stop() from any thread.
class SidecarEvaluator {
 public:
  // `evaluate` gets each new complete checkpoint (after the strategy's variables are assigned,
  // when a strategy is given) and returns its metrics. An exception from it ends Run(), which
  // rethrows it; so does a checkpoint whose variables do not match the strategy's. Nothing is
  // logged for it, and a later Run() tries that checkpoint again. kInvalidArgument for an empty
  // checkpoint_dir, a null callback, a negative limit or idle timeout, a poll interval <= 0.
  SidecarEvaluator(std::function<Metrics(const CheckpointData&)> evaluate,
                   SidecarEvaluatorOptions options);
  SidecarEvaluator(const SidecarEvaluator&) = delete;
  SidecarEvaluator& operator=(const SidecarEvaluator&) = delete;

  // Watches and evaluates until a stop condition; returns which. Can be called again (after
  // kMaxEvaluations the count starts over; kStopped is cleared by the next Run).
  EvaluatorStop Run();
  // Ends Run() after the evaluation in progress, if any. Thread-safe.
  void Stop();

  // Every evaluation made so far, in order. Not while Run() is running on another thread.
  const std::vector<Evaluation>& evaluations() const { return evaluations_; }

 private:
  // The identity of the file last looked at, so that an unchanged file is not read again.
  struct FileId {
    uint64_t device = 0, inode = 0, size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const FileId&) const = default;
  };
  // Step, epoch and epoch step: what makes a checkpoint new.
  using Key = std::tuple<int64_t, int64_t, int64_t>;

  void AppendRecord(const Evaluation& evaluation);
  // Sleeps for `duration` or until Stop(); returns whether Stop() was called.
  bool SleepOrStop(std::chrono::milliseconds duration);

  std::function<Metrics(const CheckpointData&)> evaluate_;
  SidecarEvaluatorOptions options_;
  std::vector<Evaluation> evaluations_;
  std::optional<FileId> last_file_;
  std::optional<Key> last_key_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mutex_
};

}  // namespace collectives::strategy

#endif  // COLLECTIVES_EVALUATOR_H_
