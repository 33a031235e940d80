// The TCP fabric: its construction from the set-up's sockets (ConnectTcpFabric), the drive loop
// that waits on its connections, and its break and shutdown. The connections are in
// tcp_connection.h, the set-up in tcp_mesh.h.
//
// Waiting: Wait* poll the io_context for the spin budget, then poll with a sched_yield between
// polls for the yield budget, then sleep in run_one_until up to the deadline. Abort from another
// thread records the error; if the fabric is idle, that thread sends the abort frames and closes
// at once; if a thread is driving it, Abort posts a no-op that wakes it, and the driving thread
// does the shutdown before it throws.
#include "src/transport/tcp_fabric.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "src/cluster/store_common.h"
#include "src/transport/fabric_errors.h"
#include "src/transport/frame.h"
#include "src/transport/handshake.h"
#include "src/transport/socket_buffers.h"
#include "src/transport/tcp_connection.h"
#include "src/transport/tcp_fabric_impl.h"
#include "src/transport/tcp_mesh.h"

namespace collectives::transport {
namespace {

using asio::ip::tcp;

// How long a shutdown gives its abort frames to go out.
constexpr std::chrono::milliseconds kAbortBudget{100};
// After its abort frames, a shutdown half-closes every connection and reads (and drops) what the
// peers still send until each closes its side too (it breaks on the abort frame and shuts down
// in turn), for at most this long. Closing with unread bytes, or with bytes still on their way,
// makes the kernel reset the connection, and a reset can overtake the abort frame: the peer
// would report this rank as lost instead of the error that broke the job.
constexpr std::chrono::milliseconds kLingerBudget{200};
// How long an Abort from another thread waits for the driving thread to run the shutdown: its
// two budgets and time for the driving thread to reach its next wait.
constexpr std::chrono::milliseconds kAbortWaitLimit =
    kAbortBudget + kLingerBudget + std::chrono::milliseconds(700);
// What the fabric's listener gives one handshake, as the set-up's does (tcp_mesh.cc).
constexpr std::chrono::seconds kServerHandshakeLimit{10};
// A connection on demand whose handshake the peer closed without a verdict (its set-up, still
// running, cancelled it while handing its listener to its fabric) is tried again this often.
constexpr int kConnectAttempts = 4;
// A failed accept (out of descriptors, say) is tried again after this long.
constexpr std::chrono::milliseconds kAcceptRetry{10};

std::atomic<int> g_connections_open{0};

}  // namespace

// ---- TcpConnection: waiting. ----

void TcpConnection::CheckTicket(const char* call, uint64_t ticket, bool send) const {
  const uint64_t posted = send ? sends_posted_ : recvs_posted_;
  if (ticket <= posted) return;
  throw Error(ErrorCode::kInvalidUsage,
              "rank " + std::to_string(fabric_->rank_) + ": " + call + "(" +
                  std::to_string(ticket) + ") " + (send ? "to" : "from") + " rank " +
                  std::to_string(peer_) + ", but only " + std::to_string(posted) +
                  (send ? " sends" : " receives") + " were posted");
}

void TcpConnection::WaitSend(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("WaitSend", ticket, true);
  fabric_->Drive([this, ticket] { return sends_done_ >= ticket; }, *this, true);
}

void TcpConnection::WaitRecv(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("WaitRecv", ticket, false);
  fabric_->Drive([this, ticket] { return recvs_done_ >= ticket; }, *this, false);
}

bool TcpConnection::TestSend(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("TestSend", ticket, true);
  return fabric_->Test([this, ticket] { return sends_done_ >= ticket; }, *this, true);
}

bool TcpConnection::TestRecv(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("TestRecv", ticket, false);
  return fabric_->Test([this, ticket] { return recvs_done_ >= ticket; }, *this, false);
}

// ---- TcpFabric. ----

int TcpConnectionsOpen() { return g_connections_open.load(); }

void TcpFabric::CountOpened() { g_connections_open.fetch_add(1); }
void TcpFabric::CountClosed() { g_connections_open.fetch_sub(1); }

TcpFabric::TcpFabric(int rank, int size, std::vector<std::optional<tcp::socket>>& sockets_in_setup,
                     std::unique_ptr<OnDemandSetup> on_demand)
    : work_(asio::make_work_guard(io_)),
      rank_(rank),
      size_(size),
      on_demand_(std::move(on_demand)) {
  connections_.resize(size);
  if (on_demand_) {
    connecting_.resize(size);
    asio::error_code ec;
    acceptor_.emplace(io_);
    acceptor_->assign(on_demand_->protocol, on_demand_->listener, ec);
    if (ec) {
      ::close(on_demand_->listener);
      throw Error(ErrorCode::kSystem,
                  "rank " + std::to_string(rank) +
                      ": cannot keep the listener for connections on demand: " + ec.message());
    }
    // Rank 0 connects to every peer itself: its listener has nothing more to accept.
    if (rank > 0) {
      AcceptNext();
    } else {
      acceptor_->close(ec);
    }
  }
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank || !sockets_in_setup[peer]) continue;
    tcp::socket& setup_socket = *sockets_in_setup[peer];
    asio::error_code ec;
    const auto local = setup_socket.local_endpoint(ec);
    const tcp protocol = ec ? tcp::v4() : local.protocol();
    // Move the descriptor from the set-up io_context to this fabric's.
    tcp::socket socket(io_, protocol, setup_socket.release(ec));
    if (!ec) socket.non_blocking(true, ec);  // the synchronous first attempts must never block
    if (ec) {
      throw Error(ErrorCode::kSystem, "rank " + std::to_string(rank) +
                                          ": cannot make the socket to rank " +
                                          std::to_string(peer) + " non-blocking: " + ec.message());
    }
    connections_[peer] = std::make_unique<TcpConnection>(this, peer, std::move(socket));
    CountOpened();
  }
  for (auto& connection : connections_) {
    if (connection) connection->ArmHeaderRead();
  }
}

