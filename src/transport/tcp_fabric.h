// A Fabric over TCP (Asio): connections to the peers, set up through a rendezvous Store.
//
// Set-up: every rank binds a listener (ephemeral port on `bind_host`), publishes "host:port"
// under "<key_prefix>/addr/<rank>", reads the addresses of the peers it connects to, connects to
// those of higher rank and accepts those of lower rank. Which peers: every one (a full mesh), or
// with `on_demand` only `peers_at_setup`; then the listener stays open for the fabric's life and
// any other connection is made at its first use (connection(peer) on both sides): the lower rank
// reads the higher one's address from the store and connects, the higher one accepts, with the
// same handshake. Each connection starts with the handshake of
// handshake.h (magic, version, job id, ranks, HMAC-SHA256 proof of the job token over both
// nonces); a connection that fails it is closed and the stranger is logged (a line a second at
// most), never admitted.
//
// Data: one io_context owned by the fabric; only the thread that calls Post*/Wait* touches the
// sockets. Each connection keeps one async_write in flight with a queue behind it (header and
// payload gathered into one write), and reads a fixed header, validates it against the posted
// receive, then reads the payload straight into the caller's buffer. A waiter polls the
// io_context for the spin budget, then sleeps in it until the deadline.
//
// Where it lives: tcp_fabric.cc (the fabric, its drive loop and shutdown), tcp_connection.h
// (one peer's send and receive), tcp_mesh.h (the set-up), socket_buffers.h (buffer sizes).
//
// Thread-safety: see connection.h.
#ifndef COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_H_
#define COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_H_

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "src/transport/connection.h"

namespace collectives::transport {

struct TcpFabricOptions {
  // Address the listener binds to and that peers are told to connect to.
  std::string bind_host = "127.0.0.1";
  // Agreed by all ranks; checked in the handshake.
  std::string job_id = "collectives";
  // The shared secret proven by HMAC (may be empty).
  std::string token;
  // Prefix of this fabric's keys in the store (lets several communicators share one store).
  std::string key_prefix = "collectives";
  // Limit on the whole set-up: store lookups, name lookups, connects, accepts, handshakes. One
  // of more than a year (milliseconds::max() for "never") is read as a year.
  std::chrono::milliseconds timeout{60'000};
  // When the set-up must be done, if sooner than `timeout` after it starts: a communicator
  // whose set-up has other steps gives the mesh what is left of its timeout. Errors still
  // name `timeout`, the limit of the set-up as a whole.
  Clock::time_point deadline = Clock::time_point::max();
  // Polled while the mesh waits for its connections (every kCancelPoll at most): when it
  // returns true the set-up ends with Error(kAborted). Only the mesh's own waits poll it; for
  // the address lookups, pass a store that polls too (cluster::CancellableStore). A split's
  // child is set up with "the parent broke" here.
  std::function<bool()> cancelled;
  // Connect at set-up only to `peers_at_setup` (a symmetric choice: rank a lists b iff b lists
  // a), and to any other peer at its first use, reading its address from `address_store` (which
  // must outlive the fabric). False: every peer at set-up, and the listener closes after it.
  bool on_demand = false;
  std::vector<int> peers_at_setup;
  std::shared_ptr<Store> address_store;
};

// The data connections open now in this process, over every TCP fabric (each counts once per
// end it holds here): what tests and benchmarks read to count a rank's connections.
int TcpConnectionsOpen();

// A write that fails because the peer closed or reset does not break the fabric at once when the
// connection's header read is armed: the peer may have closed because it failed itself, and its
// abort frame (naming the rank at fault) is then already on its way in on the same connection.
// Within this grace the abort frame or the EOF behind it decides; after it, the write error does.
// A peer closing a connection made on demand, or unreachable, and a store failing in a set-up
// step past the mesh get the same grace for an abort frame relayed over other connections.
inline constexpr std::chrono::milliseconds kWriteFailureGrace{200};

// How often a set-up polls TcpFabricOptions::cancelled.
inline constexpr std::chrono::milliseconds kCancelPoll{50};

// Builds the mesh. Blocks until every connection made at set-up is up. Throws Error(kTimeout)
// naming the missing peers, Error(kSystem) when binding fails.
std::unique_ptr<Fabric> ConnectTcpFabric(int rank, int size, Store& store,
                                         const TcpFabricOptions& options);

// The local address of the interface this host would use to reach `remote_host` (resolving
// names); "127.0.0.1" when it cannot tell; nullopt when the name's lookup has not answered by
// `deadline` (it goes on on a thread of its own, and its answer is dropped).
std::optional<std::string> LocalAddressToward(const std::string& remote_host,
                                              Clock::time_point deadline);

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_H_
