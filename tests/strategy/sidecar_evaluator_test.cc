// SidecarEvaluator: a writer thread stands in for the chief (WriteCheckpointFile, the final mark);
// the evaluator runs on the test's thread with an idle timeout, so that a failing test ends.
// Checked: one record per checkpoint with its step and state, metrics equal to a computation here
// on the values written (through a strategy whose variables the evaluator assigns); a directory
// created late; a partial or corrupt file reported once and skipped, the next complete one
// evaluated; stops at the final checkpoint (mark before or after the save), at
// max_evaluations, at the idle timeout and on Stop(); a restarted evaluator does not evaluate
// the checkpoint its log ends with again; mismatched variables and a failing callback end Run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/evaluator.h"
#include "collectives/strategy.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::ExpectError;

class SidecarEvaluatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    root_ = fs::temp_directory_path() /
            ("collectives_sidecar_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string dir() const { return (root_ / "export").string(); }
  std::string log() const { return (root_ / "evaluations.jsonl").string(); }
  std::vector<nlohmann::ordered_json> Records() const {
    std::vector<nlohmann::ordered_json> records;
    std::ifstream in(log());
    std::string line;
    while (std::getline(in, line)) records.push_back(nlohmann::ordered_json::parse(line));
    return records;
  }
  fs::path root_;
};

// The checkpoint a chief would save after `step` updates: "w" {2, 3} and "b" {3}, values
// depending on the step.
CheckpointData At(int64_t step, int64_t epoch) {
  CheckpointData d;
  d.state = {.epoch = epoch, .step = 0};
  d.optimizer = "SGD";
  d.iterations = step;
  std::vector<float> w(6), b(3);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = 0.01f * static_cast<float>(step) - 0.1f * static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i)
    b[i] = 0.5f * static_cast<float>(i) - 0.001f * static_cast<float>(step);
  d.variables = {{"w", {2, 3}, w}, {"b", {3}, b}};
  return d;
}

// The metric, computed here in double from the values written: y = x W + b for x = (1, 2),
// "y_sum" the sum of y, "w_max" the largest weight.
double YSum(const CheckpointData& d) {
  const std::vector<float>& w = d.variables[0].values;
  const std::vector<float>& b = d.variables[1].values;
  double sum = 0;
  for (size_t o = 0; o < 3; ++o) sum += 1.0 * w[o] + 2.0 * w[3 + o] + b[o];
  return sum;
}

// The evaluator's side: a metric computed from the strategy's variables (assigned by the
// evaluator), not from the data it is handed.
struct StrategyModel {
  DefaultStrategy strategy;
  MirroredVariable* w = &strategy.CreateVariable("w", {2, 3}, Zeros());
  MirroredVariable* b = &strategy.CreateVariable("b", {3}, Zeros());
  Metrics Evaluate() const {
    const auto wv = w->value(0);
    const auto bv = b->value(0);
    float y[3];
    for (size_t o = 0; o < 3; ++o) y[o] = 1.0f * wv[o] + 2.0f * wv[3 + o] + bv[o];
    float w_max = wv[0];
    for (float v : wv) w_max = std::max(w_max, v);
    return {{"y_sum", double{y[0]} + y[1] + y[2]}, {"w_max", w_max}};
  }
};

// Counts evaluations so that the writer can wait for one before the next save (else the
// evaluator may, rightly, skip a checkpoint replaced before it looked).
struct Progress {
  std::mutex mutex;
  std::condition_variable changed;
  int evaluated = 0;
  std::vector<std::string> skipped;
  void Evaluated() {
    std::lock_guard<std::mutex> lock(mutex);
    ++evaluated;
    changed.notify_all();
  }
  void Skipped(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex);
    skipped.push_back(message);
    changed.notify_all();
  }
  // Waits up to 20 s for `done`; false on the deadline.
  template <typename Pred>
  bool WaitFor(Pred done) {
    std::unique_lock<std::mutex> lock(mutex);
    return changed.wait_for(lock, 20s, [&] { return done(*this); });
  }
};

SidecarEvaluatorOptions Options(const std::string& dir, const std::string& log, Progress& p) {
  SidecarEvaluatorOptions o;
  o.checkpoint_dir = dir;
  o.log_path = log;
  o.poll_interval = 20ms;
  o.idle_timeout = 20s;  // a failing test ends
  o.on_evaluation = [&p](const Evaluation&) { p.Evaluated(); };
  o.on_skipped = [&p](const std::string& m) { p.Skipped(m); };
  return o;
}

