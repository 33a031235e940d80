// FNV-1a, 64 bits: a fingerprint that every rank computes alike whatever its compiler and
// standard library (std::hash promises neither), for checking that ranks agree on something
// they describe. Not a defence against anyone who chooses the input.
//
// Thread-safety: plain functions.
#ifndef COLLECTIVES_SRC_CORE_FNV1A_H_
#define COLLECTIVES_SRC_CORE_FNV1A_H_

#include <cstddef>
#include <cstdint>

namespace collectives::core {

inline constexpr uint64_t kFnv1aBasis = 0xcbf29ce484222325ull;

// Folds `bytes` bytes at `data` into `h` (start from kFnv1aBasis).
inline void Fnv1a(uint64_t& h, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
}

// Folds `value` into `h`, its bytes least significant first (the same on every byte order).
inline void Fnv1a(uint64_t& h, uint64_t value) {
  for (int byte = 0; byte < 8; ++byte) {
    h ^= (value >> (8 * byte)) & 0xffu;
    h *= 0x100000001b3ull;
  }
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_FNV1A_H_
