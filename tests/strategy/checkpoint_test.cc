// Checkpoints: a round trip of variables, optimizer slots, iterations and training state over 2
// workers; atomic replacement (no temporary left behind, an old file replaced); corrupt,
// truncated and bad-checksum files and mismatched variables refused on every worker; a missing
// checkpoint; a failed save reported on every worker; BackupAndRestore resuming a "crashed" job
// to the same weights, bit for bit, as an uninterrupted run. Header damage named as such (the
// checksum first), and meaningless fields a writer could have written refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/strategy.h"
#include "src/core/environment.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

namespace fs = std::filesystem;
using testing::BitEqual;
using testing::ExpectError;
using testing::ExpectErrorPtr;
using testing::RunWorkers;
using testing::RunWorkersCatching;

constexpr CrossDeviceOps kHC = CrossDeviceOps::kHierarchicalCopy;

// A fresh directory per test, removed afterwards.
class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() /
           ("collectives_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }
  std::string file() const { return (dir_ / "checkpoint").string(); }
  std::vector<char> ReadAll() const {
    std::ifstream in(file(), std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
  void WriteAll(const std::vector<char>& bytes) const {
    std::ofstream out(file(), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::vector<std::string> Listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path dir_;
};

// A tiny model: variables "dense/kernel" {3, 2} and "dense/bias" {2}.
struct Model {
  MirroredVariable* kernel;
  MirroredVariable* bias;
  Model(Strategy& s, uint64_t seed) {
    kernel = &s.CreateVariable("dense/kernel", {3, 2}, GlorotUniform(3, 2, seed));
    bias = &s.CreateVariable("dense/bias", {2}, Constant(0.1f));
  }
  // One step of a made-up loss whose gradient depends on the weights and the (epoch, step).
  void Step(Strategy& s, Optimizer& opt, int64_t epoch, int64_t step) const {
    s.Run([&](ReplicaContext& ctx) {
      const int r = ctx.local_replica_id();
      const float x = 0.1f * static_cast<float>(ctx.replica_id_in_sync_group() + 1) +
                      0.01f * static_cast<float>(epoch * 10 + step);
      std::vector<float> gk(6), gb(2);
      for (size_t i = 0; i < 6; ++i) gk[i] = kernel->value(r)[i] * x - 0.05f * static_cast<float>(i);
      for (size_t i = 0; i < 2; ++i) gb[i] = bias->value(r)[i] - x;
      opt.ApplyGradients(ctx, {kernel, bias}, {gk, gb});
    });
  }
  std::vector<float> Weights() const {
    std::vector<float> w(kernel->value(0).begin(), kernel->value(0).end());
    w.insert(w.end(), bias->value(0).begin(), bias->value(0).end());
    return w;
  }
};

TEST_F(CheckpointTest, RoundTripOverTwoWorkers) {
  std::vector<std::vector<float>> saved_weights(2), restored_weights(2);
  std::vector<std::vector<Optimizer::Slot>> saved_slots(2), restored_slots(2);
  RunWorkers(2, 2, kHC, [&](Strategy& s, int rank) {
    Model model(s, 5);
    Adam adam(s, {.learning_rate = 0.01f});
    for (int step = 0; step < 3; ++step) model.Step(s, adam, 0, step);
    SaveCheckpoint(s, &adam, dir(), {.epoch = 4, .step = 3});
    saved_weights[rank] = model.Weights();
    saved_slots[rank] = adam.SaveSlots();
  });
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});  // no temporary left behind
  RunWorkers(2, 2, kHC, [&](Strategy& s, int rank) {
    Model model(s, 99);  // different initial weights: the checkpoint must overwrite them
    Adam adam(s, {.learning_rate = 0.01f});
    const std::optional<TrainingState> state = RestoreCheckpoint(s, &adam, dir());
    ASSERT_TRUE(state.has_value());
    EXPECT_EQ(*state, (TrainingState{4, 3}));
    EXPECT_EQ(adam.iterations(), 3);
    restored_weights[rank] = model.Weights();
    restored_slots[rank] = adam.SaveSlots();
    for (MirroredVariable* v : s.variables()) EXPECT_TRUE(BitEqual(v->value(0), v->value(1)));
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(BitEqual(restored_weights[rank], saved_weights[0])) << "worker " << rank;
    ASSERT_EQ(restored_slots[rank].size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(restored_slots[rank][i].name, saved_slots[0][i].name);
      EXPECT_TRUE(BitEqual(restored_slots[rank][i].value, saved_slots[0][i].value));
    }
  }
}

TEST_F(CheckpointTest, AnOldCheckpointIsReplacedAtomically) {
  fs::create_directories(dir_);
  WriteAll({'o', 'l', 'd'});
  DefaultStrategy s;
  Model model(s, 1);
  Sgd sgd(s, {.learning_rate = 0.1f, .momentum = 0.9f});
  model.Step(s, sgd, 0, 0);
  SaveCheckpoint(s, &sgd, dir(), {.epoch = 1, .step = 0});
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});
  const std::vector<float> first = model.Weights();
  model.Step(s, sgd, 1, 0);
  SaveCheckpoint(s, &sgd, dir(), {.epoch = 1, .step = 1});  // replaces the previous one
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});
  const std::vector<float> second = model.Weights();
  model.Step(s, sgd, 1, 1);
  EXPECT_EQ(RestoreCheckpoint(s, &sgd, dir()), (TrainingState{1, 1}));
  EXPECT_TRUE(BitEqual(model.Weights(), second));
  EXPECT_FALSE(BitEqual(model.Weights(), first));
  EXPECT_EQ(sgd.iterations(), 2);
}

