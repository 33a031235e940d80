// The demo's model: a multilayer perceptron of Dense layers, ReLU between them, logits out
// (Keras: Dense(256, relu), Dense(256, relu), Dense(10) on 784 inputs), trained with sparse
// categorical cross-entropy from logits. Eigen does the math, in float, single-threaded.
//
// The model holds no weights: they live in the strategy's mirrored variables and every call
// takes a pointer per parameter, in Keras order (layer 0's kernel, layer 0's bias, layer 1's
// kernel, ...). A kernel of shape {in, out} is row-major (kernel[i * out + o]), so y = x W + b
// with x a row-major batch of examples.
//
// Thread-safety: Mlp is a plain value. An MlpWorkspace belongs to one replica (one thread).
#ifndef COLLECTIVES_EXAMPLES_TRAIN_MLP_H_
#define COLLECTIVES_EXAMPLES_TRAIN_MLP_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "examples/train/model.h"

namespace train {

class Mlp {
 public:
  // widths = {inputs, hidden..., classes}, e.g. {784, 256, 256, 10}; at least two entries.
  explicit Mlp(std::vector<size_t> widths);

  const std::vector<size_t>& widths() const { return widths_; }
  size_t num_layers() const { return widths_.size() - 1; }
  size_t num_inputs() const { return widths_.front(); }
  size_t num_classes() const { return widths_.back(); }

  // Parameters, Keras order: 2 * layer is the layer's kernel {in, out}, 2 * layer + 1 its bias
  // {out}.
  size_t num_parameters() const { return 2 * num_layers(); }
  std::vector<size_t> ParameterShape(size_t p) const;
  size_t ParameterCount(size_t p) const;
  // Keras' names: "dense/kernel", "dense/bias", "dense_1/kernel", ...
  std::string ParameterName(size_t p) const;
  // Total number of scalars over all parameters.
  size_t TotalParameterCount() const;

 private:
  std::vector<size_t> widths_;
};

// One replica's scratch space for batches of up to `max_batch` examples: inputs, activations,
// softmax, per-example losses, backward deltas, and one gradient buffer per parameter.
// Allocated once; Forward and Backward never allocate.
class MlpWorkspace {
 public:
  MlpWorkspace(const Mlp& model, size_t max_batch);
  MlpWorkspace(const MlpWorkspace&) = delete;
  MlpWorkspace& operator=(const MlpWorkspace&) = delete;
  MlpWorkspace(MlpWorkspace&&) = default;

  size_t max_batch() const { return max_batch_; }
  // The next batch goes here: x() is max_batch x num_inputs (row-major), labels() max_batch.
  float* x() { return acts_[0].data(); }
  int32_t* labels() { return labels_.data(); }

  // Forward pass over the first `batch` examples of x() / labels() with `params`
  // (num_parameters() pointers, Keras order). Computes logits, softmax and per-example losses
  // (stable log-softmax: loss = logsumexp(z) - z[label]); returns their sums.
  BatchStats Forward(std::span<const float* const> params, size_t batch);

  // After Forward on the same batch: the gradient of loss_scale * sum(per-example losses) with
  // respect to every parameter, into gradients(). With loss_scale = 1 / global batch size this
  // is the gradient of the replica's share of the mean loss (ComputeAverageLoss): dL/dlogits =
  // (softmax - onehot) / global_batch_size.
  void Backward(std::span<const float* const> params, size_t batch, float loss_scale);

  // One buffer per parameter, Keras order, each of ParameterCount(p) floats.
  const std::vector<std::span<float>>& gradients() const { return gradient_spans_; }
  // Of the last Forward: per-example losses (batch), logits (batch x classes), and the output
  // of hidden layer `layer` (1 <= layer < num_layers; batch x widths[layer], after ReLU).
  std::span<const float> per_example_loss(size_t batch) const;
  std::span<const float> logits(size_t batch) const;
  std::span<const float> hidden(size_t layer, size_t batch) const;

 private:
  Mlp model_;
  size_t max_batch_;
  std::vector<std::vector<float>> acts_;    // acts_[0] inputs, acts_[l] layer l's output
  std::vector<std::vector<float>> deltas_;  // deltas_[l]: dLoss/d(pre-activation of layer l+1)
  std::vector<float> probs_;                // softmax of the logits
  std::vector<float> losses_;
  std::vector<int32_t> labels_;
  std::vector<std::vector<float>> gradients_;
  std::vector<std::span<float>> gradient_spans_;
};

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_MLP_H_
