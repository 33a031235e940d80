// The Model interface (model.h), the MLP behind it, and the registry of models by name.
#include "examples/train/model.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

#include "examples/train/cnn.h"
#include "examples/train/mlp.h"

namespace train {

std::vector<std::span<const float>> WeightsOf(const std::vector<std::vector<float>>& values) {
  return {values.begin(), values.end()};
}

void GlorotUniformFill(size_t fan_in, size_t fan_out, uint64_t seed, std::span<float> value) {
  if (fan_in + fan_out == 0) throw std::invalid_argument("Glorot uniform: fan_in + fan_out is 0");
  const double limit = std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  std::mt19937_64 rng(seed);
  for (float& v : value) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
    v = static_cast<float>((2.0 * u - 1.0) * limit);
  }
}

// ---- Workspace --------------------------------------------------------------------------------

BatchStats Workspace::LossAndGradients(Weights weights, size_t n, float loss_scale) {
  const BatchStats stats = Forward(weights, n);
  Backward(weights, n, loss_scale);
  return stats;
}

BatchStats Workspace::Forward(Weights weights, const float* images, const int32_t* labels,
                              size_t n) {
  if (n > max_batch_) {
    throw std::invalid_argument("Workspace::Forward: batch of " + std::to_string(n) +
                                " is more than max_batch " + std::to_string(max_batch_));
  }
  std::copy_n(images, n * num_inputs_, x());
  std::copy_n(labels, n, this->labels());
  return Forward(weights, n);
}

BatchStats Workspace::LossAndGradients(Weights weights, const float* images, const int32_t* labels,
                                       size_t n, float loss_scale) {
  const BatchStats stats = Forward(weights, images, labels, n);
  Backward(weights, n, loss_scale);
  return stats;
}

BatchStats Workspace::Evaluate(Weights weights, const float* images, const int32_t* labels,
                               size_t n) {
  BatchStats total;
  for (size_t i = 0; i < n; i += max_batch_) {
    const size_t m = std::min(max_batch_, n - i);
    const BatchStats s = Forward(weights, images + i * num_inputs_, labels + i, m);
    total.loss_sum += s.loss_sum;
    total.correct += s.correct;
    total.count += s.count;
  }
  return total;
}

// ---- Model ------------------------------------------------------------------------------------

size_t Model::ParameterCount(size_t p) const {
  size_t count = 1;
  for (size_t d : ParameterShape(p)) count *= d;
  return count;
}

size_t Model::TotalParameterCount() const {
  size_t total = 0;
  for (size_t p = 0; p < num_parameters(); ++p) total += ParameterCount(p);
  return total;
}

// Checks `weights` against `model`: one span per parameter, each of its count. `what` names the
// caller in the message.
void CheckWeights(const Model& model, Weights weights, const char* what) {
  if (weights.size() != model.num_parameters()) {
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(weights.size()) +
                                " weights for the " + std::to_string(model.num_parameters()) +
                                " parameters of " + model.Describe());
  }
  for (size_t p = 0; p < weights.size(); ++p) {
    if (weights[p].size() != model.ParameterCount(p)) {
      throw std::invalid_argument(std::string(what) + ": " + model.ParameterName(p) + " has " +
                                  std::to_string(weights[p].size()) + " values, not " +
                                  std::to_string(model.ParameterCount(p)));
    }
  }
}

namespace {

// The MLP of mlp.h behind the interface; its workspace keeps a pointer per parameter for
// MlpWorkspace's calls, sized once.
class MlpWorkspaceAdapter final : public Workspace {
 public:
  MlpWorkspaceAdapter(const Model& model, const Mlp& mlp, size_t max_batch)
      : Workspace(mlp.num_inputs(), max_batch),
        model_(model),
        workspace_(mlp, max_batch),
        params_(mlp.num_parameters()) {}

  float* x() override { return workspace_.x(); }
  int32_t* labels() override { return workspace_.labels(); }
  BatchStats Forward(Weights weights, size_t n) override {
    Bind(weights, "MLP Forward");
    if (n > max_batch()) {
      throw std::invalid_argument("MLP Forward: batch of " + std::to_string(n) +
                                  " is more than max_batch " + std::to_string(max_batch()));
    }
    return workspace_.Forward(params_, n);
  }
  void Backward(Weights weights, size_t n, float loss_scale) override {
    Bind(weights, "MLP Backward");
    workspace_.Backward(params_, n, loss_scale);
  }
  const std::vector<std::span<float>>& gradients() const override { return workspace_.gradients(); }
  std::span<const float> logits(size_t n) const override { return workspace_.logits(n); }

 private:
  void Bind(Weights weights, const char* what) {
    CheckWeights(model_, weights, what);
    for (size_t p = 0; p < params_.size(); ++p) params_[p] = weights[p].data();
  }

  const Model& model_;
  MlpWorkspace workspace_;
  std::vector<const float*> params_;
};

class MlpModel final : public Model {
 public:
  explicit MlpModel(std::vector<size_t> widths) : mlp_(std::move(widths)) {}

  std::string name() const override { return "mlp"; }
  std::string Describe() const override {
    std::string text = "MLP ";
    for (size_t i = 0; i < mlp_.widths().size(); ++i) {
      if (i > 0) text += '-';
      text += std::to_string(mlp_.widths()[i]);
    }
    return text;
  }
  size_t num_inputs() const override { return mlp_.num_inputs(); }
  size_t num_classes() const override { return mlp_.num_classes(); }
  size_t num_parameters() const override { return mlp_.num_parameters(); }
  std::string ParameterName(size_t p) const override { return mlp_.ParameterName(p); }
  std::vector<size_t> ParameterShape(size_t p) const override { return mlp_.ParameterShape(p); }
  void InitialValue(size_t p, uint64_t seed, std::span<float> value) const override {
    const std::vector<size_t> shape = mlp_.ParameterShape(p);
    if (p % 2 == 0) {
      GlorotUniformFill(shape[0], shape[1], seed + p / 2, value);
    } else {
      std::fill(value.begin(), value.end(), 0.0f);
    }
  }
  std::unique_ptr<Workspace> MakeWorkspace(size_t max_batch) const override {
    return std::make_unique<MlpWorkspaceAdapter>(*this, mlp_, max_batch);
  }

 private:
  Mlp mlp_;
};

}  // namespace

std::vector<std::string> ModelNames() { return {"mlp", "cnn"}; }

std::unique_ptr<Model> MakeModel(std::string_view name) {
  if (name == "mlp") return std::make_unique<MlpModel>(std::vector<size_t>{784, 256, 256, 10});
  if (name == "cnn") return MakeCnnModel(CnnShape{});
  throw std::invalid_argument("unknown model '" + std::string(name) + "' (known: mlp, cnn)");
}

}  // namespace train
