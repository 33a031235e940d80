// The wording of transport errors, shared by the TCP and in-process fabrics.
#include "src/transport/fabric_errors.h"

#include <cstdint>

#include "src/core/text.h"

namespace collectives::transport {
namespace {

std::string RankPrefix(int rank) { return "rank " + std::to_string(rank) + ": "; }

}  // namespace

Error MismatchError(int rank, int peer, const core::CallTag& expected, size_t expected_bytes,
                    const core::CallTag& got, uint64_t got_bytes) {
  return Error(ErrorCode::kMismatch, RankPrefix(rank) + "frame from rank " + std::to_string(peer) +
                                         " does not match: expected " + expected.ToString() + " " +
                                         std::to_string(expected_bytes) + " bytes, got " +
                                         got.ToString() + " " + std::to_string(got_bytes) +
                                         " bytes");
}

std::optional<Error> CallMismatchError(int rank, int peer,
                                       const std::optional<core::CallTag>& running,
                                       const core::CallTag& got, uint64_t got_bytes) {
  if (!running || got.seq != running->seq || got == *running) return std::nullopt;
  return Error(ErrorCode::kMismatch, RankPrefix(rank) + "frame from rank " + std::to_string(peer) +
                                         " does not match: running " + running->ToString() +
                                         ", got " + got.ToString() + " " +
                                         std::to_string(got_bytes) + " bytes");
}

Error PeerLostError(int rank, int peer, const std::string& reason, const core::CallTag* what,
                    bool sending) {
  std::string message =
      RankPrefix(rank) + "lost rank " + std::to_string(peer) + " (" + reason + ")";
  if (what != nullptr) {
    message += sending ? " while sending " : " while waiting for ";
    message += what->ToString();
  }
  return Error(ErrorCode::kPeerLost, message);
}

Error NullBufferError(int rank, int peer, size_t bytes, bool sending) {
  return Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) +
                                                (sending ? ": PostSend of " : ": PostRecv of ") +
                                                std::to_string(bytes) +
                                                (sending ? " bytes from a null buffer to rank "
                                                         : " bytes into a null buffer "
                                                           "from rank ") +
                                                std::to_string(peer));
}

std::optional<Error> RunsMisuseError(int rank, int peer, const core::Runs& runs, size_t offset,
                                     size_t bytes, bool sending) {
  const std::string call =
      "rank " + std::to_string(rank) + (sending ? ": PostSend of " : ": PostRecv of ");
  const std::string whom = (sending ? " to rank " : " from rank ") + std::to_string(peer);
  if (offset > runs.bytes() || bytes > runs.bytes() - offset) {
    const std::string end = bytes <= SIZE_MAX - offset
                                ? std::to_string(offset + bytes)
                                : std::to_string(offset) + " + " + std::to_string(bytes);
    return Error(ErrorCode::kInvalidArgument, call + "bytes [" + std::to_string(offset) + ", " +
                                                  end + ") of a message in runs of " +
                                                  std::to_string(runs.bytes()) + " bytes" + whom);
  }
  if (bytes > 0 && runs.has_null()) {
    return Error(ErrorCode::kInvalidArgument, call + std::to_string(bytes) +
                                                  (sending ? " bytes from" : " bytes into") +
                                                  " a message in runs with a null run" + whom);
  }
  return std::nullopt;
}

Error TimeoutError(int rank, int peer, const core::CallTag& what, size_t bytes, bool sending) {
  return Error(ErrorCode::kTimeout, RankPrefix(rank) + "deadline passed while " +
                                        (sending ? "sending " : "waiting for ") + what.ToString() +
                                        " (" + std::to_string(bytes) + " bytes) " +
                                        (sending ? "to" : "from") + " rank " +
                                        std::to_string(peer));
}

Error AbortReceivedError(int rank, const AbortPayload& payload) {
  return Error(payload.code, RankPrefix(rank) + "rank " + std::to_string(payload.culprit) +
                                 " aborted the job: " + core::OneLine(payload.message));
}

AbortPayload AbortPayloadFor(int rank, const Error& error) {
  AbortPayload payload;
  payload.code = error.code();
  payload.culprit = rank;
  payload.message = error.message();
  return payload;
}

}  // namespace collectives::transport
