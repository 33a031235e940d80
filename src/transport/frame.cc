// Encoding and validating decoding of frame headers and abort payloads (see frame.h for the
// layout). Every multi-byte field is written byte by byte in little-endian order, so the wire
// format does not depend on the host's endianness or on struct padding.
#include "src/transport/frame.h"

#include <cstdio>

namespace collectives::transport {
namespace {

void PutU16(uint8_t* out, uint16_t v) {
  out[0] = static_cast<uint8_t>(v);
  out[1] = static_cast<uint8_t>(v >> 8);
}

void PutU32(uint8_t* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

void PutU64(uint8_t* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint16_t GetU16(const uint8_t* in) {
  return static_cast<uint16_t>(in[0] | (static_cast<uint16_t>(in[1]) << 8));
}

uint32_t GetU32(const uint8_t* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in[i]) << (8 * i);
  return v;
}

uint64_t GetU64(const uint8_t* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

constexpr size_t kAbortFixedBytes = 8;  // u32 code, i32 culprit
constexpr uint32_t kFirstErrorCode = static_cast<uint32_t>(ErrorCode::kInvalidArgument);
constexpr uint32_t kLastErrorCode = static_cast<uint32_t>(ErrorCode::kInternal);

void SetWhy(std::string* why, std::string text) {
  if (why != nullptr) *why = std::move(text);
}

std::string Hex32(uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08X", v);
  return text;
}

}  // namespace

EncodedHeader EncodeHeader(const FrameHeader& header) {
  EncodedHeader out{};
  uint8_t* p = out.data();
  PutU32(p + 0, kFrameMagic);
  p[4] = kWireVersion;
  p[5] = static_cast<uint8_t>(header.kind);
  PutU16(p + 6, 0);
  PutU64(p + 8, header.tag.seq);
  p[16] = static_cast<uint8_t>(header.tag.call.kind);
  p[17] = static_cast<uint8_t>(header.tag.call.dtype);
  p[18] = static_cast<uint8_t>(header.tag.call.op);
  p[19] = 0;
  PutU32(p + 20, static_cast<uint32_t>(header.tag.call.root));
  PutU64(p + 24, header.tag.call.count);
  PutU64(p + 32, header.bytes);
  return out;
}

std::optional<FrameHeader> DecodeHeader(const uint8_t* bytes, std::string* why) {
  const uint32_t magic = GetU32(bytes + 0);
  if (magic != kFrameMagic) {
    SetWhy(why, "bad magic " + Hex32(magic) + " (expected " + Hex32(kFrameMagic) + ")");
    return std::nullopt;
  }
  if (bytes[4] != kWireVersion) {
    SetWhy(why, "unsupported wire version " + std::to_string(bytes[4]) + " (this build speaks " +
                    std::to_string(kWireVersion) + ")");
    return std::nullopt;
  }
  const uint8_t kind = bytes[5];
  if (kind != static_cast<uint8_t>(FrameKind::kData) &&
      kind != static_cast<uint8_t>(FrameKind::kAbort)) {
    SetWhy(why, "unknown frame kind " + std::to_string(kind));
    return std::nullopt;
  }
  if (GetU16(bytes + 6) != 0 || bytes[19] != 0) {
    SetWhy(why, "reserved header bytes are not zero");
    return std::nullopt;
  }
  const uint8_t collective = bytes[16];
  if (collective < static_cast<uint8_t>(core::CollectiveKind::kAllReduce) ||
      collective > static_cast<uint8_t>(core::kLastCollectiveKind)) {
    SetWhy(why, "unknown collective kind " + std::to_string(collective));
    return std::nullopt;
  }
  const uint8_t dtype = bytes[17];
  if (dtype >= kNumDataTypes) {
    SetWhy(why, "unknown dtype " + std::to_string(dtype));
    return std::nullopt;
  }
  const uint8_t op = bytes[18];
  if (op >= kNumReduceOps) {
    SetWhy(why, "unknown reduce op " + std::to_string(op));
    return std::nullopt;
  }
  FrameHeader header;
  header.kind = static_cast<FrameKind>(kind);
  header.tag.seq = GetU64(bytes + 8);
  header.tag.call.kind = static_cast<core::CollectiveKind>(collective);
  header.tag.call.dtype = static_cast<DataType>(dtype);
  header.tag.call.op = static_cast<ReduceOp>(op);
  header.tag.call.root = static_cast<int32_t>(GetU32(bytes + 20));
  header.tag.call.count = GetU64(bytes + 24);
  header.bytes = GetU64(bytes + 32);
  if (header.kind == FrameKind::kAbort &&
      (header.bytes < kAbortFixedBytes || header.bytes > kMaxAbortPayload)) {
    SetWhy(why, "abort frame with a payload of " + std::to_string(header.bytes) +
                    " bytes (allowed: " + std::to_string(kAbortFixedBytes) + " to " +
                    std::to_string(kMaxAbortPayload) + ")");
    return std::nullopt;
  }
  return header;
}

std::string EncodeAbortPayload(const AbortPayload& payload) {
  constexpr size_t kMaxMessage = kMaxAbortPayload - kAbortFixedBytes;
  std::string message = payload.message;
  if (message.size() > kMaxMessage) {
    static constexpr char kEllipsis[] = "...";
    size_t keep = kMaxMessage - (sizeof(kEllipsis) - 1);
    // Do not split a UTF-8 sequence: back up over continuation bytes (10xxxxxx).
    while (keep > 0 && (static_cast<uint8_t>(message[keep]) & 0xC0) == 0x80) --keep;
    message.resize(keep);
    message += kEllipsis;
  }
  std::string out(kAbortFixedBytes + message.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  PutU32(p, static_cast<uint32_t>(payload.code));
  PutU32(p + 4, static_cast<uint32_t>(payload.culprit));
  message.copy(out.data() + kAbortFixedBytes, message.size());
  return out;
}

std::optional<AbortPayload> DecodeAbortPayload(const uint8_t* bytes, size_t size, std::string* why,
                                               int world_size) {
  if (size < kAbortFixedBytes || size > kMaxAbortPayload) {
    SetWhy(why, "abort payload of " + std::to_string(size) +
                    " bytes (allowed: " + std::to_string(kAbortFixedBytes) + " to " +
                    std::to_string(kMaxAbortPayload) + ")");
    return std::nullopt;
  }
  const uint32_t code = GetU32(bytes);
  if (code < kFirstErrorCode || code > kLastErrorCode) {
    SetWhy(why, "unknown error code " + std::to_string(code) + " in abort payload");
    return std::nullopt;
  }
  const auto culprit = static_cast<int32_t>(GetU32(bytes + 4));
  if (culprit < 0) {
    SetWhy(why, "negative culprit rank " + std::to_string(culprit) + " in abort payload");
    return std::nullopt;
  }
  if (world_size > 0 && culprit >= world_size) {
    SetWhy(why, "culprit rank " + std::to_string(culprit) +
                    " in abort payload is not in the world of " + std::to_string(world_size) +
                    " ranks");
    return std::nullopt;
  }
  AbortPayload payload;
  payload.code = static_cast<ErrorCode>(code);
  payload.culprit = culprit;
  payload.message.assign(reinterpret_cast<const char*>(bytes) + kAbortFixedBytes,
                         size - kAbortFixedBytes);
  return payload;
}

}  // namespace collectives::transport
