// The handshake that opens every TCP connection of a fabric: both sides say who they are (job,
// wire version, rank, world size) and prove, by HMAC-SHA256 over fresh nonces of both sides,
// that they hold the job's token. The token itself never travels; a proof is bound to both
// ranks, both nonces and a role byte, so it can be neither replayed nor reflected.
//
// Wire (little-endian):
//   hello:  0 u32 magic 0x48534C43 ("CLSH")   8 i32 rank
//           4 u8  wire version (1)            12 i32 world size
//           5 u8  refusal (0 in a hello)      16 32-byte random nonce
//           6 u16 job id bytes (<= 256)        48 job id
//   refusal: a hello of the server (its version, rank and world size) whose byte 5 says why it
//           refused the client's hello: 1 wire version, 2 job id, 3 world size, 4 the client's
//           rank is not one it expects (or it has that rank's connection already); no job id
//           (0 bytes) and a zero nonce. Only a client accepts one, in place of the server's hello.
//   proof:  32 bytes HMAC-SHA256(token, "collectives-v1" | u16 job id bytes | job id |
//           i32 client rank | i32 server rank | client nonce | server nonce | u8 role),
//           role 1 for the client's proof, 2 for the server's.
//   server verdict: u8 (1 accepted, 0 rejected), then the server's proof (zeros if rejected).
//   client verdict: u8 (1 accepted).
// A refusal carries wire version 1, as the hello does: every rank of a job runs the same build,
// and a build that knows no refusals reads one as a malformed hello, which fails its set-up as a
// refusal should.
//
// Sequence: the client (the lower rank, which connected) sends its hello; the server checks it
// and answers with its own hello, or with a refusal and closes; the client checks that and
// sends its proof; the server checks the proof and sends its verdict and proof; the client
// checks those and sends its verdict. Every read is bounded by the deadline and reads exactly
// the bytes of its message (nothing past the handshake is consumed); the job id length is
// checked before any byte of it is read.
//
// A server that rejects a connection closes it and reports why to its caller (what the peer sent
// is escaped), which logs it (tcp_mesh.cc: at most a line a second) and keeps accepting. A
// client that is refused or rejected, or that finds the server is not the rank of this job it
// expected, gets ErrorCode::kUnauthenticated naming what differs. A client whose server closes the
// connection without a refusal or a verdict (the server stopped, or gave up its own set-up) gets
// ErrorCode::kPeerLost: nothing says that the server would refuse it, and a caller may retry.
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

// Byte 5 of a hello: 0, or why the server refuses the client's hello (see the wire above).
enum class HelloRefusal : uint8_t {
  kNone = 0,
  kVersion = 1,
  kJobId = 2,
  kWorldSize = 3,
  kRank = 4,
};

struct Hello {
  uint8_t version = 0;
  HelloRefusal refusal = HelloRefusal::kNone;
  int32_t rank = -1;
  int32_t world_size = 0;
  Nonce nonce{};
  std::string job_id;
};

// The hello's bytes: the fixed part then the job id. Throws Error(kInvalidArgument) if the job
// id is longer than kMaxJobIdBytes, or if a refusal carries a job id.
std::vector<uint8_t> EncodeHello(const Hello& hello);

// The refusal a server of `rank` in a world of `world_size` sends for `reason`.
std::vector<uint8_t> EncodeRefusal(HelloRefusal reason, int32_t rank, int32_t world_size);

// Decodes the fixed kHelloFixedBytes of a hello (everything but the job id, whose length it
// returns in *job_id_bytes). Checks the magic, byte 5 and the job id length bound; not the
// version, which the caller compares to report it. Byte 5 must be 0 unless `refusal_allowed`
// (a client reading the server's answer): then a known refusal reason with no job id is
// accepted too, and its Hello has `refusal` set. Returns nullopt and sets *why otherwise.
std::optional<Hello> DecodeHelloFixed(const uint8_t* bytes, size_t* job_id_bytes, std::string* why,
                                      bool refusal_allowed = false);

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
  // When !ok: kUnauthenticated (refused, rejected, not the expected peer, or a malformed
  // hello), kPeerLost (client: the server closed the connection without a refusal or a
  // verdict), kTimeout (deadline), kAborted (Cancel, or the socket was closed under it),
  // kSystem (the socket failed).
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
  // claims rank r is one this rank expects. Failures are not logged: `done` has the why and the
  // remote address.
  static std::weak_ptr<HandshakeSession> StartServer(asio::ip::tcp::socket socket,
                                                     const HandshakeConfig& config,
                                                     std::function<bool(int)> accept_rank,
                                                     Clock::time_point deadline,
                                                     HandshakeDone done);

  // Stops the handshake: closes the socket; `done` runs with code kAborted (not logged), later,
  // from the io_context, unless the session had finished already.
  void Cancel();

  // Whether `done` has run (or is running).
  bool finished() const { return finished_; }

  // Server: whether the client proved the job's token (only its verdict is still to come): a
  // rank of the job, not a stranger.
  bool proven() const { return proven_; }

  HandshakeSession(asio::ip::tcp::socket socket, const HandshakeConfig& config, HandshakeRole role,
                   int expected_peer, std::function<bool(int)> accept_rank,
                   Clock::time_point deadline, HandshakeDone done);

 private:
  void Begin();
  void SendHello();
  void ReadHelloFixed();
  void ReadJobId(size_t bytes);
  void CheckPeerHello();
  // Server: sends a refusal for `reason`, then finishes with kUnauthenticated and `why`.
  void Refuse(HelloRefusal reason, std::string why);
  void SendClientProof();
  void ReadClientProof();
  void ReadServerVerdict();
  void ReadClientVerdict();
  // Ends the session (once): cancels the timer, calls done_.
  void Finish(bool ok, ErrorCode code, std::string why);
  // Finish for an error on the socket during `step`.
  void Fail(const asio::error_code& ec, const char* step);

  asio::ip::tcp::socket socket_;
  asio::steady_timer timer_;
  HandshakeConfig config_;
  HandshakeRole role_;
  int expected_peer_;  // client: the server's rank
  std::function<bool(int)> accept_rank_;
  HandshakeDone done_;
  std::string remote_;
  bool finished_ = false;
  bool answered_ = false;  // client: the server's hello came
  bool timed_out_ = false;
  bool cancelled_ = false;
  bool proven_ = false;  // server: the client's proof was right

  Nonce my_nonce_{};
  Hello peer_;
  std::vector<uint8_t> out_;  // the message being written
  std::array<uint8_t, kHelloFixedBytes> in_fixed_{};
  std::vector<uint8_t> in_job_id_;
  std::array<uint8_t, 1 + kProofBytes> in_proof_{};
};

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_HANDSHAKE_H_
