// Uninitialised byte buffers aligned to a cache line, for the library's scratch memory (the ring's
// staging area, the packer's fusion buffers). malloc aligns only to 16 bytes; a reduction whose
// operands sit at different offsets within a cache line splits every other vector load across
// two lines, which slows the kernel in cache (see docs/tuning.md).
//
// The buffer is a plain new[] of 63 bytes more, with the pointer moved up to the next boundary,
// rather than an aligned operator new: glibc serves large aligned requests from its heap, where
// a staging area that grows step by step leaves fragments behind; plain large blocks are mmap'd
// and given back.
#ifndef COLLECTIVES_SRC_CORE_ALIGNED_BYTES_H_
#define COLLECTIVES_SRC_CORE_ALIGNED_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace collectives::core {

inline constexpr size_t kCacheLineBytes = 64;

// Bytes from `p` up to the next cache-line boundary (0 when p is on one).
inline size_t BytesToCacheLine(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  return (kCacheLineBytes - address % kCacheLineBytes) % kCacheLineBytes;
}

// Frees the whole allocation, whose start the aligned pointer does not show.
struct AlignedDelete {
  uint8_t* base = nullptr;
  void operator()(uint8_t*) const { delete[] base; }
};

using AlignedBytes = std::unique_ptr<uint8_t[], AlignedDelete>;

// `bytes` bytes, 64-byte aligned, contents unspecified.
inline AlignedBytes AllocateAligned(size_t bytes) {
  uint8_t* const base = new uint8_t[bytes + kCacheLineBytes - 1];
  return AlignedBytes(base + BytesToCacheLine(base), AlignedDelete{base});
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_ALIGNED_BYTES_H_
