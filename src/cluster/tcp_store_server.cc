// The TCP store's server (see tcp_store.h for the design, tcp_store_wire.h for the protocol).
//
// A standard header comes before <asio.hpp> on purpose: Asio decides how it allocates handler
// memory (aligned_alloc or operator new) from a libstdc++ macro, so every file must have seen
// <bits/c++config.h> before Asio, or two files disagree and memory is freed the wrong way.
#include <array>
#include <asio.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/listener_guard.h"
#include "src/cluster/memory_store.h"
#include "src/cluster/name_lookups.h"
#include "src/cluster/store_common.h"
#include "src/cluster/tcp_store.h"
#include "src/cluster/tcp_store_auth.h"
#include "src/cluster/tcp_store_wire.h"

namespace collectives::cluster {
namespace {

using asio::ip::tcp;

void Log(const std::string& line) {
  std::string text = "collectives: " + line + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);
}

std::string Describe(const tcp::endpoint& endpoint) {
  return FormatHostPort(endpoint.address().to_string(), endpoint.port());
}

}  // namespace

// The server's state. table() may be used from any thread; everything else belongs to the io
// thread once the constructor has started it.
class TcpStoreServer::Impl {
 public:
  Impl(const std::string& host, uint16_t port, std::string token, int world_size,
       Clock::time_point lookup_deadline, std::chrono::milliseconds timeout);
  ~Impl();

  MemoryStore& table() { return *table_; }
  uint16_t port() const { return port_; }
  const std::string& token() const { return token_; }

 private:
  class Session;

  void Accept();
  // After an exception ended a run of the io thread (a handler threw: an allocation or RAND_bytes
  // failed): starts accepting again, as the one chain of accepts, whether the current chain's
  // accept, wait or retry is still pending or was lost with the exception (the accept threw).
  void ResumeAccepting();
  // On a failed accept: makes room (EvictOldestUnproven, or the spare descriptor) and accepts
  // again, waits for the next connection, or retries shortly.
  void OnAcceptError(const asio::error_code& ec);
  // Closes the connection that has waited longest without proving the token, preferring one
  // with nothing unread (a client whose proof is in is about to be judged); false if none.
  bool EvictOldestUnproven(const char* why);
  // On the io thread: answers the sessions waiting for `key`.
  void OnKeySet(const std::string& key);
  void Forget(Session* session) { sessions_.erase(session); }
  void RemoveWaiter(const std::string& key, Session* session);
  // On the io thread: hands the generated token to `peer` for `rank` (returns it), or refuses
  // (returns nullopt with the reason, the address that took the rank, and a line for the log).
  std::optional<std::string> Enrol(uint32_t rank, const std::string& peer,
                                   auth::EnrolRefusal* reason, std::string* taken_by,
                                   std::string* why);
  // On the io thread: undoes `peer`'s enrolment for `rank`, whose reply could not be sent, so
  // that the rank's retry is not refused as taken.
  void Unenrol(uint32_t rank, const std::string& peer, const std::string& error);