TEST_F(SidecarEvaluatorTest, OneRecordPerCheckpointWithMetricsOfTheSavedWeights) {
  StrategyModel model;
  Progress progress;
  SidecarEvaluatorOptions options = Options(dir(), log(), progress);
  options.strategy = &model.strategy;
  std::vector<CheckpointData> written;
  SidecarEvaluator evaluator([&](const CheckpointData&) { return model.Evaluate(); }, options);
  std::thread chief([&] {
    for (int epoch = 1; epoch <= 3; ++epoch) {
      const CheckpointData d = At(100 * epoch, epoch);
      written.push_back(d);
      if (epoch == 3) MarkFinalCheckpoint(dir(), {d.state, d.iterations});
      WriteCheckpointFile(dir(), d);
      if (!progress.WaitFor([&](Progress& p) { return p.evaluated >= epoch; })) return;
    }
  });
  const EvaluatorStop stop = evaluator.Run();
  chief.join();
  EXPECT_EQ(stop, EvaluatorStop::kFinalCheckpoint) << ToString(stop);
  ASSERT_EQ(written.size(), 3u);
  const std::vector<nlohmann::ordered_json> records = Records();
  ASSERT_EQ(records.size(), 3u);
  ASSERT_EQ(evaluator.evaluations().size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE("record " + std::to_string(i));
    const CheckpointData& d = written[i];
    EXPECT_EQ(records[i]["step"], d.iterations);
    EXPECT_EQ(records[i]["epoch"], d.state.epoch);
    EXPECT_EQ(records[i]["epoch_step"], 0);
    EXPECT_EQ(records[i]["final"], i == 2);
    EXPECT_NEAR(records[i]["metrics"]["y_sum"].get<double>(), YSum(d), 1e-5);
    EXPECT_EQ(
        records[i]["metrics"]["w_max"].get<double>(),
        double{*std::max_element(d.variables[0].values.begin(), d.variables[0].values.end())});
    EXPECT_EQ(evaluator.evaluations()[i].step, d.iterations);
    EXPECT_TRUE(records[i]["eval_seconds"].is_number());
    EXPECT_GT(records[i]["time"].get<double>(), 1.7e9);
  }
  // Metric names in the callback's order.
  EXPECT_EQ(records[0]["metrics"].begin().key(), "y_sum");
  EXPECT_TRUE(progress.skipped.empty());
}

TEST_F(SidecarEvaluatorTest, WaitsForADirectoryCreatedLate) {
  Progress progress;
  std::vector<int64_t> steps;
  SidecarEvaluator evaluator(
      [&](const CheckpointData& d) {
        steps.push_back(d.iterations);
        return Metrics{{"y_sum", YSum(d)}};
      },
      Options(dir(), "", progress));
  std::thread chief([&] {
    std::this_thread::sleep_for(300ms);  // the evaluator polls a directory that is not there
    const CheckpointData d = At(7, 1);
    MarkFinalCheckpoint(dir(), {d.state, d.iterations});
    WriteCheckpointFile(dir(), d);
  });
  EXPECT_EQ(evaluator.Run(), EvaluatorStop::kFinalCheckpoint);
  chief.join();
  EXPECT_EQ(steps, std::vector<int64_t>{7});
  EXPECT_TRUE(progress.skipped.empty());
}

