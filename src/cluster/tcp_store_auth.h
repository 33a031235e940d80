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
// The token is the job's (CommunicationOptions::job_token, ClusterSpec::job_token or
// COLLECTIVES_JOB_TOKEN). When the job sets none, the store's creator (rank 0) generates one,
// 32 random bytes, and hands it out by enrolment, trust on first use per rank: a client that
// holds no token sends, in place of its proof, an enrolment request of the same size,
//
//   client -> server: u32 magic 0x45535343 ("CSSE"), u32 rank, 56 zero bytes               64 bytes
//   server -> client: u8 verdict (2 enrolled, 0 refused), u8 reason (0 when enrolled),
//                     u8 n, n bytes                                                   3 + n bytes
//
// (integers little-endian). Enrolled: the n bytes are the job token (n = 32), which travels
// once, in clear, to that enrolee; the client then sends the proof above with it on the same
// connection (fresh client nonce, the challenge's server nonce) and the server answers with its
// verdict, so both sides prove the token before the first request. Refused (the server then
// closes the connection): reason 1, the rank has enrolled already and the n bytes (at most 64)
// are the address ("host:port") it enrolled from; reason 2, the rank is outside
// 1..world_size-1; reason 3, the server does not enrol (it holds a token the job set). The
// server hands the token out at most once per rank, so a stranger who enrols first takes a
// rank's place and the real rank is refused, loudly; once every rank has enrolled, every
// request is refused. On a network where strangers may listen or come first, set
// COLLECTIVES_JOB_TOKEN to a shared secret. A server created with no token and no world size
// (CreateTcpStore) keeps the empty token as its key and answers an enrolment with it (n = 0).
//
// A client that does not enrol and holds no token proves the empty token, a valid key shared
// by every job that sets none and enrols none, so it only keeps out peers that do not speak the
// protocol; a server with a generated token refuses it.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_CLUSTER_TCP_STORE_AUTH_H_
#define COLLECTIVES_SRC_CLUSTER_TCP_STORE_AUTH_H_

#include <algorithm>
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

constexpr uint32_t kEnrolMagic = 0x45535343;
constexpr size_t kGeneratedTokenBytes = 32;
constexpr size_t kEnrolReplyHeaderBytes = 3;
constexpr size_t kMaxEnrolPayloadBytes = 64;
// The enrolment reply's verdicts and reasons. Wire values: append, never renumber.
constexpr uint8_t kEnrolled = 2;
constexpr uint8_t kEnrolRefused = 0;
enum class EnrolRefusal : uint8_t { kNone = 0, kTaken = 1, kRankOutOfRange = 2, kNotEnrolling = 3 };

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

using Response = std::array<uint8_t, kResponseBytes>;

inline Response EncodeEnrolment(uint32_t rank) {
  Response out{};
  for (int i = 0; i < 4; ++i) out[size_t(i)] = uint8_t(kEnrolMagic >> (8 * i));
  for (int i = 0; i < 4; ++i) out[size_t(4 + i)] = uint8_t(rank >> (8 * i));
  return out;
}

// What a client's 64-byte response is: a proof, an enrolment request (its rank in `*rank`), or
// something that starts like an enrolment request and is not one. A proof whose first 4 bytes
// happen to be the enrolment magic and whose last 56 bytes are zero (chance 2^-480) is taken
// for an enrolment request.
enum class ResponseKind { kProof, kEnrolment, kMalformedEnrolment };

inline ResponseKind ClassifyResponse(const Response& in, uint32_t* rank) {
  uint32_t magic = 0;
  for (int i = 0; i < 4; ++i) magic |= uint32_t(in[size_t(i)]) << (8 * i);
  if (magic != kEnrolMagic) return ResponseKind::kProof;
  bool padding_zero = true;
  for (size_t i = 8; i < in.size(); ++i) padding_zero = padding_zero && in[i] == 0;
  if (!padding_zero) return ResponseKind::kMalformedEnrolment;
  *rank = 0;
  for (int i = 0; i < 4; ++i) *rank |= uint32_t(in[size_t(4 + i)]) << (8 * i);
  return ResponseKind::kEnrolment;
}

// The enrolment reply: verdict, reason, n, then `payload` (at most kMaxEnrolPayloadBytes).
inline std::vector<uint8_t> EncodeEnrolReply(uint8_t verdict, EnrolRefusal reason,
                                             const std::string& payload) {
  const size_t n = std::min(payload.size(), kMaxEnrolPayloadBytes);
  std::vector<uint8_t> out(kEnrolReplyHeaderBytes + n);
  out[0] = verdict;
  out[1] = static_cast<uint8_t>(reason);
  out[2] = static_cast<uint8_t>(n);
  std::memcpy(out.data() + kEnrolReplyHeaderBytes, payload.data(), n);
  return out;
}

// Why an enrolment reply's header is malformed, or "" when it is well formed.
inline std::string CheckEnrolReply(const std::array<uint8_t, kEnrolReplyHeaderBytes>& in) {
  const uint8_t verdict = in[0], reason = in[1], n = in[2];
  if (verdict == kEnrolled) {
    if (reason != 0) return "an enrolment with a refusal reason";
    if (n != 0 && n != kGeneratedTokenBytes) {
      return "a job token of " + std::to_string(n) + " bytes";
    }
    return "";
  }
  if (verdict != kEnrolRefused) return "unknown enrolment verdict " + std::to_string(verdict);
  if (reason < static_cast<uint8_t>(EnrolRefusal::kTaken) ||
      reason > static_cast<uint8_t>(EnrolRefusal::kNotEnrolling)) {
    return "unknown enrolment refusal " + std::to_string(reason);
  }
  if (n > kMaxEnrolPayloadBytes) return "a refusal of " + std::to_string(n) + " bytes";
  return "";
}

}  // namespace collectives::cluster::auth

#endif  // COLLECTIVES_SRC_CLUSTER_TCP_STORE_AUTH_H_