  // The job token every connection must prove: the one given, else one generated when a world
  // size was given, else empty. Set by the constructor, constant afterwards.
  std::string token_;
  const bool enrolling_;  // the token was generated: ranks 1..world_size_-1 enrol for it
  const int world_size_;
  std::string name_;                    // "TCP store server at host:port"
  std::unique_ptr<MemoryStore> table_;  // set once the port is known
  uint16_t port_ = 0;
  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  asio::steady_timer accept_retry_{io_};
  // Which chain of accepts is current: ResumeAccepting starts a new one, and a handler of an
  // older one does nothing (only the io thread touches it).
  uint64_t accept_chain_ = 0;
  // Only the io thread touches the rest.
  // The connections that have not proven the token yet, oldest first (with some that since
  // have, or closed, not yet dropped). At most MaxUnproven(): a new connection past it closes
  // the oldest, so that strangers who connect and say nothing cannot hold every descriptor of
  // the process for the 10 s each may take, while a rank waits in the backlog. A rank's client
  // whose connection is closed before the challenge connects again.
  std::deque<std::weak_ptr<Session>> unproven_;
  // Two per rank (a client may open a second connection while its first is busy) and 16 for
  // strangers; 256 when the world size is not known.
  size_t MaxUnproven() const { return world_size_ > 0 ? 2 * size_t(world_size_) + 16 : 256; }
  SpareDescriptor spare_;
  RateLimitedLog accept_log_;
  RateLimitedLog eviction_log_;
  // The connections closed with a reason (a failed proof, a malformed request): a stranger who
  // connects again and again must not write a line each time, for as long as the job runs.
  RateLimitedLog close_log_;
  // The same for the refused enrolments (a rank whose token is missing or whose rank another
  // address took: what the operator must see) and for the closed connections of ranks (proven
  // or enrolled): limited apart, so that a stranger's junk (connections that fail the proof or
  // send malformed requests) cannot hide them. A stranger that sends enrolment requests can
  // still take the refusals' line of a second.
  RateLimitedLog refusal_log_;
  RateLimitedLog rank_close_log_;
  std::unordered_map<Session*, std::weak_ptr<Session>> sessions_;
  std::unordered_map<std::string, std::vector<std::weak_ptr<Session>>> waiters_;
  // Only the io thread touches these two: the address each rank enrolled from ("" not yet),
  // indexed by rank, and how many have.
  std::vector<std::string> enrolled_from_;
  int enrolled_count_ = 0;
  std::thread thread_;
};

