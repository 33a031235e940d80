// The demo's MLP with Eigen: see mlp.h.
//
// Forward, for layer l = 0 .. L-1 with A_0 = x (batch x in):
//   Z = A_l W_l + b_l;  A_{l+1} = relu(Z) for hidden layers, the logits for the last.
// Loss, per example: logsumexp(z) - z[label], with the max subtracted first so exp never
// overflows; softmax p = exp(z - logsumexp(z)).
// Backward, with D_L = loss_scale * (p - onehot(label)) (batch x classes):
//   dW_l = A_l^T D_{l+1};  db_l = column sums of D_{l+1};
//   D_l = (D_{l+1} W_l^T) .* (A_l > 0)   (the ReLU's derivative; not needed for l = 0).
#include "examples/train/mlp.h"

#include <Eigen/Core>
#include <cmath>
#include <stdexcept>
#include <string>

namespace train {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using RowVectorMap = Eigen::Map<Eigen::RowVectorXf>;
using ConstRowVectorMap = Eigen::Map<const Eigen::RowVectorXf>;

}  // namespace

Mlp::Mlp(std::vector<size_t> widths) : widths_(std::move(widths)) {
  if (widths_.size() < 2) throw std::invalid_argument("Mlp: needs at least inputs and outputs");
  for (size_t w : widths_) {
    if (w == 0) throw std::invalid_argument("Mlp: a layer of width 0");
  }
}

std::vector<size_t> Mlp::ParameterShape(size_t p) const {
  const size_t layer = p / 2;
  if (p % 2 == 0) return {widths_[layer], widths_[layer + 1]};
  return {widths_[layer + 1]};
}

size_t Mlp::ParameterCount(size_t p) const {
  const size_t layer = p / 2;
  return p % 2 == 0 ? widths_[layer] * widths_[layer + 1] : widths_[layer + 1];
}

std::string Mlp::ParameterName(size_t p) const {
  const size_t layer = p / 2;
  std::string name = layer == 0 ? "dense" : "dense_" + std::to_string(layer);
  return name + (p % 2 == 0 ? "/kernel" : "/bias");
}

size_t Mlp::TotalParameterCount() const {
  size_t total = 0;
  for (size_t p = 0; p < num_parameters(); ++p) total += ParameterCount(p);
  return total;
}

MlpWorkspace::MlpWorkspace(const Mlp& model, size_t max_batch)
    : model_(model), max_batch_(max_batch) {
  const auto& w = model_.widths();
  const size_t layers = model_.num_layers();
  acts_.resize(layers + 1);
  for (size_t l = 0; l <= layers; ++l) acts_[l].assign(max_batch * w[l], 0.0f);
  deltas_.resize(layers);
  for (size_t l = 0; l < layers; ++l) deltas_[l].assign(max_batch * w[l + 1], 0.0f);
  probs_.assign(max_batch * model_.num_classes(), 0.0f);
  losses_.assign(max_batch, 0.0f);
  labels_.assign(max_batch, 0);
  gradients_.resize(model_.num_parameters());
  for (size_t p = 0; p < model_.num_parameters(); ++p) {
    gradients_[p].assign(model_.ParameterCount(p), 0.0f);
    gradient_spans_.emplace_back(gradients_[p]);
  }
}

BatchStats MlpWorkspace::Forward(std::span<const float* const> params, size_t batch) {
  if (params.size() != model_.num_parameters()) {
    throw std::invalid_argument("MlpWorkspace::Forward: wrong number of parameters");
  }
  if (batch > max_batch_) throw std::invalid_argument("MlpWorkspace::Forward: batch too large");
  const auto& w = model_.widths();
  const auto n = static_cast<Eigen::Index>(batch);
  const size_t layers = model_.num_layers();
  for (size_t l = 0; l < layers; ++l) {
    const auto in = static_cast<Eigen::Index>(w[l]);
    const auto out = static_cast<Eigen::Index>(w[l + 1]);
    ConstMatrixMap a(acts_[l].data(), n, in);
    ConstMatrixMap kernel(params[2 * l], in, out);
    ConstRowVectorMap bias(params[2 * l + 1], out);
    MatrixMap z(acts_[l + 1].data(), n, out);
    z.noalias() = a * kernel;
    z.rowwise() += bias;
    if (l + 1 < layers) z = z.cwiseMax(0.0f);
  }

  const auto classes = static_cast<Eigen::Index>(model_.num_classes());
  ConstMatrixMap logits(acts_[layers].data(), n, classes);
  MatrixMap probs(probs_.data(), n, classes);
  BatchStats stats;
  stats.count = batch;
  for (Eigen::Index i = 0; i < n; ++i) {
    Eigen::Index arg_max = 0;
    const float max = logits.row(i).maxCoeff(&arg_max);
    probs.row(i) = (logits.row(i).array() - max).exp().matrix();
    const float sum = probs.row(i).sum();
    const float log_sum_exp = max + std::log(sum);
    probs.row(i) /= sum;
    const int32_t label = labels_[static_cast<size_t>(i)];
    const float loss = log_sum_exp - logits(i, label);
    losses_[static_cast<size_t>(i)] = loss;
    stats.loss_sum += loss;
    if (arg_max == label) ++stats.correct;
  }
  return stats;
}

void MlpWorkspace::Backward(std::span<const float* const> params, size_t batch, float loss_scale) {
  if (params.size() != model_.num_parameters()) {
    throw std::invalid_argument("MlpWorkspace::Backward: wrong number of parameters");
  }
  const auto& w = model_.widths();
  const auto n = static_cast<Eigen::Index>(batch);
  const size_t layers = model_.num_layers();
  const auto classes = static_cast<Eigen::Index>(model_.num_classes());

  MatrixMap d_logits(deltas_[layers - 1].data(), n, classes);
  d_logits = ConstMatrixMap(probs_.data(), n, classes);
  for (Eigen::Index i = 0; i < n; ++i) d_logits(i, labels_[static_cast<size_t>(i)]) -= 1.0f;
  d_logits *= loss_scale;

  for (size_t l = layers; l-- > 0;) {
    const auto in = static_cast<Eigen::Index>(w[l]);
    const auto out = static_cast<Eigen::Index>(w[l + 1]);
    ConstMatrixMap a(acts_[l].data(), n, in);
    ConstMatrixMap delta(deltas_[l].data(), n, out);
    MatrixMap d_kernel(gradients_[2 * l].data(), in, out);
    RowVectorMap d_bias(gradients_[2 * l + 1].data(), out);
    d_kernel.noalias() = a.transpose() * delta;
    d_bias = delta.colwise().sum();
    if (l > 0) {
      ConstMatrixMap kernel(params[2 * l], in, out);
      MatrixMap d_prev(deltas_[l - 1].data(), n, in);
      d_prev.noalias() = delta * kernel.transpose();
      d_prev = (a.array() > 0.0f).select(d_prev, 0.0f);
    }
  }
}

std::span<const float> MlpWorkspace::per_example_loss(size_t batch) const {
  return {losses_.data(), batch};
}

std::span<const float> MlpWorkspace::logits(size_t batch) const {
  return {acts_.back().data(), batch * model_.num_classes()};
}

std::span<const float> MlpWorkspace::hidden(size_t layer, size_t batch) const {
  return {acts_.at(layer).data(), batch * model_.widths().at(layer)};
}

}  // namespace train
