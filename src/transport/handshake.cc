// The connection handshake (see handshake.h): hello encoding, HMAC proofs, and the
// asynchronous client and server sessions that run it under the set-up deadline.
#include "src/transport/handshake.h"

#include <asio/read.hpp>
#include <asio/write.hpp>
#include <cstring>
#include <utility>

#include "src/cluster/store_common.h"

namespace collectives::transport {
namespace {

constexpr char kProofContext[] = "collectives-v1";
constexpr uint8_t kAccepted = 1;
constexpr uint8_t kRejected = 0;

void PutU16(uint8_t* out, uint16_t v) {
  out[0] = static_cast<uint8_t>(v);
  out[1] = static_cast<uint8_t>(v >> 8);
}

void PutU32(uint8_t* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint32_t GetU32(const uint8_t* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in[i]) << (8 * i);
  return v;
}

// What a client reports when `server_rank` refused its hello with `refusal`. Only numbers of
// the server's message are shown: the reason, its version, rank and world size.
std::string RefusalText(const Hello& refusal, int server_rank, const HandshakeConfig& mine) {
  std::string text = "rank " + std::to_string(server_rank);
  if (refusal.rank != server_rank) {
    text += " (which says it is rank " + std::to_string(refusal.rank) + ")";
  }
  text += " refused this rank's hello: ";
  switch (refusal.refusal) {
    case HelloRefusal::kVersion:
      return text + "it speaks wire version " + std::to_string(refusal.version) +
             ", this rank speaks " + std::to_string(kWireVersion);
    case HelloRefusal::kJobId:
      return text + "it is in another job than this rank's job id " +
             cluster::QuoteKey(mine.job_id);
    case HelloRefusal::kWorldSize:
      return text + "its world size is " + std::to_string(refusal.world_size) +
             ", this rank's is " + std::to_string(mine.world_size);
    case HelloRefusal::kRank:
    case HelloRefusal::kNone:
      break;
  }
  return text + "it does not expect rank " + std::to_string(mine.rank) +
         " to connect (or has its connection already)";
}

std::string EndpointText(const asio::ip::tcp::socket& socket) {
  asio::error_code ec;
  const auto endpoint = socket.remote_endpoint(ec);
  if (ec) return "an unknown address";
  return endpoint.address().to_string() + ":" + std::to_string(endpoint.port());
}

}  // namespace

std::vector<uint8_t> EncodeHello(const Hello& hello) {
  if (hello.job_id.size() > kMaxJobIdBytes) {
    throw Error(ErrorCode::kInvalidArgument, "job id of " + std::to_string(hello.job_id.size()) +
                                                 " bytes is longer than " +
                                                 std::to_string(kMaxJobIdBytes));
  }
  if (hello.refusal != HelloRefusal::kNone && !hello.job_id.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "a hello's refusal carries no job id");
  }
  std::vector<uint8_t> out(kHelloFixedBytes + hello.job_id.size());
  PutU32(out.data(), kHelloMagic);
  out[4] = hello.version;
  out[5] = static_cast<uint8_t>(hello.refusal);
  PutU16(out.data() + 6, static_cast<uint16_t>(hello.job_id.size()));
  PutU32(out.data() + 8, static_cast<uint32_t>(hello.rank));
  PutU32(out.data() + 12, static_cast<uint32_t>(hello.world_size));
  std::copy(hello.nonce.begin(), hello.nonce.end(), out.begin() + 16);
  std::copy(hello.job_id.begin(), hello.job_id.end(), out.begin() + kHelloFixedBytes);
  return out;
}

std::vector<uint8_t> EncodeRefusal(HelloRefusal reason, int32_t rank, int32_t world_size) {
  Hello refusal;
  refusal.version = kWireVersion;
  refusal.refusal = reason;
  refusal.rank = rank;
  refusal.world_size = world_size;
  return EncodeHello(refusal);  // a zero nonce, no job id
}

