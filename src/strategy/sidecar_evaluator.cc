// SidecarEvaluator: polls the checkpoint directory, evaluates each new complete checkpoint once,
// logs a JSON line per evaluation.
//
// One poll: stat `<dir>/checkpoint`; when its identity (device, inode, size, mtime) differs from
// the last file looked at, read and verify it (ReadCheckpointFile). The chief replaces the file
// by a rename, so a new checkpoint is a new inode, and a file that has not changed is never read
// twice; a file that fails verification is reported once (its identity is remembered) and the
// next poll waits for another. A verified checkpoint whose (step, epoch, epoch step) differs
// from the last evaluated one is evaluated; then the final mark is read (after the checkpoint:
// the chief writes the mark before its last save, so a mark that names this checkpoint is there
// by now). The evaluator stops after the checkpoint the mark names, after max_evaluations, after
// idle_timeout without a new checkpoint, or on Stop().
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "collectives/errors.h"
#include "collectives/evaluator.h"

namespace collectives::strategy {
namespace {

using Clock = std::chrono::steady_clock;

// The (step, epoch, epoch step) of the last record of the log at `path`, if it has one that
// parses (a line cut short by a crash does not).
std::optional<std::tuple<int64_t, int64_t, int64_t>> LastLoggedKey(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  if (last.empty()) return std::nullopt;
  const nlohmann::json record = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  if (!record.is_object() || !record.contains("step") || !record.contains("epoch") ||
      !record.contains("epoch_step") || !record["step"].is_number_integer() ||
      !record["epoch"].is_number_integer() || !record["epoch_step"].is_number_integer()) {
    return std::nullopt;
  }
  return std::make_tuple(record["step"].get<int64_t>(), record["epoch"].get<int64_t>(),
                         record["epoch_step"].get<int64_t>());
}

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

const char* ToString(EvaluatorStop stop) {
  switch (stop) {
    case EvaluatorStop::kFinalCheckpoint:
      return "the final checkpoint was evaluated";
    case EvaluatorStop::kMaxEvaluations:
      return "the maximum number of evaluations was reached";
    case EvaluatorStop::kIdleTimeout:
      return "no new checkpoint within the idle timeout";
    case EvaluatorStop::kStopped:
      return "stopped";
  }
  return "unknown";
}

SidecarEvaluator::SidecarEvaluator(std::function<Metrics(const CheckpointData&)> evaluate,
                                   SidecarEvaluatorOptions options)
    : evaluate_(std::move(evaluate)), options_(std::move(options)) {
  const auto refuse = [](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, "SidecarEvaluator: " + why);
  };
  if (!evaluate_) refuse("the evaluation function is empty");
  if (options_.checkpoint_dir.empty()) refuse("checkpoint_dir is empty");
  if (options_.max_evaluations < 0) refuse("max_evaluations is negative");
  if (options_.poll_interval.count() <= 0) refuse("poll_interval must be positive");
  if (options_.idle_timeout.count() < 0) refuse("idle_timeout is negative");
  if (!options_.on_skipped) {
    options_.on_skipped = [](const std::string& message) {
      const std::string line = "collectives: SidecarEvaluator: skipped: " + message + "\n";
      std::fwrite(line.data(), 1, line.size(), stderr);
    };
  }
  if (!options_.log_path.empty()) last_key_ = LastLoggedKey(options_.log_path);
}

void SidecarEvaluator::Stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  stop_ = true;
  wake_.notify_all();
}

bool SidecarEvaluator::SleepOrStop(std::chrono::milliseconds duration) {
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, duration, [&] { return stop_; });
  return stop_;
}

void SidecarEvaluator::AppendRecord(const Evaluation& e) {
  if (options_.log_path.empty()) return;
  nlohmann::ordered_json record;
  record["step"] = e.step;
  record["epoch"] = e.state.epoch;
  record["epoch_step"] = e.state.step;
  record["final"] = e.final;
  nlohmann::ordered_json metrics = nlohmann::ordered_json::object();
  for (const auto& [name, value] : e.metrics) metrics[name] = value;  // NaN is written as null
  record["metrics"] = std::move(metrics);
  record["eval_seconds"] = e.eval_seconds;
  record["time"] = UnixSeconds();
  const std::string line = record.dump() + "\n";
  // One write of a whole line in append mode: a reader (the plot script, tail -f) never sees
  // half a record, except after a crash mid-write, which the next Run skips.
  std::FILE* file = std::fopen(options_.log_path.c_str(), "a");
  if (file == nullptr) {
    throw Error(ErrorCode::kSystem, "SidecarEvaluator: cannot open the log " + options_.log_path +
                                        ": " + std::strerror(errno));
  }
  const bool written = std::fwrite(line.data(), 1, line.size(), file) == line.size();
  const int error = errno;
  if (std::fclose(file) != 0 || !written) {
    throw Error(ErrorCode::kSystem, "SidecarEvaluator: cannot write the log " + options_.log_path +
                                        ": " + std::strerror(error));
  }
}

