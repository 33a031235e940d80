// The TCP store's client (see tcp_store.h for the design, tcp_store_wire.h for the protocol).
//
// A standard header comes before <asio.hpp> on purpose (see tcp_store_server.cc).
#include <algorithm>
#include <array>
#include <asio.hpp>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/name_lookups.h"
#include "src/cluster/store_common.h"
#include "src/cluster/tcp_store.h"
#include "src/cluster/tcp_store_auth.h"
#include "src/cluster/tcp_store_wire.h"
#include "src/core/text.h"

namespace collectives::cluster {
namespace {

using asio::ip::tcp;

constexpr std::chrono::milliseconds kFirstRetry{10};
constexpr std::chrono::milliseconds kMaxRetry{200};
constexpr std::chrono::milliseconds kMinIoTimeout{1000};
constexpr std::chrono::milliseconds kMinAttempt{50};
// How long a connection to one of several addresses may take before the next is tried: TCP
// sends its SYN again after 1 s, so a connection not made by then lost one (or the address
// drops them); the next round of attempts comes back to it.
constexpr std::chrono::milliseconds kConnectSlice{1000};
// How long after the end of a Get's wait the server's answer may take to start coming (its
// timer ends the wait on its side); the value then gets the whole I/O limit to arrive.
constexpr std::chrono::milliseconds kGetAnswerGrace{2000};  // ample on a loaded machine
constexpr size_t kMaxIdleConnections = 4;

// One connection to the server with its own io_context, driven synchronously by the calling
// thread. Used by one thread at a time.
class Connection {
 public:
  // kRejected: the server refused this client's proof of the token, or could not prove it.
  enum class Result { kOk, kTimedOut, kFailed, kRejected };

  Connection() : socket_(io_) {}

  // Tries each endpoint in turn until one connects or the deadline passes. Each but the last
  // gets kConnectSlice at most: one that drops connection requests (a host that is down, a
  // firewall) would otherwise hold every attempt until its deadline, and the next endpoint would
  // never be tried.
  Result Connect(const std::vector<tcp::endpoint>& endpoints, Clock::time_point deadline,
                 std::string* why) {
    *why = "no address";
    for (size_t i = 0; i < endpoints.size(); ++i) {
      const tcp::endpoint& endpoint = endpoints[i];
      const bool last = i + 1 == endpoints.size();
      asio::error_code error;
      socket_.open(endpoint.protocol(), error);
      if (error) {  // this address's family may be off here: the next may do
        Failed(why, error);
        continue;
      }
      SetCloseOnExec(socket_.native_handle());
      error = asio::error::would_block;
      socket_.async_connect(endpoint, [&error](const asio::error_code& ec) { error = ec; });
      if (!RunUntil(last ? deadline : std::min(deadline, Clock::now() + kConnectSlice))) {
        TimedOut(why, "connecting");
        if (last || Clock::now() >= deadline) return Result::kTimedOut;
        continue;  // RunUntil closed the socket
      }
      if (!error) {
        asio::error_code ignored;
        socket_.set_option(tcp::no_delay(true), ignored);
        return Result::kOk;
      }
      Failed(why, error);
      asio::error_code ignored;
      socket_.close(ignored);
    }
    return Result::kFailed;
  }

  // The client side of tcp_store_auth.h, right after Connect: reads the server's challenge.
  Result ReadChallenge(Clock::time_point deadline, std::string* why) {
    std::array<uint8_t, auth::kChallengeBytes> challenge{};
    const Result read =
        ReadAll(asio::buffer(challenge), deadline, "waiting for the server's challenge", why);
    if (read != Result::kOk) return read;
    if (!auth::DecodeChallenge(challenge, &server_nonce_)) {
      *why = "the server did not open with a store challenge (not a collectives TCP store?)";
      return Result::kRejected;
    }
    return Result::kOk;
  }