TcpFabric::~TcpFabric() {
  std::lock_guard<std::mutex> lock(drive_mu_);
  if (broken()) {
    RunShutdown();
  } else {
    StopOnDemand();
    for (auto& connection : connections_) {
      if (connection) connection->Close();
    }
    // Run the cancelled operations now: their handler memory lives in the connections.
    io_.poll();
  }
  connections_.clear();
  work_.reset();
}

Connection& TcpFabric::connection(int peer) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) +
                                                 ": no connection to rank " + std::to_string(peer) +
                                                 " in a fabric of " + std::to_string(size_));
  }
  // Only the driving thread makes connections, so it may read its own writes unlocked.
  if (connections_[peer]) return *connections_[peer];
  std::lock_guard<std::mutex> lock(drive_mu_);
  return Open(peer);
}

TcpConnection& TcpFabric::Open(int peer) {
  auto& slot = connections_[peer];
  if (slot) return *slot;
  if (!on_demand_) {
    throw Error(ErrorCode::kInternal, "rank " + std::to_string(rank_) + ": no connection to rank " +
                                          std::to_string(peer));
  }
  slot = std::make_unique<TcpConnection>(this, peer, io_);
  if (peer > rank_ && !broken()) StartConnect(peer, 1);
  return *slot;
}

void TcpFabric::Unreachable(int peer, ErrorCode code, const std::string& why) {
  TcpConnection& connection = *connections_[peer];
  if (code == ErrorCode::kTimeout || code == ErrorCode::kUnauthenticated ||
      code == ErrorCode::kSystem) {
    BreakLocal(Error(code, "rank " + std::to_string(rank_) + ": cannot connect to rank " +
                               std::to_string(peer) + ": " + why));
    return;
  }
  // Like a connection that closes: the peer's listener lives as long as its communicator. As
  // for a write to a peer that closed (kWriteFailureGrace), the peer may have broken on an error
  // of its own, whose abort frame is on its way over another connection: within the grace that
  // frame decides, after it the lost peer does.
  auto timer = std::make_unique<asio::steady_timer>(io_, kWriteFailureGrace);
  timer->async_wait([this, peer, why, &connection](const asio::error_code& ec) {
    if (ec || broken()) return;
    const core::CallTag* what = nullptr;
    bool sending = true;
    if (!connection.sends_.empty()) {
      what = &connection.sends_.front().tag;
    } else if (!connection.recvs_.empty()) {
      what = &connection.recvs_.front().tag;
      sending = false;
    }
    BreakLocal(PeerLostError(rank_, peer, "cannot connect to it: " + why, what, sending));
  });
  timers_.push_back(std::move(timer));
}

