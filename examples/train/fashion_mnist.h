// Reads Fashion-MNIST (or MNIST) from its IDX files, gzipped or not, as Debian's
// dataset-fashion-mnist installs them under /usr/share/datasets/fashion-mnist/:
//   train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz   (60000 examples)
//   t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz    (10000 examples)
//
// IDX format: a big-endian header, magic 0x00 0x00 <type> <rank> (type 0x08 = unsigned byte),
// then `rank` 32-bit big-endian dimension sizes, then the elements in row-major order.
//
// Errors (a missing file, a bad magic, a truncated body, labels and images that disagree) throw
// std::runtime_error with the path and what is wrong.
//
// Thread-safety: plain functions and values.
#ifndef COLLECTIVES_EXAMPLES_TRAIN_FASHION_MNIST_H_
#define COLLECTIVES_EXAMPLES_TRAIN_FASHION_MNIST_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace train {

// An IDX array of unsigned bytes: its dimension sizes and its elements.
struct IdxArray {
  std::vector<size_t> dims;
  std::vector<uint8_t> data;
};

// Reads a whole IDX file (gzip or plain: zlib reads both). `max_items` > 0 keeps only the first
// `max_items` items along the first dimension (the rest is not decompressed).
IdxArray ReadIdx(const std::string& path, size_t max_items = 0);

// Images and labels of one split. Pixels stay bytes (0..255) until a batch is gathered.
struct ImageDataset {
  size_t count = 0;
  size_t rows = 0;
  size_t cols = 0;
  std::vector<uint8_t> pixels;  // count x rows x cols
  std::vector<uint8_t> labels;  // count, each < num_classes
  size_t features() const { return rows * cols; }

  // Copies the examples `indices` into `x` (indices.size() x features(), row-major, scaled to
  // [0, 1]) and their labels into `y`.
  void Gather(const std::vector<size_t>& indices, float* x, int32_t* y) const;
  // The same for the contiguous range [begin, begin + n).
  void GatherRange(size_t begin, size_t n, float* x, int32_t* y) const;
};

// Reads `<dir>/<prefix>-images-idx3-ubyte.gz` and `<dir>/<prefix>-labels-idx1-ubyte.gz`
// (prefix "train" or "t10k"; without ".gz" when only the plain file exists). `limit` > 0 keeps
// the first `limit` examples. Checks that the counts agree and every label is < num_classes.
ImageDataset LoadFashionMnist(const std::string& dir, const std::string& prefix, size_t limit = 0,
                              int num_classes = 10);

// The default folder of Debian's dataset-fashion-mnist.
inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

}  // namespace train

#endif  // COLLECTIVES_EXAMPLES_TRAIN_FASHION_MNIST_H_
