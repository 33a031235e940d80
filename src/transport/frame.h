// The wire format of frames, with encoders and validating decoders (the handshake that opens a
// connection has its own messages: handshake.h).
//
// Frame header, 40 bytes, little-endian:
//   0  u32 magic 0x46534C43 ("CLSF")     8  u64 seq
//   4  u8  version (1)                   16 u8 collective kind, u8 dtype, u8 op, u8 reserved
//   5  u8  frame kind (1 data, 2 abort)  20 i32 root
//   6  u16 reserved (0)                  24 u64 count
//                                        32 u64 payload bytes
// An abort frame's payload: u32 error code, i32 culprit rank, then the message (UTF-8), at most
// kMaxAbortPayload bytes in all.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_TRANSPORT_FRAME_H_
#define COLLECTIVES_SRC_TRANSPORT_FRAME_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "collectives/errors.h"
#include "src/core/call.h"

namespace collectives::transport {

inline constexpr uint32_t kFrameMagic = 0x46534C43;
inline constexpr uint8_t kWireVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 40;
inline constexpr size_t kMaxAbortPayload = 4096;

enum class FrameKind : uint8_t { kData = 1, kAbort = 2 };

struct FrameHeader {
  FrameKind kind = FrameKind::kData;
  core::CallTag tag;
  uint64_t bytes = 0;
};

using EncodedHeader = std::array<uint8_t, kFrameHeaderBytes>;

EncodedHeader EncodeHeader(const FrameHeader& header);

// Decodes and checks magic, version, frame kind and the enum ranges of the descriptor. Returns
// nullopt and sets *why ("bad magic 0x...", "unknown dtype 9", ...) when the bytes are not a
// frame header.
std::optional<FrameHeader> DecodeHeader(const uint8_t* bytes, std::string* why);

// What an abort frame carries: the error that broke the sender's fabric and the rank that
// first raised it (which may differ from the sender when an abort is relayed).
struct AbortPayload {
  ErrorCode code = ErrorCode::kAborted;
  int32_t culprit = -1;
  std::string message;
};

// Encodes `payload`; a message too long for kMaxAbortPayload is cut (at a UTF-8 character
// boundary) and ends in "...".
std::string EncodeAbortPayload(const AbortPayload& payload);

// Decodes an abort frame's payload of `size` bytes: checks the size bounds, the error code's
// range and that the culprit is a rank (not negative; below `world_size` when that is given,
// > 0). Returns nullopt and sets *why otherwise.
std::optional<AbortPayload> DecodeAbortPayload(const uint8_t* bytes, size_t size, std::string* why,
                                               int world_size = 0);

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_FRAME_H_
