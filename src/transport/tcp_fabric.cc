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

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "src/transport/fabric_errors.h"
#include "src/transport/frame.h"
#include "src/transport/handshake.h"
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

TcpFabric::TcpFabric(int rank, int size, std::vector<std::optional<tcp::socket>>& sockets_in_setup)
    : work_(asio::make_work_guard(io_)), rank_(rank), size_(size) {
  connections_.resize(size);
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
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
  return *connections_[peer];
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
    if (!connection || connection->closed_ || connection->peer_closed_) continue;
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
  MeshBuilder builder(rank, size, options);
  return std::make_unique<TcpFabric>(rank, size, builder.Build(store));
}

}  // namespace collectives::transport