std::optional<Hello> DecodeHelloFixed(const uint8_t* bytes, size_t* job_id_bytes, std::string* why,
                                      bool refusal_allowed) {
  const uint32_t magic = GetU32(bytes);
  if (magic != kHelloMagic) {
    if (why != nullptr) *why = "not a collectives hello (bad magic)";
    return std::nullopt;
  }
  const uint8_t refusal = bytes[5];
  if (refusal != 0 && !refusal_allowed) {
    if (why != nullptr) *why = "reserved hello byte is not zero";
    return std::nullopt;
  }
  if (refusal > static_cast<uint8_t>(HelloRefusal::kRank)) {
    if (why != nullptr) *why = "unknown refusal reason " + std::to_string(refusal);
    return std::nullopt;
  }
  const size_t length = static_cast<size_t>(bytes[6]) | (static_cast<size_t>(bytes[7]) << 8);
  if (length > kMaxJobIdBytes) {
    if (why != nullptr) {
      *why = "job id of " + std::to_string(length) + " bytes exceeds the limit of " +
             std::to_string(kMaxJobIdBytes);
    }
    return std::nullopt;
  }
  if (refusal != 0 && length != 0) {
    if (why != nullptr) *why = "a refusal with a job id of " + std::to_string(length) + " bytes";
    return std::nullopt;
  }
  Hello hello;
  hello.version = bytes[4];
  hello.refusal = static_cast<HelloRefusal>(refusal);
  hello.rank = static_cast<int32_t>(GetU32(bytes + 8));
  hello.world_size = static_cast<int32_t>(GetU32(bytes + 12));
  std::copy(bytes + 16, bytes + 16 + kNonceBytes, hello.nonce.begin());
  *job_id_bytes = length;
  return hello;
}

Proof ComputeProof(const std::string& token, const std::string& job_id, int32_t client_rank,
                   int32_t server_rank, const Nonce& client_nonce, const Nonce& server_nonce,
                   HandshakeRole role) {
  // Laid out at fixed offsets (GCC 12 warns falsely about a chain of inserts here).
  const size_t context = sizeof(kProofContext) - 1;
  std::vector<uint8_t> message(context + 2 + job_id.size() + 8 + 2 * kNonceBytes + 1);
  uint8_t* out = message.data();
  std::memcpy(out, kProofContext, context);
  out += context;
  PutU16(out, static_cast<uint16_t>(job_id.size()));
  out += 2;
  if (!job_id.empty()) std::memcpy(out, job_id.data(), job_id.size());
  out += job_id.size();
  PutU32(out, static_cast<uint32_t>(client_rank));
  PutU32(out + 4, static_cast<uint32_t>(server_rank));
  out += 8;
  std::memcpy(out, client_nonce.data(), kNonceBytes);
  std::memcpy(out + kNonceBytes, server_nonce.data(), kNonceBytes);
  out[2 * kNonceBytes] = static_cast<uint8_t>(role);
  return core::HmacSha256(token, message);
}

// ---- Sessions. ----

HandshakeSession::HandshakeSession(asio::ip::tcp::socket socket, const HandshakeConfig& config,
                                   HandshakeRole role, int expected_peer,
                                   std::function<bool(int)> accept_rank, Clock::time_point deadline,
                                   HandshakeDone done)
    : socket_(std::move(socket)),
      timer_(socket_.get_executor()),
      config_(config),
      role_(role),
      expected_peer_(expected_peer),
      accept_rank_(std::move(accept_rank)),
      done_(std::move(done)),
      remote_(EndpointText(socket_)),
      my_nonce_(RandomNonce()) {
  timer_.expires_at(deadline);
}

std::weak_ptr<HandshakeSession> HandshakeSession::StartClient(asio::ip::tcp::socket socket,
                                                              const HandshakeConfig& config,
                                                              int server_rank,
                                                              Clock::time_point deadline,
                                                              HandshakeDone done) {
  auto session =
      std::make_shared<HandshakeSession>(std::move(socket), config, HandshakeRole::kClient,
                                         server_rank, nullptr, deadline, std::move(done));
  session->Begin();
  return session;
}

