// GpuMlp: see gpu_mlp.h. The products, with row-major matrices seen by cuBLAS as their
// column-major transposes (a row-major r x c matrix is a column-major c x r one):
//   forward   Z (n x out) = A (n x in) W (in x out):     Sgemm(N, N, out, n, in, W, A -> Z)
//   kernel    dW (in x out) = A^T (in x n) D (n x out):   Sgemm(N, T, out, in, n, D, A -> dW)
//   delta     D' (n x in) = D (n x out) W^T (out x in):   Sgemm(T, N, in, n, out, W, D -> D')
#include "examples/train/gpu_mlp.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#if TRAIN_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

namespace train {

std::vector<size_t> GpuMlp::WidthsOf(const Model& model) {
  if (model.name() != "mlp") {
    throw std::invalid_argument("--device gpu trains the MLP only (--model mlp); the " +
                                model.name() + " has no GPU path");
  }
  std::vector<size_t> widths;
  for (size_t p = 0; p < model.num_parameters(); p += 2) {
    const std::vector<size_t> shape = model.ParameterShape(p);
    if (widths.empty()) widths.push_back(shape.at(0));
    widths.push_back(shape.at(1));
  }
  return widths;
}

#if TRAIN_WITH_CUDA

// The runtime functions, looked up once per process.
struct GpuMlp::Cuda {
  decltype(&::cudaSetDevice) set_device = nullptr;
  cudaError_t (*malloc)(void**, size_t) = nullptr;
  decltype(&::cudaFree) free = nullptr;
  decltype(&::cudaMemcpy) memcpy = nullptr;
  decltype(&::cudaGetErrorString) error_string = nullptr;
  decltype(&::cublasCreate_v2) create = nullptr;
  decltype(&::cublasDestroy_v2) destroy = nullptr;
  decltype(&::cublasSgemm_v2) sgemm = nullptr;
  cublasHandle_t handle = nullptr;
  int device = 0;