// One client connection. Lives as long as an operation of its socket or timer is pending;
// touched only on the io thread.
class TcpStoreServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Impl* server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), timer_(socket_.get_executor()) {
    asio::error_code ec;
    tcp::endpoint peer = socket_.remote_endpoint(ec);
    peer_ = ec ? "an unknown peer" : Describe(peer);
  }

  // Authenticates (tcp_store_auth.h), then serves requests.
  void Start() {
    server_nonce_ = core::RandomNonce();
    challenge_ = auth::EncodeChallenge(server_nonce_);
    timer_.expires_after(kAuthTimeout);
    timer_.async_wait([self = shared_from_this()](const asio::error_code& ec) {
      if (!ec && !self->authenticated_) self->Close("no proof of the job token within 10 s");
    });
    asio::async_write(socket_, asio::buffer(challenge_),
                      [self = shared_from_this()](const asio::error_code& ec, size_t) {
                        if (ec == asio::error::operation_aborted) return;
                        if (ec) return self->Close("");
                        self->ReadProof();
                      });
  }

  // Closes the socket; logs `reason` when it is not empty (a line a second at most).
  void Close(const std::string& reason) { Close(reason, Proven() ? server_->rank_close_log_
                                                                    : server_->close_log_); }
  void Close(const std::string& reason, RateLimitedLog& log) {
    if (!reason.empty()) {
      log.Write(server_->name_ + ": closing the connection from " + peer_ + ": " + reason);
    }
    if (waiting_) server_->RemoveWaiter(key_, this);
    Shutdown();
    server_->Forget(this);
  }

  // Whether it still has to prove the token (or enrol), and nothing has made it the rank's own.
  bool Unproven() const { return !Proven() && socket_.is_open(); }
  bool Proven() const { return authenticated_ || proven_ || enrolled_; }

  // Bytes that came in and were not read yet.
  size_t Unread() {
    asio::error_code ec;
    const size_t bytes = socket_.available(ec);
    return ec ? 0 : bytes;
  }

  const std::string& peer() const { return peer_; }

  // Closes the socket and cancels the timer, touching nothing of the server.
  void Shutdown() {
    asio::error_code ignored;
    socket_.close(ignored);
    timer_.cancel();
    waiting_ = false;
  }

  // Answers a parked Get if it waits for `key` and `key` is now set.
  void Wake(const std::string& key) {
    if (!waiting_ || key != key_) return;
    std::string value;
    if (!server_->table_->TryGet(key_, &value)) return;
    Unpark();
    Reply(wire::Status::kOk, 0, std::move(value));
  }

 private:
  static constexpr std::chrono::seconds kAuthTimeout{10};

  void ReadProof() {
    asio::async_read(
        socket_, asio::buffer(response_),
        [self = shared_from_this()](const asio::error_code& ec, size_t bytes) {
          if (ec == asio::error::operation_aborted) return;
          if (ec) {
            return self->Close(bytes == 0 ? "closed before proving the job token"
                                          : "read failed during the proof: " + ec.message());
          }
          self->CheckProof();
        });
  }

  void CheckProof() {
    uint32_t rank = 0;
    switch (auth::ClassifyResponse(response_, &rank)) {
      case auth::ResponseKind::kProof:
        break;
      case auth::ResponseKind::kEnrolment:
        return HandleEnrolment(rank);
      case auth::ResponseKind::kMalformedEnrolment:
        return Close("malformed enrolment request (padding is not zero)");
    }
    core::Nonce client_nonce;
    core::Proof proof;
    std::memcpy(client_nonce.data(), response_.data(), client_nonce.size());
    std::memcpy(proof.data(), response_.data() + client_nonce.size(), proof.size());
    const bool ok = core::ProofsEqual(
        proof, auth::StoreProof(server_->token_, client_nonce, server_nonce_, auth::kClientRole));
    verdict_.fill(0);
    if (ok) {
      proven_ = true;  // not a stranger to make room against
      verdict_[0] = 1;
      const core::Proof mine =
          auth::StoreProof(server_->token_, client_nonce, server_nonce_, auth::kServerRole);
      std::memcpy(verdict_.data() + 1, mine.data(), mine.size());
    }
    asio::async_write(socket_, asio::buffer(verdict_),
                      [self = shared_from_this(), ok](const asio::error_code& ec, size_t) {
                        if (ec == asio::error::operation_aborted) return;
                        if (!ok) return self->Close("failed the proof of the job token");
                        if (ec) return self->Close("");
                        self->authenticated_ = true;
                        self->timer_.cancel();
                        self->ReadHeader();
                      });
  }

  // An enrolment request for `rank` (tcp_store_auth.h): the token, then the proof as usual on
  // this connection; or a refusal, logged, and the connection closed.
  void HandleEnrolment(uint32_t rank) {
    if (enrol_seen_) return Close("a second enrolment request on one connection");
    enrol_seen_ = true;
    auth::EnrolRefusal reason = auth::EnrolRefusal::kNone;
    std::string taken_by, why;
    std::optional<std::string> token = server_->Enrol(rank, peer_, &reason, &taken_by, &why);
    enrol_reply_ = token ? auth::EncodeEnrolReply(auth::kEnrolled, reason, *token)
                         : auth::EncodeEnrolReply(auth::kEnrolRefused, reason, taken_by);
    const bool ok = token.has_value();
    enrolled_ = ok;
    asio::async_write(
        socket_, asio::buffer(enrol_reply_),
        [self = shared_from_this(), ok, why, rank](const asio::error_code& ec, size_t) {
          // The client did not get the token: its retry must not find the rank taken (by its
          // own address).
          if (ec && ok) self->server_->Unenrol(rank, self->peer_, ec.message());
          if (ec == asio::error::operation_aborted) return;
          if (!ok) return self->Close(why, self->server_->refusal_log_);
          if (ec) return self->Close("");
          self->ReadProof();
        });
  }

  void ReadHeader() {
    asio::async_read(socket_, asio::buffer(header_bytes_),
                     [self = shared_from_this()](const asio::error_code& ec, size_t bytes) {
                       self->OnHeader(ec, bytes);
                     });
  }

  void OnHeader(const asio::error_code& ec, size_t bytes) {
    if (ec == asio::error::operation_aborted) return;
    if (ec) {
      // A clean close between requests is normal; anything else is worth a line.
      bool clean = bytes == 0 && (ec == asio::error::eof || ec == asio::error::connection_reset);
      Close(clean
                ? ""
                : "read failed after " + std::to_string(bytes) + " header bytes: " + ec.message());
      return;
    }
    request_ = wire::Decode(header_bytes_);
    std::string why = wire::CheckRequest(request_);
    if (!why.empty()) {
      Close("malformed request: " + why);
      return;
    }
    // Sizes were checked above, so these allocations are bounded.
    key_.resize(request_.key_bytes);
    value_.resize(request_.value_bytes);
    std::array<asio::mutable_buffer, 2> body = {asio::buffer(key_), asio::buffer(value_)};
    asio::async_read(
        socket_, body, [self = shared_from_this()](const asio::error_code& read_ec, size_t) {
          if (read_ec == asio::error::operation_aborted) return;
          if (read_ec) {
            self->Close("connection lost in the middle of a request: " + read_ec.message());
            return;
          }
          self->Handle();
        });
  }

  void Handle() {
    MemoryStore& table = *server_->table_;
    try {
      switch (static_cast<wire::Op>(request_.code)) {
        case wire::Op::kSet:
          table.Set(key_, value_);
          value_.clear();
          Reply(wire::Status::kOk, 0, "");
          return;
        case wire::Op::kAdd: {
          int64_t sum = table.Add(key_, request_.arg);
          Reply(wire::Status::kOk, sum, "");
          return;
        }
        case wire::Op::kGet: {
          std::string value;
          if (table.TryGet(key_, &value)) {
            Reply(wire::Status::kOk, 0, std::move(value));
          } else if (request_.arg == 0) {
            Reply(wire::Status::kTimeout, 0, "");
          } else {
            Park();
          }
          return;
        }
      }
    } catch (const Error& e) {
      Reply(wire::Status::kInvalidArgument, 0, e.message());
      return;
    }
    Close("unknown request code " + std::to_string(request_.code));  // CheckRequest forbids it
  }

  // Waits for key_ until it is set (Wake) or the Get's timeout passes. Meanwhile a one-byte
  // read watches the socket: a well-behaved client sends nothing before it has the reply, so
  // whatever completes that read (the client closing, or sending early) ends the session now
  // rather than when the timer fires.
  void Park() {
    waiting_ = true;
    uint64_t park = ++parks_;
    server_->waiters_[key_].push_back(weak_from_this());
    timer_.expires_after(ClampTimeout(std::chrono::milliseconds(request_.arg)));
    timer_.async_wait([self = shared_from_this(), park](const asio::error_code& ec) {
      // A timer that fired just as Wake answered must not answer a later Get.
      if (ec || !self->waiting_ || park != self->parks_) return;
      self->Unpark();
      self->Reply(wire::Status::kTimeout, 0, "");
    });
    socket_.async_read_some(asio::buffer(probe_), [self = shared_from_this(), park](
                                                      const asio::error_code& ec, size_t) {
      if (ec == asio::error::operation_aborted) return;
      bool parked = self->waiting_ && park == self->parks_;
      if (!ec) {
        self->Close("sent data before reading the reply to its Get");
      } else if (parked) {
        bool clean = ec == asio::error::eof || ec == asio::error::connection_reset;
        self->Close(clean ? "" : "connection failed while its Get waited: " + ec.message());
      }
      // Otherwise the reply is already being written; its handler sees the error.
    });
  }

  // Ends a park: no timer, no watching read, not among the waiters.
  void Unpark() {
    waiting_ = false;
    timer_.cancel();
    asio::error_code ignored;
    socket_.cancel(ignored);
    server_->RemoveWaiter(key_, this);
  }

  void Reply(wire::Status status, int64_t arg, std::string value) {
    wire::Header header;
    header.code = static_cast<uint8_t>(status);
    header.value_bytes = static_cast<uint32_t>(value.size());
    header.arg = arg;
    reply_header_ = wire::Encode(header);
    reply_value_ = std::move(value);
    std::array<asio::const_buffer, 2> reply = {asio::buffer(reply_header_),
                                               asio::buffer(reply_value_)};
    asio::async_write(socket_, reply,
                      [self = shared_from_this()](const asio::error_code& ec, size_t) {
                        if (ec == asio::error::operation_aborted) return;
                        if (ec) {
                          self->Close("sending a reply failed: " + ec.message());
                          return;
                        }
                        self->reply_value_.clear();
                        self->ReadHeader();
                      });
  }

  Impl* const server_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  std::string peer_;
  wire::HeaderBytes header_bytes_{};
  wire::Header request_;
  std::string key_;
  std::string value_;
  wire::HeaderBytes reply_header_{};
  std::string reply_value_;
  std::array<uint8_t, 1> probe_{};  // the watching read of a parked Get
  core::Nonce server_nonce_{};
  std::array<uint8_t, auth::kChallengeBytes> challenge_{};
  std::array<uint8_t, auth::kResponseBytes> response_{};
  std::array<uint8_t, auth::kVerdictBytes> verdict_{};
  std::vector<uint8_t> enrol_reply_;
  bool enrol_seen_ = false;  // this connection has sent its one enrolment request
  bool enrolled_ = false;    // and was given the token for its rank
  bool proven_ = false;      // its proof of the token was right (the verdict may be on its way)
  bool authenticated_ = false;
  bool waiting_ = false;            // a Get is parked on key_
  uint64_t parks_ = 0;              // how many Gets were parked so far
};

