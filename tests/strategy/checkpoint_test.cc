// Checkpoints: a round trip of variables, optimizer slots, iterations and training state over 2
// workers; atomic replacement (no temporary left behind, an old file replaced); corrupt,
// truncated and bad-checksum files and mismatched variables refused on every worker; a missing
// checkpoint; a failed save reported on every worker; BackupAndRestore resuming a "crashed" job
// to the same weights, bit for bit, as an uninterrupted run. A restore agreed by every worker
// (another optimizer on one worker, or a file that fits one worker only, fails them all and
// changes nothing); header damage named as such; concurrent savers in one process; no partial
// temporary left by a failed write; every worker's error saying why; new directories.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/strategy.h"
#include "src/core/environment.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

namespace fs = std::filesystem;
using testing::BitEqual;
using testing::Describe;
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
    // Each worker's message starts with its name; the other worker's says the chief failed.
    ExpectErrorPtr(errors[0], ErrorCode::kInvalidArgument,
                   {"worker 0 checkpoint ", file().c_str(), c.expected});
    ExpectErrorPtr(errors[1], ErrorCode::kInvalidArgument,
                   {"worker 1 RestoreCheckpoint of ", file().c_str(),
                    " failed on worker 0 (the chief, which reads the file): worker 0 checkpoint ",
                    c.expected});
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

// The chief's arguments alone make the file: a worker that saves another training state, or an
// optimizer where the chief passes none (a backup whose optimizer state no restore could find),
// would be overruled in silence. Every worker gets kMismatch naming the difference, and the
// checkpoint already there stays as it was.
TEST_F(CheckpointTest, WorkersThatSaveDifferentStatesOrOptimizersAllGetMismatch) {
  RunWorkers(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 1);
    SaveCheckpoint(s, nullptr, dir(), {.epoch = 1, .step = 2});
  });
  const std::vector<char> good = ReadAll();
  auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int rank) {
    Model model(s, 2);
    SaveCheckpoint(s, nullptr, dir(), {.epoch = 1, .step = rank == 0 ? 3 : 4});
  });
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    ExpectErrorPtr(errors[rank], ErrorCode::kMismatch,
                   {"SaveCheckpoint: the workers disagree on the training state: worker 0 has "
                    "'epoch 1, step 3', worker 1 has 'epoch 1, step 4'"});
  }
  errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int rank) {
    Model model(s, 2);
    Adam adam(s);
    SaveCheckpoint(s, rank == 0 ? nullptr : &adam, dir(), {.epoch = 1, .step = 3});
  });
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    ExpectErrorPtr(errors[rank], ErrorCode::kMismatch,
                   {"SaveCheckpoint: the workers disagree on whether an optimizer is given: "
                    "worker 0 has 'no', worker 1 has 'yes'"});
  }
  EXPECT_EQ(ReadAll(), good);
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});
}

// ---- Restore is agreed: it succeeds on every worker or on none. ----

// Saves a checkpoint of Model(5) after 3 steps of `make`'s optimizer, from one worker.
void SaveTrained(const std::string& dir,
                 const std::function<std::unique_ptr<Optimizer>(Strategy&)>& make) {
  DefaultStrategy s;
  Model model(s, 5);
  std::unique_ptr<Optimizer> opt = make(s);
  for (int step = 0; step < 3; ++step) model.Step(s, *opt, 0, step);
  SaveCheckpoint(s, opt.get(), dir, {.epoch = 1, .step = 0});
}

// A worker that passes no optimizer (or one with other slots) where the others pass theirs would
// restore other state than they do, and the workers would silently diverge from the next step
// on: every worker gets kMismatch naming the difference, before anything changes.
TEST_F(CheckpointTest, AnOptimizerOnOneWorkerOnlyFailsEveryWorker) {
  SaveTrained(dir(), [](Strategy& s) { return std::make_unique<Adam>(s); });
  std::vector<std::vector<float>> before(2), after(2);
  std::vector<int64_t> iterations(2, -1);
  auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int rank) {
    Model model(s, 7);
    Adam adam(s);
    before[rank] = model.Weights();
    try {
      RestoreCheckpoint(s, rank == 0 ? &adam : nullptr, dir());
    } catch (...) {
      after[rank] = model.Weights();
      iterations[rank] = adam.iterations();
      throw;
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    ExpectErrorPtr(errors[rank], ErrorCode::kMismatch,
                   {"RestoreCheckpoint: the workers disagree on whether an optimizer is given: "
                    "worker 0 has 'yes', worker 1 has 'no'"});
    EXPECT_TRUE(BitEqual(after[rank], before[rank]));
    EXPECT_EQ(iterations[rank], 0);
  }

  // Both "SGD", one with momentum (a slot), one without.
  SaveTrained(dir(),
              [](Strategy& s) { return std::make_unique<Sgd>(s, SgdOptions{.momentum = 0.9f}); });
  errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int rank) {
    Model model(s, 7);
    Sgd sgd(s, {.momentum = rank == 0 ? 0.9f : 0.0f});
    RestoreCheckpoint(s, &sgd, dir());
  });
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    ExpectErrorPtr(errors[rank], ErrorCode::kMismatch,
                   {"the workers disagree on the optimizer's slots: worker 0 has '[momentum]', "
                    "worker 1 has '[]'"});
  }
}

