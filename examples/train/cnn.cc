// The guide's CNN with Eigen: see cnn.h.
//
// Names below: n examples, an image R x C, the convolution's output OR x OC = (R-2) x (C-2), the
// pooled map PR x PC = OR/2 x OC/2, F filters, H hidden units, K classes. Row-major throughout.
//
// Forward:
//   P = im2col(x): (n*OR*OC) x 9, row (b, i, j) holds x[b][i+di][j+dj] at column di*3 + dj.
//   A = relu(P Kc + bc): (n*OR*OC) x F. Kc, the kernel {3, 3, 1, F}, is a 9 x F matrix as stored.
//   Q = maxpool(A): n x (PR*PC*F), Q[b][(pi*PC + pj)*F + f] = max over the 2x2 window; the winner's
//       index into A is kept (the first of equal values).
//   Hd = relu(Q K1 + b1): n x H;  Z = Hd K2 + b2: n x K logits; loss = logsumexp(z) - z[label].
// Backward, with dZ = loss_scale * (softmax(Z) - onehot(label)):
//   dK2 = Hd^T dZ; db2 = column sums; dHd = (dZ K2^T) .* (Hd > 0)
//   dK1 = Q^T dHd; db1 = column sums; dQ = dHd K1^T
//   dA = dQ routed to each window's winner where A > 0 (the ReLU's derivative), 0 elsewhere
//   dKc = P^T dA; dbc = column sums of dA. (No gradient with respect to the input.)
#include "examples/train/cnn.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace train {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using RowVectorMap = Eigen::Map<Eigen::RowVectorXf>;
using ConstRowVectorMap = Eigen::Map<const Eigen::RowVectorXf>;
using Index = Eigen::Index;

constexpr size_t kKernel = 3;  // 3x3 convolution
constexpr size_t kTaps = kKernel * kKernel;

// Parameter indices, Keras order.
enum : size_t { kConvKernel, kConvBias, kDenseKernel, kDenseBias, kOutKernel, kOutBias, kParams };

struct Dims {
  explicit Dims(const CnnShape& s)
      : shape(s),
        out_rows(s.rows - 2),
        out_cols(s.cols - 2),
        pooled_rows(out_rows / 2),
        pooled_cols(out_cols / 2),
        positions(out_rows * out_cols),
        flat(pooled_rows * pooled_cols * s.filters) {}
  CnnShape shape;
  size_t out_rows, out_cols, pooled_rows, pooled_cols;
  size_t positions;  // convolution outputs per filter per example
  size_t flat;       // Flatten's width
};

class CnnWorkspace final : public Workspace {
 public:
  CnnWorkspace(const Model& model, const Dims& d, size_t max_batch)
      : Workspace(d.shape.rows * d.shape.cols, max_batch),
        model_(model),
        d_(d),
        x_(max_batch * d.shape.rows * d.shape.cols),
        labels_(max_batch),
        patches_(max_batch * d.positions * kTaps),
        conv_(max_batch * d.positions * d.shape.filters),
        pooled_(max_batch * d.flat),
        winner_(max_batch * d.flat),
        hidden_(max_batch * d.shape.hidden),
        logits_(max_batch * d.shape.classes),
        probs_(max_batch * d.shape.classes),
        d_logits_(max_batch * d.shape.classes),
        d_hidden_(max_batch * d.shape.hidden),
        d_pooled_(max_batch * d.flat),
        d_conv_(max_batch * d.positions * d.shape.filters) {
    for (size_t p = 0; p < model.num_parameters(); ++p) {
      gradients_.emplace_back(model.ParameterCount(p), 0.0f);
    }
    for (auto& g : gradients_) gradient_spans_.emplace_back(g);
  }

  float* x() override { return x_.data(); }
  int32_t* labels() override { return labels_.data(); }
  const std::vector<std::span<float>>& gradients() const override { return gradient_spans_; }
  std::span<const float> logits(size_t n) const override {
    return {logits_.data(), n * d_.shape.classes};
  }

