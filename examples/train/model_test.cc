// Tests of the Model interface (model.h) and the CNN (cnn.h), without a strategy: the CNN's names
// and shapes, its forward pass and its gradients against a direct computation in double (loops
// over pixels, windows and units, no im2col, no Eigen), the MLP behind the interface against
// MlpWorkspace, the initial values, and the refusals.
#include "examples/train/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/train/cnn.h"
#include "examples/train/mlp.h"

namespace train {
namespace {

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::vector<std::vector<float>> RandomValues(const Model& model, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<std::vector<float>> values(model.num_parameters());
  for (size_t p = 0; p < values.size(); ++p) {
    values[p].resize(model.ParameterCount(p));
    for (float& v : values[p]) v = normal(rng);
  }
  return values;
}

TEST(CnnTest, ParameterNamesAndShapesFollowKeras) {
  const std::unique_ptr<Model> model = MakeModel("cnn");
  EXPECT_EQ(model->name(), "cnn");
  EXPECT_EQ(model->num_inputs(), 784u);
  EXPECT_EQ(model->num_classes(), 10u);
  ASSERT_EQ(model->num_parameters(), 6u);
  const std::vector<std::string> names = {"conv2d/kernel", "conv2d/bias",    "dense/kernel",
                                          "dense/bias",    "dense_1/kernel", "dense_1/bias"};
  const std::vector<std::vector<size_t>> shapes = {{3, 3, 1, 32}, {32},     {13 * 13 * 32, 64},
                                                   {64},          {64, 10}, {10}};
  for (size_t p = 0; p < 6; ++p) {
    EXPECT_EQ(model->ParameterName(p), names[p]);
    EXPECT_EQ(model->ParameterShape(p), shapes[p]) << names[p];
  }
  // Keras' model.summary() for the guide's network: 320 + 346,176 + 650.
  EXPECT_EQ(model->TotalParameterCount(), 347146u);
}

TEST(ModelTest, UnknownNameIsRefusedNamingTheKnownOnes) {
  const std::string error = ErrorOf([] { MakeModel("resnet"); });
  EXPECT_NE(error.find("'resnet'"), std::string::npos) << error;
  EXPECT_NE(error.find("mlp, cnn"), std::string::npos) << error;
  EXPECT_EQ(ModelNames(), (std::vector<std::string>{"mlp", "cnn"}));
}

// Glorot uniform within its limit, spread over it, the same for the same seed, other numbers for
// another; biases zero.
TEST(ModelTest, InitialValuesAreGlorotUniformKernelsAndZeroBiases) {
  for (const std::string name : {"mlp", "cnn"}) {
    const std::unique_ptr<Model> model = MakeModel(name);
    for (size_t p = 0; p < model->num_parameters(); ++p) {
      std::vector<float> a(model->ParameterCount(p)), b(a.size()), c(a.size());
      model->InitialValue(p, 7, a);
      model->InitialValue(p, 7, b);
      model->InitialValue(p, 8, c);
      EXPECT_EQ(a, b) << model->ParameterName(p);
      const std::vector<size_t> shape = model->ParameterShape(p);
      if (shape.size() == 1) {
        EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](float v) { return v == 0.0f; }));
        continue;
      }
      EXPECT_NE(a, c) << model->ParameterName(p);
      // Keras' fans: a Conv2D kernel {kh, kw, in, out} has kh*kw*in and kh*kw*out.
      const double receptive = shape.size() == 4 ? static_cast<double>(shape[0] * shape[1]) : 1;
      const double fan_in = receptive * static_cast<double>(shape[shape.size() - 2]);
      const double fan_out = receptive * static_cast<double>(shape.back());
      const double limit = std::sqrt(6.0 / (fan_in + fan_out));
      const auto [lo, hi] = std::minmax_element(a.begin(), a.end());
      EXPECT_GE(*lo, -limit);
      EXPECT_LE(*hi, limit);
      EXPECT_LT(*lo, -0.9 * limit) << model->ParameterName(p);
      EXPECT_GT(*hi, 0.9 * limit) << model->ParameterName(p);
    }
  }
}

// The same draws as strategy::GlorotUniform's documented recipe: mt19937_64(seed), top 53 bits.
TEST(ModelTest, GlorotUniformFillFollowsItsRecipe) {
  std::vector<float> value(5);
  GlorotUniformFill(3, 5, 11, value);
  std::mt19937_64 rng(11);
  const double limit = std::sqrt(6.0 / 8.0);
  for (float v : value) {
    const double u = static_cast<double>(rng() >> 11) / 9007199254740992.0;
    EXPECT_EQ(v, static_cast<float>((2 * u - 1) * limit));
  }
}