  // After ReadChallenge, for a client that holds no token: enrols for `rank` and returns the
  // job token in `*token`. kRejected with the reason in `*why` when the server refuses.
  Result Enrol(int rank, Clock::time_point deadline, std::string* token, std::string* why) {
    const auth::Response request = auth::EncodeEnrolment(uint32_t(rank));
    Result step = WriteAll(asio::buffer(request), deadline, "sending the enrolment request", why);
    if (step != Result::kOk) return step;
    std::array<uint8_t, auth::kEnrolReplyHeaderBytes> header{};
    step = ReadAll(asio::buffer(header), deadline, "waiting for the enrolment reply", why);
    if (step != Result::kOk) return step;
    const std::string malformed = auth::CheckEnrolReply(header);
    if (!malformed.empty()) {
      *why = "malformed enrolment reply: " + malformed;
      return Result::kRejected;
    }
    std::string payload(header[2], '\0');
    if (!payload.empty()) {
      step = ReadAll(asio::buffer(payload), deadline, "reading the enrolment reply", why);
      if (step != Result::kOk) return step;
    }
    if (header[0] == auth::kEnrolled) {
      *token = std::move(payload);
      return Result::kOk;
    }
    const std::string who = "rank " + std::to_string(rank) + "'s enrolment in the job's store";
    switch (static_cast<auth::EnrolRefusal>(header[1])) {
      case auth::EnrolRefusal::kTaken:
        *why = who + " was already taken by " + core::OneLine(payload) +
               "; a stranger may be on the store's port; set COLLECTIVES_JOB_TOKEN to a shared "
               "secret";
        break;
      case auth::EnrolRefusal::kRankOutOfRange:
        *why = who +
               " was refused: the rank is outside the job's (is the world size the same "
               "on every rank?)";
        break;
      default:
        *why = who +
               " was refused: the store holds a job token and this rank has none (set "
               "COLLECTIVES_JOB_TOKEN to the same secret on every rank)";
        break;
    }
    return Result::kRejected;
  }

  // After ReadChallenge (and Enrol): proves `token` and checks the server's proof.
  Result Authenticate(const std::string& token, Clock::time_point deadline, std::string* why) {
    const core::Nonce client_nonce = core::RandomNonce();
    const core::Proof proof =
        auth::StoreProof(token, client_nonce, server_nonce_, auth::kClientRole);
    std::array<asio::const_buffer, 2> response = {asio::buffer(client_nonce), asio::buffer(proof)};
    const Result sent = WriteAll(response, deadline, "sending the proof", why);
    if (sent != Result::kOk) return sent;
    std::array<uint8_t, auth::kVerdictBytes> verdict{};
    asio::error_code error;
    const Result read =
        ReadAll(asio::buffer(verdict), deadline, "waiting for the verdict", why, &error);
    if (read == Result::kTimedOut) return read;
    // The server writes a verdict before it closes on a wrong proof: a close without one (the
    // server made room for other connections, or stopped) is worth another attempt.
    if (!error && verdict[0] != 1) {
      *why =
          "the server rejected this client's proof of the job token (is "
          "COLLECTIVES_JOB_TOKEN the same on every rank?)";
      return Result::kRejected;
    }
    if (read != Result::kOk) return read;
    core::Proof server_proof;
    std::memcpy(server_proof.data(), verdict.data() + 1, server_proof.size());
    if (!core::ProofsEqual(server_proof, auth::StoreProof(token, client_nonce, server_nonce_,
                                                          auth::kServerRole))) {
      *why = "the server could not prove that it holds the job token";
      return Result::kRejected;
    }
    return Result::kOk;
  }

  // Sends a request and reads its reply (header into `*reply`, value into `*reply_value`): the
  // request and the reply's header by `answer_deadline`, the value by `deadline`.
  Result Call(const wire::Header& request, const std::string& key, const std::string& value,
              Clock::time_point answer_deadline, Clock::time_point deadline, wire::Header* reply,
              std::string* reply_value, std::string* why) {
    wire::HeaderBytes request_bytes = wire::Encode(request);
    std::array<asio::const_buffer, 3> out = {asio::buffer(request_bytes), asio::buffer(key),
                                             asio::buffer(value)};
    Result step = WriteAll(out, answer_deadline, "sending the request", why);
    if (step != Result::kOk) return step;

    wire::HeaderBytes reply_bytes{};
    step = ReadAll(asio::buffer(reply_bytes), answer_deadline, "waiting for the reply", why);
    if (step != Result::kOk) return step;
    *reply = wire::Decode(reply_bytes);
    std::string malformed = wire::CheckReply(*reply, static_cast<wire::Op>(request.code));
    if (!malformed.empty()) {
      *why = "malformed reply: " + malformed;
      return Result::kFailed;
    }
    reply_value->resize(reply->value_bytes);  // bounded by CheckReply
    if (reply->value_bytes == 0) return Result::kOk;
    return ReadAll(asio::buffer(*reply_value), deadline, "reading the reply", why);
  }