  BatchStats Forward(Weights w, size_t n) override {
    CheckWeights(model_, w, "CNN Forward");
    if (n > max_batch()) {
      throw std::invalid_argument("CNN Forward: batch of " + std::to_string(n) +
                                  " is more than max_batch " + std::to_string(max_batch()));
    }
    const CnnShape& s = d_.shape;
    const auto rows = static_cast<Index>(n * d_.positions);
    const auto filters = static_cast<Index>(s.filters);

    // im2col.
    float* patch = patches_.data();
    for (size_t b = 0; b < n; ++b) {
      const float* image = x_.data() + b * s.rows * s.cols;
      for (size_t i = 0; i < d_.out_rows; ++i) {
        for (size_t j = 0; j < d_.out_cols; ++j) {
          for (size_t di = 0; di < kKernel; ++di) {
            const float* src = image + (i + di) * s.cols + j;
            *patch++ = src[0];
            *patch++ = src[1];
            *patch++ = src[2];
          }
        }
      }
    }
    ConstMatrixMap patches(patches_.data(), rows, static_cast<Index>(kTaps));
    MatrixMap conv(conv_.data(), rows, filters);
    conv.noalias() = patches * ConstMatrixMap(w[kConvKernel].data(), kTaps, filters);
    conv.rowwise() += ConstRowVectorMap(w[kConvBias].data(), filters);
    conv = conv.cwiseMax(0.0f);

    // 2x2 max pooling, stride 2.
    for (size_t b = 0; b < n; ++b) {
      for (size_t pi = 0; pi < d_.pooled_rows; ++pi) {
        for (size_t pj = 0; pj < d_.pooled_cols; ++pj) {
          const size_t out =
              (b * d_.pooled_rows * d_.pooled_cols + pi * d_.pooled_cols + pj) * s.filters;
          const size_t top = (b * d_.positions + 2 * pi * d_.out_cols + 2 * pj) * s.filters;
          const size_t window[4] = {top, top + s.filters, top + d_.out_cols * s.filters,
                                    top + (d_.out_cols + 1) * s.filters};
          for (size_t f = 0; f < s.filters; ++f) {
            size_t best = window[0] + f;
            for (size_t k = 1; k < 4; ++k) {
              if (conv_[window[k] + f] > conv_[best]) best = window[k] + f;
            }
            pooled_[out + f] = conv_[best];
            winner_[out + f] = static_cast<uint32_t>(best);
          }
        }
      }
    }

    const auto batch = static_cast<Index>(n);
    const auto flat = static_cast<Index>(d_.flat);
    const auto hidden_units = static_cast<Index>(s.hidden);
    const auto classes = static_cast<Index>(s.classes);
    MatrixMap hidden(hidden_.data(), batch, hidden_units);
    hidden.noalias() = ConstMatrixMap(pooled_.data(), batch, flat) *
                       ConstMatrixMap(w[kDenseKernel].data(), flat, hidden_units);
    hidden.rowwise() += ConstRowVectorMap(w[kDenseBias].data(), hidden_units);
    hidden = hidden.cwiseMax(0.0f);
    MatrixMap logits(logits_.data(), batch, classes);
    logits.noalias() = hidden * ConstMatrixMap(w[kOutKernel].data(), hidden_units, classes);
    logits.rowwise() += ConstRowVectorMap(w[kOutBias].data(), classes);

    MatrixMap probs(probs_.data(), batch, classes);
    BatchStats stats;
    stats.count = n;
    for (Index i = 0; i < batch; ++i) {
      Index arg_max = 0;
      const float max = logits.row(i).maxCoeff(&arg_max);
      probs.row(i) = (logits.row(i).array() - max).exp().matrix();
      const float sum = probs.row(i).sum();
      probs.row(i) /= sum;
      const int32_t label = labels_[static_cast<size_t>(i)];
      if (label < 0 || static_cast<size_t>(label) >= s.classes) {
        throw std::invalid_argument("CNN Forward: label " + std::to_string(label) +
                                    " is not a class");
      }
      stats.loss_sum += max + std::log(sum) - logits(i, label);
      if (arg_max == label) ++stats.correct;
    }
    return stats;
  }

  void Backward(Weights w, size_t n, float loss_scale) override {
    CheckWeights(model_, w, "CNN Backward");
    const CnnShape& s = d_.shape;
    const auto batch = static_cast<Index>(n);
    const auto flat = static_cast<Index>(d_.flat);
    const auto hidden_units = static_cast<Index>(s.hidden);
    const auto classes = static_cast<Index>(s.classes);
    const auto filters = static_cast<Index>(s.filters);
    const auto rows = static_cast<Index>(n * d_.positions);

    MatrixMap d_logits(d_logits_.data(), batch, classes);
    d_logits = ConstMatrixMap(probs_.data(), batch, classes);
    for (Index i = 0; i < batch; ++i) d_logits(i, labels_[static_cast<size_t>(i)]) -= 1.0f;
    d_logits *= loss_scale;

    ConstMatrixMap hidden(hidden_.data(), batch, hidden_units);
    MatrixMap(gradients_[kOutKernel].data(), hidden_units, classes).noalias() =
        hidden.transpose() * d_logits;
    RowVectorMap(gradients_[kOutBias].data(), classes) = d_logits.colwise().sum();
    MatrixMap d_hidden(d_hidden_.data(), batch, hidden_units);
    d_hidden.noalias() =
        d_logits * ConstMatrixMap(w[kOutKernel].data(), hidden_units, classes).transpose();
    d_hidden = (hidden.array() > 0.0f).select(d_hidden, 0.0f);

    ConstMatrixMap pooled(pooled_.data(), batch, flat);
    MatrixMap(gradients_[kDenseKernel].data(), flat, hidden_units).noalias() =
        pooled.transpose() * d_hidden;
    RowVectorMap(gradients_[kDenseBias].data(), hidden_units) = d_hidden.colwise().sum();
    MatrixMap d_pooled(d_pooled_.data(), batch, flat);
    d_pooled.noalias() =
        d_hidden * ConstMatrixMap(w[kDenseKernel].data(), flat, hidden_units).transpose();

    std::fill_n(d_conv_.begin(), n * d_.positions * s.filters, 0.0f);
    for (size_t k = 0; k < n * d_.flat; ++k) {
      const uint32_t at = winner_[k];
      if (conv_[at] > 0.0f) d_conv_[at] += d_pooled_[k];
    }
    ConstMatrixMap d_conv(d_conv_.data(), rows, filters);
    MatrixMap(gradients_[kConvKernel].data(), static_cast<Index>(kTaps), filters).noalias() =
        ConstMatrixMap(patches_.data(), rows, static_cast<Index>(kTaps)).transpose() * d_conv;
    RowVectorMap(gradients_[kConvBias].data(), filters) = d_conv.colwise().sum();
  }