TEST_F(SidecarEvaluatorTest, APartialOrCorruptFileIsReportedOnceAndSkipped) {
  // Written as a copy by hand would be: in place, not renamed.
  CheckpointData first = At(5, 1);
  WriteCheckpointFile(dir(), first);
  std::vector<char> good;
  {
    std::ifstream in(dir() + "/checkpoint", std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto write_in_place = [&](const std::vector<char>& bytes) {
    std::ofstream out(dir() + "/checkpoint", std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  write_in_place({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 2)});

  Progress progress;
  std::vector<int64_t> steps;
  SidecarEvaluator evaluator(
      [&](const CheckpointData& d) {
        steps.push_back(d.iterations);
        return Metrics{{"y_sum", YSum(d)}};
      },
      Options(dir(), log(), progress));
  std::thread chief([&] {
    if (!progress.WaitFor([](Progress& p) { return p.skipped.size() == 1; })) return;
    std::this_thread::sleep_for(100ms);  // several polls of the same partial file
    std::vector<char> flipped = good;
    flipped[good.size() - 10] ^= 0x01;
    {  // renamed into place, so that the evaluator never reads it half-written
      std::ofstream out(root_ / "damaged", std::ios::binary);
      out.write(flipped.data(), static_cast<std::streamsize>(flipped.size()));
    }
    fs::rename(root_ / "damaged", dir() + "/checkpoint");
    if (!progress.WaitFor([](Progress& p) { return p.skipped.size() == 2; })) return;
    const CheckpointData next = At(9, 2);
    MarkFinalCheckpoint(dir(), {next.state, next.iterations});
    WriteCheckpointFile(dir(), next);
  });
  EXPECT_EQ(evaluator.Run(), EvaluatorStop::kFinalCheckpoint);
  chief.join();
  EXPECT_EQ(steps, std::vector<int64_t>{9});  // never the partial nor the corrupt file
  ASSERT_EQ(progress.skipped.size(), 2u);
  const std::string file = dir() + "/checkpoint";
  for (const std::string& m : progress.skipped) EXPECT_NE(m.find(file), std::string::npos) << m;
  EXPECT_NE(progress.skipped[0].find("truncated"), std::string::npos) << progress.skipped[0];
  EXPECT_NE(progress.skipped[1].find("checksum mismatch"), std::string::npos)
      << progress.skipped[1];
  const std::vector<nlohmann::ordered_json> records = Records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["step"], 9);
  EXPECT_NEAR(records[0]["metrics"]["y_sum"].get<double>(), YSum(At(9, 2)), 1e-9);
}

TEST_F(SidecarEvaluatorTest, StopsAtMaxEvaluations) {
  Progress progress;
  SidecarEvaluatorOptions options = Options(dir(), log(), progress);
  options.max_evaluations = 2;
  SidecarEvaluator evaluator(
      [](const CheckpointData& d) {
        return Metrics{{"y_sum", YSum(d)}};
      },
      options);
  std::thread chief([&] {
    for (int i = 1; i <= 2; ++i) {
      WriteCheckpointFile(dir(), At(i, i));
      if (!progress.WaitFor([&](Progress& p) { return p.evaluated >= i; })) return;
    }
    WriteCheckpointFile(dir(), At(3, 3));  // after the limit: not evaluated
  });
  EXPECT_EQ(evaluator.Run(), EvaluatorStop::kMaxEvaluations);
  chief.join();
  ASSERT_EQ(Records().size(), 2u);
  EXPECT_EQ(Records()[1]["step"], 2);
  EXPECT_EQ(Records()[1]["final"], false);
}

TEST_F(SidecarEvaluatorTest, StopsAtTheIdleTimeoutAndOnStop) {
  Progress progress;
  SidecarEvaluatorOptions options = Options(dir(), log(), progress);
  options.idle_timeout = 300ms;
  int calls = 0;
  const auto evaluate = [&](const CheckpointData&) {
    ++calls;
    return Metrics{};
  };
  SidecarEvaluator idle(evaluate, options);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(idle.Run(), EvaluatorStop::kIdleTimeout);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 300ms);
  EXPECT_LT(waited, 10s);
  EXPECT_TRUE(progress.skipped.empty());  // a directory not there yet is not an error

  // A file where the directory should be is said once, then waited out as well.
  std::ofstream(dir()) << "not a directory\n";
  SidecarEvaluator blocked(evaluate, options);
  EXPECT_EQ(blocked.Run(), EvaluatorStop::kIdleTimeout);
  ASSERT_EQ(progress.skipped.size(), 1u);
  EXPECT_NE(progress.skipped[0].find("Not a directory"), std::string::npos) << progress.skipped[0];
  fs::remove(dir());

  options.idle_timeout = 20s;
  SidecarEvaluator stopped(evaluate, options);
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    stopped.Stop();
  });
  EXPECT_EQ(stopped.Run(), EvaluatorStop::kStopped);
  stopper.join();
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(fs::exists(log()));
}