// A chief that died while saving left `checkpoint.tmp-<host>-<pid>` behind: the next save on
// the host removes it, and leaves alone a temporary whose process still runs (a save in
// progress) and other hosts' temporaries (a shared file system).
TEST_F(CheckpointTest, TemporariesOfDeadChiefsAreRemovedByTheNextSave) {
  fs::create_directories(dir_);
  const std::string host = core::HostName();
  const std::string mine = "checkpoint.tmp-" + host + "-";
  // Above Linux's largest pid (2^22), so no process has it.
  const std::string dead = mine + "4194305";
  const std::string alive = mine + std::to_string(::getppid());
  const std::string elsewhere = "checkpoint.tmp-" + host + "x-4194305";
  const std::string not_a_pid = mine + "12ab";
  for (const std::string& name : {dead, alive, elsewhere, not_a_pid}) {
    std::ofstream(dir_ / name) << "partial";
  }
  DefaultStrategy s;
  Model model(s, 1);
  SaveCheckpoint(s, nullptr, dir(), {.epoch = 1, .step = 0});
  std::vector<std::string> expected = {"checkpoint", alive, elsewhere, not_a_pid};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(Listing(), expected);
  EXPECT_EQ(RestoreCheckpoint(s, nullptr, dir()), (TrainingState{1, 0}));
}

TEST_F(CheckpointTest, MissingCheckpointIsNulloptAndChangesNothing) {
  RunWorkers(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 3);
    Adam adam(s);
    const std::vector<float> before = model.Weights();
    EXPECT_EQ(RestoreCheckpoint(s, &adam, dir()), std::nullopt);
    EXPECT_TRUE(BitEqual(model.Weights(), before));
    EXPECT_EQ(adam.iterations(), 0);
  });
}