TcpStoreServer::Impl::Impl(const std::string& host, uint16_t port, std::string token,
                           int world_size, Clock::time_point lookup_deadline,
                           std::chrono::milliseconds timeout)
    : token_(std::move(token)),
      enrolling_(token_.empty() && world_size > 1),
      world_size_(world_size),
      name_("TCP store server at " + FormatHostPort(host, port)) {
  if (enrolling_) {
    const core::Nonce random = core::RandomNonce();  // RAND_bytes
    static_assert(core::kNonceBytes == auth::kGeneratedTokenBytes);
    token_.assign(reinterpret_cast<const char*>(random.data()), random.size());
    enrolled_from_.resize(size_t(world_size));
  }
  // An address, or every interface (""), needs no name server; a name is looked up on a thread
  // of its own, by the deadline, since getaddrinfo cannot be cancelled.
  asio::error_code ec;
  std::vector<tcp::endpoint> endpoints;
  const asio::ip::address address = asio::ip::make_address(host, ec);
  if (!ec) {
    endpoints.emplace_back(address, port);
  } else if (host.empty()) {
    for (const auto& entry : tcp::resolver(io_).resolve(host, "0", tcp::resolver::passive, ec)) {
      endpoints.emplace_back(entry.endpoint().address(), port);
    }
  } else {
    const auto found = LookUpBy(host, lookup_deadline, &ec);
    if (!found) {
      throw Error(ErrorCode::kTimeout, name_ + ": the lookup of '" + host +
                                           "' has not answered within " +
                                           std::to_string(timeout.count()) + " ms");
    }
    for (const auto& entry : *found) endpoints.emplace_back(entry.endpoint().address(), port);
  }
  if (endpoints.empty()) {
    throw Error(ErrorCode::kSystem,
                name_ + ": cannot resolve '" + host + "': " + (ec ? ec.message() : "no address"));
  }
  std::string failures;
  for (const tcp::endpoint& endpoint : endpoints) {
    asio::error_code step;
    acceptor_.open(endpoint.protocol(), step);
    if (!step) SetCloseOnExec(acceptor_.native_handle());
    if (!step) acceptor_.set_option(tcp::acceptor::reuse_address(true), step);
    if (!step) acceptor_.bind(endpoint, step);
    if (!step) acceptor_.listen(asio::socket_base::max_listen_connections, step);
    if (!step) {
      port_ = acceptor_.local_endpoint(step).port();
      if (!step) break;
    }
    failures += (failures.empty() ? "" : "; ") + Describe(endpoint) + ": " + step.message();
    asio::error_code ignored;
    acceptor_.close(ignored);
    port_ = 0;
  }
  if (port_ == 0) {
    throw Error(ErrorCode::kSystem,
                name_ + ": cannot listen: " + (failures.empty() ? "no address" : failures));
  }
  name_ = "TCP store server at " + FormatHostPort(host, port_);
  table_ = std::make_unique<MemoryStore>(
      name_, [this](const std::string& key) { asio::post(io_, [this, key] { OnKeySet(key); }); });
  Accept();
  thread_ = std::thread([this] {
    // Only the destructor's stop ends the runs: a handler that threw does not leave the
    // io_context out of work, hence stopped, with the accept it was to start again.
    const auto work = asio::make_work_guard(io_);
    bool resume = false;
    for (;;) {
      try {
        if (resume) ResumeAccepting();
        io_.run();
        return;
      } catch (const std::exception& e) {
        Log(name_ + ": unexpected exception in the server thread (accepting again): " + e.what());
        resume = true;
      }
    }
  });
}