std::weak_ptr<HandshakeSession> HandshakeSession::StartServer(asio::ip::tcp::socket socket,
                                                              const HandshakeConfig& config,
                                                              std::function<bool(int)> accept_rank,
                                                              Clock::time_point deadline,
                                                              HandshakeDone done) {
  auto session =
      std::make_shared<HandshakeSession>(std::move(socket), config, HandshakeRole::kServer, -1,
                                         std::move(accept_rank), deadline, std::move(done));
  session->Begin();
  return session;
}

void HandshakeSession::Begin() {
  timer_.async_wait([self = shared_from_this()](const asio::error_code& ec) {
    if (ec || self->finished()) return;
    self->timed_out_ = true;
    asio::error_code ignored;
    self->socket_.close(ignored);  // the pending read or write completes with an error
  });
  if (role_ == HandshakeRole::kClient) {
    SendHello();
  } else {
    ReadHelloFixed();
  }
}

void HandshakeSession::Cancel() {
  if (finished_) return;
  cancelled_ = true;
  asio::error_code ignored;
  socket_.close(ignored);
}

void HandshakeSession::SendHello() {
  Hello hello;
  hello.version = kWireVersion;
  hello.rank = config_.rank;
  hello.world_size = config_.world_size;
  hello.nonce = my_nonce_;
  hello.job_id = config_.job_id;
  out_ = EncodeHello(hello);
  asio::async_write(socket_, asio::buffer(out_),
                    [self = shared_from_this()](const asio::error_code& ec, size_t) {
                      if (self->finished()) return;
                      if (ec) return self->Fail(ec, "sending hello");
                      if (self->role_ == HandshakeRole::kClient) {
                        self->ReadHelloFixed();
                      } else {
                        self->ReadClientProof();
                      }
                    });
}

void HandshakeSession::ReadHelloFixed() {
  asio::async_read(socket_, asio::buffer(in_fixed_),
                   [self = shared_from_this()](const asio::error_code& ec, size_t) {
                     if (self->finished()) return;
                     if (ec) return self->Fail(ec, "waiting for hello");
                     std::string why;
                     size_t job_id_bytes = 0;
                     const bool client = self->role_ == HandshakeRole::kClient;
                     auto hello =
                         DecodeHelloFixed(self->in_fixed_.data(), &job_id_bytes, &why, client);
                     if (!hello) {
                       return self->Finish(false, ErrorCode::kUnauthenticated,
                                           "malformed hello: " + why);
                     }
                     self->answered_ = client;
                     if (hello->refusal != HelloRefusal::kNone) {
                       return self->Finish(
                           false, ErrorCode::kUnauthenticated,
                           RefusalText(*hello, self->expected_peer_, self->config_));
                     }
                     self->peer_ = std::move(*hello);
                     self->ReadJobId(job_id_bytes);
                   });
}

void HandshakeSession::ReadJobId(size_t bytes) {
  in_job_id_.resize(bytes);  // bounded by kMaxJobIdBytes in DecodeHelloFixed
  asio::async_read(socket_, asio::buffer(in_job_id_),
                   [self = shared_from_this()](const asio::error_code& ec, size_t) {
                     if (self->finished()) return;
                     if (ec) return self->Fail(ec, "waiting for hello");
                     self->peer_.job_id.assign(self->in_job_id_.begin(), self->in_job_id_.end());
                     self->CheckPeerHello();
                   });
}