// When the file does not fit one worker's state (here worker 1's optimizer belongs to a strategy
// without the variables), every worker throws that worker's error, and no worker restores
// anything: worker 0 keeps its weights and its optimizer state.
TEST_F(CheckpointTest, ARestoreThatFailsOnOneWorkerFailsEveryWorkerAndChangesNothing) {
  SaveTrained(dir(), [](Strategy& s) { return std::make_unique<Adam>(s); });
  std::vector<std::vector<float>> before(2), after(2);
  std::vector<int64_t> iterations(2, -1);
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int rank) {
    Model model(s, 7);
    Adam adam(s);
    DefaultStrategy elsewhere;  // no variables
    Adam foreign(elsewhere);    // "Adam" with slots [m, v], as worker 0's
    before[rank] = model.Weights();
    try {
      RestoreCheckpoint(s, rank == 0 ? &adam : &foreign, dir());
    } catch (...) {
      after[rank] = model.Weights();
      iterations[rank] = adam.iterations();
      throw;
    }
  });
  ExpectErrorPtr(errors[0], ErrorCode::kInvalidArgument,
                 {"worker 0 RestoreCheckpoint of ", file().c_str(),
                  " failed on worker 1: worker 1 checkpoint ",
                  "does not match the strategy: Adam.RestoreSlots: slot 'dense/kernel/m' "
                  "is not a slot of a variable of the strategy"});
  ExpectErrorPtr(errors[1], ErrorCode::kInvalidArgument,
                 {"worker 1 checkpoint ", file().c_str(), "'dense/kernel/m' is not a slot"});
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    EXPECT_TRUE(BitEqual(after[rank], before[rank]));
    EXPECT_EQ(iterations[rank], 0);
  }
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

// ---- Saving. ----

// Two savers in one process (two jobs, threads of a harness) saving to one directory: each has
// its own temporary, so every save succeeds, and the file is always one whole checkpoint.
TEST_F(CheckpointTest, ConcurrentSaversInOneProcessEachSucceedAndTheFileIsAlwaysWhole) {
  constexpr int kSaves = 40;
  std::atomic<int> failures{0};
  std::mutex mu;
  std::string first_failure;
  const auto saver = [&](uint64_t seed) {
    DefaultStrategy s;
    s.CreateVariable("big", {1 << 16}, GlorotUniform(1, 1, seed));
    DefaultStrategy reader;
    reader.CreateVariable("big", {1 << 16}, Zeros());
    for (int i = 0; i < kSaves; ++i) {
      try {
        SaveCheckpoint(s, nullptr, dir(), {.epoch = i, .step = 0});
        const std::optional<TrainingState> state = RestoreCheckpoint(reader, nullptr, dir());
        if (!state.has_value()) throw std::runtime_error("no checkpoint after a save");
      } catch (const std::exception& e) {
        ++failures;
        std::lock_guard<std::mutex> lock(mu);
        if (first_failure.empty()) first_failure = e.what();
      }
    }
  };
  std::thread a(saver, 1), b(saver, 2);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});  // no temporary left behind
}

// Two jobs of two workers each save into the same directory at once: their workers 1 must not
// share a temporary such as `.worker-1.tmp`, or one job's delete would take the other's file
// ("cannot delete ... No such file or directory") or its write truncate the other's. Each save
// of each job succeeds, with no warning: a non-chief's failed write or delete is only a line on
// stderr, which is where a shared temporary would show.
TEST_F(CheckpointTest, TwoJobsSavingIntoOneDirectoryDoNotShareTemporaries) {
  constexpr int kSaves = 60;
  const auto job = [&](uint64_t seed, std::vector<std::exception_ptr>* errors) {
    *errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int) {
      s.CreateVariable("big", {1 << 15}, GlorotUniform(1, 1, seed));
      for (int i = 0; i < kSaves; ++i) SaveCheckpoint(s, nullptr, dir(), {.epoch = i});
    });
  };
  std::vector<std::exception_ptr> a_errors, b_errors;
  ::testing::internal::CaptureStderr();
  std::thread a(job, 1, &a_errors), b(job, 2, &b_errors);
  a.join();
  b.join();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(log.find("collectives: worker"), std::string::npos) << log.substr(0, 2000);
  for (const auto* errors : {&a_errors, &b_errors}) {
    for (size_t r = 0; r < errors->size(); ++r) {
      if ((*errors)[r]) ADD_FAILURE() << "worker " << r << ": " << Describe((*errors)[r]);
    }
  }
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});  // no temporary left behind
}