// A mark written after the final save still stops the evaluator; restarted on the same log, it
// does not evaluate that checkpoint again and stops at once.
TEST_F(SidecarEvaluatorTest, AMarkAfterTheSaveStopsAndARestartDoesNotRepeat) {
  Progress progress;
  int calls = 0;
  const auto evaluate = [&](const CheckpointData& d) {
    ++calls;
    return Metrics{{"y_sum", YSum(d)}};
  };
  SidecarEvaluator evaluator(evaluate, Options(dir(), log(), progress));
  std::thread chief([&] {
    const CheckpointData d = At(40, 4);
    WriteCheckpointFile(dir(), d);
    if (!progress.WaitFor([](Progress& p) { return p.evaluated == 1; })) return;
    MarkFinalCheckpoint(dir(), {d.state, d.iterations});
  });
  EXPECT_EQ(evaluator.Run(), EvaluatorStop::kFinalCheckpoint);
  chief.join();
  EXPECT_EQ(calls, 1);

  SidecarEvaluator restarted(evaluate, Options(dir(), log(), progress));
  EXPECT_EQ(restarted.Run(), EvaluatorStop::kFinalCheckpoint);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(Records().size(), 1u);
  EXPECT_EQ(ReadFinalCheckpointMark(dir()), (FinalCheckpointMark{{4, 0}, 40}));
}

TEST_F(SidecarEvaluatorTest, MismatchedVariablesAndFailingCallbacksEndRun) {
  WriteCheckpointFile(dir(), At(1, 1));
  Progress progress;
  DefaultStrategy other;
  other.CreateVariable("w", {3, 2}, Zeros());
  other.CreateVariable("b", {3}, Zeros());
  SidecarEvaluatorOptions options = Options(dir(), log(), progress);
  options.strategy = &other;
  SidecarEvaluator mismatched([](const CheckpointData&) { return Metrics{}; }, options);
  ExpectError(ErrorCode::kInvalidArgument,
              {"does not match the strategy", "'w' has shape [2, 3] in the checkpoint, [3, 2]"},
              [&] { mismatched.Run(); });

  int calls = 0;
  SidecarEvaluatorOptions limited = Options(dir(), log(), progress);
  limited.max_evaluations = 1;
  SidecarEvaluator failing(
      [&](const CheckpointData& d) -> Metrics {
        if (++calls == 1) throw std::runtime_error("no data");
        return {{"y_sum", YSum(d)}};
      },
      limited);
  EXPECT_THROW(failing.Run(), std::runtime_error);
  EXPECT_FALSE(fs::exists(log()));  // nothing logged for a failed evaluation
  // Run again: the checkpoint whose evaluation failed is evaluated, not taken as seen.
  EXPECT_EQ(failing.Run(), EvaluatorStop::kMaxEvaluations);
  EXPECT_EQ(calls, 2);
  ASSERT_EQ(Records().size(), 1u);
  EXPECT_EQ(Records()[0]["step"], 1);
}

TEST_F(SidecarEvaluatorTest, BadOptionsAndMarksAreRefused) {
  Progress progress;
  const auto evaluate = [](const CheckpointData&) { return Metrics{}; };
  ExpectError(ErrorCode::kInvalidArgument, {"checkpoint_dir is empty"},
              [&] { SidecarEvaluator e(evaluate, Options("", "", progress)); });
  ExpectError(ErrorCode::kInvalidArgument, {"the evaluation function is empty"},
              [&] { SidecarEvaluator e(nullptr, Options(dir(), "", progress)); });
  SidecarEvaluatorOptions negative = Options(dir(), "", progress);
  negative.max_evaluations = -1;
  ExpectError(ErrorCode::kInvalidArgument, {"max_evaluations is negative"},
              [&] { SidecarEvaluator e(evaluate, negative); });
  ExpectError(ErrorCode::kInvalidArgument, {"negative step, epoch or epoch step (-1, 1, 0)"}, [&] {
    MarkFinalCheckpoint(dir(), {{1, 0}, -1});
  });
  EXPECT_EQ(ReadFinalCheckpointMark(dir()), std::nullopt);
  fs::create_directories(dir());
  std::ofstream(dir() + "/checkpoint.final") << "the end\n";
  ExpectError(ErrorCode::kInvalidArgument, {dir().c_str(), "checkpoint.final", "is not one line"},
              [&] { ReadFinalCheckpointMark(dir()); });
}

}  // namespace
}  // namespace collectives::strategy