TcpStoreServer::Impl::~Impl() {
  io_.stop();
  thread_.join();
  // The io thread is gone: close what is left from here. Handlers still queued are destroyed
  // with io_ and release the sessions.
  asio::error_code ignored;
  acceptor_.close(ignored);
  accept_retry_.cancel();
  for (auto& [raw, weak] : sessions_) {
    if (auto session = weak.lock()) session->Shutdown();
  }
  sessions_.clear();
  waiters_.clear();
}

void TcpStoreServer::Impl::ResumeAccepting() {
  ++accept_chain_;
  asio::error_code ignored;
  acceptor_.cancel(ignored);
  accept_retry_.cancel();
  Accept();
}

void TcpStoreServer::Impl::Accept() {
  acceptor_.async_accept([this, chain = accept_chain_](const asio::error_code& ec,
                                                       tcp::socket socket) {
    if (ec == asio::error::operation_aborted || chain != accept_chain_) return;
    if (ec) return OnAcceptError(ec);
    asio::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    SetCloseOnExec(socket.native_handle());
    std::erase_if(unproven_, [](const std::weak_ptr<Session>& weak) {
      const auto session = weak.lock();
      return !session || !session->Unproven();
    });
    if (unproven_.size() >= MaxUnproven()) EvictOldestUnproven("to make room for a new one");
    auto session = std::make_shared<Session>(this, std::move(socket));
    // Assigned, not emplaced: a session whose handler threw (an allocation failed) was destroyed
    // without Forget, and its address, still a key here, may be the new one's.
    sessions_.insert_or_assign(session.get(), session);
    unproven_.push_back(session);
    session->Start();
    Accept();
  });
}