void HandshakeSession::CheckPeerHello() {
  const Hello& peer = peer_;
  std::string why;
  HelloRefusal reason = HelloRefusal::kNone;
  if (peer.version != kWireVersion) {
    reason = HelloRefusal::kVersion;
    why = "its hello speaks wire version " + std::to_string(peer.version) + ", this rank speaks " +
          std::to_string(kWireVersion);
  } else if (peer.job_id != config_.job_id) {
    // The peer's job id is any 256 bytes: escaped, so that it cannot forge lines of the log.
    reason = HelloRefusal::kJobId;
    why = "its hello is for job id " + cluster::QuoteKey(peer.job_id) + ", this rank is in job " +
          cluster::QuoteKey(config_.job_id);
  } else if (peer.world_size != config_.world_size) {
    reason = HelloRefusal::kWorldSize;
    why = "its hello says world size " + std::to_string(peer.world_size) + ", this rank has " +
          std::to_string(config_.world_size);
  } else if (role_ == HandshakeRole::kClient && peer.rank != expected_peer_) {
    why = "its hello says rank " + std::to_string(peer.rank) + ", expected rank " +
          std::to_string(expected_peer_);
  } else if (role_ == HandshakeRole::kServer &&
             (peer.rank < 0 || peer.rank >= config_.world_size || !accept_rank_(peer.rank))) {
    reason = HelloRefusal::kRank;
    why = "its hello claims rank " + std::to_string(peer.rank) +
          ", which this rank does not expect to connect";
  }
  if (!why.empty()) {
    if (role_ == HandshakeRole::kServer) return Refuse(reason, std::move(why));
    return Finish(false, ErrorCode::kUnauthenticated, why);
  }
  if (role_ == HandshakeRole::kClient) {
    SendClientProof();
  } else {
    SendHello();  // continues with ReadClientProof
  }
}

void HandshakeSession::Refuse(HelloRefusal reason, std::string why) {
  // The client waits for an answer to its hello: this one says why, so that it does not take
  // the close for a rank that stopped (which it retries).
  out_ = EncodeRefusal(reason, config_.rank, config_.world_size);
  asio::async_write(
      socket_, asio::buffer(out_),
      [self = shared_from_this(), why = std::move(why)](const asio::error_code&, size_t) mutable {
        if (self->finished()) return;
        self->Finish(false, ErrorCode::kUnauthenticated, std::move(why));
      });
}

void HandshakeSession::SendClientProof() {
  const Proof proof = ComputeProof(config_.token, config_.job_id, config_.rank, peer_.rank,
                                   my_nonce_, peer_.nonce, HandshakeRole::kClient);
  out_.assign(proof.begin(), proof.end());
  asio::async_write(socket_, asio::buffer(out_),
                    [self = shared_from_this()](const asio::error_code& ec, size_t) {
                      if (self->finished()) return;
                      if (ec) return self->Fail(ec, "sending proof");
                      self->ReadServerVerdict();
                    });
}

void HandshakeSession::ReadClientProof() {
  asio::async_read(
      socket_, asio::buffer(in_proof_.data(), kProofBytes),
      [self = shared_from_this()](const asio::error_code& ec, size_t) {
        if (self->finished()) return;
        if (ec) return self->Fail(ec, "waiting for the client's proof");
        Proof got;
        std::copy(self->in_proof_.begin(), self->in_proof_.begin() + kProofBytes, got.begin());
        const HandshakeConfig& config = self->config_;
        const Proof want = ComputeProof(config.token, config.job_id, self->peer_.rank, config.rank,
                                        self->peer_.nonce, self->my_nonce_, HandshakeRole::kClient);
        const bool good = ProofsEqual(got, want);
        self->proven_ = good;
        self->out_.assign(1 + kProofBytes, 0);
        if (good) {
          self->out_[0] = kAccepted;
          const Proof mine =
              ComputeProof(config.token, config.job_id, self->peer_.rank, config.rank,
                           self->peer_.nonce, self->my_nonce_, HandshakeRole::kServer);
          std::copy(mine.begin(), mine.end(), self->out_.begin() + 1);
        } else {
          self->out_[0] = kRejected;
        }
        asio::async_write(self->socket_, asio::buffer(self->out_),
                          [self, good](const asio::error_code& write_ec, size_t) {
                            if (self->finished()) return;
                            if (!good) {
                              return self->Finish(false, ErrorCode::kUnauthenticated,
                                                  "wrong proof of the job token");
                            }
                            if (write_ec) return self->Fail(write_ec, "sending verdict");
                            self->ReadClientVerdict();
                          });
      });
}