TEST_F(CheckpointTest, CorruptFilesFailOnEveryWorker) {
  {
    DefaultStrategy s;
    Model model(s, 2);
    Adam adam(s);
    model.Step(s, adam, 0, 0);
    SaveCheckpoint(s, &adam, dir(), {});
  }
  const std::vector<char> good = ReadAll();
  ASSERT_GT(good.size(), 100u);
  struct Case {
    const char* what;
    std::vector<char> bytes;
    const char* expected;
  };
  std::vector<Case> cases;
  {
    std::vector<char> flipped = good;
    flipped[good.size() / 2] ^= 0x10;
    cases.push_back({"one bit flipped", flipped, "checksum mismatch"});
  }
  cases.push_back({"truncated", std::vector<char>(good.begin(), good.end() - 9), "truncated"});
  cases.push_back({"truncated to the header", std::vector<char>(good.begin(), good.begin() + 12),
                   "truncated"});
  {
    std::vector<char> magic = good;
    magic[0] = 'X';
    cases.push_back({"bad magic", magic, "bad magic"});
  }
  cases.push_back({"empty", {}, "truncated"});  // a copy cut short, not a stranger's file
  cases.push_back(
      {"shorter than the magic", std::vector<char>(good.begin(), good.begin() + 5), "truncated"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    WriteAll(c.bytes);
    const auto errors = RunWorkersCatching(2, 2, kHC, [&](Strategy& s, int) {
      Model model(s, 2);
      Adam adam(s);
      RestoreCheckpoint(s, &adam, dir());
    });
    for (int rank = 0; rank < 2; ++rank) {
      SCOPED_TRACE(rank);
      ExpectErrorPtr(errors[rank], ErrorCode::kInvalidArgument, {file().c_str(), c.expected});
    }
  }
}

TEST_F(CheckpointTest, MismatchedVariablesAreRefusedBeforeAnythingChanges) {
  {
    DefaultStrategy s;
    Model model(s, 2);
    Adam adam(s);
    model.Step(s, adam, 0, 0);
    SaveCheckpoint(s, &adam, dir(), {});
  }
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int) {
    s.CreateVariable("dense/kernel", {2, 3}, Zeros());  // transposed
    s.CreateVariable("dense/bias", {2}, Zeros());
    Adam adam(s);
    try {
      RestoreCheckpoint(s, &adam, dir());
    } catch (...) {
      for (MirroredVariable* v : s.variables()) {
        for (float x : v->value(0)) EXPECT_EQ(x, 0.0f);
      }
      throw;
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    ExpectErrorPtr(errors[rank], ErrorCode::kInvalidArgument,
                   {"'dense/kernel' has shape [3, 2] in the checkpoint, [2, 3] in the strategy"});
  }
  DefaultStrategy missing;
  missing.CreateVariable("dense/kernel", {3, 2}, Zeros());
  ExpectError(ErrorCode::kInvalidArgument, {"the checkpoint has variable 'dense/bias'"},
              [&] { RestoreCheckpoint(missing, nullptr, dir()); });
  DefaultStrategy extra;
  Model model(extra, 1);
  extra.CreateVariable("other", {1}, Zeros());
  ExpectError(ErrorCode::kInvalidArgument, {"'other' is not in the checkpoint"},
              [&] { RestoreCheckpoint(extra, nullptr, dir()); });
  DefaultStrategy wrong_optimizer;
  Model model2(wrong_optimizer, 1);
  Sgd sgd(wrong_optimizer);
  ExpectError(ErrorCode::kInvalidArgument, {"optimizer Adam, not of SGD"},
              [&] { RestoreCheckpoint(wrong_optimizer, &sgd, dir()); });
  // Without an optimizer: the variables alone.
  DefaultStrategy weights_only;
  Model model3(weights_only, 1);
  EXPECT_TRUE(RestoreCheckpoint(weights_only, nullptr, dir()).has_value());
}

TEST_F(CheckpointTest, AFailedSaveIsReportedOnEveryWorker) {
  fs::create_directories(dir_.parent_path());
  { std::ofstream(dir_.string()) << "a file where the directory should be"; }
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 1);
    SaveCheckpoint(s, nullptr, dir(), {});
  });
  ExpectErrorPtr(errors[0], ErrorCode::kSystem, {dir().c_str()});
  ExpectErrorPtr(errors[1], ErrorCode::kSystem, {dir().c_str()});
  fs::remove(dir_);
}