EvaluatorStop SidecarEvaluator::Run() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
  }
  const std::string& dir = options_.checkpoint_dir;
  const std::string path = dir + "/checkpoint";
  int64_t made = 0;
  Clock::time_point last_progress = Clock::now();
  std::optional<std::string> reported_error;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) return EvaluatorStop::kStopped;
    }
    struct stat status;
    if (::stat(path.c_str(), &status) == 0) {
      const FileId id{
          static_cast<uint64_t>(status.st_dev), static_cast<uint64_t>(status.st_ino),
          static_cast<uint64_t>(status.st_size),
          static_cast<int64_t>(status.st_mtim.tv_sec) * 1'000'000'000 + status.st_mtim.tv_nsec};
      if (!last_file_ || *last_file_ != id) {
        last_file_ = id;
        std::optional<CheckpointData> data;
        try {
          data = ReadCheckpointFile(dir);
        } catch (const Error& e) {
          options_.on_skipped(e.message());  // partial or corrupt: wait for the next one
        }
        const std::optional<Key> key =
            data ? std::optional<Key>(Key{data->iterations, data->state.epoch, data->state.step})
                 : std::nullopt;
        if (key && key != last_key_) {
          Evaluation evaluation;
          evaluation.step = data->iterations;
          evaluation.state = data->state;
          const Clock::time_point start = Clock::now();
          try {
            if (options_.strategy != nullptr) AssignVariables(*options_.strategy, *data);
            evaluation.metrics = evaluate_(*data);
          } catch (...) {
            last_file_.reset();  // a later Run tries this checkpoint again
            throw;
          }
          evaluation.eval_seconds = std::chrono::duration<double>(Clock::now() - start).count();
          // Read after the checkpoint: a mark written before this checkpoint's save is seen.
          std::optional<FinalCheckpointMark> mark;
          try {
            mark = ReadFinalCheckpointMark(dir);
          } catch (const Error& e) {
            if (reported_error != e.message()) options_.on_skipped(e.message());
            reported_error = e.message();
          }
          evaluation.final =
              mark && mark->iterations == evaluation.step && mark->state == evaluation.state;
          AppendRecord(evaluation);
          evaluations_.push_back(evaluation);
          last_key_ = key;
          ++made;
          last_progress = Clock::now();
          if (options_.on_evaluation) options_.on_evaluation(evaluation);
          if (evaluation.final) return EvaluatorStop::kFinalCheckpoint;
          if (options_.max_evaluations > 0 && made >= options_.max_evaluations) {
            return EvaluatorStop::kMaxEvaluations;
          }
          continue;  // look again at once: a newer checkpoint may be there already
        }
      }
    } else if (errno != ENOENT) {
      // Not yet there is normal; anything else (no permission, a file where a directory should
      // be) is said once per kind of error.
      const std::string message = "cannot stat " + path + ": " + std::strerror(errno);
      if (reported_error != message) options_.on_skipped(message);
      reported_error = message;
    }
    // The mark may name the checkpoint evaluated last (a mark written after the final save).
    if (last_key_) {
      std::optional<FinalCheckpointMark> mark;
      try {
        mark = ReadFinalCheckpointMark(dir);
      } catch (const Error& e) {
        if (reported_error != e.message()) options_.on_skipped(e.message());
        reported_error = e.message();
      }
      if (mark && Key{mark->iterations, mark->state.epoch, mark->state.step} == *last_key_) {
        return EvaluatorStop::kFinalCheckpoint;
      }
    }
    if (options_.idle_timeout.count() > 0 &&
        Clock::now() - last_progress >= options_.idle_timeout) {
      return EvaluatorStop::kIdleTimeout;
    }
    if (SleepOrStop(options_.poll_interval)) return EvaluatorStop::kStopped;
  }
}

}  // namespace collectives::strategy