void HandshakeSession::ReadServerVerdict() {
  asio::async_read(
      socket_, asio::buffer(in_proof_),
      [self = shared_from_this()](const asio::error_code& ec, size_t) {
        if (self->finished()) return;
        if (ec) return self->Fail(ec, "waiting for the server's verdict");
        if (self->in_proof_[0] != kAccepted) {
          return self->Finish(false, ErrorCode::kUnauthenticated,
                              "rank " + std::to_string(self->peer_.rank) +
                                  " rejected this rank's proof of the job token (do all ranks "
                                  "use the same token?)");
        }
        Proof got;
        std::copy(self->in_proof_.begin() + 1, self->in_proof_.end(), got.begin());
        const HandshakeConfig& config = self->config_;
        const Proof want = ComputeProof(config.token, config.job_id, config.rank, self->peer_.rank,
                                        self->my_nonce_, self->peer_.nonce, HandshakeRole::kServer);
        if (!ProofsEqual(got, want)) {
          return self->Finish(false, ErrorCode::kUnauthenticated,
                              "the server failed to prove the job token");
        }
        self->out_.assign(1, kAccepted);
        asio::async_write(self->socket_, asio::buffer(self->out_),
                          [self](const asio::error_code& write_ec, size_t) {
                            if (self->finished()) return;
                            if (write_ec) return self->Fail(write_ec, "sending verdict");
                            self->Finish(true, ErrorCode::kInternal, "");
                          });
      });
}

void HandshakeSession::ReadClientVerdict() {
  asio::async_read(socket_, asio::buffer(in_proof_.data(), 1),
                   [self = shared_from_this()](const asio::error_code& ec, size_t) {
                     if (self->finished()) return;
                     if (ec) return self->Fail(ec, "waiting for the client's verdict");
                     if (self->in_proof_[0] != kAccepted) {
                       return self->Finish(false, ErrorCode::kUnauthenticated,
                                           "the client rejected this rank's proof");
                     }
                     self->Finish(true, ErrorCode::kInternal, "");
                   });
}

void HandshakeSession::Fail(const asio::error_code& ec, const char* step) {
  if (cancelled_) return Finish(false, ErrorCode::kAborted, "cancelled");
  if (timed_out_) {
    return Finish(false, ErrorCode::kTimeout,
                  std::string("handshake not finished by the deadline (") + step + ")");
  }
  const bool closed = ec == asio::error::eof || ec == asio::error::connection_reset ||
                      ec == asio::error::broken_pipe;
  if (closed && role_ == HandshakeRole::kClient) {
    // A server that refuses this rank says so (a refusal, or a verdict); one that closes without
    // a word stopped, or gave up its own set-up (its deadline passed, or its set-up failed).
    const std::string who = "rank " + std::to_string(expected_peer_) + " closed the connection";
    return Finish(false, ErrorCode::kPeerLost,
                  (answered_ ? who + " while " + step : who + " before answering") + " (" +
                      ec.message() + "; it stopped, or gave up its set-up)");
  }
  Finish(false, closed ? ErrorCode::kUnauthenticated : ErrorCode::kSystem,
         std::string(step) + ": " + ec.message());
}

void HandshakeSession::Finish(bool ok, ErrorCode code, std::string why) {
  if (finished_) return;
  finished_ = true;
  if (ok && (cancelled_ || timed_out_ || !socket_.is_open())) {
    // The last read or write completed, but its handler ran only after Cancel or the deadline
    // closed the socket: the caller has given up on this handshake, and the socket is gone.
    ok = false;
    code = timed_out_ ? ErrorCode::kTimeout : ErrorCode::kAborted;
    why = timed_out_ ? "handshake not finished by the deadline" : "cancelled";
  }
  timer_.cancel();
  HandshakeResult result;
  result.ok = ok;
  result.peer_rank = ok ? peer_.rank : -1;
  result.code = code;
  result.why = std::move(why);
  result.remote = remote_;
  if (!ok) {
    asio::error_code ignored;
    socket_.close(ignored);
  }
  HandshakeDone done = std::move(done_);
  done_ = nullptr;
  done(result, std::move(socket_));
}

}  // namespace collectives::transport
