// A Fabric over TCP (Asio): a full mesh of connections, set up through a rendezvous Store.
//
// Set-up: every rank binds a listener (ephemeral port on `bind_host`), publishes "host:port"
// under "<key_prefix>/addr/<rank>", reads every peer's address, connects to the peers of higher
// rank and accepts the peers of lower rank. Each connection starts with the handshake of
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
// Thread-safety: see connection.h.
#ifndef COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_H_
#define COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_H_

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

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
};

// How often a set-up polls TcpFabricOptions::cancelled.
inline constexpr std::chrono::milliseconds kCancelPoll{50};

// Builds the mesh. Blocks until every connection is up. Throws Error(kTimeout) naming the
// missing peers, Error(kSystem) when binding fails.
std::unique_ptr<Fabric> ConnectTcpFabric(int rank, int size, Store& store,
                                         const TcpFabricOptions& options);

// The local address of the interface this host would use to reach `remote_host` (resolving
// names); "127.0.0.1" when it cannot tell; nullopt when the name's lookup has not answered by
// `deadline` (it goes on on a thread of its own, and its answer is dropped).
std::optional<std::string> LocalAddressToward(const std::string& remote_host,
                                              Clock::time_point deadline);

// The receive buffer (SO_RCVBUF) a data connection asks for, in bytes; 0 leaves it to the
// kernel's autotuning. `env` is $COLLECTIVES_SOCKET_RCVBUF (null when unset; a byte count, 0 for
// autotuning); `rmem_max` is net.core.rmem_max (0 when unknown), the kernel's cap on what a
// process may ask for; `core_per_rank`: this host has at least as many cores as the job has
// ranks. Without `env`: kDefaultReceiveBuffer when the host has a core per rank and the cap
// allows it, else 0 (see the .cc for the measurements behind both conditions).
inline constexpr size_t kDefaultReceiveBuffer = size_t{4} << 20;
size_t ReceiveBufferBytes(const char* env, size_t rmem_max, bool core_per_rank);

// net.core.rmem_max / net.core.wmem_max (the most SO_RCVBUF / SO_SNDBUF a process may ask
// for), read from /proc; 0 when it cannot be read.
size_t ReceiveBufferCap();
size_t SendBufferCap();

// The send buffer (SO_SNDBUF) a data connection asks for, in bytes; 0 leaves it to the kernel's
// autotuning. `env` is $COLLECTIVES_SOCKET_SNDBUF (null when unset; a byte count, 0 for
// autotuning), which applies to every connection. Unset: kDefaultLocalSendBuffer for a peer on
// this host (its frames go through loopback, see the .cc for why a small buffer is faster
// there), autotuning for a peer on another host, where the buffer must cover the link's
// bandwidth-delay product.
inline constexpr size_t kDefaultLocalSendBuffer = size_t{320} << 10;
struct SendBuffers {
  size_t same_host = 0;
  size_t other_host = 0;
};
SendBuffers SendBufferBytes(const char* env);

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_TCP_FABRIC_H_