void TcpFabric::StartConnect(int peer, int attempt) {
  cluster::HostPort& address = on_demand_->addresses[size_t(peer)];
  const auto limit = std::min(deadline_, Clock::now() + on_demand_->timeout);
  if (address.host.empty()) {
    // Published before the peer's set-up ended, so before any call of the peer's: a Get that
    // waits is a store that does not answer, bounded by the call's deadline.
    const std::string key = on_demand_->key_prefix + "/addr/" + std::to_string(peer);
    std::string value;
    try {
      value = on_demand_->store->Get(
          key, std::max(std::chrono::duration_cast<std::chrono::milliseconds>(limit - Clock::now()),
                        std::chrono::milliseconds(1)));
    } catch (const Error& error) {
      return Unreachable(peer, ErrorCode::kTimeout,
                         "reading its address from the store: " + error.message());
    }
    std::string why;
    auto parsed = cluster::ParseHostPort(value, &why);
    if (!parsed) {
      return Unreachable(peer, ErrorCode::kSystem,
                         "it published a malformed address under '" + key + "': " + why);
    }
    address = *parsed;
  }
  asio::error_code ec;
  const auto numeric = asio::ip::make_address(address.host, ec);
  if (!ec) return ConnectTo(peer, tcp::endpoint(numeric, address.port), attempt);
  const auto results = cluster::LookUpBy(address.host, limit);
  if (!results || results->empty()) {
    return Unreachable(peer, ErrorCode::kTimeout, "cannot resolve " + address.host);
  }
  ConnectTo(peer, tcp::endpoint(results->begin()->endpoint().address(), address.port), attempt);
}

void TcpFabric::ConnectTo(int peer, const tcp::endpoint& endpoint, int attempt) {
  const std::string where =
      cluster::FormatHostPort(endpoint.address().to_string(), endpoint.port());
  // Close-on-exec, as the set-up's (tcp_mesh.cc): a child must not hold the connection open.
  const int fd = ::socket(endpoint.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
  if (fd < 0)
    return Unreachable(peer, ErrorCode::kSystem, std::string("socket: ") + std::strerror(errno));
  auto socket = std::make_shared<tcp::socket>(io_);
  asio::error_code ec;
  socket->assign(endpoint.protocol(), fd, ec);
  if (ec) {
    ::close(fd);
    return Unreachable(peer, ErrorCode::kSystem, "socket: " + ec.message());
  }
  connecting_[size_t(peer)] = socket;
  socket->async_connect(endpoint, [this, peer, socket, endpoint, where,
                                   attempt](const asio::error_code& error) {
    connecting_[size_t(peer)].reset();
    if (error == asio::error::operation_aborted || broken()) return;
    if (error)
      return Unreachable(peer, ErrorCode::kPeerLost,
                         "connect to " + where + ": " + error.message());
    asio::error_code ignored;
    socket->set_option(tcp::no_delay(true), ignored);
    const auto limit = std::min(deadline_, Clock::now() + on_demand_->timeout);
    handshakes_.push_back(HandshakeSession::StartClient(
        std::move(*socket), on_demand_->config, peer, limit,
        [this, peer, endpoint, where, attempt](const HandshakeResult& result,
                                               tcp::socket connected) {
          if (result.code == ErrorCode::kAborted || broken()) return;
          if (result.ok) {
            SetDataSocketBuffers(connected, ConfiguredReceiveBuffer(size_),
                                 SendBufferBytes(std::getenv("COLLECTIVES_SOCKET_SNDBUF")));
            asio::error_code nb;
            connected.non_blocking(true, nb);
            connections_[size_t(peer)]->Attach(std::move(connected));
            resume_reads_ = true;
            return;
          }
          if (result.code == ErrorCode::kPeerLost && attempt < kConnectAttempts) {
            auto timer =
                std::make_unique<asio::steady_timer>(io_, std::chrono::milliseconds(5 << attempt));
            timer->async_wait([this, peer, endpoint, attempt](const asio::error_code& timer_ec) {
              if (!timer_ec && !broken()) ConnectTo(peer, endpoint, attempt + 1);
            });
            timers_.push_back(std::move(timer));
            return;
          }
          Unreachable(peer, result.code, "handshake with " + where + " failed: " + result.why);
        }));
  });
}

void TcpFabric::AcceptNext() {
  acceptor_->async_accept([this](const asio::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_ || !acceptor_->is_open()) return;
    if (ec) {
      // Out of descriptors, or a connection reset in the backlog: try again shortly.
      accept_error_ = ec.message();
      accept_retry_.expires_after(kAcceptRetry);
      accept_retry_.async_wait([this](const asio::error_code& timer_ec) {
        if (!timer_ec && acceptor_ && acceptor_->is_open()) AcceptNext();
      });
      return;
    }
    cluster::SetCloseOnExec(socket.native_handle());
    asio::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    // Strangers cannot hold the listener: past a bound, the oldest handshake whose client has
    // not proved the token is closed (as in the set-up, tcp_mesh.h).
    std::erase_if(server_handshakes_, [](const std::weak_ptr<HandshakeSession>& weak) {
      const auto session = weak.lock();
      return !session || session->finished();
    });
    if (server_handshakes_.size() >= 2 * size_t(rank_) + 16) {
      for (auto it = server_handshakes_.begin(); it != server_handshakes_.end(); ++it) {
        const auto session = it->lock();
        if (session && !session->proven()) {
          session->Cancel();
          server_handshakes_.erase(it);
          break;
        }
      }
    }
    std::erase_if(handshakes_,
                  [](const std::weak_ptr<HandshakeSession>& weak) { return weak.expired(); });
    auto accept_rank = [this](int client) {
      return client >= 0 && client < rank_ &&
             (!connections_[size_t(client)] || connections_[size_t(client)]->pending_);
    };
    auto session = HandshakeSession::StartServer(
        std::move(socket), on_demand_->config, accept_rank, Clock::now() + kServerHandshakeLimit,
        [this](const HandshakeResult& result, tcp::socket admitted) {
          if (result.code == ErrorCode::kAborted || broken()) return;
          if (!result.ok) {
            refusal_log_.Write("rank " + std::to_string(rank_) + " refused a connection from " +
                               result.remote + ": " + result.why);
            return;
          }
          TcpConnection& connection = Open(result.peer_rank);
          if (!connection.pending_) return;  // a second one claiming the rank: dropped
          SetDataSocketBuffers(admitted, ConfiguredReceiveBuffer(size_),
                               SendBufferBytes(std::getenv("COLLECTIVES_SOCKET_SNDBUF")));
          asio::error_code nb;
          admitted.non_blocking(true, nb);
          connection.Attach(std::move(admitted));
          resume_reads_ = true;
        });
    server_handshakes_.push_back(session);
    handshakes_.push_back(std::move(session));
    AcceptNext();
  });
}