 private:
  // Writes / reads all of `buffers` by `deadline`: kOk, kTimedOut (`doing` names the step in
  // `*why`) or kFailed (the transport's error in `*why`, and in `*error_out` when given).
  template <typename Buffers>
  Result WriteAll(const Buffers& buffers, Clock::time_point deadline, const char* doing,
                  std::string* why) {
    asio::error_code error = asio::error::would_block;
    asio::async_write(socket_, buffers,
                      [&error](const asio::error_code& ec, size_t) { error = ec; });
    return Finish(error, deadline, doing, why);
  }

  template <typename Buffers>
  Result ReadAll(const Buffers& buffers, Clock::time_point deadline, const char* doing,
                 std::string* why, asio::error_code* error_out = nullptr) {
    asio::error_code error = asio::error::would_block;
    asio::async_read(socket_, buffers,
                     [&error](const asio::error_code& ec, size_t) { error = ec; });
    const Result result = Finish(error, deadline, doing, why);
    if (error_out != nullptr) *error_out = error;
    return result;
  }

  // Runs the pending operation, whose handler writes `error`, to its end.
  Result Finish(const asio::error_code& error, Clock::time_point deadline, const char* doing,
                std::string* why) {
    if (!RunUntil(deadline)) return TimedOut(why, doing);
    if (error) return Failed(why, error);
    return Result::kOk;
  }

  // Runs the one pending operation until it completes (true) or `deadline` passes (false; the
  // socket is then closed and the operation's handler has run with operation_aborted).
  bool RunUntil(Clock::time_point deadline) {
    io_.restart();
    io_.run_until(deadline);
    if (io_.stopped()) return true;
    asio::error_code ignored;
    socket_.close(ignored);
    io_.run();
    return false;
  }

  static Result TimedOut(std::string* why, const char* doing) {
    *why = std::string("deadline passed while ") + doing;
    return Result::kTimedOut;
  }

  static Result Failed(std::string* why, const asio::error_code& error) {
    *why = error == asio::error::eof ? "the server closed the connection" : error.message();
    return Result::kFailed;
  }

