// A message that lies in runs of memory, end to end: the packer's fused bucket, its tensors
// where they are. The TCP and in-process transports send frames gathered from such a message
// and receive them scattered into it (transport::Connection), and the shared-memory group copies
// it into and out of its slots (hierarchical::ShmGroup), so that a bucket needs no fusion buffer.
//
// Thread-safety: built by one thread before the call that uses it; const afterwards.
#ifndef COLLECTIVES_SRC_CORE_RUNS_H_
#define COLLECTIVES_SRC_CORE_RUNS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "collectives/types.h"

namespace collectives::core {

// Byte `offset` of the message is byte offset - (the bytes of the runs before it) of the run that
// holds it. Empty runs are left out.
class Runs {
 public:
  void Add(void* data, size_t bytes) {
    if (bytes == 0) return;
    has_null_ = has_null_ || data == nullptr;
    runs_.push_back(Run{static_cast<uint8_t*>(data), bytes});
    starts_.push_back(bytes_);
    bytes_ += bytes;
  }
  size_t bytes() const { return bytes_; }
  // Whether a run of one byte or more starts at a null pointer (a caller's mistake, which the
  // transports refuse before they touch any byte).
  bool has_null() const { return has_null_; }

  // Bytes [offset, offset + bytes) of the message into `to`; and `from` into them.
  void Read(size_t offset, size_t bytes, uint8_t* to) const {
    ForEach(offset, bytes, [&to](const uint8_t* data, size_t n) {
      std::memcpy(to, data, n);
      to += n;
    });
  }
  void Write(size_t offset, const uint8_t* from, size_t bytes) const {
    ForEach(offset, bytes, [&from](uint8_t* data, size_t n) {
      std::memcpy(data, from, n);
      from += n;
    });
  }

  // Calls f(uint8_t* data, size_t bytes) for the parts of the runs that hold the message's
  // bytes [offset, offset + bytes), in order; offset + bytes <= this->bytes(). An f that returns
  // bool stops the walk by returning false.
  template <typename F>
  void ForEach(size_t offset, size_t bytes, F&& f) const {
    if (bytes == 0) return;
    size_t i = Find(offset);
    size_t within = offset - starts_[i];
    while (bytes > 0) {
      const size_t n = std::min(bytes, runs_[i].bytes - within);
      if constexpr (std::is_same_v<std::invoke_result_t<F&, uint8_t*, size_t>, bool>) {
        if (!f(runs_[i].data + within, n)) return;
      } else {
        f(runs_[i].data + within, n);
      }
      bytes -= n;
      within = 0;
      ++i;
    }
  }
  // Where byte `offset` (< bytes()) of the message is, and how many bytes of its run follow from
  // there (itself included).
  std::pair<uint8_t*, size_t> At(size_t offset) const {
    const size_t i = Find(offset);
    const size_t within = offset - starts_[i];
    return {runs_[i].data + within, runs_[i].bytes - within};
  }
  // The index of the run that holds byte `offset` (< bytes()).
  size_t Find(size_t offset) const {
    return size_t(std::upper_bound(starts_.begin(), starts_.end(), offset) - starts_.begin()) - 1;
  }

 private:
  struct Run {
    uint8_t* data;
    size_t bytes;
  };
  std::vector<Run> runs_;
  std::vector<size_t> starts_;  // of each run, in message bytes
  size_t bytes_ = 0;
  bool has_null_ = false;
};

// The tensors' bytes, in order, as one message in runs.
inline Runs RunsOf(const std::vector<Tensor>& tensors) {
  Runs runs;
  for (const Tensor& t : tensors) runs.Add(t.data, t.bytes());
  return runs;
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_RUNS_H_
