// IDX reader for Fashion-MNIST: see fashion_mnist.h.
#include "examples/train/fashion_mnist.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace train {
namespace {

[[noreturn]] void Fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("fashion_mnist: " + path + ": " + what);
}

// Owns a gzFile; gzread reads plain files unchanged, so both forms work.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb")) {
    if (file_ == nullptr) Fail(path, "cannot open (missing file? install dataset-fashion-mnist)");
    gzbuffer(file_, 1 << 17);
  }
  ~GzReader() { gzclose(file_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads `bytes` bytes, fewer only at the end of the data; returns how many. Throws on a read
  // error, naming `what` was being read.
  size_t ReadUpTo(void* out, size_t bytes, const char* what) {
    auto* p = static_cast<unsigned char*>(out);
    size_t done = 0;
    while (done < bytes) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(bytes - done, 1u << 30));
      const int got = gzread(file_, p + done, chunk);
      if (got < 0) {
        int errnum = 0;
        const char* message = gzerror(file_, &errnum);
        Fail(path_, std::string("read error in ") + what + ": " + message);
      }
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }

  // Reads exactly `bytes` bytes or throws, naming `what` was being read.
  void ReadExactly(void* out, size_t bytes, const char* what) {
    const size_t got = ReadUpTo(out, bytes, what);
    if (got < bytes) Truncated(what, bytes, got);
  }

  [[noreturn]] void Truncated(const char* what, size_t expected, size_t got) const {
    Fail(path_, std::string("truncated ") + what + ": expected " + std::to_string(expected) +
                    " bytes, got " + std::to_string(got));
  }

 private:
  std::string path_;
  gzFile file_;
};

uint32_t BigEndian32(const unsigned char* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// `<dir>/<name>.gz` when it exists, else `<dir>/<name>` (which may not exist either: ReadIdx
// then says so).
std::string Locate(const std::string& dir, const std::string& name) {
  const std::string gz = dir + "/" + name + ".gz";
  if (Exists(gz)) return gz;
  const std::string plain = dir + "/" + name;
  return Exists(plain) ? plain : gz;
}

}  // namespace

IdxArray ReadIdx(const std::string& path, size_t max_items) {
  GzReader in(path);
  unsigned char magic[4];
  in.ReadExactly(magic, sizeof magic, "header");
  if (magic[0] != 0 || magic[1] != 0) Fail(path, "not an IDX file (bad magic)");
  if (magic[2] != 0x08) {
    char type[8];
    std::snprintf(type, sizeof type, "0x%02x", magic[2]);
    Fail(path,
         std::string("unsupported IDX element type ") + type + " (only unsigned bytes, 0x08)");
  }
  const int rank = magic[3];
  if (rank < 1 || rank > 4) Fail(path, "unsupported IDX rank " + std::to_string(rank));

  IdxArray array;
  size_t total = 1;
  for (int d = 0; d < rank; ++d) {
    unsigned char b[4];
    in.ReadExactly(b, sizeof b, "header");
    const size_t size = BigEndian32(b);
    // Fashion-MNIST has at most 60000 items of 28x28: anything near 2^32 is a corrupt header.
    if (size == 0 || size > (size_t{1} << 28)) {
      Fail(path, "implausible dimension " + std::to_string(d) + " size " + std::to_string(size));
    }
    array.dims.push_back(size);
  }
  if (max_items > 0 && max_items < array.dims[0]) array.dims[0] = max_items;
  for (size_t size : array.dims) {
    total *= size;
    if (total > (size_t{1} << 32)) Fail(path, "IDX array larger than 4 GiB");
  }
  // The body is read in chunks that grow (1 MiB, then doubling) as data arrives, never sized by
  // the header alone: a header that declares more than the file holds (up to 4 GiB) fails as
  // "truncated body" having allocated at most 1 MiB more than the file's data.
  constexpr size_t kFirstChunk = size_t{1} << 20;
  while (array.data.size() < total) {
    const size_t done = array.data.size();
    const size_t want = std::min(total - done, std::max(kFirstChunk, done));
    array.data.resize(done + want);
    const size_t got = in.ReadUpTo(array.data.data() + done, want, "body");
    if (got < want) in.Truncated("body", total, done + got);
  }
  return array;
}

void ImageDataset::Gather(const std::vector<size_t>& indices, float* x, int32_t* y) const {
  const size_t f = features();
  constexpr float kScale = 1.0f / 255.0f;
  for (size_t i = 0; i < indices.size(); ++i) {
    const uint8_t* src = pixels.data() + indices[i] * f;
    float* dst = x + i * f;
    for (size_t j = 0; j < f; ++j) dst[j] = static_cast<float>(src[j]) * kScale;
    y[i] = labels[indices[i]];
  }
}

void ImageDataset::GatherRange(size_t begin, size_t n, float* x, int32_t* y) const {
  const size_t f = features();
  constexpr float kScale = 1.0f / 255.0f;
  const uint8_t* src = pixels.data() + begin * f;
  for (size_t j = 0; j < n * f; ++j) x[j] = static_cast<float>(src[j]) * kScale;
  for (size_t i = 0; i < n; ++i) y[i] = labels[begin + i];
}

ImageDataset LoadFashionMnist(const std::string& dir, const std::string& prefix, size_t limit,
                              int num_classes) {
  const std::string images_path = Locate(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = Locate(dir, prefix + "-labels-idx1-ubyte");
  IdxArray images = ReadIdx(images_path, limit);
  IdxArray labels = ReadIdx(labels_path, limit);
  if (images.dims.size() != 3) {
    Fail(images_path,
         "expected 3 dimensions (count, rows, cols), got " + std::to_string(images.dims.size()));
  }
  if (labels.dims.size() != 1) {
    Fail(labels_path, "expected 1 dimension (count), got " + std::to_string(labels.dims.size()));
  }
  if (images.dims[0] != labels.dims[0]) {
    Fail(labels_path, std::to_string(labels.dims[0]) + " labels for " +
                          std::to_string(images.dims[0]) + " images in " + images_path);
  }
  for (size_t i = 0; i < labels.data.size(); ++i) {
    if (labels.data[i] >= num_classes) {
      Fail(labels_path, "label " + std::to_string(labels.data[i]) + " of example " +
                            std::to_string(i) + " is not below " + std::to_string(num_classes));
    }
  }
  ImageDataset dataset;
  dataset.count = images.dims[0];
  dataset.rows = images.dims[1];
  dataset.cols = images.dims[2];
  dataset.pixels = std::move(images.data);
  dataset.labels = std::move(labels.data);
  return dataset;
}

}  // namespace train