  asio::io_context io_;
  tcp::socket socket_;
  core::Nonce server_nonce_{};  // from the challenge
};

}  // namespace

class TcpStoreClient::Impl {
 public:
  Impl(const std::string& host, uint16_t port, std::chrono::milliseconds timeout, std::string token,
       int rank)
      : token_(std::move(token)),
        enrol_(token_.empty() && rank >= 0),
        rank_(rank),
        host_(StripBrackets(host)),
        port_(port),
        timeout_(ClampTimeout(timeout)),
        io_timeout_(std::max(timeout_, kMinIoTimeout)),
        name_("TCP store at " + FormatHostPort(host_, port)) {
    if (host_.empty()) {
      throw Error(ErrorCode::kInvalidArgument, "CreateTcpStore: the host is empty");
    }
    if (port == 0) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "CreateTcpStore: a client needs the server's port; got port 0 for '" + host_ + "'");
    }
    Release(Open(timeout_, Clock::time_point::max(), ""));
  }

  const std::string& token() const { return token_; }

  void Set(const std::string& key, const std::string& value, Clock::time_point deadline) {
    CheckKey(name_, key);
    CheckValue(name_, key, value);
    wire::Header request;
    request.code = static_cast<uint8_t>(wire::Op::kSet);
    request.key_bytes = static_cast<uint32_t>(key.size());
    request.value_bytes = static_cast<uint32_t>(value.size());
    std::string ignored;
    Call("Set", request, key, value, IoDeadlines(deadline), &ignored);
  }

  std::string Get(const std::string& key, std::chrono::milliseconds timeout) {
    CheckKey(name_, key);
    std::chrono::milliseconds clamped = ClampTimeout(timeout);
    wire::Header request;
    request.code = static_cast<uint8_t>(wire::Op::kGet);
    request.key_bytes = static_cast<uint32_t>(key.size());
    request.arg = clamped.count();
    // The server answers when the key is set or its timer ends the wait: the answer must start
    // coming within a grace after that (a set-up's Get ends near the set-up's deadline, not a
    // whole store timeout later), a value then gets the I/O limit to arrive whole.
    Deadlines deadlines;
    deadlines.answer = DeadlineAfter(clamped + kGetAnswerGrace);
    deadlines.whole = std::max(deadlines.answer, DeadlineAfter(clamped + io_timeout_));
    deadlines.limit = "within " + std::to_string(kGetAnswerGrace.count()) +
                      " ms of the end of its " + std::to_string(clamped.count()) + " ms wait";
    std::string value;
    wire::Header reply = Call("Get", request, key, "", deadlines, &value);
    if (reply.code == static_cast<uint8_t>(wire::Status::kTimeout)) {
      ThrowGetTimeout(name_, key, clamped);
    }
    return value;
  }

  int64_t Add(const std::string& key, int64_t delta, Clock::time_point deadline) {
    CheckKey(name_, key);
    wire::Header request;
    request.code = static_cast<uint8_t>(wire::Op::kAdd);
    request.key_bytes = static_cast<uint32_t>(key.size());
    request.arg = delta;
    std::string ignored;
    return Call("Add", request, key, "", IoDeadlines(deadline), &ignored).arg;
  }

 private:
  // When one call must end: `answer`, the connection (when it has to be opened again), the
  // request and the reply's header; `whole`, the reply's value. `limit` says `answer` in errors.
  struct Deadlines {
    Clock::time_point answer;
    Clock::time_point whole;
    std::string limit;
  };

  // A Set's or an Add's: the I/O limit for all of it, or the caller's `deadline` when sooner
  // (but a moment at least, as for a connection, so that a server that is up always answers).
  Deadlines IoDeadlines(Clock::time_point deadline) const {
    Deadlines deadlines;
    deadlines.answer = deadlines.whole = DeadlineAfter(io_timeout_);
    std::chrono::milliseconds limit = io_timeout_;
    deadline = std::max(deadline, Clock::now() + kMinAttempt);
    if (deadline < deadlines.answer) {
      deadlines.answer = deadlines.whole = deadline;
      limit = std::max(std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()),
                       std::chrono::milliseconds(0));
    }
    deadlines.limit = "within " + std::to_string(limit.count()) + " ms";
    return deadlines;
  }

  // Runs one exchange on a pooled (or new) connection. Returns the reply, whose status is kOk,
  // or kTimeout for a Get; throws for everything else. A reply malformed as the answer to this
  // request (wire::CheckReply: a timeout answering a Set, a value on an Add's "ok", ...) is a
  // server out of step with this client: kPeerLost, and the connection is not reused.
  wire::Header Call(const char* what, const wire::Header& request, const std::string& key,
                    const std::string& value, const Deadlines& deadlines,
                    std::string* reply_value) {
    const std::string context = std::string(what) + " of key " + QuoteKey(key);
    std::unique_ptr<Connection> connection = Acquire(deadlines.answer, context);
    wire::Header reply;
    std::string why;
    Connection::Result result = connection->Call(request, key, value, deadlines.answer,
                                                 deadlines.whole, &reply, reply_value, &why);
    if (result == Connection::Result::kTimedOut) {
      throw StoreFailure(ErrorCode::kTimeout, name_ + ": " + context + " got no reply " +
                                                  deadlines.limit + " (" + why + ")");
    }
    if (result == Connection::Result::kFailed) {
      // The pooled connections lead to the same server, which is gone (or restarted, or out of
      // step): the next call opens a new connection instead of failing on another of them.
      DropIdle();
      throw StoreFailure(ErrorCode::kPeerLost, name_ + ": " + context + " failed: " + why);
    }
    Release(std::move(connection));
    if (reply.code == static_cast<uint8_t>(wire::Status::kInvalidArgument)) {
      throw StoreFailure(ErrorCode::kInvalidArgument, core::OneLine(*reply_value));
    }
    return reply;
  }

  // An idle connection, or a new one opened by `deadline` (`what` names the call in errors).
  std::unique_ptr<Connection> Acquire(Clock::time_point deadline, const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        std::unique_ptr<Connection> connection = std::move(idle_.back());
        idle_.pop_back();
        return connection;
      }
    }
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    return Open(std::max(left, std::chrono::milliseconds(0)), deadline, what + " ");
  }

  void DropIdle() {
    std::vector<std::unique_ptr<Connection>> dropped;  // closed after the lock is released
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(idle_);
  }

  void Release(std::unique_ptr<Connection> connection) {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(connection));
  }

  // Connects, retrying with a backoff until `budget` has passed; each attempt proves the token
  // within the I/O limit, but not past `io_cap`. `what` ("Get of key 'k' ", or "") starts the
  // timeout's message.
  std::unique_ptr<Connection> Open(std::chrono::milliseconds budget, Clock::time_point io_cap,
                                   const std::string& what) {
    Clock::time_point deadline = DeadlineAfter(budget);
    std::chrono::milliseconds backoff = kFirstRetry;
    std::string last_error = "no attempt made";
    for (;;) {
      // Every attempt gets a moment, even with a zero timeout, so that a server that is up
      // is always reached.
      Clock::time_point attempt_deadline = std::max(deadline, Clock::now() + kMinAttempt);
      std::vector<tcp::endpoint> endpoints;
      if (Resolve(attempt_deadline, &endpoints, &last_error)) {
        auto connection = std::make_unique<Connection>();
        Connection::Result result = connection->Connect(endpoints, attempt_deadline, &last_error);
        const Clock::time_point io_deadline =
            std::max(attempt_deadline, std::min(DeadlineAfter(io_timeout_), io_cap));
        if (result == Connection::Result::kOk) {
          result = connection->ReadChallenge(io_deadline, &last_error);
        }
        if (result == Connection::Result::kOk && enrol_) {
          // Only the constructor's Open gets here: once the token arrived, enrol_ is false and
          // a retry or a later connection proves the token instead of enrolling again.
          result = connection->Enrol(rank_, io_deadline, &token_, &last_error);
          if (result == Connection::Result::kOk) enrol_ = false;
        }
        if (result == Connection::Result::kOk) {
          result = connection->Authenticate(token_, io_deadline, &last_error);
          if (result == Connection::Result::kOk) return connection;
        }
        if (result == Connection::Result::kRejected) {
          throw StoreFailure(ErrorCode::kUnauthenticated, name_ + ": " + last_error);
        }
      }
      Clock::time_point now = Clock::now();
      if (now >= deadline) break;
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, kMaxRetry);
    }
    throw StoreFailure(ErrorCode::kTimeout, name_ + ": " + what + "could not connect within " +
                                                std::to_string(budget.count()) +
                                                " ms (last error: " + last_error + ")");
  }

  // The server's addresses, with its port, in `*endpoints`: an address as it is, a name looked
  // up on a thread of its own by `deadline` (getaddrinfo cannot be cancelled). False, with why
  // in `*why`, when the name does not resolve or its lookup has not answered by then.
  bool Resolve(Clock::time_point deadline, std::vector<tcp::endpoint>* endpoints,
               std::string* why) const {
    asio::error_code ec;
    const asio::ip::address address = asio::ip::make_address(host_, ec);
    if (!ec) {
      endpoints->emplace_back(address, port_);
      return true;
    }
    const auto found = LookUpBy(host_, deadline, &ec);
    if (!found) {
      *why = "the lookup of '" + host_ + "' has not answered";
      return false;
    }
    for (const auto& entry : *found) endpoints->emplace_back(entry.endpoint().address(), port_);
    if (endpoints->empty()) {
      *why = "cannot resolve '" + host_ + "': " + (ec ? ec.message() : "no address");
      return false;
    }
    return true;
  }

  // The token every connection proves, and whether this client must still enrol for it (as
  // rank_). Written only while the constructor runs (its Open), constant afterwards.
  std::string token_;
  bool enrol_;
  const int rank_;
  const std::string host_;
  const uint16_t port_;
  const std::chrono::milliseconds timeout_;     // for connecting
  const std::chrono::milliseconds io_timeout_;  // for one exchange, besides a Get's own wait
  const std::string name_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> idle_;  // guarded by mu_
};

TcpStoreClient::TcpStoreClient(const std::string& host, uint16_t port,
                               std::chrono::milliseconds timeout, const std::string& token,
                               int rank)
    : impl_(std::make_unique<Impl>(host, port, timeout, token, rank)) {}

std::string TcpStoreClient::JobToken() const { return impl_->token(); }

TcpStoreClient::~TcpStoreClient() = default;

void TcpStoreClient::Set(const std::string& key, const std::string& value) {
  impl_->Set(key, value, Clock::time_point::max());
}

void TcpStoreClient::SetBy(const std::string& key, const std::string& value,
                           Clock::time_point deadline) {
  impl_->Set(key, value, deadline);
}

std::string TcpStoreClient::Get(const std::string& key, std::chrono::milliseconds timeout) {
  return impl_->Get(key, timeout);
}

int64_t TcpStoreClient::Add(const std::string& key, int64_t delta) {
  return impl_->Add(key, delta, Clock::time_point::max());
}

int64_t TcpStoreClient::AddBy(const std::string& key, int64_t delta, Clock::time_point deadline) {
  return impl_->Add(key, delta, deadline);
}

}  // namespace collectives::cluster
