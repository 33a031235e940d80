// The demo's MLP (mlp.h) on one CUDA device, for GPU replicas (`train --device gpu`): weights,
// activations and gradients in device memory; the dense layers' matrix products through cuBLAS
// (cublasSgemm); the element-wise steps (bias, ReLU, softmax cross-entropy, the ReLU mask and
// the bias gradient) on the host over copies, since the library and the demo have no CUDA
// kernels of their own. Per layer and step that costs a copy of the layer's output down and
// back up (forward) and of its delta (backward); the matrix products, most of the arithmetic,
// stay on the device.
//
// libcudart and libcublas are opened at run time (dlopen, as src/nccl/nccl_loader.h does), so
// the demo builds without CUDA and runs its CPU path on any machine; GpuMlp's constructor throws
// std::runtime_error naming what is missing.
//
// Thread-safety: a GpuMlp belongs to one replica's thread; every call makes its device current
// on that thread.
#ifndef COLLECTIVES_EXAMPLES_TRAIN_GPU_MLP_H_
#define COLLECTIVES_EXAMPLES_TRAIN_GPU_MLP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "collectives/types.h"
#include "examples/train/model.h"

namespace train {

class GpuMlp {
 public:
  // widths = {inputs, hidden..., classes}; the parameters are in mlp.h's order (kernel {in,
  // out} row-major, then bias, per layer). Buffers for batches of up to `max_batch` examples on
  // CUDA device `device`.
  GpuMlp(std::vector<size_t> widths, int device, size_t max_batch);
  ~GpuMlp();
  GpuMlp(const GpuMlp&) = delete;
  GpuMlp& operator=(const GpuMlp&) = delete;

  // The widths of a model with mlp.h's parameter layout ("mlp"); throws std::invalid_argument
  // for any other model (the CNN has no GPU path).
  static std::vector<size_t> WidthsOf(const Model& model);

  size_t max_batch() const { return max_batch_; }
  // The next batch goes here (host memory), as Workspace::x() and labels().
  float* x() { return host_acts_[0].data(); }
  int32_t* labels() { return labels_.data(); }

  // As MlpWorkspace::Forward and Backward, with `params` pointers into the memory of this
  // replica's device (MirroredVariable::tensor(i).data).
  BatchStats Forward(const std::vector<const float*>& params, size_t batch);
  void Backward(const std::vector<const float*>& params, size_t batch, float loss_scale);

  // The gradients of the last Backward, in device memory, one float32 tensor per parameter.
  const std::vector<collectives::Tensor>& gradients() const { return gradient_tensors_; }

 private:
  struct Cuda;
  std::unique_ptr<Cuda> cuda_;
  std::vector<size_t> widths_;
  int device_;
  size_t max_batch_;
  std::vector<std::vector<float>> host_acts_;    // [0] inputs, [l] layer l's output
  std::vector<std::vector<float>> host_deltas_;  // [l]: d loss / d pre-activation of layer l+1
  std::vector<std::vector<float>> host_bias_;    // layer l's bias, read per Forward
  std::vector<float> probs_;
  std::vector<int32_t> labels_;
  std::vector<float> bias_gradient_;
  std::vector<float*> acts_;    // device: [0] inputs, [l] layer l's output (after ReLU)
  std::vector<float*> deltas_;  // device, as host_deltas_
  std::vector<float*> grads_;   // device, one per parameter
  std::vector<collectives::Tensor> gradient_tensors_;
};

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_GPU_MLP_H_