// A write that fails (here the file size limit, as a full disk would) on the chief and the other
// worker: neither leaves its partial temporary in the directory, and every worker says why.
TEST_F(CheckpointTest, AFailedWriteLeavesNoTemporaryOnAnyWorker) {
  fs::create_directories(dir_);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 4096;
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int rank) {
    s.CreateVariable("big", {100'000}, Zeros());
    s.Barrier();
    if (rank == 0) ::setrlimit(RLIMIT_FSIZE, &small);  // the "disk" is full from now on
    s.Barrier();
    SaveCheckpoint(s, nullptr, dir(), {});
  });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  ExpectErrorPtr(errors[0], ErrorCode::kSystem, {"worker 0 cannot write ", "File too large"});
  ExpectErrorPtr(errors[1], ErrorCode::kSystem,
                 {"worker 1 SaveCheckpoint to ", " failed on worker 0: worker 0 cannot write ",
                  "File too large"});
  EXPECT_EQ(Listing(), std::vector<std::string>{});
}

// Only the chief fails (`checkpoint` is a directory, so its rename fails): the other worker's
// error carries the chief's message, so that its log says why.
TEST_F(CheckpointTest, WhenOnlyTheChiefFailsEveryWorkerSaysWhy) {
  fs::create_directories(dir_ / "checkpoint");
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 1);
    SaveCheckpoint(s, nullptr, dir(), {});
  });
  ExpectErrorPtr(errors[0], ErrorCode::kSystem,
                 {"worker 0 cannot rename ", file().c_str(), "Is a directory"});
  ExpectErrorPtr(errors[1], ErrorCode::kSystem,
                 {"worker 1 SaveCheckpoint to ", " failed on worker 0: worker 0 cannot rename ",
                  file().c_str(), "Is a directory"});
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});  // the chief's temporary is gone
}

// Only the chief's file is the checkpoint (as in Keras, where the other workers save to
// temporary places): when another worker's own write fails (here its directory is a file),
// that worker says so on its stderr and every worker returns, with the chief's new checkpoint
// in place. Every worker returns normally once the new file has replaced the old one; none
// raises kSystem.
TEST_F(CheckpointTest, ANonChiefsFailedWriteIsAWarningAndTheChiefsCheckpointStands) {
  RunWorkers(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 1);
    SaveCheckpoint(s, nullptr, dir(), {.epoch = 1, .step = 0});
  });
  const std::string elsewhere = dir() + "_worker_1";
  { std::ofstream(elsewhere) << "a file where worker 1's directory should be"; }
  ::testing::internal::CaptureStderr();
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int rank) {
    Model model(s, 2);
    SaveCheckpoint(s, nullptr, rank == 0 ? dir() : elsewhere, {.epoch = 2, .step = 0});
  });
  const std::string log = ::testing::internal::GetCapturedStderr();
  fs::remove(elsewhere);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_FALSE(errors[rank]) << "worker " << rank << ": " << Describe(errors[rank]);
  }
  EXPECT_NE(log.find("collectives: worker 1 cannot create directory " + elsewhere),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("(the chief's save stands: only its file is the checkpoint)"),
            std::string::npos)
      << log;
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});
  DefaultStrategy s;
  Model model(s, 3);
  EXPECT_EQ(RestoreCheckpoint(s, nullptr, dir()), (TrainingState{2, 0}));
}

