// Socket-buffer policy of the TCP data connections: the SO_RCVBUF and SO_SNDBUF each asks for,
// from the environment, the kernel's caps and where the peer is, and setting them on a socket.
// The evidence behind the defaults is in docs/tuning.md.
//
// Thread-safety: plain functions; ConfiguredReceiveBuffer reads the kernel's cap once per process.
#ifndef COLLECTIVES_SRC_TRANSPORT_SOCKET_BUFFERS_H_
#define COLLECTIVES_SRC_TRANSPORT_SOCKET_BUFFERS_H_

#include <asio.hpp>
#include <cstddef>

namespace collectives::transport {

// The receive buffer (SO_RCVBUF) a data connection asks for, in bytes; 0 leaves it to the
// kernel's autotuning. `env` is $COLLECTIVES_SOCKET_RCVBUF (null when unset; a byte count, 0 for
// autotuning); `rmem_max` is net.core.rmem_max (0 when unknown), the kernel's cap on what a
// process may ask for; `core_per_rank`: this host has at least as many cores as the job has
// ranks. Without `env`: kDefaultReceiveBuffer when the host has a core per rank and the cap
// allows it, else 0.
inline constexpr size_t kDefaultReceiveBuffer = size_t{4} << 20;
size_t ReceiveBufferBytes(const char* env, size_t rmem_max, bool core_per_rank);

// ReceiveBufferBytes for this process: $COLLECTIVES_SOCKET_RCVBUF, this host's cap, and whether
// it has a core for each of the `world_size` ranks' local share.
size_t ConfiguredReceiveBuffer(int world_size);

// net.core.rmem_max / net.core.wmem_max (the most SO_RCVBUF / SO_SNDBUF a process may ask
// for), read from /proc; 0 when it cannot be read.
size_t ReceiveBufferCap();
size_t SendBufferCap();

// The send buffer (SO_SNDBUF) a data connection asks for, in bytes; 0 leaves it to the kernel's
// autotuning. `env` is $COLLECTIVES_SOCKET_SNDBUF (null when unset; a byte count, 0 for
// autotuning), which applies to every connection. Unset: kDefaultLocalSendBuffer for a peer on
// this host (its frames go through loopback, where a small buffer keeps the pages warm),
// autotuning for a peer on another host, where the buffer must cover the link's
// bandwidth-delay product.
inline constexpr size_t kDefaultLocalSendBuffer = size_t{320} << 10;
struct SendBuffers {
  size_t same_host = 0;
  size_t other_host = 0;
};
SendBuffers SendBufferBytes(const char* env);

// Whether a connected socket's peer is on this host: the kernel routes a connection to any of
// the host's own addresses through loopback and gives it that address as its source too.
bool PeerOnThisHost(const asio::ip::tcp::socket& socket);

// Asks for `receive_buffer` (0: autotuning) and the send buffer `send_buffers` gives the peer's
// place on a data connection. A refused size leaves autotuning on, which still works.
void SetDataSocketBuffers(asio::ip::tcp::socket& socket, size_t receive_buffer,
                          const SendBuffers& send_buffers);

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_SOCKET_BUFFERS_H_
