// Checkpoint files without a strategy (ReadCheckpointFile, WriteCheckpointFile): the bytes written
// against a serialiser written here from the format's description (with a bitwise CRC-32); a
// round trip; files written by SaveCheckpoint read back, and files written here restored by
// RestoreCheckpoint; no file or no directory is nullopt; truncated, bit-flipped and foreign files
// refused naming the file and what is wrong; bad input refused with nothing written.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "collectives/strategy.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

namespace fs = std::filesystem;
using testing::ExpectError;

class CheckpointFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() / ("collectives_ckpt_file_" + std::to_string(::getpid()) +
                                        "_" + std::to_string(counter++));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }
  std::string file() const { return (dir_ / "checkpoint").string(); }
  std::vector<unsigned char> ReadAll() const {
    std::ifstream in(file(), std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
  void WriteAll(const std::vector<unsigned char>& bytes) const {
    fs::create_directories(dir_);
    std::ofstream out(file(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  }
  std::vector<std::string> Listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  fs::path dir_;
};

// CRC-32 (IEEE), bit by bit: the reference for the writer's table-driven one.
uint32_t BitwiseCrc32(const std::vector<unsigned char>& bytes) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

// The format as the header comment of src/strategy/checkpoint.cc describes it.
std::vector<unsigned char> Expected(const CheckpointData& d) {
  std::vector<unsigned char> out;
  const auto put = [&](uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<unsigned char>(value >> (8 * i)));
  };
  const auto put_string = [&](const std::string& s) {
    put(s.size(), 4);
    out.insert(out.end(), s.begin(), s.end());
  };
  for (char c : std::string("COLLCKPT")) out.push_back(static_cast<unsigned char>(c));
  put(1, 4);
  put(0, 4);
  put(0, 8);  // size, below
  put(static_cast<uint64_t>(d.state.epoch), 8);
  put(static_cast<uint64_t>(d.state.step), 8);
  put_string(d.optimizer);
  put(static_cast<uint64_t>(d.iterations), 8);
  put(d.variables.size() + d.slots.size(), 8);
  for (int kind = 0; kind < 2; ++kind) {
    for (const CheckpointData::Tensor& t : kind == 0 ? d.variables : d.slots) {
      put(static_cast<uint64_t>(kind), 1);
      put_string(t.name);
      put(t.shape.size(), 4);
      for (size_t dim : t.shape) put(dim, 8);
      put(t.values.size(), 8);
      for (float v : t.values) {
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        put(bits, 4);
      }
    }
  }
  const uint64_t total = out.size() + 4;
  for (int i = 0; i < 8; ++i) out[16 + i] = static_cast<unsigned char>(total >> (8 * i));
  put(BitwiseCrc32(out), 4);
  return out;
}

CheckpointData Sample() {
  CheckpointData d;
  d.state = {.epoch = 3, .step = 7};
  d.optimizer = "Adam";
  d.iterations = 1234;
  d.variables = {{"dense/kernel", {2, 3}, {0.5f, -1.25f, 3.0f, 1e-8f, -0.0f, 7.75f}},
                 {"dense/bias", {3}, {0.1f, 0.2f, 0.3f}}};
  d.slots = {{"dense/kernel/m", {6}, {1, 2, 3, 4, 5, 6}}, {"dense/bias/m", {3}, {-1, -2, -3}}};
  return d;
}

TEST_F(CheckpointFileTest, WritesTheDocumentedFormatAtomicallyAndReadsItBack) {
  const CheckpointData d = Sample();
  WriteCheckpointFile(dir(), d);  // the directory does not exist yet
  EXPECT_EQ(ReadAll(), Expected(d));
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});  // no temporary left
  const std::optional<CheckpointData> back = ReadCheckpointFile(dir());
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, d);
  ASSERT_NE(back->FindVariable("dense/bias"), nullptr);
  EXPECT_EQ(back->FindVariable("dense/bias")->values, (std::vector<float>{0.1f, 0.2f, 0.3f}));
  EXPECT_EQ(back->FindVariable("nope"), nullptr);

  CheckpointData next = d;  // replaces the old file
  next.iterations = 1300;
  next.state = {.epoch = 4, .step = 0};
  WriteCheckpointFile(dir(), next);
  EXPECT_EQ(ReadCheckpointFile(dir()), next);
  EXPECT_EQ(Listing(), std::vector<std::string>{"checkpoint"});
}

TEST_F(CheckpointFileTest, NoFileOrNoDirectoryIsNullopt) {
  EXPECT_EQ(ReadCheckpointFile(dir()), std::nullopt);
  fs::create_directories(dir_);
  EXPECT_EQ(ReadCheckpointFile(dir()), std::nullopt);
}

