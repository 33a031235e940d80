// A message that lies in runs of memory, end to end: one buffer, or the packer's fused bucket, its
// tensors where they are. The TCP and in-process transports send frames gathered from such a
// message and receive them scattered into it (transport::Connection), the RING algorithms and the
// shared-memory group copy and reduce it in place (ring, hierarchical::ShmGroup), so that a bucket
// needs no fusion buffer.
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

// A message: one buffer, or several runs of memory back to back. Byte `offset` of the message is
// byte offset - (the bytes of the runs before it) of the run that holds it. Empty runs are left
// out. A message of one run (a buffer) lives inline: building it allocates nothing, and its
// walks take no search. A Runs built from read-only memory (a send) is only read.
class Runs {
 public:
  Runs() = default;
  // One buffer of `bytes` at `data`.
  Runs(const void* data, size_t bytes) { Add(const_cast<void*>(data), bytes); }

  void Add(void* data, size_t bytes) {
    if (bytes == 0) return;
    has_null_ = has_null_ || data == nullptr;
    const Run run{static_cast<uint8_t*>(data), bytes, bytes_};
    if (count_ == 0) {
      first_ = run;
    } else {
      if (count_ == 1) all_.push_back(first_);
      all_.push_back(run);
    }
    ++count_;
    bytes_ += bytes;
  }
  size_t bytes() const { return bytes_; }
  // Whether the message lies in one run or none (a buffer, at data()).
  bool contiguous() const { return count_ <= 1; }
  // The first run's address; nullptr for an empty message.
  uint8_t* data() const { return first_.data; }
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
    const Run* run = runs() + Find(offset);
    size_t within = offset - run->start;
    while (bytes > 0) {
      const size_t n = std::min(bytes, run->bytes - within);
      if constexpr (std::is_same_v<std::invoke_result_t<F&, uint8_t*, size_t>, bool>) {
        if (!f(run->data + within, n)) return;
      } else {
        f(run->data + within, n);
      }
      bytes -= n;
      within = 0;
      ++run;
    }
  }
  // Where byte `offset` (< bytes()) of the message is, and how many bytes of its run follow from
  // there (itself included).
  std::pair<uint8_t*, size_t> At(size_t offset) const {
    const Run& run = runs()[Find(offset)];
    const size_t within = offset - run.start;
    return {run.data + within, run.bytes - within};
  }
  // The index of the run that holds byte `offset` (< bytes()).
  size_t Find(size_t offset) const {
    if (count_ <= 1) return 0;
    const auto after = std::upper_bound(all_.begin(), all_.end(), offset,
                                        [](size_t o, const Run& run) { return o < run.start; });
    return size_t(after - all_.begin()) - 1;
  }

 private:
  struct Run {
    uint8_t* data;
    size_t bytes;
    size_t start;  // in message bytes
  };
  const Run* runs() const { return count_ <= 1 ? &first_ : all_.data(); }

  Run first_{nullptr, 0, 0};
  std::vector<Run> all_;  // every run, once there are two or more
  size_t count_ = 0;
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