void TcpFabric::StopOnDemand() {
  if (!on_demand_) return;
  asio::error_code ec;
  if (acceptor_) acceptor_->close(ec);
  for (auto& weak : handshakes_) {
    if (auto session = weak.lock()) session->Cancel();
  }
  for (auto& socket : connecting_) {
    if (socket) socket->close(ec);
  }
  for (auto& timer : timers_) timer->cancel();
  accept_retry_.cancel();
}

void TcpFabric::SetDeadline(Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(drive_mu_);
  deadline_ = deadline;
}

void TcpFabric::SetCall(const core::CallTag& call) {
  std::lock_guard<std::mutex> lock(drive_mu_);
  call_ = call;
  // A fabric already broken raises its error at the call's first wait. Headers held from the
  // previous call are checked against this one, and a mismatch is raised here, not at the first
  // wait: a call that never drives the fabric (a member of a two-level plan that stays in shared
  // memory) would return, and its peers hear of it late.
  if (broken()) return;
  for (auto& connection : connections_) {
    if (connection && !connection->closed_) connection->CheckHeldHeader();
  }
  ThrowIfBroken();
}

void TcpFabric::SetSpin(std::chrono::microseconds spin, std::chrono::microseconds yield) {
  std::lock_guard<std::mutex> lock(drive_mu_);
  spin_ = std::max(spin, std::chrono::microseconds(0));
  yield_ = std::max(yield, std::chrono::microseconds(0));
}

void TcpFabric::Break(const Error& error, std::optional<AbortPayload> payload, int skip_peer) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (error_) return;
  error_.emplace(error);
  abort_to_send_ = std::move(payload);
  abort_skip_peer_ = skip_peer;
  broken_.store(true, std::memory_order_release);
}

