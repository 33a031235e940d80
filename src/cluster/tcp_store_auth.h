// Authentication of TCP store connections: before any request, the server and the client prove
// to each other that they hold the job token, by HMAC-SHA256 over fresh nonces of both sides (the
// token never travels; a proof is bound to both nonces and to a role byte, so it can be neither
// replayed nor reflected). A stranger that cannot prove the token never reaches the table: it
// cannot read the published addresses nor overwrite them.
//
//   server -> client: u32 magic 0x41535343 ("CSSA"), 32-byte server nonce                 36 bytes
//   client -> server: 32-byte client nonce, 32-byte client proof                          64 bytes
//   server -> client: u8 verdict (1 accepted, 0 rejected), 32-byte server proof (zeros
//                     when rejected)                                                      33 bytes
//   proof = HMAC-SHA256(token, "collectives-store-v1" | client nonce | server nonce | role),
//   role 1 for the client's proof, 2 for the server's.
//
// The token is the job's (CommunicationOptions::job_token or COLLECTIVES_JOB_TOKEN); an empty
// token is a valid key, shared by every job that sets none, so it only keeps out peers that do
// not speak the protocol.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_CLUSTER_TCP_STORE_AUTH_H_
#define COLLECTIVES_SRC_CLUSTER_TCP_STORE_AUTH_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "src/core/auth.h"

namespace collectives::cluster::auth {

constexpr uint32_t kMagic = 0x41535343;
constexpr size_t kChallengeBytes = 4 + core::kNonceBytes;
constexpr size_t kResponseBytes = core::kNonceBytes + core::kProofBytes;
constexpr size_t kVerdictBytes = 1 + core::kProofBytes;
constexpr uint8_t kClientRole = 1;
constexpr uint8_t kServerRole = 2;

inline core::Proof StoreProof(const std::string& token, const core::Nonce& client_nonce,
                              const core::Nonce& server_nonce, uint8_t role) {
  static constexpr char kContext[] = "collectives-store-v1";
  std::vector<uint8_t> message(sizeof(kContext) - 1 + 2 * core::kNonceBytes + 1);
  std::memcpy(message.data(), kContext, sizeof(kContext) - 1);
  uint8_t* out = message.data() + sizeof(kContext) - 1;
  std::memcpy(out, client_nonce.data(), core::kNonceBytes);
  std::memcpy(out + core::kNonceBytes, server_nonce.data(), core::kNonceBytes);
  out[2 * core::kNonceBytes] = role;
  return core::HmacSha256(token, message);
}

inline std::array<uint8_t, kChallengeBytes> EncodeChallenge(const core::Nonce& server_nonce) {
  std::array<uint8_t, kChallengeBytes> out{};
  for (int i = 0; i < 4; ++i) out[size_t(i)] = uint8_t(kMagic >> (8 * i));
  std::memcpy(out.data() + 4, server_nonce.data(), core::kNonceBytes);
  return out;
}

inline bool DecodeChallenge(const std::array<uint8_t, kChallengeBytes>& in, core::Nonce* nonce) {
  uint32_t magic = 0;
  for (int i = 0; i < 4; ++i) magic |= uint32_t(in[size_t(i)]) << (8 * i);
  if (magic != kMagic) return false;
  std::memcpy(nonce->data(), in.data() + 4, core::kNonceBytes);
  return true;
}

}  // namespace collectives::cluster::auth

#endif  // COLLECTIVES_SRC_CLUSTER_TCP_STORE_AUTH_H_
