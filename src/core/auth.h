// The cryptographic primitives of the job-token proofs (OpenSSL's libcrypto), shared by the
// fabric handshake (src/transport/handshake.h) and the TCP store's (src/cluster/tcp_store_auth.h):
// fresh nonces, HMAC-SHA256, and a constant-time comparison.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_CORE_AUTH_H_
#define COLLECTIVES_SRC_CORE_AUTH_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace collectives::core {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

// Fresh random bytes. Throws Error(kSystem) if the generator fails.
Nonce RandomNonce();
// HMAC-SHA256(key, message); an empty key is allowed. Throws Error(kSystem) if OpenSSL fails.
Proof HmacSha256(const std::string& key, const std::vector<uint8_t>& message);
// Constant-time comparison.
bool ProofsEqual(const Proof& a, const Proof& b);

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_AUTH_H_