// Saving creates missing directories (nested, with a trailing '/', or relative to the working
// directory) and fsyncs their parents; OnTrainEnd fsyncs the directory after its unlink. A test
// cannot observe that an fsync made anything durable (that takes a power cut): this checks that
// these paths work and the checkpoint is there, then gone.
TEST_F(CheckpointTest, SavingIntoNewDirectoriesAndDeletingAtTheEndWork) {
  for (const std::string& directory : {dir() + "/a/b/c/", std::string("relative/d")}) {
    SCOPED_TRACE(directory);
    const fs::path cwd = fs::current_path();
    fs::create_directories(dir_);
    fs::current_path(dir_);  // "relative/d" lands inside dir_
    {
      DefaultStrategy s;
      Model model(s, 1);
      Sgd sgd(s);
      BackupAndRestore backup(s, &sgd, directory, {});
      EXPECT_EQ(backup.OnTrainBegin(), TrainingState{});
      backup.OnEpochEnd(0);
      EXPECT_TRUE(fs::exists(fs::path(directory) / "checkpoint"));
      BackupAndRestore again(s, &sgd, directory, {});
      EXPECT_EQ(again.OnTrainBegin(), (TrainingState{1, 0}));
      again.OnTrainEnd();
      EXPECT_FALSE(fs::exists(fs::path(directory) / "checkpoint"));
    }
    fs::current_path(cwd);
  }
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

// A backup that outlives a finished training would make the next run with this directory resume
// it (and skip the training): when the chief cannot delete it (here `checkpoint` is a
// directory), OnTrainEnd throws on every worker, the others saying that it failed on the chief
// and why. No worker returns as if all was well while the chief throws.
TEST_F(CheckpointTest, OnTrainEndThatCannotDeleteTheBackupFailsOnEveryWorker) {
  fs::create_directories(dir_ / "checkpoint");
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 1);
    BackupAndRestore backup(s, nullptr, dir(), {});
    backup.OnTrainEnd();
  });
  ExpectErrorPtr(errors[0], ErrorCode::kSystem,
                 {"worker 0 cannot delete ", file().c_str(), "Is a directory"});
  ExpectErrorPtr(errors[1], ErrorCode::kSystem,
                 {"worker 1 BackupAndRestore::OnTrainEnd deleting ", " failed on worker 0: ",
                  "worker 0 cannot delete ", file().c_str(), "Is a directory"});
  // Without delete_on_train_end nothing is deleted, and every worker returns.
  RunWorkers(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 1);
    BackupAndRestore backup(s, nullptr, dir(), {.delete_on_train_end = false});
    backup.OnTrainEnd();
  });
}

// A FIFO at the checkpoint's path (or a device: /dev/zero would never end) is refused before it
// is read, kInvalidArgument naming the file and what it is, on every worker. Opening it would
// block the chief until a writer came, forever, and the other workers would wait for its
// broadcast.
TEST_F(CheckpointTest, AFifoAtThePathIsRefusedInsteadOfBlockingForever) {
  fs::create_directories(dir_);
  ASSERT_EQ(::mkfifo(file().c_str(), 0644), 0);
  auto restore = std::async(std::launch::async, [&] {
    return RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int) {
      Model model(s, 1);
      RestoreCheckpoint(s, nullptr, dir());
    });
  });
  if (restore.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ADD_FAILURE() << "RestoreCheckpoint still blocked after 5 s";
    ::close(::open(file().c_str(), O_WRONLY));  // a writer that closes: the chief reads nothing
  }
  const auto errors = restore.get();
  ExpectErrorPtr(errors[0], ErrorCode::kInvalidArgument,
                 {"worker 0 checkpoint ", file().c_str(), " is a FIFO, not a regular file"});
  ExpectErrorPtr(errors[1], ErrorCode::kInvalidArgument,
                 {"worker 1 RestoreCheckpoint of ", file().c_str(),
                  " failed on worker 0 (the chief, which reads the file): worker 0 checkpoint ",
                  " is a FIFO, not a regular file"});
}

// A socket at the checkpoint's path, which open() refuses (ENXIO), is named as what it is, as a
// FIFO is: kInvalidArgument, not kSystem "cannot open ...: No such device or address".
TEST_F(CheckpointTest, ASocketAtThePathIsNamedAsOne) {
  fs::create_directories(dir_);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  const std::string path = file();
  if (path.size() >= sizeof address.sun_path) {
    GTEST_SKIP() << "too long for a socket: " << path;
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  const int bound = ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address);
  const int bind_error = errno;
  if (bound != 0) ::close(fd);
  ASSERT_EQ(bound, 0) << std::strerror(bind_error);
  const auto errors = RunWorkersCatching(2, 1, kHC, [&](Strategy& s, int) {
    Model model(s, 1);
    RestoreCheckpoint(s, nullptr, dir());
  });
  ::close(fd);
  ExpectErrorPtr(errors[0], ErrorCode::kInvalidArgument,
                 {"worker 0 checkpoint ", path.c_str(), " is a socket, not a regular file"});
  ExpectErrorPtr(errors[1], ErrorCode::kInvalidArgument,
                 {"worker 1 RestoreCheckpoint of ", path.c_str(),
                  " is a socket, not a regular file"});
}

}  // namespace
}  // namespace collectives::strategy