// The MLP behind the interface computes what MlpWorkspace computes, bit for bit.
TEST(ModelTest, MlpBehindTheInterfaceIsMlpWorkspace) {
  const std::unique_ptr<Model> model = MakeModel("mlp");
  EXPECT_EQ(model->Describe(), "MLP 784-256-256-10");
  EXPECT_EQ(model->ParameterName(2), "dense_1/kernel");
  const auto values = RandomValues(*model, 3, 0.05f);
  const Mlp mlp({784, 256, 256, 10});
  MlpWorkspace direct(mlp, 4);
  const std::unique_ptr<Workspace> ws = model->MakeWorkspace(4);
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (size_t i = 0; i < 4 * 784; ++i) direct.x()[i] = ws->x()[i] = uniform(rng);
  for (int32_t i = 0; i < 4; ++i) direct.labels()[i] = ws->labels()[i] = i;
  std::vector<const float*> pointers;
  for (const auto& v : values) pointers.push_back(v.data());
  const BatchStats a = direct.Forward(pointers, 4);
  direct.Backward(pointers, 4, 0.25f);
  const BatchStats b = ws->LossAndGradients(WeightsOf(values), 4, 0.25f);
  EXPECT_EQ(a.loss_sum, b.loss_sum);
  EXPECT_EQ(a.correct, b.correct);
  for (size_t p = 0; p < values.size(); ++p) {
    EXPECT_TRUE(std::equal(direct.gradients()[p].begin(), direct.gradients()[p].end(),
                           ws->gradients()[p].begin()))
        << model->ParameterName(p);
  }
}

// ---- The CNN against a direct computation ------------------------------------------------------

// A small CNN: 8x7 images (6x5 convolution outputs, 3x2 pooled, the odd column dropped), 3
// filters, 5 hidden units, 4 classes.
CnnShape SmallShape() { return {.rows = 8, .cols = 7, .filters = 3, .hidden = 5, .classes = 4}; }

// Loss (loss_scale * sum of per-example cross-entropies) and logits of the CNN in double, by the
// definition. `pattern` gets every ReLU's sign and every pooling window's winner, so that a caller
// can tell when a perturbation crossed a kink.
double ReferenceLoss(const CnnShape& s, const std::vector<std::vector<double>>& w,
                     const std::vector<float>& x, const std::vector<int32_t>& labels, size_t n,
                     double loss_scale, std::vector<double>* logits_out,
                     std::vector<int>* pattern) {
  const size_t orows = s.rows - 2, ocols = s.cols - 2, prows = orows / 2, pcols = ocols / 2;
  const size_t flat = prows * pcols * s.filters;
  const auto& kc = w[0];
  const auto& bc = w[1];
  const auto& k1 = w[2];
  const auto& b1 = w[3];
  const auto& k2 = w[4];
  const auto& b2 = w[5];
  if (pattern != nullptr) pattern->clear();
  if (logits_out != nullptr) logits_out->clear();
  double loss = 0;
  for (size_t b = 0; b < n; ++b) {
    auto pixel = [&](size_t r, size_t c) {
      return static_cast<double>(x[b * s.rows * s.cols + r * s.cols + c]);
    };
    auto conv = [&](size_t i, size_t j, size_t f) {
      double z = bc[f];
      for (size_t di = 0; di < 3; ++di) {
        for (size_t dj = 0; dj < 3; ++dj)
          z += pixel(i + di, j + dj) * kc[(di * 3 + dj) * s.filters + f];
      }
      if (pattern != nullptr) pattern->push_back(z > 0);
      return std::max(z, 0.0);
    };
    std::vector<double> pooled(flat);
    for (size_t pi = 0; pi < prows; ++pi) {
      for (size_t pj = 0; pj < pcols; ++pj) {
        for (size_t f = 0; f < s.filters; ++f) {
          double best = -1;
          int winner = -1;
          for (int k = 0; k < 4; ++k) {
            const double a =
                conv(2 * pi + static_cast<size_t>(k / 2), 2 * pj + static_cast<size_t>(k % 2), f);
            if (a > best) {
              best = a;
              winner = k;
            }
          }
          if (pattern != nullptr) pattern->push_back(winner);
          pooled[(pi * pcols + pj) * s.filters + f] = best;
        }
      }
    }
    std::vector<double> hidden(s.hidden);
    for (size_t h = 0; h < s.hidden; ++h) {
      double z = b1[h];
      for (size_t i = 0; i < flat; ++i) z += pooled[i] * k1[i * s.hidden + h];
      if (pattern != nullptr) pattern->push_back(z > 0);
      hidden[h] = std::max(z, 0.0);
    }
    std::vector<double> logits(s.classes);
    for (size_t c = 0; c < s.classes; ++c) {
      double z = b2[c];
      for (size_t h = 0; h < s.hidden; ++h) z += hidden[h] * k2[h * s.classes + c];
      logits[c] = z;
      if (logits_out != nullptr) logits_out->push_back(z);
    }
    double sum = 0;
    for (double z : logits) sum += std::exp(z);
    loss += std::log(sum) - logits[static_cast<size_t>(labels[b])];
  }
  return loss * loss_scale;
}