// ---- The header: the checksum first, then what it covers. ----

uint32_t Crc32(const std::vector<char>& bytes, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= static_cast<unsigned char>(bytes[i]);
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return c ^ 0xFFFFFFFFu;
}

// Writes `value` at `offset`, then a checksum that matches: what a writer could have written.
template <typename T>
std::vector<char> Rewritten(std::vector<char> bytes, size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
  const uint32_t crc = Crc32(bytes, bytes.size() - 4);
  std::memcpy(bytes.data() + bytes.size() - 4, &crc, sizeof crc);
  return bytes;
}

// A flipped bit in the version, reserved or size field is damage (the checksum says so), not a
// file of another format nor a truncated one; fields that a writer could have written but that
// mean nothing (another version, a reserved field set, a wrong size, a negative epoch, step or
// iteration count) are refused as corrupt, each named.
TEST_F(CheckpointTest, HeaderCorruptionIsNamedAsSuch) {
  {
    DefaultStrategy s;
    Model model(s, 2);
    SaveCheckpoint(s, nullptr, dir(), {.epoch = 2, .step = 1});
  }
  const std::vector<char> good = ReadAll();
  // magic 0, version 8, reserved 12, file_bytes 16, epoch 24, step 32, optimizer name 40 (empty),
  // iterations 44.
  ASSERT_EQ(good[40], 0);
  struct Case {
    std::string what;
    std::vector<char> bytes;
    const char* expected;
  };
  std::vector<Case> cases;
  for (size_t offset : {8, 12, 16, 23}) {
    std::vector<char> flipped = good;
    flipped[offset] ^= 0x02;
    cases.push_back({"bit flipped at " + std::to_string(offset), flipped, "checksum mismatch"});
  }
  cases.push_back({"version 2", Rewritten<uint32_t>(good, 8, 2),
                   "format version 2, this library reads version 1"});
  cases.push_back({"reserved", Rewritten<uint32_t>(good, 12, 1), "the reserved field holds 1"});
  cases.push_back({"size field", Rewritten<uint64_t>(good, 16, good.size() + 2),
                   "wrong size field: the file has"});
  cases.push_back({"negative epoch", Rewritten<int64_t>(good, 24, -5),
                   "negative epoch, step or iterations (-5, 1, 0)"});
  cases.push_back({"negative step", Rewritten<int64_t>(good, 32, -7),
                   "negative epoch, step or iterations (2, -7, 0)"});
  cases.push_back({"negative iterations", Rewritten<int64_t>(good, 44, -1),
                   "negative epoch, step or iterations (2, 1, -1)"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    WriteAll(c.bytes);
    DefaultStrategy s;
    Model model(s, 2);
    ExpectError(ErrorCode::kInvalidArgument, {file().c_str(), "is corrupt", c.expected},
                [&] { RestoreCheckpoint(s, nullptr, dir()); });
  }
  WriteAll(good);
  DefaultStrategy s;
  Model model(s, 2);
  EXPECT_EQ(RestoreCheckpoint(s, nullptr, dir()), (TrainingState{2, 1}));
}

// Trains 3 epochs of 4 steps with BackupAndRestore (a save every 3 steps and at every epoch's
// end). `crash_at`: the (epoch, step) after which the job "dies" (every worker's strategy is
// thrown away without OnTrainEnd); then a new job resumes. Returns worker 0's final weights.
std::vector<float> TrainWithBackup(const std::string& dir, std::optional<TrainingState> crash_at,
                                   std::vector<TrainingState>* starts) {
  constexpr int64_t kEpochs = 3, kStepsPerEpoch = 4;
  std::vector<float> final_weights;
  bool crashed = false;
  for (int attempt = 0; attempt < 2 && !(attempt == 1 && !crashed); ++attempt) {
    std::vector<TrainingState> begin(2);
    RunWorkers(2, 2, kHC, [&](Strategy& s, int rank) {
      Model model(s, 17);
      Adam adam(s, {.learning_rate = 0.05f});
      BackupAndRestore backup(s, &adam, dir, {.save_every_steps = 3});
      const TrainingState start = backup.OnTrainBegin();
      begin[rank] = start;
      for (int64_t epoch = start.epoch; epoch < kEpochs; ++epoch) {
        for (int64_t step = epoch == start.epoch ? start.step : 0; step < kStepsPerEpoch; ++step) {
          model.Step(s, adam, epoch, step);
          backup.OnStepEnd(epoch, step);
          if (attempt == 0 && crash_at && *crash_at == TrainingState{epoch, step}) return;
        }
        backup.OnEpochEnd(epoch);
      }
      backup.OnTrainEnd();
      if (rank == 0) final_weights = model.Weights();
    });
    EXPECT_EQ(begin[0], begin[1]);
    starts->push_back(begin[0]);
    crashed = final_weights.empty();
  }
  return final_weights;
}

// A Run in which one replica failed after the other changed its copy breaks the strategy: a
// checkpoint of it would keep replicas that disagree, so SaveCheckpoint (and every other
// cross-replica call) rethrows the failure, and the last good checkpoint stays as it was.
TEST_F(CheckpointTest, ABrokenStrategyDoesNotReplaceAGoodCheckpoint) {
  MirroredStrategy s(MirroredOptions{.num_replicas = 2});
  Model model(s, 3);
  SaveCheckpoint(s, nullptr, dir(), TrainingState{});
  const std::vector<char> good = ReadAll();
  EXPECT_THROW(s.Run([&](ReplicaContext& ctx) {
    if (ctx.local_replica_id() == 1) throw std::runtime_error("replica 1 failed");
    model.bias->value(0)[0] = 42.0f;  // only replica 0's copy changes
  }),
               std::runtime_error);
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { SaveCheckpoint(s, nullptr, dir(), TrainingState{}); },
           [&] { RestoreCheckpoint(s, nullptr, dir()); }, [&] { s.Barrier(); },
           [&] { s.CreateVariable("late", {1}, Constant(0.0f)); }}) {
    try {
      call();
      ADD_FAILURE() << "a cross-replica call went on after a failed Run";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "replica 1 failed");
    }
  }
  EXPECT_EQ(ReadAll(), good);
}

