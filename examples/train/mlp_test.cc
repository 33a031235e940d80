// Tests of the demo's pieces that need no strategy: the MLP's backward pass against finite
// differences, the loss's numerical stability, and the IDX reader on the real files and on
// malformed ones.
#include "examples/train/mlp.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/train/fashion_mnist.h"

namespace train {
namespace {

// Parameters of `model` filled with N(0, scale), in Keras order.
std::vector<std::vector<float>> RandomParams(const Mlp& model, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<std::vector<float>> params(model.num_parameters());
  for (size_t p = 0; p < params.size(); ++p) {
    params[p].resize(model.ParameterCount(p));
    for (float& v : params[p]) v = normal(rng);
  }
  return params;
}

std::vector<const float*> Pointers(const std::vector<std::vector<float>>& params) {
  std::vector<const float*> out;
  for (const auto& p : params) out.push_back(p.data());
  return out;
}

TEST(MlpTest, ParameterNamesAndShapesFollowKeras) {
  const Mlp model({784, 256, 256, 10});
  ASSERT_EQ(model.num_parameters(), 6u);
  EXPECT_EQ(model.ParameterName(0), "dense/kernel");
  EXPECT_EQ(model.ParameterName(1), "dense/bias");
  EXPECT_EQ(model.ParameterName(2), "dense_1/kernel");
  EXPECT_EQ(model.ParameterName(5), "dense_2/bias");
  EXPECT_EQ(model.ParameterShape(0), (std::vector<size_t>{784, 256}));
  EXPECT_EQ(model.ParameterShape(3), (std::vector<size_t>{256}));
  EXPECT_EQ(model.TotalParameterCount(), 784u * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
}

// Central differences of L = loss_scale * sum(per-example loss) against Backward, for every
// parameter of a small model. A coordinate whose perturbation flips a ReLU is skipped: the loss
// has a kink there and the difference quotient means nothing.
TEST(MlpTest, BackwardMatchesFiniteDifferences) {
  const Mlp model({7, 6, 5, 4});
  constexpr size_t kBatch = 5;
  constexpr float kLossScale = 1.0f / 8;  // as with a global batch of 8
  auto params = RandomParams(model, 1, 0.6f);
  MlpWorkspace ws(model, kBatch);
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (size_t i = 0; i < kBatch * model.num_inputs(); ++i) ws.x()[i] = uniform(rng);
  for (size_t i = 0; i < kBatch; ++i) ws.labels()[i] = static_cast<int32_t>(i % 4);

  auto loss_and_masks = [&](std::vector<bool>* masks) {
    const BatchStats stats = ws.Forward(Pointers(params), kBatch);
    if (masks != nullptr) {
      masks->clear();
      for (size_t l = 1; l < model.num_layers(); ++l) {
        for (float a : ws.hidden(l, kBatch)) masks->push_back(a > 0);
      }
    }
    return stats.loss_sum * kLossScale;
  };
  loss_and_masks(nullptr);
  ws.Backward(Pointers(params), kBatch, kLossScale);
  std::vector<std::vector<float>> analytic;
  for (std::span<float> g : ws.gradients()) analytic.emplace_back(g.begin(), g.end());

  constexpr float kEps = 1e-2f;
  size_t checked = 0, skipped = 0;
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t i = 0; i < params[p].size(); ++i) {
      const float saved = params[p][i];
      std::vector<bool> mask_plus, mask_minus;
      params[p][i] = saved + kEps;
      const double plus = loss_and_masks(&mask_plus);
      params[p][i] = saved - kEps;
      const double minus = loss_and_masks(&mask_minus);
      params[p][i] = saved;
      if (mask_plus != mask_minus) {
        ++skipped;
        continue;
      }
      const double numeric = (plus - minus) / (2 * kEps);
      EXPECT_NEAR(analytic[p][i], numeric, 2e-4 + 1e-2 * std::fabs(numeric))
          << model.ParameterName(p) << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 9 * (checked + skipped) / 10) << "too many coordinates on a ReLU kink";
}

TEST(MlpTest, LossIsStableForHugeLogitsAndAccuracyCountsArgMax) {
  const Mlp model({2, 3});  // one Dense layer: logits = x W + b
  // W = 0, b = (1000, -1000, 0): logits of every example are the bias.
  std::vector<std::vector<float>> params = {std::vector<float>(6, 0.0f), {1000.0f, -1000.0f, 0.0f}};
  MlpWorkspace ws(model, 2);
  ws.labels()[0] = 0;  // right, loss ~ 0
  ws.labels()[1] = 2;  // wrong, loss ~ 1000
  const BatchStats stats = ws.Forward(Pointers(params), 2);
  EXPECT_EQ(stats.correct, 1u);
  EXPECT_EQ(stats.count, 2u);
  ASSERT_TRUE(std::isfinite(stats.loss_sum));
  EXPECT_NEAR(ws.per_example_loss(2)[0], 0.0f, 1e-6f);
  EXPECT_NEAR(ws.per_example_loss(2)[1], 1000.0f, 1e-3f);
}

TEST(MlpTest, EmptyBatchGivesZeroGradients) {
  const Mlp model({4, 3, 2});
  auto params = RandomParams(model, 3, 1.0f);
  MlpWorkspace ws(model, 4);
  ws.Forward(Pointers(params), 4);
  ws.Backward(Pointers(params), 4, 1.0f);
  ws.Forward(Pointers(params), 0);
  ws.Backward(Pointers(params), 0, 1.0f);
  for (std::span<float> g : ws.gradients()) {
    for (float v : g) EXPECT_EQ(v, 0.0f);
  }
}

// ---- IDX reader ----

bool HaveFashionMnist() {
  struct stat st {};
  return ::stat((std::string(kDefaultDataDir) + "/train-images-idx3-ubyte.gz").c_str(), &st) == 0;
}

TEST(FashionMnistTest, ReadsTheRealFiles) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const ImageDataset train = LoadFashionMnist(kDefaultDataDir, "train");
  EXPECT_EQ(train.count, 60000u);
  EXPECT_EQ(train.rows, 28u);
  EXPECT_EQ(train.cols, 28u);
  EXPECT_EQ(train.pixels.size(), 60000u * 28 * 28);
  std::vector<size_t> per_class(10, 0);
  for (uint8_t label : train.labels) {
    ASSERT_LT(label, 10);
    ++per_class[label];
  }
  for (size_t c : per_class) EXPECT_EQ(c, 6000u);  // Fashion-MNIST is balanced