struct SmallCnnBatch {
  explicit SmallCnnBatch(size_t count) : model(MakeCnnModel(SmallShape())), n(count) {
    values = RandomValues(*model, 5, 0.5f);
    std::mt19937_64 rng(6);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    x.resize(n * model->num_inputs());
    for (float& v : x) v = uniform(rng);
    for (size_t i = 0; i < n; ++i) labels.push_back(static_cast<int32_t>(i % 4));
  }
  std::vector<std::vector<double>> Doubles() const {
    std::vector<std::vector<double>> out;
    for (const auto& v : values) out.emplace_back(v.begin(), v.end());
    return out;
  }
  std::unique_ptr<Model> model;
  size_t n;
  std::vector<std::vector<float>> values;
  std::vector<float> x;
  std::vector<int32_t> labels;
};

TEST(CnnTest, ForwardMatchesADirectComputation) {
  SmallCnnBatch batch(6);
  const std::unique_ptr<Workspace> ws = batch.model->MakeWorkspace(8);
  const BatchStats stats =
      ws->Forward(WeightsOf(batch.values), batch.x.data(), batch.labels.data(), batch.n);
  std::vector<double> logits;
  const double loss = ReferenceLoss(SmallShape(), batch.Doubles(), batch.x, batch.labels, batch.n,
                                    1.0, &logits, nullptr);
  EXPECT_EQ(stats.count, 6u);
  EXPECT_NEAR(stats.loss_sum, loss, 1e-4 * std::max(1.0, loss));
  const std::span<const float> got = ws->logits(batch.n);
  ASSERT_EQ(got.size(), logits.size());
  size_t correct = 0;
  for (size_t b = 0; b < batch.n; ++b) {
    for (size_t c = 0; c < 4; ++c) {
      EXPECT_NEAR(got[b * 4 + c], logits[b * 4 + c],
                  1e-4 * std::max(1.0, std::fabs(logits[b * 4 + c])));
    }
    const auto row = logits.begin() + static_cast<std::ptrdiff_t>(b * 4);
    if (std::max_element(row, row + 4) - row == batch.labels[b]) ++correct;
  }
  EXPECT_EQ(stats.correct, correct);
}