 private:
  const Model& model_;
  Dims d_;
  std::vector<float> x_;
  std::vector<int32_t> labels_;
  std::vector<float> patches_;    // P, (n*OR*OC) x 9
  std::vector<float> conv_;       // A, (n*OR*OC) x F, after the ReLU
  std::vector<float> pooled_;     // Q, n x (PR*PC*F)
  std::vector<uint32_t> winner_;  // for each element of Q, its window's winner in A
  std::vector<float> hidden_;     // Hd, n x H, after the ReLU
  std::vector<float> logits_;     // Z, n x K
  std::vector<float> probs_;      // softmax(Z)
  std::vector<float> d_logits_, d_hidden_, d_pooled_, d_conv_;
  std::vector<std::vector<float>> gradients_;
  std::vector<std::span<float>> gradient_spans_;
};

class CnnModel final : public Model {
 public:
  explicit CnnModel(const CnnShape& shape) : d_(shape) {
    if (shape.rows < 4 || shape.cols < 4) {
      throw std::invalid_argument("CNN: images must be at least 4x4 (3x3 valid, then 2x2 pooling)");
    }
    if (shape.filters == 0 || shape.hidden == 0 || shape.classes == 0) {
      throw std::invalid_argument("CNN: a layer of width 0");
    }
    // The pooling winners are 32-bit indices into a batch's convolution output.
    if (d_.positions * shape.filters > (size_t{1} << 24)) {
      throw std::invalid_argument("CNN: images too large");
    }
  }

  std::string name() const override { return "cnn"; }
  std::string Describe() const override {
    const CnnShape& s = d_.shape;
    return "CNN " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + "x1 Conv2D(" +
           std::to_string(s.filters) + ", 3x3, ReLU) MaxPooling(2x2) Dense(" +
           std::to_string(s.hidden) + ", ReLU) Dense(" + std::to_string(s.classes) + ")";
  }
  size_t num_inputs() const override { return d_.shape.rows * d_.shape.cols; }
  size_t num_classes() const override { return d_.shape.classes; }
  size_t num_parameters() const override { return kParams; }
  std::string ParameterName(size_t p) const override {
    static const char* const kNames[kParams] = {"conv2d/kernel", "conv2d/bias",    "dense/kernel",
                                                "dense/bias",    "dense_1/kernel", "dense_1/bias"};
    if (p >= kParams) throw std::out_of_range("CNN: no parameter " + std::to_string(p));
    return kNames[p];
  }
  std::vector<size_t> ParameterShape(size_t p) const override {
    const CnnShape& s = d_.shape;
    switch (p) {
      case kConvKernel:
        return {kKernel, kKernel, 1, s.filters};
      case kConvBias:
        return {s.filters};
      case kDenseKernel:
        return {d_.flat, s.hidden};
      case kDenseBias:
        return {s.hidden};
      case kOutKernel:
        return {s.hidden, s.classes};
      case kOutBias:
        return {s.classes};
      default:
        throw std::out_of_range("CNN: no parameter " + std::to_string(p));
    }
  }
  void InitialValue(size_t p, uint64_t seed, std::span<float> value) const override {
    if (value.size() != ParameterCount(p)) {
      throw std::invalid_argument("CNN: " + ParameterName(p) + " has " +
                                  std::to_string(ParameterCount(p)) + " values, not " +
                                  std::to_string(value.size()));
    }
    const std::vector<size_t> shape = ParameterShape(p);
    if (p % 2 == 1) {
      std::fill(value.begin(), value.end(), 0.0f);
    } else if (p == kConvKernel) {  // Keras: fans are receptive field x in / out channels
      GlorotUniformFill(kTaps * shape[2], kTaps * shape[3], seed + p / 2, value);
    } else {
      GlorotUniformFill(shape[0], shape[1], seed + p / 2, value);
    }
  }
  std::unique_ptr<Workspace> MakeWorkspace(size_t max_batch) const override {
    return std::make_unique<CnnWorkspace>(*this, d_, max_batch);
  }

 private:
  Dims d_;
};

}  // namespace

std::unique_ptr<Model> MakeCnnModel(const CnnShape& shape) {
  return std::make_unique<CnnModel>(shape);
}

}  // namespace train