  void Check(cudaError_t status, const char* what) const {
    if (status != cudaSuccess) {
      throw std::runtime_error(std::string("GPU MLP on cuda:") + std::to_string(device) + ": " +
                               what + " failed: " + error_string(status));
    }
  }
  void Use() const { Check(set_device(device), "cudaSetDevice"); }
  void Down(float* dst, const float* src, size_t count) const {  // device -> host
    if (count > 0)
      Check(memcpy(dst, src, count * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  void Up(float* dst, const float* src, size_t count) const {  // host -> device
    if (count > 0)
      Check(memcpy(dst, src, count * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  // C = op(A) op(B), column-major (cuBLAS's convention).
  void Gemm(bool ta, bool tb, size_t m, size_t n, size_t k, const float* a, size_t lda,
            const float* b, size_t ldb, float* c, size_t ldc) const {
    const float one = 1.0f;
    const float zero = 0.0f;
    const cublasStatus_t status =
        sgemm(handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &one, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), &zero, c, static_cast<int>(ldc));
    if (status != CUBLAS_STATUS_SUCCESS) {
      throw std::runtime_error("GPU MLP on cuda:" + std::to_string(device) +
                               ": cublasSgemm failed with status " + std::to_string(status));
    }
  }
};

namespace {

void* OpenFirst(std::initializer_list<const char*> names, std::string& errors) {
  for (const char* name : names) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return handle;
    errors += std::string(errors.empty() ? "" : "; ") + dlerror();
  }
  return nullptr;
}

template <typename T>
void Find(void* library, const char* name, T& out) {
  out = reinterpret_cast<T>(dlsym(library, name));
  if (out == nullptr)
    throw std::runtime_error(std::string("--device gpu: ") + name + " is missing");
}

}  // namespace

GpuMlp::GpuMlp(std::vector<size_t> widths, int device, size_t max_batch)
    : cuda_(std::make_unique<Cuda>()),
      widths_(std::move(widths)),
      device_(device),
      max_batch_(max_batch) {
  std::string errors;
  void* cudart = OpenFirst({"libcudart.so.13", "libcudart.so.12", "libcudart.so"}, errors);
  void* cublas = OpenFirst({"libcublas.so.13", "libcublas.so.12", "libcublas.so"}, errors);
  if (cudart == nullptr || cublas == nullptr) {
    throw std::runtime_error("--device gpu needs libcudart and libcublas: " + errors);
  }
  Cuda& c = *cuda_;
  c.device = device;
  Find(cudart, "cudaSetDevice", c.set_device);
  Find(cudart, "cudaMalloc", c.malloc);
  Find(cudart, "cudaFree", c.free);
  Find(cudart, "cudaMemcpy", c.memcpy);
  Find(cudart, "cudaGetErrorString", c.error_string);
  Find(cublas, "cublasCreate_v2", c.create);
  Find(cublas, "cublasDestroy_v2", c.destroy);
  Find(cublas, "cublasSgemm_v2", c.sgemm);
  c.Use();
  if (c.create(&c.handle) != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error("--device gpu: cublasCreate failed on cuda:" + std::to_string(device));
  }
  const size_t layers = widths_.size() - 1;
  const auto alloc = [&](size_t count) {
    void* p = nullptr;
    c.Check(c.malloc(&p, std::max<size_t>(count, 1) * sizeof(float)), "cudaMalloc");
    return static_cast<float*>(p);
  };
  host_acts_.resize(layers + 1);
  acts_.resize(layers + 1);
  for (size_t l = 0; l <= layers; ++l) {
    host_acts_[l].assign(max_batch * widths_[l], 0.0f);
    acts_[l] = alloc(max_batch * widths_[l]);
  }
  host_deltas_.resize(layers);
  deltas_.resize(layers);
  host_bias_.resize(layers);
  for (size_t l = 0; l < layers; ++l) {
    host_deltas_[l].assign(max_batch * widths_[l + 1], 0.0f);
    deltas_[l] = alloc(max_batch * widths_[l + 1]);
    host_bias_[l].assign(widths_[l + 1], 0.0f);
  }
  probs_.assign(max_batch * widths_.back(), 0.0f);
  labels_.assign(max_batch, 0);
  for (size_t l = 0; l < layers; ++l) {
    for (size_t count : {widths_[l] * widths_[l + 1], widths_[l + 1]}) {
      grads_.push_back(alloc(count));
      gradient_tensors_.push_back(collectives::Tensor{grads_.back(), count,
                                                      collectives::DataType::kFloat32,
                                                      collectives::Device::Cuda(device)});
    }
  }
}

GpuMlp::~GpuMlp() {
  Cuda& c = *cuda_;
  if (c.set_device == nullptr) return;
  c.set_device(device_);
  for (float* p : acts_) c.free(p);
  for (float* p : deltas_) c.free(p);
  for (float* p : grads_) c.free(p);
  if (c.handle != nullptr) c.destroy(c.handle);
}

BatchStats GpuMlp::Forward(const std::vector<const float*>& params, size_t batch) {
  const size_t layers = widths_.size() - 1;
  if (params.size() != 2 * layers)
    throw std::invalid_argument("GpuMlp::Forward: wrong number of parameters");
  if (batch > max_batch_) throw std::invalid_argument("GpuMlp::Forward: batch too large");
  const Cuda& c = *cuda_;
  c.Use();
  c.Up(acts_[0], host_acts_[0].data(), batch * widths_[0]);
  for (size_t l = 0; l < layers; ++l) {
    const size_t in = widths_[l];
    const size_t out = widths_[l + 1];
    c.Gemm(false, false, out, batch, in, params[2 * l], out, acts_[l], in, acts_[l + 1], out);
    // Bias and ReLU on the host.
    c.Down(host_bias_[l].data(), params[2 * l + 1], out);
    float* z = host_acts_[l + 1].data();
    c.Down(z, acts_[l + 1], batch * out);
    const bool hidden = l + 1 < layers;
    for (size_t i = 0; i < batch; ++i) {
      for (size_t o = 0; o < out; ++o) {
        float& v = z[i * out + o];
        v += host_bias_[l][o];
        if (hidden) v = std::max(v, 0.0f);
      }
    }
    if (hidden) c.Up(acts_[l + 1], z, batch * out);
  }
  // Softmax cross-entropy from the logits, on the host (mlp.cc's arithmetic).
  const size_t classes = widths_.back();
  const float* logits = host_acts_[layers].data();
  BatchStats stats;
  stats.count = batch;
  for (size_t i = 0; i < batch; ++i) {
    const float* row = logits + i * classes;
    float* p = probs_.data() + i * classes;
    const size_t arg_max = static_cast<size_t>(std::max_element(row, row + classes) - row);
    const float max = row[arg_max];
    float sum = 0.0f;
    for (size_t k = 0; k < classes; ++k) sum += (p[k] = std::exp(row[k] - max));
    for (size_t k = 0; k < classes; ++k) p[k] /= sum;
    const auto label = static_cast<size_t>(labels_[i]);
    const float loss = max + std::log(sum) - row[label];
    stats.loss_sum += loss;
    if (arg_max == label) ++stats.correct;
  }
  return stats;
}

void GpuMlp::Backward(const std::vector<const float*>& params, size_t batch, float loss_scale) {
  const size_t layers = widths_.size() - 1;
  const Cuda& c = *cuda_;
  c.Use();
  const size_t classes = widths_.back();
  float* d_logits = host_deltas_[layers - 1].data();
  for (size_t i = 0; i < batch; ++i) {
    for (size_t k = 0; k < classes; ++k) {
      const float onehot = static_cast<size_t>(labels_[i]) == k ? 1.0f : 0.0f;
      d_logits[i * classes + k] = (probs_[i * classes + k] - onehot) * loss_scale;
    }
  }
  c.Up(deltas_[layers - 1], d_logits, batch * classes);
  for (size_t l = layers; l-- > 0;) {
    const size_t in = widths_[l];
    const size_t out = widths_[l + 1];
    c.Gemm(false, true, out, in, batch, deltas_[l], out, acts_[l], in, grads_[2 * l], out);
    // The bias gradient: column sums of the delta, on the host.
    bias_gradient_.assign(out, 0.0f);
    const float* delta = host_deltas_[l].data();
    for (size_t i = 0; i < batch; ++i) {
      for (size_t o = 0; o < out; ++o) bias_gradient_[o] += delta[i * out + o];
    }
    c.Up(grads_[2 * l + 1], bias_gradient_.data(), out);
    if (l == 0) continue;
    c.Gemm(true, false, in, batch, out, params[2 * l], out, deltas_[l], out, deltas_[l - 1], in);
    float* prev = host_deltas_[l - 1].data();
    c.Down(prev, deltas_[l - 1], batch * in);
    const float* a = host_acts_[l].data();  // this layer's input, after the ReLU
    for (size_t j = 0; j < batch * in; ++j) {
      if (!(a[j] > 0.0f)) prev[j] = 0.0f;
    }
    c.Up(deltas_[l - 1], prev, batch * in);
  }
}

#else  // !TRAIN_WITH_CUDA

struct GpuMlp::Cuda {};

GpuMlp::GpuMlp(std::vector<size_t> widths, int device, size_t max_batch)
    : widths_(std::move(widths)), device_(device), max_batch_(max_batch) {
  throw std::runtime_error(
      "--device gpu: this build of the demo has no CUDA support (build with "
      "-DCOLLECTIVES_WITH_NCCL=ON and the CUDA toolkit)");
}
GpuMlp::~GpuMlp() = default;
BatchStats GpuMlp::Forward(const std::vector<const float*>&, size_t) { return {}; }
void GpuMlp::Backward(const std::vector<const float*>&, size_t, float) {}

#endif  // TRAIN_WITH_CUDA

}  // namespace train