  const ImageDataset test = LoadFashionMnist(kDefaultDataDir, "t10k");
  EXPECT_EQ(test.count, 10000u);
  EXPECT_EQ(test.features(), 784u);

  // A limit keeps a prefix of the same examples.
  const ImageDataset head = LoadFashionMnist(kDefaultDataDir, "t10k", 100);
  ASSERT_EQ(head.count, 100u);
  EXPECT_TRUE(std::equal(head.pixels.begin(), head.pixels.end(), test.pixels.begin()));
  EXPECT_TRUE(std::equal(head.labels.begin(), head.labels.end(), test.labels.begin()));

  std::vector<float> x(2 * 784);
  std::vector<int32_t> y(2);
  test.Gather({5, 7}, x.data(), y.data());
  EXPECT_EQ(y[1], test.labels[7]);
  EXPECT_FLOAT_EQ(x[784 + 400], test.pixels[7 * 784 + 400] / 255.0f);
  for (float v : x) ASSERT_TRUE(v >= 0.0f && v <= 1.0f);
}

class MalformedIdxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/mlp_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    for (const std::string& f : files_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  // Writes `bytes` gzipped to <dir>/<name>.gz.
  std::string WriteGz(const std::string& name, const std::vector<uint8_t>& bytes) {
    const std::string path = dir_ + "/" + name + ".gz";
    gzFile f = gzopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    EXPECT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
    gzclose(f);
    files_.push_back(path);
    return path;
  }
  // Writes `bytes` as they are to <dir>/<name>.
  std::string WritePlain(const std::string& name, const std::vector<uint8_t>& bytes) {
    const std::string path = dir_ + "/" + name;
    FILE* f = std::fopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    EXPECT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
    files_.push_back(path);
    return path;
  }
  // This process's peak resident set size so far.
  static long MaxRssKiB() {
    struct rusage usage {};
    ::getrusage(RUSAGE_SELF, &usage);
    return usage.ru_maxrss;
  }
  static std::vector<uint8_t> Header(uint8_t rank, std::vector<uint32_t> dims) {
    std::vector<uint8_t> h = {0, 0, 0x08, rank};
    for (uint32_t d : dims) {
      h.insert(h.end(), {uint8_t(d >> 24), uint8_t(d >> 16), uint8_t(d >> 8), uint8_t(d)});
    }
    return h;
  }
  static std::string ErrorOf(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "(no error)";
  }
  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(MalformedIdxTest, BadMagicIsRefused) {
  const std::string path = WriteGz("bad", {0x12, 0x34, 0x08, 0x03, 0, 0, 0, 1});
  const std::string error = ErrorOf([&] { ReadIdx(path); });
  EXPECT_NE(error.find(path), std::string::npos) << error;
  EXPECT_NE(error.find("bad magic"), std::string::npos) << error;
}

TEST_F(MalformedIdxTest, TruncatedBodyIsRefused) {
  std::vector<uint8_t> bytes = Header(3, {10, 28, 28});
  bytes.resize(bytes.size() + 3 * 784);  // 3 images of the 10 the header promises
  const std::string path = WriteGz("short", bytes);
  const std::string error = ErrorOf([&] { ReadIdx(path); });
  EXPECT_NE(error.find("truncated body"), std::string::npos) << error;
}

// A header may declare up to 4 GiB. The reader does not allocate (and zero) all of it before
// reading the body: a 120-byte file declaring 1 GiB fails at once, allocating little.
TEST_F(MalformedIdxTest, AHeaderThatDeclaresMoreThanTheFileHoldsAllocatesLittle) {
  std::vector<uint8_t> bytes = Header(3, {16384, 256, 256});  // 1 GiB
  bytes.resize(120, 1);
  const std::string plain = WritePlain("huge", bytes);
  const std::string gz = WriteGz("huge", bytes);
  for (const std::string& path : {plain, gz}) {
    const long before = MaxRssKiB();
    const std::string error = ErrorOf([&] { ReadIdx(path); });
    EXPECT_NE(error.find("truncated body: expected 1073741824 bytes, got 104"), std::string::npos)
        << error;
    EXPECT_LT(MaxRssKiB() - before, 64 * 1024) << path << ": the peak RSS grew by more than 64 MiB";
  }
}

TEST_F(MalformedIdxTest, TruncatedGzipStreamIsRefused) {
  std::vector<uint8_t> bytes = Header(1, {50000});
  bytes.resize(bytes.size() + 50000, 7);
  const std::string path = WriteGz("cut", bytes);
  // Cut the compressed file in half.
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  ASSERT_EQ(::truncate(path.c_str(), st.st_size / 2), 0);
  const std::string error = ErrorOf([&] { ReadIdx(path); });
  EXPECT_NE(error.find(path), std::string::npos) << error;
}

TEST_F(MalformedIdxTest, MissingFileAndMismatchedCountsAreRefused) {
  EXPECT_NE(ErrorOf([&] { LoadFashionMnist(dir_, "train"); }).find("cannot open"),
            std::string::npos);

  std::vector<uint8_t> images = Header(3, {4, 2, 2});
  images.resize(images.size() + 16, 255);
  WriteGz("train-images-idx3-ubyte", images);
  std::vector<uint8_t> labels = Header(1, {3});
  labels.insert(labels.end(), {1, 2, 3});
  WriteGz("train-labels-idx1-ubyte", labels);
  const std::string error = ErrorOf([&] { LoadFashionMnist(dir_, "train"); });
  EXPECT_NE(error.find("3 labels for 4 images"), std::string::npos) << error;
}

TEST_F(MalformedIdxTest, LabelOutOfRangeIsRefused) {
  std::vector<uint8_t> images = Header(3, {2, 2, 2});
  images.resize(images.size() + 8, 0);
  WriteGz("t10k-images-idx3-ubyte", images);
  std::vector<uint8_t> labels = Header(1, {2});
  labels.insert(labels.end(), {9, 10});
  WriteGz("t10k-labels-idx1-ubyte", labels);
  const std::string error = ErrorOf([&] { LoadFashionMnist(dir_, "t10k"); });
  EXPECT_NE(error.find("label 10 of example 1"), std::string::npos) << error;
}

}  // namespace
}  // namespace train
