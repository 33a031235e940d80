// The TCP store's wire format: every request and every reply is a fixed 24-byte header followed
// by the key bytes and then the value bytes.
//
//   offset  size  field
//        0     4  magic 0x31545343 ("CST1" on the wire), little-endian
//        4     1  code: an Op in a request, a Status in a reply
//        5     3  reserved, zero
//        8     4  key_bytes, little-endian (requests: 1..kMaxKeyBytes; replies: 0)
//       12     4  value_bytes, little-endian (0..kMaxValueBytes; Get and Add requests: 0)
//       16     8  arg, little-endian two's complement: Get's timeout in ms (>= 0), Add's delta,
//                 the sum in Add's reply; 0 otherwise
//
// Requests: Set(key, value) -> kOk. Get(key, timeout) -> kOk with the value, or kTimeout when
// the key did not appear in time. Add(key, delta) -> kOk with the sum in arg. Any request may
// be answered kInvalidArgument with a message as the value (an Add on a value that is not a
// number, say). A connection carries one request at a time: the
// client sends the next request after it read the reply. The header is validated before any
// buffer for the key or value is allocated; a server closes a connection that sends a header
// that fails validation, and a client drops one whose reply does not fit its request.
//
// Thread-safety: plain functions over values.
#ifndef COLLECTIVES_SRC_CLUSTER_TCP_STORE_WIRE_H_
#define COLLECTIVES_SRC_CLUSTER_TCP_STORE_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "src/cluster/store_common.h"

namespace collectives::cluster::wire {

constexpr uint32_t kMagic = 0x31545343;
constexpr size_t kHeaderBytes = 24;

// Wire values: append, never renumber.
enum class Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3 };
enum class Status : uint8_t { kOk = 0, kTimeout = 1, kInvalidArgument = 2 };

struct Header {
  uint32_t magic = kMagic;
  uint8_t code = 0;
  uint8_t reserved[3] = {0, 0, 0};
  uint32_t key_bytes = 0;
  uint32_t value_bytes = 0;
  int64_t arg = 0;
};

using HeaderBytes = std::array<uint8_t, kHeaderBytes>;

inline HeaderBytes Encode(const Header& header) {
  HeaderBytes out{};
  auto put = [&out](size_t offset, uint64_t value, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) out[offset + i] = static_cast<uint8_t>(value >> (8 * i));
  };
  put(0, header.magic, 4);
  out[4] = header.code;
  out[5] = header.reserved[0];
  out[6] = header.reserved[1];
  out[7] = header.reserved[2];
  put(8, header.key_bytes, 4);
  put(12, header.value_bytes, 4);
  put(16, static_cast<uint64_t>(header.arg), 8);
  return out;
}

inline Header Decode(const HeaderBytes& in) {
  auto get = [&in](size_t offset, size_t bytes) {
    uint64_t value = 0;
    for (size_t i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(in[offset + i]) << (8 * i);
    return value;
  };
  Header header;
  header.magic = static_cast<uint32_t>(get(0, 4));
  header.code = in[4];
  header.reserved[0] = in[5];
  header.reserved[1] = in[6];
  header.reserved[2] = in[7];
  header.key_bytes = static_cast<uint32_t>(get(8, 4));
  header.value_bytes = static_cast<uint32_t>(get(12, 4));
  header.arg = static_cast<int64_t>(get(16, 8));
  return header;
}

// "0x31545343".
inline std::string HexWord(uint32_t value) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) out.push_back(kDigits[(value >> shift) & 15]);
  return out;
}

// Why a request header is malformed, or "" when it is well formed.
inline std::string CheckRequest(const Header& header) {
  if (header.magic != kMagic) return "bad magic " + HexWord(header.magic);
  if (header.reserved[0] != 0 || header.reserved[1] != 0 || header.reserved[2] != 0) {
    return "reserved header bytes are not zero";
  }
  if (header.code < static_cast<uint8_t>(Op::kSet) ||
      header.code > static_cast<uint8_t>(Op::kAdd)) {
    return "unknown request code " + std::to_string(header.code);
  }
  if (header.key_bytes == 0 || header.key_bytes > kMaxKeyBytes) {
    return "key of " + std::to_string(header.key_bytes) + " bytes (allowed 1.." +
           std::to_string(kMaxKeyBytes) + ")";
  }
  if (header.value_bytes > kMaxValueBytes) {
    return "value of " + std::to_string(header.value_bytes) + " bytes (limit " +
           std::to_string(kMaxValueBytes) + ")";
  }
  Op op = static_cast<Op>(header.code);
  if (op != Op::kSet && header.value_bytes != 0) return "a Get or Add request carries a value";
  if (op == Op::kSet && header.arg != 0) return "a Set request carries an argument";
  if (op == Op::kGet && header.arg < 0) return "negative Get timeout";
  return "";
}

// Why a reply header is malformed whatever it answers, or "" when it may be well formed.
inline std::string CheckReplyHeader(const Header& header) {
  if (header.magic != kMagic) return "bad magic " + HexWord(header.magic);
  if (header.reserved[0] != 0 || header.reserved[1] != 0 || header.reserved[2] != 0) {
    return "reserved header bytes are not zero";
  }
  if (header.code > static_cast<uint8_t>(Status::kInvalidArgument)) {
    return "unknown reply status " + std::to_string(header.code);
  }
  if (header.key_bytes != 0) return "a reply carries a key";
  if (header.value_bytes > kMaxValueBytes) {
    return "value of " + std::to_string(header.value_bytes) + " bytes (limit " +
           std::to_string(kMaxValueBytes) + ")";
  }
  return "";
}

inline const char* OpName(Op op) {
  switch (op) {
    case Op::kSet:
      return "Set";
    case Op::kGet:
      return "Get";
    case Op::kAdd:
      return "Add";
  }
  return "unknown request";
}

// Why a reply header is malformed as the answer to `op`, or "" when it is well formed: only a
// Get's kOk carries a value, only an Add's kOk an argument (the sum), kTimeout answers only a
// Get and carries neither, kInvalidArgument carries its message as the value and no argument.
inline std::string CheckReply(const Header& header, Op op) {
  std::string malformed = CheckReplyHeader(header);
  if (!malformed.empty()) return malformed;
  const std::string answering = std::string(" answering a ") + OpName(op);
  switch (static_cast<Status>(header.code)) {
    case Status::kOk:
      if (op != Op::kGet && header.value_bytes != 0) return "status 'ok' with a value" + answering;
      if (op != Op::kAdd && header.arg != 0) return "status 'ok' with an argument" + answering;
      return "";
    case Status::kTimeout:
      if (op != Op::kGet)
        return "status 'timeout' answers only a Get, not a " + std::string(OpName(op));
      if (header.value_bytes != 0 || header.arg != 0) {
        return "status 'timeout' with a value or an argument";
      }
      return "";
    case Status::kInvalidArgument:
      if (header.arg != 0) return "status 'invalid argument' with an argument" + answering;
      return "";
  }
  return "unknown reply status " + std::to_string(header.code);
}

}  // namespace collectives::cluster::wire

#endif  // COLLECTIVES_SRC_CLUSTER_TCP_STORE_WIRE_H_