TEST_F(CheckpointTest, BackupAndRestoreResumesToTheSameWeights) {
  std::vector<TrainingState> starts;
  const std::vector<float> uninterrupted = TrainWithBackup(dir(), std::nullopt, &starts);
  EXPECT_EQ(starts, (std::vector<TrainingState>{{0, 0}}));
  EXPECT_FALSE(fs::exists(file()));  // deleted by OnTrainEnd
  ASSERT_EQ(uninterrupted.size(), 8u);

  // Killed after step 1 of epoch 1: the last save was at the end of epoch 0 -> resume at {1, 0}.
  starts.clear();
  std::vector<float> resumed = TrainWithBackup(dir(), TrainingState{1, 1}, &starts);
  EXPECT_EQ(starts, (std::vector<TrainingState>{{0, 0}, {1, 0}}));
  EXPECT_TRUE(BitEqual(resumed, uninterrupted));

  // Killed after step 3 of epoch 1: saved there by save_every_steps (3 steps) -> {1, 3}.
  starts.clear();
  resumed = TrainWithBackup(dir(), TrainingState{1, 2}, &starts);
  EXPECT_EQ(starts, (std::vector<TrainingState>{{0, 0}, {1, 3}}));
  EXPECT_TRUE(BitEqual(resumed, uninterrupted));
  EXPECT_FALSE(fs::exists(file()));
}

}  // namespace
}  // namespace collectives::strategy