void TcpStoreServer::Impl::OnAcceptError(const asio::error_code& ec) {
  accept_log_.Write(name_ + ": accept failed: " + ec.message());
  switch (DecideAfterAcceptFailure(
      ec, acceptor_.native_handle(), [this] { return EvictOldestUnproven("out of descriptors"); },
      spare_)) {
    case AfterAcceptFailure::kAcceptAgain:
      return Accept();
    case AfterAcceptFailure::kWaitForConnection:
      acceptor_.async_wait(tcp::acceptor::wait_read,
                           [this, chain = accept_chain_](const asio::error_code& wait_ec) {
                             if (!wait_ec && chain == accept_chain_) Accept();
                           });
      return;
    case AfterAcceptFailure::kRetryShortly:
      accept_retry_.expires_after(kAcceptRetryDelay);
      accept_retry_.async_wait([this, chain = accept_chain_](const asio::error_code& wait_ec) {
        if (!wait_ec && chain == accept_chain_) Accept();
      });
      return;
  }
}

bool TcpStoreServer::Impl::EvictOldestUnproven(const char* why) {
  std::shared_ptr<Session> oldest;
  std::shared_ptr<Session> oldest_quiet;
  for (const auto& weak : unproven_) {
    auto session = weak.lock();
    if (!session || !session->Unproven()) continue;
    if (!oldest) oldest = session;
    if (session->Unread() == 0) {
      oldest_quiet = std::move(session);
      break;
    }
  }
  std::shared_ptr<Session> victim = oldest_quiet ? oldest_quiet : oldest;
  if (!victim) return false;
  eviction_log_.Write(name_ + ": closed the oldest connection that has not proven the job token (" +
                      victim->peer() + "), " + why);
  victim->Close("");
  std::erase_if(unproven_,
                [&victim](const std::weak_ptr<Session>& weak) { return weak.lock() == victim; });
  return true;
}

