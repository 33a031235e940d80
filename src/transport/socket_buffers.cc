// Socket-buffer policy of the TCP data connections (socket_buffers.h).
#include "src/transport/socket_buffers.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "src/core/environment.h"

namespace collectives::transport {
namespace {

using asio::ip::tcp;

// A byte count from a file under /proc/sys; 0 when it cannot be read.
size_t ProcSysBytes(const char* path) {
  size_t value = 0;
  if (FILE* file = std::fopen(path, "r")) {
    unsigned long long read = 0;
    if (std::fscanf(file, "%llu", &read) == 1) value = static_cast<size_t>(read);
    std::fclose(file);
  }
  return value;
}

}  // namespace

// A fixed receive buffer, where autotuning settles at sizes that differ from one connection to
// the next and the small ones are slow; only with a core per rank, where a sender that queues a
// whole message does not run ahead of a receiver waiting for a core, and only where rmem_max
// allows it (a clamped request turns autotuning off). See docs/tuning.md.
size_t ConfiguredReceiveBuffer(int world_size) {
  static const size_t rmem_max = ReceiveBufferCap();
  return ReceiveBufferBytes(std::getenv("COLLECTIVES_SOCKET_RCVBUF"), rmem_max,
                            core::CoresFor(core::LocalRanks(world_size)));
}

size_t ReceiveBufferCap() { return ProcSysBytes("/proc/sys/net/core/rmem_max"); }

size_t SendBufferCap() { return ProcSysBytes("/proc/sys/net/core/wmem_max"); }

size_t ReceiveBufferBytes(const char* env, size_t rmem_max, bool core_per_rank) {
  if (const auto bytes = core::CountFromText("COLLECTIVES_SOCKET_RCVBUF", env,
                                             "a byte count, 0 for the kernel's autotuning")) {
    return static_cast<size_t>(std::min<uint64_t>(*bytes, INT_MAX));
  }
  return core_per_rank && rmem_max >= kDefaultReceiveBuffer ? kDefaultReceiveBuffer : 0;
}

// On loopback a sender left to autotuning runs megabytes ahead and copies into pages that have
// left the cache by the time the receiver reads them; 320 KiB (doubled by the kernel) stays
// close behind the receiver and holds a whole 512 KiB chunk frame. See docs/tuning.md.
SendBuffers SendBufferBytes(const char* env) {
  if (const auto bytes = core::CountFromText("COLLECTIVES_SOCKET_SNDBUF", env,
                                             "a byte count, 0 for the kernel's autotuning")) {
    const size_t value = static_cast<size_t>(std::min<uint64_t>(*bytes, INT_MAX));
    return SendBuffers{value, value};
  }
  return SendBuffers{kDefaultLocalSendBuffer, 0};
}

bool PeerOnThisHost(const tcp::socket& socket) {
  asio::error_code local_error;
  asio::error_code remote_error;
  const auto local = socket.local_endpoint(local_error);
  const auto remote = socket.remote_endpoint(remote_error);
  if (local_error || remote_error) return false;
  return remote.address().is_loopback() || remote.address() == local.address();
}

void SetDataSocketBuffers(tcp::socket& socket, size_t receive_buffer,
                          const SendBuffers& send_buffers) {
  if (receive_buffer > 0) {
    asio::error_code ignored;  // a refused size leaves autotuning on, which still works
    socket.set_option(asio::socket_base::receive_buffer_size(static_cast<int>(receive_buffer)),
                      ignored);
  }
  if (const size_t send_buffer =
          PeerOnThisHost(socket) ? send_buffers.same_host : send_buffers.other_host;
      send_buffer > 0) {
    asio::error_code ignored;  // likewise
    socket.set_option(asio::socket_base::send_buffer_size(static_cast<int>(send_buffer)), ignored);
  }
}

}  // namespace collectives::transport