// Central differences of the direct computation (in double) against Backward, for every
// coordinate of every parameter. A coordinate whose perturbation changes a ReLU's sign or a
// pooling window's winner is skipped: the loss has a kink there.
TEST(CnnTest, BackwardMatchesFiniteDifferencesOfADirectComputation) {
  SmallCnnBatch batch(5);
  constexpr float kLossScale = 1.0f / 8;  // as with a global batch of 8
  const std::unique_ptr<Workspace> ws = batch.model->MakeWorkspace(5);
  ws->LossAndGradients(WeightsOf(batch.values), batch.x.data(), batch.labels.data(), batch.n,
                       kLossScale);
  std::vector<std::vector<double>> w = batch.Doubles();
  constexpr double kEps = 1e-4;
  size_t checked = 0, skipped = 0;
  double largest = 0;
  for (size_t p = 0; p < w.size(); ++p) {
    for (size_t i = 0; i < w[p].size(); ++i) {
      const double saved = w[p][i];
      std::vector<int> pattern_plus, pattern_minus;
      w[p][i] = saved + kEps;
      const double plus = ReferenceLoss(SmallShape(), w, batch.x, batch.labels, batch.n, kLossScale,
                                        nullptr, &pattern_plus);
      w[p][i] = saved - kEps;
      const double minus = ReferenceLoss(SmallShape(), w, batch.x, batch.labels, batch.n,
                                         kLossScale, nullptr, &pattern_minus);
      w[p][i] = saved;
      if (pattern_plus != pattern_minus) {
        ++skipped;
        continue;
      }
      const double numeric = (plus - minus) / (2 * kEps);
      largest = std::max(largest, std::fabs(numeric));
      EXPECT_NEAR(ws->gradients()[p][i], numeric, 1e-5 + 1e-3 * std::fabs(numeric))
          << batch.model->ParameterName(p) << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 9 * (checked + skipped) / 10) << "too many coordinates on a kink";
  EXPECT_GT(largest, 1e-3) << "the gradients are all about zero: the check would pass anything";
}

// A batch of 0 gives zero gradients; gradients do not depend on the batch's stale tail.
TEST(CnnTest, GradientsOfAPrefixIgnoreTheRestOfTheWorkspace) {
  SmallCnnBatch batch(4);
  const std::unique_ptr<Workspace> ws = batch.model->MakeWorkspace(4);
  ws->LossAndGradients(WeightsOf(batch.values), batch.x.data(), batch.labels.data(), 4, 1.0f);
  ws->LossAndGradients(WeightsOf(batch.values), batch.x.data(), batch.labels.data(), 2, 1.0f);
  std::vector<std::vector<float>> two;
  for (std::span<float> g : ws->gradients()) two.emplace_back(g.begin(), g.end());
  const std::unique_ptr<Workspace> fresh = batch.model->MakeWorkspace(2);
  fresh->LossAndGradients(WeightsOf(batch.values), batch.x.data(), batch.labels.data(), 2, 1.0f);
  for (size_t p = 0; p < two.size(); ++p) {
    EXPECT_TRUE(std::equal(two[p].begin(), two[p].end(), fresh->gradients()[p].begin()))
        << batch.model->ParameterName(p);
  }
  ws->LossAndGradients(WeightsOf(batch.values), 0, 1.0f);
  for (std::span<float> g : ws->gradients()) {
    EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float v) { return v == 0.0f; }));
  }
}

// Evaluate over more examples than max_batch sums what one big Forward gives.
TEST(CnnTest, EvaluateInChunksSumsTheBatches) {
  SmallCnnBatch batch(7);
  const std::unique_ptr<Workspace> big = batch.model->MakeWorkspace(7);
  const BatchStats whole =
      big->Forward(WeightsOf(batch.values), batch.x.data(), batch.labels.data(), 7);
  const std::unique_ptr<Workspace> small = batch.model->MakeWorkspace(3);
  const BatchStats chunks =
      small->Evaluate(WeightsOf(batch.values), batch.x.data(), batch.labels.data(), 7);
  EXPECT_EQ(chunks.count, 7u);
  EXPECT_EQ(chunks.correct, whole.correct);
  EXPECT_NEAR(chunks.loss_sum, whole.loss_sum, 1e-5 * std::fabs(whole.loss_sum));
}

TEST(ModelTest, WrongWeightsAndOversizedBatchesAreRefused) {
  for (const std::string name : {"mlp", "cnn"}) {
    const std::unique_ptr<Model> model = MakeModel(name);
    auto values = RandomValues(*model, 1, 0.1f);
    const std::unique_ptr<Workspace> ws = model->MakeWorkspace(2);
    std::fill_n(ws->x(), 2 * model->num_inputs(), 0.5f);
    std::fill_n(ws->labels(), 2, 1);
    EXPECT_NO_THROW(ws->Forward(WeightsOf(values), 2));
    EXPECT_NE(ErrorOf([&] { ws->Forward(WeightsOf(values), 3); }).find("max_batch"),
              std::string::npos);
    values[2].pop_back();
    const std::string short_kernel = ErrorOf([&] { ws->Forward(WeightsOf(values), 2); });
    EXPECT_NE(short_kernel.find(model->ParameterName(2)), std::string::npos) << short_kernel;
    values.pop_back();
    EXPECT_NE(ErrorOf([&] { ws->Forward(WeightsOf(values), 2); }).find("weights for the"),
              std::string::npos);
  }
  EXPECT_NE(ErrorOf([] { MakeCnnModel({.rows = 3, .cols = 28}); }).find("at least 4x4"),
            std::string::npos);
}

}  // namespace
}  // namespace train
