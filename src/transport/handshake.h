// The handshake that opens every TCP connection of a fabric: both sides say who they are (job,
// wire version, rank, world size) and prove, by HMAC-SHA256 over fresh nonces of both sides,
// that they hold the job's token. The token itself never travels; a proof is bound to both
// ranks, both nonces and a role byte, so it can be neither replayed nor reflected.
//
// Wire (little-endian):
//   hello:  0 u32 magic 0x48534C43 ("CLSH")   8 i32 rank
//           4 u8  wire version (1)            12 i32 world size
//           5 u8  reserved (0)                16 32-byte random nonce
//           6 u16 job id bytes (<= 256)        48 job id
//   proof:  32 bytes HMAC-SHA256(token, "collectives-v1" | u16 job id bytes | job id |
//           i32 client rank | i32 server rank | client nonce | server nonce | u8 role),
//           role 1 for the client's proof, 2 for the server's.
//   server verdict: u8 (1 accepted, 0 rejected), then the server's proof (zeros if rejected).
//   client verdict: u8 (1 accepted).
//
// Sequence: the client (the lower rank, which connected) sends its hello; the server checks it
// and answers with its own hello or closes; the client checks that and sends its proof; the
// server checks the proof and sends its verdict and proof; the client checks those and sends
// its verdict. Every read is bounded by the set-up deadline and reads exactly the bytes of its
// message (nothing past the handshake is consumed); the job id length is checked before any
// byte of it is read.
//
// A server that rejects a connection logs one line to stderr with the remote address and
// closes it; the caller keeps accepting. A client that is rejected, or that finds the server
// is not the rank of this job it expected, gets ErrorCode::kUnauthenticated.
//
// Thread-safety: the encode/decode/proof functions are pure. A HandshakeSession runs on its
// socket's io_context and must only be touched (Cancel) from that io_context's thread.
#ifndef COLLECTIVES_SRC_TRANSPORT_HANDSHAKE_H_
#define COLLECTIVES_SRC_TRANSPORT_HANDSHAKE_H_

#include <array>
#include <asio.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/errors.h"
#include "src/core/auth.h"
#include "src/transport/connection.h"
#include "src/transport/frame.h"

namespace collectives::transport {

inline constexpr uint32_t kHelloMagic = 0x48534C43;
inline constexpr size_t kHelloFixedBytes = 48;
inline constexpr size_t kMaxJobIdBytes = 256;
// Nonces, proofs, RandomNonce() and the constant-time ProofsEqual() come from src/core/auth.h.
using core::kNonceBytes;
using core::kProofBytes;
using core::Nonce;
using core::Proof;
using core::ProofsEqual;
using core::RandomNonce;

enum class HandshakeRole : uint8_t { kClient = 1, kServer = 2 };

struct Hello {
  uint8_t version = 0;
  int32_t rank = -1;
  int32_t world_size = 0;
  Nonce nonce{};
  std::string job_id;
};

// The hello's bytes: the fixed part then the job id. Throws Error(kInvalidArgument) if the job
// id is longer than kMaxJobIdBytes.
std::vector<uint8_t> EncodeHello(const Hello& hello);

// Decodes the fixed kHelloFixedBytes of a hello (everything but the job id, whose length it
// returns in *job_id_bytes). Checks the magic, the reserved byte and the job id length bound;
// not the version, which the caller compares to report it. Returns nullopt and sets *why
// otherwise.
std::optional<Hello> DecodeHelloFixed(const uint8_t* bytes, size_t* job_id_bytes, std::string* why);

// The proof `role` sends in a handshake between these ranks with these nonces.
Proof ComputeProof(const std::string& token, const std::string& job_id, int32_t client_rank,
                   int32_t server_rank, const Nonce& client_nonce, const Nonce& server_nonce,
                   HandshakeRole role);

// What both sides must agree on.
struct HandshakeConfig {
  std::string job_id;
  std::string token;
  int rank = 0;
  int world_size = 1;
};

struct HandshakeResult {
  bool ok = false;
  int peer_rank = -1;
  // When !ok: kUnauthenticated (rejected / not the expected peer), kTimeout (deadline),
  // kAborted (Cancel), kSystem (the socket failed), kInvalidArgument (malformed hello).
  ErrorCode code = ErrorCode::kInternal;
  // When !ok: what went wrong, without a rank prefix.
  std::string why;
  // "address:port" of the other side.
  std::string remote;
};

// Receives the outcome and, on success, the socket (positioned just after the handshake).
using HandshakeDone = std::function<void(const HandshakeResult&, asio::ip::tcp::socket)>;

// One handshake in progress. Owned by its pending handlers: keep a weak_ptr to cancel it.
class HandshakeSession : public std::enable_shared_from_this<HandshakeSession> {
 public:
  // Runs the client side on a connected `socket` toward `server_rank`. `done` runs exactly
  // once, from the socket's io_context.
  static std::weak_ptr<HandshakeSession> StartClient(asio::ip::tcp::socket socket,
                                                     const HandshakeConfig& config, int server_rank,
                                                     Clock::time_point deadline,
                                                     HandshakeDone done);

  // Runs the server side on an accepted `socket`; `accept_rank(r)` says whether a client that
  // claims rank r is one this rank expects. Failures are logged to stderr.
  static std::weak_ptr<HandshakeSession> StartServer(asio::ip::tcp::socket socket,
                                                     const HandshakeConfig& config,
                                                     std::function<bool(int)> accept_rank,
                                                     Clock::time_point deadline,
                                                     HandshakeDone done);

  // Stops the handshake: closes the socket; `done` runs with code kAborted (not logged).
  void Cancel();

  HandshakeSession(asio::ip::tcp::socket socket, const HandshakeConfig& config, HandshakeRole role,
                   int expected_peer, std::function<bool(int)> accept_rank,
                   Clock::time_point deadline, HandshakeDone done);

 private:
  void Begin();
  void SendHello();
  void ReadHelloFixed();
  void ReadJobId(size_t bytes);
  void CheckPeerHello();
  void SendClientProof();
  void ReadClientProof();
  void ReadServerVerdict();
  void ReadClientVerdict();
  // Ends the session (once): cancels the timer, logs a server-side failure, calls done_.
  void Finish(bool ok, ErrorCode code, std::string why);
  // Finish for an error on the socket during `step`.
  void Fail(const asio::error_code& ec, const char* step);
  bool finished() const { return finished_; }

  asio::ip::tcp::socket socket_;
  asio::steady_timer timer_;
  HandshakeConfig config_;
  HandshakeRole role_;
  int expected_peer_;  // client: the server's rank
  std::function<bool(int)> accept_rank_;
  HandshakeDone done_;
  std::string remote_;
  bool finished_ = false;
  bool timed_out_ = false;
  bool cancelled_ = false;

  Nonce my_nonce_{};
  Hello peer_;
  std::vector<uint8_t> out_;  // the message being written
  std::array<uint8_t, kHelloFixedBytes> in_fixed_{};
  std::vector<uint8_t> in_job_id_;
  std::array<uint8_t, 1 + kProofBytes> in_proof_{};
};

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_HANDSHAKE_H_