void TcpStoreServer::Impl::OnKeySet(const std::string& key) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  std::vector<std::weak_ptr<Session>> waiting = std::move(it->second);
  waiters_.erase(it);
  for (auto& weak : waiting) {
    if (auto session = weak.lock()) session->Wake(key);
  }
}

std::optional<std::string> TcpStoreServer::Impl::Enrol(uint32_t rank, const std::string& peer,
                                                       auth::EnrolRefusal* reason,
                                                       std::string* taken_by, std::string* why) {
  const std::string who = "enrolment for rank " + std::to_string(rank);
  if (!enrolling_) {
    // The empty key of a store that was given neither a token nor a world size is no secret.
    if (token_.empty()) return token_;
    *reason = auth::EnrolRefusal::kNotEnrolling;
    *why = who +
           " refused: this store holds the job's token, the client has none (is "
           "COLLECTIVES_JOB_TOKEN set on every rank?)";
    return std::nullopt;
  }
  if (rank < 1 || rank >= uint32_t(world_size_)) {
    *reason = auth::EnrolRefusal::kRankOutOfRange;
    *why = who + " refused: the job's ranks that enrol are 1.." + std::to_string(world_size_ - 1);
    return std::nullopt;
  }
  std::string& from = enrolled_from_[rank];
  if (!from.empty()) {
    *reason = auth::EnrolRefusal::kTaken;
    *taken_by = from;
    *why = who + " refused: " + from + " enrolled for it already" +
           (enrolled_count_ == world_size_ - 1 ? " (every rank has enrolled)" : "") +
           "; a stranger may be on this port (set COLLECTIVES_JOB_TOKEN to a shared secret)";
    return std::nullopt;
  }
  from = peer;
  ++enrolled_count_;
  return token_;
}

void TcpStoreServer::Impl::Unenrol(uint32_t rank, const std::string& peer,
                                   const std::string& error) {
  if (!enrolling_ || rank >= enrolled_from_.size() || enrolled_from_[rank] != peer) return;
  enrolled_from_[rank].clear();
  --enrolled_count_;
  Log(name_ + ": enrolment for rank " + std::to_string(rank) + " from " + peer +
      " undone: the reply did not reach it (" + error + ")");
}

void TcpStoreServer::Impl::RemoveWaiter(const std::string& key, Session* session) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  auto& list = it->second;
  std::erase_if(list, [session](const std::weak_ptr<Session>& weak) {
    auto locked = weak.lock();
    return !locked || locked.get() == session;
  });
  if (list.empty()) waiters_.erase(it);
}

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, const std::string& token,
                               int world_size, Clock::time_point lookup_deadline,
                               std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(host, port, token, world_size, lookup_deadline, timeout)) {}

TcpStoreServer::~TcpStoreServer() = default;

uint16_t TcpStoreServer::port() const { return impl_->port(); }

std::string TcpStoreServer::JobToken() const { return impl_->token(); }

void TcpStoreServer::Set(const std::string& key, const std::string& value) {
  impl_->table().Set(key, value);
}

std::string TcpStoreServer::Get(const std::string& key, std::chrono::milliseconds timeout) {
  return impl_->table().Get(key, timeout);
}

int64_t TcpStoreServer::Add(const std::string& key, int64_t delta) {
  return impl_->table().Add(key, delta);
}

}  // namespace collectives::cluster