void TcpFabric::Abort(const Error& error) {
  Break(error, AbortPayloadFor(rank_, error), -1);
  {
    std::unique_lock<std::mutex> lock(drive_mu_, std::try_to_lock);
    if (lock.owns_lock()) {
      RunShutdown();
      return;
    }
  }
  // The driving thread is inside a call: wake it; its next wait runs the shutdown (a call that
  // was already returning does not wait again: the owner calls Abort again once it ended, see
  // Fabric::Abort). Return once it has, so that the peers have been told when Abort returns
  // (a process may exit right after), but not later than kAbortWaitLimit: the driving thread
  // may be busy between waits.
  asio::post(io_, [] {});
  std::unique_lock<std::mutex> lock(shutdown_mu_);
  shutdown_cv_.wait_for(lock, kAbortWaitLimit, [this] { return shutdown_finished_; });
}

std::optional<Error> TcpFabric::ErrorWithin(Clock::duration wait) {
  std::lock_guard<std::mutex> lock(drive_mu_);
  const auto until = Clock::now() + wait;
  while (!broken() && Clock::now() < until) {
    if (ResumeReads()) continue;
    io_.run_one_until(until);
  }
  if (!broken()) return std::nullopt;
  try {
    ThrowIfBroken();
  } catch (const Error& error) {
    return error;
  }
  return std::nullopt;
}

void TcpFabric::ThrowIfBroken() {
  if (!broken()) return;
  RunShutdown();
  std::lock_guard<std::mutex> lock(error_mu_);
  throw *error_;
}

void TcpFabric::RunShutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // However the shutdown ends (a bad_alloc encoding the payload included), an Abort waiting
  // for it is let go.
  struct Finished {
    TcpFabric* fabric;
    ~Finished() {
      {
        std::lock_guard<std::mutex> lock(fabric->shutdown_mu_);
        fabric->shutdown_finished_ = true;
      }
      fabric->shutdown_cv_.notify_all();
    }
  } finished{this};
  StopOnDemand();
  std::optional<AbortPayload> payload;
  int skip = -1;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    payload = abort_to_send_;
    skip = abort_skip_peer_;
  }
  if (payload) {
    abort_payload_ = EncodeAbortPayload(*payload);
    FrameHeader header;
    header.kind = FrameKind::kAbort;
    header.bytes = abort_payload_.size();
    abort_header_ = EncodeHeader(header);
    for (auto& connection : connections_) {
      if (!connection || connection->peer_ == skip) continue;
      connection->StartAbortWrite(asio::buffer(abort_header_),
                                  asio::buffer(abort_payload_.data(), abort_payload_.size()));
    }
    const auto until = Clock::now() + kAbortBudget;
    auto pending = [this] {
      for (auto& connection : connections_) {
        if (connection && (connection->abort_write_ == TcpConnection::AbortWrite::kPending ||
                           connection->abort_write_ == TcpConnection::AbortWrite::kWriting)) {
          return true;
        }
      }
      return false;
    };
    while (pending() && Clock::now() < until) io_.run_one_until(until);
  }
  Linger();
  for (auto& connection : connections_) {
    if (connection) connection->Close();
  }
  // Let the cancelled operations finish now, so none runs later on freed user buffers.
  io_.poll();
}

void TcpFabric::Linger() {
  std::vector<pollfd> open;
  for (auto& connection : connections_) {
    if (!connection || connection->closed_ || connection->peer_closed_ || connection->pending_) {
      continue;
    }
    asio::error_code ec;
    // Not in the middle of a frame: a cut frame would be a malformed stream to the peer.
    if (connection->abort_write_ != TcpConnection::AbortWrite::kPending &&
        connection->abort_write_ != TcpConnection::AbortWrite::kWriting &&
        !connection->write_in_flight_) {
      connection->socket_.shutdown(tcp::socket::shutdown_send, ec);
    }
    open.push_back(pollfd{connection->socket_.native_handle(), POLLIN, 0});
  }
  const auto until = Clock::now() + kLingerBudget;
  std::array<uint8_t, 64 << 10> scratch;
  while (!open.empty()) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) break;
    const int ready = ::poll(open.data(), open.size(), static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    std::erase_if(open, [&](const pollfd& fd) {
      if (fd.revents == 0) return false;
      for (;;) {
        const ssize_t got = ::recv(fd.fd, scratch.data(), scratch.size(), MSG_DONTWAIT);
        if (got > 0) continue;
        if (got < 0 && errno == EINTR) continue;
        // 0: the peer closed its side. EAGAIN: nothing more for now. Anything else: gone.
        return got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
      }
    });
  }
}

