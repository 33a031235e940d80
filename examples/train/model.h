// The demo's models behind one interface, usable with or without a strategy: the training loop
// passes its replica's copy of every variable, a parameter-server worker the buffers it read from
// the servers, an evaluator the values it loaded from a checkpoint. Weights are plain float
// spans, one per parameter, in the model's fixed order (Keras' order and names, e.g.
// "dense/kernel" {784, 256}, row-major), so that any of them can hold them.
//
//   std::unique_ptr<train::Model> model = train::MakeModel("cnn");
//   std::vector<std::vector<float>> values(model->num_parameters());
//   for (size_t p = 0; p < values.size(); ++p) {
//     values[p].resize(model->ParameterCount(p));
//     model->InitialValue(p, seed, values[p]);
//   }
//   std::unique_ptr<train::Workspace> ws = model->MakeWorkspace(256);
//   train::Weights weights = train::WeightsOf(values);
//   data.Gather(batch, ws->x(), ws->labels());
//   train::BatchStats stats = ws->LossAndGradients(weights, batch.size(), 1.0f / global_batch);
//   ... ws->gradients()[p] is d(loss_scale * sum of losses) / d(parameter p)
//
// Models: "mlp", Dense(256, ReLU), Dense(256, ReLU), Dense(10) on 784 inputs (mlp.h); "cnn", the
// Keras multi-worker guide's network on 28x28x1 images: Conv2D(32, 3x3, valid, ReLU),
// MaxPooling2D(2x2), Flatten, Dense(64, ReLU), Dense(10) (cnn.h). Both output logits and train
// with sparse categorical cross-entropy from logits.
//
// Thread-safety: a Model is immutable; its methods may be called from any thread. A Workspace
// belongs to one thread at a time (one per replica).
#ifndef COLLECTIVES_EXAMPLES_TRAIN_MODEL_H_
#define COLLECTIVES_EXAMPLES_TRAIN_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace train {

// Sums over the examples of one batch.
struct BatchStats {
  double loss_sum = 0;  // sum of per-example cross-entropies
  size_t correct = 0;   // examples whose arg-max logit is the label
  size_t count = 0;     // examples
};

// One read-only span per parameter, in the model's order, each of ParameterCount(p) floats.
using Weights = std::span<const std::span<const float>>;

// Spans over `values` (one vector per parameter), for the calls below. The vectors must outlive
// the spans.
std::vector<std::span<const float>> WeightsOf(const std::vector<std::vector<float>>& values);

// One thread's scratch space for batches of up to max_batch() examples: inputs, activations,
// per-example losses, backward buffers, and one gradient buffer per parameter. Allocated once:
// no call below allocates.
class Workspace {
 public:
  virtual ~Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  size_t max_batch() const { return max_batch_; }
  // The next batch goes here: x() is max_batch() x num_inputs floats (row-major; an image is
  // rows x cols, row-major, values in [0, 1]), labels() max_batch() class indices.
  virtual float* x() = 0;
  virtual int32_t* labels() = 0;

  // The loss of the first `n` examples of x() / labels() under `weights`: logits, stable
  // log-softmax (loss = logsumexp(z) - z[label]), per-example losses; returns their sums.
  // Throws std::invalid_argument for a wrong number or size of weights, or n > max_batch().
  virtual BatchStats Forward(Weights weights, size_t n) = 0;
  // After Forward on the same batch and weights: the gradient of
  // loss_scale * sum(per-example losses) with respect to every parameter, into gradients().
  // With loss_scale = 1 / global batch size it is the replica's share of the gradient of the
  // global batch's mean loss (ComputeAverageLoss).
  virtual void Backward(Weights weights, size_t n, float loss_scale) = 0;
  // Forward, then Backward.
  BatchStats LossAndGradients(Weights weights, size_t n, float loss_scale);

  // The same, with the batch copied in from `images` (n x num_inputs) and `labels` (n) first.
  BatchStats Forward(Weights weights, const float* images, const int32_t* labels, size_t n);
  BatchStats LossAndGradients(Weights weights, const float* images, const int32_t* labels, size_t n,
                              float loss_scale);
  // Loss and accuracy sums over `n` examples, any number, max_batch() at a time.
  BatchStats Evaluate(Weights weights, const float* images, const int32_t* labels, size_t n);

  // One buffer per parameter, in the model's order, each ParameterCount(p) floats; written by
  // Backward. The spans stay valid, and keep pointing at the same memory, for the workspace's
  // life (the optimizer may overwrite them with the summed gradients).
  virtual const std::vector<std::span<float>>& gradients() const = 0;
  // Of the last Forward: the logits, n x num_classes, row-major.
  virtual std::span<const float> logits(size_t n) const = 0;

 protected:
  Workspace(size_t num_inputs, size_t max_batch) : num_inputs_(num_inputs), max_batch_(max_batch) {}

 private:
  size_t num_inputs_;
  size_t max_batch_;
};

class Model;
// Throws std::invalid_argument, naming `what` and the parameter, unless `weights` has one span
// per parameter of `model`, each of ParameterCount(p) floats.
void CheckWeights(const Model& model, Weights weights, const char* what);

class Model {
 public:
  virtual ~Model() = default;

  // "mlp" or "cnn": what MakeModel takes.
  virtual std::string name() const = 0;
  // One line for a person, e.g. "MLP 784-256-256-10".
  virtual std::string Describe() const = 0;
  virtual size_t num_inputs() const = 0;   // floats per example (784)
  virtual size_t num_classes() const = 0;  // 10

  // Parameters, in a fixed order: each layer's kernel, then its bias.
  virtual size_t num_parameters() const = 0;
  // Keras' names: "conv2d/kernel", "dense/bias", "dense_1/kernel", ...
  virtual std::string ParameterName(size_t p) const = 0;
  // Keras' shapes: a Dense kernel {in, out}, a Conv2D kernel {kh, kw, in_channels, filters}, a
  // bias {out}; values row-major in that shape.
  virtual std::vector<size_t> ParameterShape(size_t p) const = 0;
  size_t ParameterCount(size_t p) const;
  size_t TotalParameterCount() const;
  // Keras' default initial value into `value` (ParameterCount(p) floats): a kernel is Glorot
  // uniform, U(-l, l) with l = sqrt(6 / (fan_in + fan_out)), drawn from std::mt19937_64 seeded
  // with seed + its layer's index (the same numbers as collectives::strategy::GlorotUniform);
  // a bias is zero. Deterministic for a given seed.
  virtual void InitialValue(size_t p, uint64_t seed, std::span<float> value) const = 0;

  virtual std::unique_ptr<Workspace> MakeWorkspace(size_t max_batch) const = 0;
};

// The names MakeModel knows, "mlp" first (the default).
std::vector<std::string> ModelNames();
// The model called `name`, for Fashion-MNIST's 28x28 images and 10 classes. Throws
// std::invalid_argument naming the known models for any other name.
std::unique_ptr<Model> MakeModel(std::string_view name);

// Glorot uniform, as Model::InitialValue draws it: U(-l, l), l = sqrt(6 / (fan_in + fan_out)),
// from std::mt19937_64(seed), each 64-bit draw mapped to [0, 1) as its top 53 bits x 2^-53.
void GlorotUniformFill(size_t fan_in, size_t fan_out, uint64_t seed, std::span<float> value);

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_MODEL_H_
