// The errors both fabrics raise, built in one place so that TCP and the in-process transport
// word them the same way. Each names this rank, the peer and the call concerned.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_TRANSPORT_FABRIC_ERRORS_H_
#define COLLECTIVES_SRC_TRANSPORT_FABRIC_ERRORS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "collectives/errors.h"
#include "src/core/call.h"
#include "src/core/runs.h"
#include "src/transport/frame.h"

namespace collectives::transport {

// "rank 1: frame from rank 0 does not match: expected #3 all_reduce(f32, sum, count=10) 40
// bytes, got #3 all_reduce(f32, sum, count=12) 48 bytes" (kMismatch).
Error MismatchError(int rank, int peer, const core::CallTag& expected, size_t expected_bytes,
                    const core::CallTag& got, uint64_t got_bytes);

// For a frame for which no receive is posted (Fabric::SetCall): when it has the number of the
// `running` call but names another call, "rank 1: frame from rank 0 does not match: running #3
// all_gather(f32, count=10), got #3 all_reduce(f32, sum, count=10) 40 bytes" (kMismatch); else
// (no call running, another number, the running call itself) nothing.
std::optional<Error> CallMismatchError(int rank, int peer,
                                       const std::optional<core::CallTag>& running,
                                       const core::CallTag& got, uint64_t got_bytes);

// "rank 2: lost rank 3 (connection closed by peer) while waiting for #5 all_reduce(...)" or
// "... while sending #5 ..." (kPeerLost). `what` may be null when no call is concerned.
Error PeerLostError(int rank, int peer, const std::string& reason, const core::CallTag* what,
                    bool sending);

// "rank 1: PostSend of 40 bytes from a null buffer to rank 0" or "... PostRecv of 40 bytes into
// a null buffer from rank 0" (kInvalidArgument): a misuse, which does not break the fabric.
Error NullBufferError(int rank, int peer, size_t bytes, bool sending);

// Unless [offset, offset + bytes) lies within `runs`: "rank 1: PostSend of bytes [100, 140) of a
// message in runs of 120 bytes to rank 0" (or PostRecv ... from; an end past SIZE_MAX is written
// "100 + 18446744073709551615"), kInvalidArgument. The same where a run is null and bytes > 0:
// "rank 1: PostSend of 40 bytes from a message in runs with a null run to rank 0".
std::optional<Error> RunsMisuseError(int rank, int peer, const core::Runs& runs, size_t offset,
                                     size_t bytes, bool sending);

// "rank 1: deadline passed while waiting for #5 all_reduce(...) (40 bytes) from rank 0" or
// "... while sending #5 ... (40 bytes) to rank 0" (kTimeout).
Error TimeoutError(int rank, int peer, const core::CallTag& what, size_t bytes, bool sending);

// "rank 0: rank 3 aborted the job: <its message>", with the payload's code.
Error AbortReceivedError(int rank, const AbortPayload& payload);

// The abort payload this rank sends when its fabric breaks with `error`.
AbortPayload AbortPayloadFor(int rank, const Error& error);

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_FABRIC_ERRORS_H_
