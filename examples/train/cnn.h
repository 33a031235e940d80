// The Keras multi-worker guide's convolutional network, behind the Model interface (model.h):
//
//   Conv2D(filters, 3x3, valid, ReLU) on rows x cols x 1 -> (rows-2) x (cols-2) x filters
//   MaxPooling2D(2x2) (stride 2, valid: an odd last row or column is dropped)
//   Flatten (Keras' NHWC order: index (row * pooled_cols + col) * filters + filter)
//   Dense(hidden, ReLU), Dense(classes) logits
//
// For Fashion-MNIST (CnnShape's defaults: 28x28, 32 filters, 64 hidden, 10 classes) that is
// 26x26x32 -> 13x13x32 = 5408 -> 64 -> 10, 347,146 parameters: "conv2d/kernel" {3, 3, 1, 32},
// "conv2d/bias" {32}, "dense/kernel" {5408, 64}, "dense/bias" {64}, "dense_1/kernel" {64, 10},
// "dense_1/bias" {10}. Glorot-uniform kernels (a Conv2D kernel's fans are 3 * 3 * in_channels and
// 3 * 3 * filters, as Keras computes them), zero biases.
//
// Eigen, float, single-threaded; the convolution is im2col then one GEMM over the batch.
#ifndef COLLECTIVES_EXAMPLES_TRAIN_CNN_H_
#define COLLECTIVES_EXAMPLES_TRAIN_CNN_H_

#include <cstddef>
#include <memory>

#include "examples/train/model.h"

namespace train {

struct CnnShape {
  size_t rows = 28;
  size_t cols = 28;
  size_t filters = 32;
  size_t hidden = 64;
  size_t classes = 10;
};

// Throws std::invalid_argument for an image smaller than 4x4 or a zero width.
std::unique_ptr<Model> MakeCnnModel(const CnnShape& shape);

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_CNN_H_
