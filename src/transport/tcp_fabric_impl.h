// The TCP fabric itself: the mesh's connections, one io_context, the drive loop that waits on
// them, and the shutdown that sends the abort frames (tcp_fabric.cc). Private to the TCP
// transport: callers build one with ConnectTcpFabric (tcp_fabric.h) and see a Fabric.
#ifndef COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_IMPL_H_
#define COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_IMPL_H_

#include <asio.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/listener_guard.h"
#include "src/core/call.h"
#include "src/transport/connection.h"
#include "src/transport/fabric_errors.h"
#include "src/transport/frame.h"
#include "src/transport/handshake.h"
#include "src/transport/tcp_connection.h"

namespace collectives::transport {

// How long a waiter polls the io_context before it yields or sleeps, unless SetSpin says.
constexpr std::chrono::microseconds kDefaultSpin{50};

// What a fabric with connections on demand keeps from its set-up: the listener (it goes on
// accepting the lower ranks that connect at their first use), the addresses it read, and where
// to read the others.
struct OnDemandSetup {
  int listener = -1;  // descriptor, owned by the fabric from now on
  asio::ip::tcp protocol = asio::ip::tcp::v4();
  std::vector<cluster::HostPort> addresses;  // by rank; an empty host: not read yet
  std::shared_ptr<Store> store;
  std::string key_prefix;
  HandshakeConfig config;
  std::chrono::milliseconds timeout{60'000};  // the communicator's, for the messages
};

// TcpConnections on one io_context: every peer's, made at set-up, or with OnDemandSetup those
// of the set-up and the others at their first use (connection(peer)): the lower rank of the
// pair connects, the higher one accepts, both with the handshake of handshake.h; until then the
// connection queues what is posted on it. Built by ConnectTcpFabric from the sockets a
// MeshBuilder set up. Thread-safety: one thread at a time drives the fabric (Post*/Wait*/Test*,
// connection()); Abort may be called from any thread. drive_mu_ is held for the duration of
// every driving call, so an Abort from another thread can tell whether it may touch the sockets.
class TcpFabric final : public Fabric {
 public:
  // Takes the descriptors of `sockets_in_setup` (one per peer; none for this rank).
  TcpFabric(int rank, int size, std::vector<std::optional<asio::ip::tcp::socket>>& sockets_in_setup,
            std::unique_ptr<OnDemandSetup> on_demand = nullptr);
  ~TcpFabric() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Connection& connection(int peer) override;
  void SetDeadline(Clock::time_point deadline) override;
  void SetCall(const core::CallTag& call) override;
  void SetSpin(std::chrono::microseconds spin, std::chrono::microseconds yield) override;
  void Abort(const Error& error) override;
  std::optional<Error> ErrorWithin(Clock::duration wait) override;

 private:
  friend class TcpConnection;

  // The process-wide count of open data connections (TcpConnectionsOpen).
  void CountOpened();
  void CountClosed();
  // The connection to `peer`, made (pending) if there is none yet; the lower rank starts
  // connecting. Driving thread, drive_mu_ held.
  TcpConnection& Open(int peer);
  // On demand: reads `peer`'s address if needed and starts connecting (attempt 1, 2, ...).
  void StartConnect(int peer, int attempt);
  void ConnectTo(int peer, const asio::ip::tcp::endpoint& endpoint, int attempt);
  // On demand: breaks the fabric because `peer` cannot be reached.
  void Unreachable(int peer, ErrorCode code, const std::string& why);
  void AcceptNext();
  // Closes the listener and stops the handshakes and connects in progress (driving thread).
  void StopOnDemand();

  // Records the fabric's first error; `payload` is what the shutdown sends to every peer but
  // `skip_peer` (nullopt: send nothing). Later errors are ignored.
  void Break(const Error& error, std::optional<AbortPayload> payload, int skip_peer);
  void BreakLocal(const Error& error) { Break(error, AbortPayloadFor(rank_, error), -1); }
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // If broken: runs the shutdown (driving thread only) and throws the first error.
  void ThrowIfBroken();
  // Sends the abort frames (bounded by kAbortBudget) and closes every socket. Driving thread.
  void RunShutdown();
  // Half-closes every open connection and drops what arrives until each peer closes its side
  // (bounded by kLingerBudget). Driving thread, during the shutdown.
  void Linger();
  // Drives the io_context until `done()` (throwing on error or past the deadline); on timeout
  // it reports the oldest send (`sending`) or receive of `connection`.
  template <typename Done>
  void Drive(Done done, TcpConnection& connection, bool sending);
  // Arms the header read of every connection in kIdle (TcpConnection::FrameDone), and matches
  // the headers OnHeader left to it. Drive and Test call it before they poll (and after they
  // checked for completion: right after a frame, an armed read would find nothing), so that a
  // frame, an EOF or an abort from any peer is read while the fabric is driven. Returns whether
  // it matched a header (which may have completed receives).
  bool ResumeReads();
  template <typename Done>
  bool Test(Done done, TcpConnection& connection, bool sending);
  [[noreturn]] void ThrowTimeout(TcpConnection& connection, bool sending);

  // Declared first: destroyed after the sockets that belong to it.
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  const int rank_;
  const int size_;
  std::vector<std::unique_ptr<TcpConnection>> connections_;
  Clock::time_point deadline_ = Clock::time_point::max();
  std::optional<core::CallTag> call_;  // SetCall (driving thread)
  std::chrono::microseconds spin_ = kDefaultSpin;
  std::chrono::microseconds yield_{0};

  std::mutex drive_mu_;
  bool shut_down_ = false;
  // Set when the shutdown has run, for an Abort that left it to the driving thread.
  std::mutex shutdown_mu_;
  std::condition_variable shutdown_cv_;
  bool shutdown_finished_ = false;  // guarded by shutdown_mu_
  // Some connection may be in kIdle, or hold a header to match (driving thread).
  bool resume_reads_ = false;

  mutable std::mutex error_mu_;
  std::optional<Error> error_;                 // guarded by error_mu_
  std::optional<AbortPayload> abort_to_send_;  // guarded by error_mu_
  int abort_skip_peer_ = -1;                   // guarded by error_mu_
  std::atomic<bool> broken_{false};
  // Whether a data frame's call descriptor (sequence number, collective, dtype, op, count, root)
  // is compared with the receive's. Always, unless COLLECTIVES_UNSAFE_SKIP_CALL_CHECK=1 is set:
  // that exists only to measure what the check costs (docs/tuning.md).
  const bool check_calls_ = [] {
    const char* skip = std::getenv("COLLECTIVES_UNSAFE_SKIP_CALL_CHECK");
    return skip == nullptr || std::string(skip) != "1";
  }();

  // Connections on demand (null without): see OnDemandSetup.
  std::unique_ptr<OnDemandSetup> on_demand_;
  std::optional<asio::ip::tcp::acceptor> acceptor_;
  std::vector<std::weak_ptr<HandshakeSession>> handshakes_;  // client and server, to cancel
  std::deque<std::weak_ptr<HandshakeSession>> server_handshakes_;
  std::vector<std::shared_ptr<asio::ip::tcp::socket>> connecting_;  // by peer
  std::vector<std::unique_ptr<asio::steady_timer>> timers_;  // connect retries, grace periods
  asio::steady_timer accept_retry_{io_};
  cluster::RateLimitedLog refusal_log_;
  std::string accept_error_;

  // The abort frame being sent during shutdown.
  EncodedHeader abort_header_{};
  std::string abort_payload_;
};

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_IMPL_H_