bool TcpFabric::ResumeReads() {
  bool matched = false;
  // A match may complete a frame whose read took the next header, which may be matched in turn
  // (or leave the connection idle): loop until no connection is left waiting for this.
  while (resume_reads_ && !broken()) {
    resume_reads_ = false;
    for (auto& connection : connections_) {
      if (!connection || connection->closed_) continue;
      if (connection->read_state_ == TcpConnection::ReadState::kIdle) {
        connection->ArmHeaderRead();
      } else if (connection->read_state_ == TcpConnection::ReadState::kHeaderReady &&
                 !connection->recvs_.empty()) {
        connection->TryMatch();
        matched = true;
      }
    }
  }
  return matched;
}

template <typename Done>
void TcpFabric::Drive(Done done, TcpConnection& connection, bool sending) {
  if (done()) return;
  const auto spin_end = Clock::now() + spin_;
  const auto yield_end = spin_end + yield_;
  for (;;) {
    ThrowIfBroken();
    if (done()) return;
    if (ResumeReads()) continue;  // a receive may have completed: check before polling
    const auto now = Clock::now();
    if (now >= deadline_) ThrowTimeout(connection, sending);
    if (now < spin_end) {
      io_.poll();
    } else if (now < yield_end) {
      // Still runnable, so data that arrives needs no wake-up; the yield lets any thread with
      // work (a peer rank on this core, the kernel's softirq thread) run first.
      if (io_.poll() == 0) sched_yield();
    } else {
      io_.run_one_until(deadline_);
    }
  }
}

template <typename Done>
bool TcpFabric::Test(Done done, TcpConnection& connection, bool sending) {
  ThrowIfBroken();
  if (done()) return true;
  if (ResumeReads()) {
    ThrowIfBroken();
    if (done()) return true;
  }
  io_.poll();
  ThrowIfBroken();
  if (done()) return true;
  if (Clock::now() >= deadline_) ThrowTimeout(connection, sending);
  return false;
}

void TcpFabric::ThrowTimeout(TcpConnection& connection, bool sending) {
  // Report the oldest incomplete operation: it is the one that holds the rest up.
  if (sending) {
    const auto& op = connection.sends_.front();
    BreakLocal(TimeoutError(rank_, connection.peer_, op.tag, op.bytes, true));
  } else {
    const auto& op = connection.recvs_.front();
    BreakLocal(TimeoutError(rank_, connection.peer_, op.tag, op.bytes, false));
  }
  ThrowIfBroken();
  throw Error(ErrorCode::kInternal, "unreachable: broken fabric did not throw");
}

std::unique_ptr<Fabric> ConnectTcpFabric(int rank, int size, Store& store,
                                         const TcpFabricOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error(
        ErrorCode::kInvalidArgument,
        "rank " + std::to_string(rank) + " is not in a world of size " + std::to_string(size));
  }
  if (options.job_id.size() > kMaxJobIdBytes) {
    throw Error(ErrorCode::kInvalidArgument, "job id '" + options.job_id + "' is longer than " +
                                                 std::to_string(kMaxJobIdBytes) + " bytes");
  }
  std::vector<std::optional<tcp::socket>> none;
  if (size == 1) {
    return std::make_unique<TcpFabric>(rank, size, none);
  }
  if (options.on_demand && !options.address_store) {
    throw Error(ErrorCode::kInvalidArgument, "connections on demand need an address store");
  }
  MeshBuilder builder(rank, size, options);
  auto& sockets = builder.Build(store);
  if (!options.on_demand) return std::make_unique<TcpFabric>(rank, size, sockets);
  auto on_demand = std::make_unique<OnDemandSetup>();
  on_demand->listener = builder.ReleaseListener(&on_demand->protocol);
  on_demand->addresses = builder.addresses();
  on_demand->store = options.address_store;
  on_demand->key_prefix = options.key_prefix;
  on_demand->config = builder.handshake_config();
  on_demand->timeout = cluster::ClampTimeout(options.timeout);
  return std::make_unique<TcpFabric>(rank, size, sockets, std::move(on_demand));
}

}  // namespace collectives::transport