// Files written by the collective SaveCheckpoint read back by value, and a file written by value
// restored by RestoreCheckpoint into a strategy and its optimizer.
TEST_F(CheckpointFileTest, InteroperatesWithSaveAndRestoreCheckpoint) {
  {
    DefaultStrategy s;
    MirroredVariable& w = s.CreateVariable("w", {2, 2}, Constant(1.0f));
    MirroredVariable& b = s.CreateVariable("b", {2}, Constant(0.5f));
    Adam adam(s, {.learning_rate = 0.1f});
    s.Run([&](ReplicaContext& ctx) {
      std::vector<float> gw = {1, -1, 2, -2}, gb = {0.5f, -0.5f};
      adam.ApplyGradients(ctx, {&w, &b}, {gw, gb});
    });
    SaveCheckpoint(s, &adam, dir(), {.epoch = 1, .step = 2});
    const std::optional<CheckpointData> d = ReadCheckpointFile(dir());
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->state, (TrainingState{1, 2}));
    EXPECT_EQ(d->optimizer, "Adam");
    EXPECT_EQ(d->iterations, 1);
    ASSERT_EQ(d->variables.size(), 2u);
    EXPECT_EQ(d->variables[0].name, "w");
    EXPECT_EQ(d->variables[0].shape, (std::vector<size_t>{2, 2}));
    EXPECT_TRUE(testing::BitEqual(d->variables[0].values, w.value(0)));
    EXPECT_TRUE(testing::BitEqual(d->variables[1].values, b.value(0)));
    // Adam's first step moves every weight by lr against the gradient's sign.
    EXPECT_NEAR(d->variables[0].values[0], 0.9f, 1e-5f);
    EXPECT_NEAR(d->variables[0].values[1], 1.1f, 1e-5f);
    std::vector<std::string> slot_names;
    for (const auto& t : d->slots) slot_names.push_back(t.name);
    EXPECT_EQ(slot_names, (std::vector<std::string>{"w/m", "w/v", "b/m", "b/v"}));
    // m = (1 - 0.9) g after one step.
    EXPECT_NEAR(d->slots[0].values[2], 0.2f, 1e-6f);
  }
  CheckpointData d = *ReadCheckpointFile(dir());
  d.variables[0].values = {4, 3, 2, 1};
  d.iterations = 9;
  d.state = {.epoch = 5, .step = 0};
  WriteCheckpointFile(dir(), d);
  DefaultStrategy s;
  MirroredVariable& w = s.CreateVariable("w", {2, 2}, Zeros());
  s.CreateVariable("b", {2}, Zeros());
  Adam adam(s, {});
  EXPECT_EQ(RestoreCheckpoint(s, &adam, dir()), (TrainingState{5, 0}));
  EXPECT_EQ(std::vector<float>(w.value(0).begin(), w.value(0).end()),
            (std::vector<float>{4, 3, 2, 1}));
  EXPECT_EQ(adam.iterations(), 9);
}

TEST_F(CheckpointFileTest, PartialCorruptAndForeignFilesAreRefusedNamingTheFile) {
  const std::vector<unsigned char> good = Expected(Sample());
  // Cut short anywhere: in the magic, the header, a record, just before the checksum.
  for (size_t keep : {size_t{3}, size_t{20}, good.size() / 2, good.size() - 1}) {
    SCOPED_TRACE("kept " + std::to_string(keep) + " bytes");
    WriteAll({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep)});
    ExpectError(ErrorCode::kInvalidArgument, {file().c_str(), "is corrupt", "truncated"},
                [&] { ReadCheckpointFile(dir()); });
  }
  // One flipped byte in a value.
  std::vector<unsigned char> flipped = good;
  flipped[good.size() - 20] ^= 0x10;
  WriteAll(flipped);
  ExpectError(ErrorCode::kInvalidArgument, {file().c_str(), "is corrupt", "checksum mismatch"},
              [&] { ReadCheckpointFile(dir()); });
  // Another format.
  std::vector<unsigned char> foreign = good;
  foreign[0] = 'X';
  WriteAll(foreign);
  ExpectError(ErrorCode::kInvalidArgument, {file().c_str(), "is corrupt", "bad magic"},
              [&] { ReadCheckpointFile(dir()); });
  // A directory where the file should be.
  fs::remove(file());
  fs::create_directory(file());
  ExpectError(ErrorCode::kInvalidArgument, {file().c_str(), "a directory, not a regular file"},
              [&] { ReadCheckpointFile(dir()); });
  fs::remove(file());
  WriteAll(good);
  EXPECT_EQ(ReadCheckpointFile(dir()), Sample());
}

TEST_F(CheckpointFileTest, BadDataIsRefusedAndNothingIsWritten) {
  CheckpointData d = Sample();
  d.variables[1].values.pop_back();
  ExpectError(ErrorCode::kInvalidArgument,
              {"WriteCheckpointFile to", "variable 'dense/bias' has 2 values for shape [3]",
               "nothing written"},
              [&] { WriteCheckpointFile(dir(), d); });
  d = Sample();
  d.slots[0].shape = {7};
  ExpectError(ErrorCode::kInvalidArgument, {"slot 'dense/kernel/m' has 6 values for shape [7]"},
              [&] { WriteCheckpointFile(dir(), d); });
  d = Sample();
  d.iterations = -1;
  ExpectError(ErrorCode::kInvalidArgument, {"negative epoch, step or iterations (3, 7, -1)"},
              [&] { WriteCheckpointFile(dir(), d); });
  EXPECT_FALSE(fs::exists(dir_));
}

}  // namespace
}  // namespace collectives::strategy
