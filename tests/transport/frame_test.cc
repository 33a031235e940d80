// Frame headers and abort payloads: exact byte layout, round trips, and every rejection.
#include "src/transport/frame.h"

#include <gtest/gtest.h>

#include <string>

namespace collectives::transport {
namespace {

FrameHeader SampleHeader() {
  FrameHeader header;
  header.kind = FrameKind::kData;
  header.tag.seq = 0x0102030405060708ull;
  header.tag.call.kind = core::CollectiveKind::kBroadcast;
  header.tag.call.dtype = DataType::kBFloat16;
  header.tag.call.op = ReduceOp::kMax;
  header.tag.call.root = -2;
  header.tag.call.count = 0x1112131415161718ull;
  header.bytes = 0x2122232425262728ull;
  return header;
}

TEST(FrameTest, LayoutIsLittleEndianAtTheDocumentedOffsets) {
  const EncodedHeader bytes = EncodeHeader(SampleHeader());
  ASSERT_EQ(bytes.size(), 40u);
  // "CLSF" as a little-endian u32 0x46534C43.
  EXPECT_EQ(bytes[0], 0x43);
  EXPECT_EQ(bytes[1], 0x4C);
  EXPECT_EQ(bytes[2], 0x53);
  EXPECT_EQ(bytes[3], 0x46);
  EXPECT_EQ(bytes[4], kWireVersion);
  EXPECT_EQ(bytes[5], 1);  // data
  EXPECT_EQ(bytes[6], 0);
  EXPECT_EQ(bytes[7], 0);
  EXPECT_EQ(bytes[8], 0x08);  // seq, low byte first
  EXPECT_EQ(bytes[15], 0x01);
  EXPECT_EQ(bytes[16], 2);  // broadcast
  EXPECT_EQ(bytes[17], 3);  // bf16
  EXPECT_EQ(bytes[18], 3);  // max
  EXPECT_EQ(bytes[19], 0);
  EXPECT_EQ(bytes[20], 0xFE);  // root -2
  EXPECT_EQ(bytes[23], 0xFF);
  EXPECT_EQ(bytes[24], 0x18);
  EXPECT_EQ(bytes[31], 0x11);
  EXPECT_EQ(bytes[32], 0x28);
  EXPECT_EQ(bytes[39], 0x21);
}

TEST(FrameTest, RoundTripsEveryKindDtypeAndOp) {
  for (int kind = 1; kind <= 5; ++kind) {
    for (int dtype = 0; dtype < kNumDataTypes; ++dtype) {
      for (int op = 0; op < kNumReduceOps; ++op) {
        FrameHeader header;
        header.tag.seq = static_cast<uint64_t>(kind * 100 + dtype * 10 + op);
        header.tag.call.kind = static_cast<core::CollectiveKind>(kind);
        header.tag.call.dtype = static_cast<DataType>(dtype);
        header.tag.call.op = static_cast<ReduceOp>(op);
        header.tag.call.root = dtype;
        header.tag.call.count = ~0ull - static_cast<uint64_t>(op);
        header.bytes = static_cast<uint64_t>(dtype) << 40;
        const EncodedHeader bytes = EncodeHeader(header);
        std::string why;
        auto decoded = DecodeHeader(bytes.data(), &why);
        ASSERT_TRUE(decoded) << why;
        EXPECT_EQ(decoded->kind, FrameKind::kData);
        EXPECT_EQ(decoded->tag, header.tag);
        EXPECT_EQ(decoded->bytes, header.bytes);
      }
    }
  }
}

TEST(FrameTest, RoundTripsAnAbortHeader) {
  FrameHeader header;
  header.kind = FrameKind::kAbort;
  header.bytes = 100;
  const EncodedHeader bytes = EncodeHeader(header);
  auto decoded = DecodeHeader(bytes.data(), nullptr);
  ASSERT_TRUE(decoded);
  EXPECT_EQ(decoded->kind, FrameKind::kAbort);
  EXPECT_EQ(decoded->bytes, 100u);
}

// Decodes `bytes` after `mutate`, expecting a rejection whose reason contains `expected`.
void ExpectRejected(void (*mutate)(EncodedHeader&), const std::string& expected) {
  EncodedHeader bytes = EncodeHeader(SampleHeader());
  mutate(bytes);
  std::string why;
  EXPECT_FALSE(DecodeHeader(bytes.data(), &why));
  EXPECT_NE(why.find(expected), std::string::npos) << "why: " << why;
}

TEST(FrameTest, RejectsBadMagic) {
  ExpectRejected([](EncodedHeader& b) { b[0] = 'X'; }, "bad magic 0x46534C58");
}
TEST(FrameTest, RejectsOtherVersions) {
  ExpectRejected([](EncodedHeader& b) { b[4] = 2; }, "unsupported wire version 2");
  ExpectRejected([](EncodedHeader& b) { b[4] = 0; }, "unsupported wire version 0");
}
TEST(FrameTest, RejectsUnknownFrameKinds) {
  ExpectRejected([](EncodedHeader& b) { b[5] = 0; }, "unknown frame kind 0");
  ExpectRejected([](EncodedHeader& b) { b[5] = 3; }, "unknown frame kind 3");
}
TEST(FrameTest, RejectsNonZeroReservedBytes) {
  ExpectRejected([](EncodedHeader& b) { b[6] = 1; }, "reserved");
  ExpectRejected([](EncodedHeader& b) { b[7] = 1; }, "reserved");
  ExpectRejected([](EncodedHeader& b) { b[19] = 1; }, "reserved");
}
TEST(FrameTest, RejectsCollectiveKindsOutOfRange) {
  ExpectRejected([](EncodedHeader& b) { b[16] = 0; }, "unknown collective kind 0");
  ExpectRejected([](EncodedHeader& b) { b[16] = 12; }, "unknown collective kind 12");
}
TEST(FrameTest, RejectsDtypesOutOfRange) {
  ExpectRejected([](EncodedHeader& b) { b[17] = 8; }, "unknown dtype 8");
  ExpectRejected([](EncodedHeader& b) { b[17] = 255; }, "unknown dtype 255");
}
TEST(FrameTest, RejectsOpsOutOfRange) {
  ExpectRejected([](EncodedHeader& b) { b[18] = 5; }, "unknown reduce op 5");
}
TEST(FrameTest, RejectsAbortFramesWithAnImpossibleSize) {
  for (uint64_t size : {uint64_t{0}, uint64_t{7}, uint64_t{kMaxAbortPayload + 1}, ~uint64_t{0}}) {
    FrameHeader header;
    header.kind = FrameKind::kAbort;
    header.bytes = size;
    const EncodedHeader bytes = EncodeHeader(header);
    std::string why;
    EXPECT_FALSE(DecodeHeader(bytes.data(), &why)) << size;
    EXPECT_NE(why.find("abort frame"), std::string::npos) << why;
  }
}

TEST(AbortPayloadTest, RoundTrips) {
  AbortPayload payload;
  payload.code = ErrorCode::kMismatch;
  payload.culprit = 3;
  payload.message = "rank 3: frame from rank 2 does not match";
  const std::string bytes = EncodeAbortPayload(payload);
  EXPECT_EQ(bytes.size(), 8 + payload.message.size());
  std::string why;
  auto decoded =
      DecodeAbortPayload(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &why);
  ASSERT_TRUE(decoded) << why;
  EXPECT_EQ(decoded->code, ErrorCode::kMismatch);
  EXPECT_EQ(decoded->culprit, 3);
  EXPECT_EQ(decoded->message, payload.message);
}

TEST(AbortPayloadTest, EmptyMessageRoundTrips) {
  AbortPayload payload;
  payload.code = ErrorCode::kAborted;
  payload.culprit = 0;
  const std::string bytes = EncodeAbortPayload(payload);
  auto decoded =
      DecodeAbortPayload(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), nullptr);
  ASSERT_TRUE(decoded);
  EXPECT_EQ(decoded->message, "");
}

TEST(AbortPayloadTest, LongMessagesAreCutToTheBoundAtACharacterBoundary) {
  AbortPayload payload;
  payload.code = ErrorCode::kTimeout;
  payload.culprit = 1;
  // Two-byte characters (U+00E9), so a cut at an odd offset would split one.
  for (int i = 0; i < 5000; ++i) payload.message += "\xC3\xA9";
  const std::string bytes = EncodeAbortPayload(payload);
  EXPECT_LE(bytes.size(), kMaxAbortPayload);
  auto decoded =
      DecodeAbortPayload(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), nullptr);
  ASSERT_TRUE(decoded);
  const std::string& message = decoded->message;
  ASSERT_GE(message.size(), 3u);
  EXPECT_EQ(message.substr(message.size() - 3), "...");
  const std::string body = message.substr(0, message.size() - 3);
  EXPECT_EQ(body.size() % 2, 0u);
  EXPECT_EQ(body.substr(body.size() - 2), "\xC3\xA9");
}

TEST(AbortPayloadTest, RejectsBadSizesCodesAndCulprits) {
  AbortPayload payload;
  payload.code = ErrorCode::kAborted;
  payload.culprit = 2;
  payload.message = "x";
  std::string bytes = EncodeAbortPayload(payload);
  auto* data = reinterpret_cast<uint8_t*>(bytes.data());
  std::string why;
  EXPECT_FALSE(DecodeAbortPayload(data, 7, &why));
  EXPECT_NE(why.find("7 bytes"), std::string::npos) << why;
  EXPECT_FALSE(DecodeAbortPayload(data, kMaxAbortPayload + 1, &why));

  std::string bad_code = bytes;
  bad_code[0] = 0;
  EXPECT_FALSE(
      DecodeAbortPayload(reinterpret_cast<uint8_t*>(bad_code.data()), bad_code.size(), &why));
  EXPECT_NE(why.find("unknown error code 0"), std::string::npos) << why;
  bad_code[0] = 11;
  EXPECT_FALSE(
      DecodeAbortPayload(reinterpret_cast<uint8_t*>(bad_code.data()), bad_code.size(), &why));

  std::string bad_culprit = bytes;
  bad_culprit[7] = static_cast<char>(0x80);
  EXPECT_FALSE(
      DecodeAbortPayload(reinterpret_cast<uint8_t*>(bad_culprit.data()), bad_culprit.size(), &why));
  EXPECT_NE(why.find("culprit"), std::string::npos) << why;
}

// Where the world size is known (the fabric), the culprit must be one of its ranks.
TEST(AbortPayloadTest, RejectsACulpritOutsideTheWorldWhereItsSizeIsKnown) {
  AbortPayload payload;
  payload.code = ErrorCode::kAborted;
  payload.culprit = 12345;
  const std::string bytes = EncodeAbortPayload(payload);
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  std::string why;
  EXPECT_TRUE(DecodeAbortPayload(data, bytes.size(), &why)) << why;  // size unknown
  EXPECT_FALSE(DecodeAbortPayload(data, bytes.size(), &why, 4));
  EXPECT_NE(why.find("culprit rank 12345"), std::string::npos) << why;
  EXPECT_NE(why.find("world of 4 ranks"), std::string::npos) << why;
  payload.culprit = 4;
  const std::string edge = EncodeAbortPayload(payload);
  EXPECT_FALSE(
      DecodeAbortPayload(reinterpret_cast<const uint8_t*>(edge.data()), edge.size(), &why, 4));
  payload.culprit = 3;
  const std::string last = EncodeAbortPayload(payload);
  auto decoded =
      DecodeAbortPayload(reinterpret_cast<const uint8_t*>(last.data()), last.size(), &why, 4);
  ASSERT_TRUE(decoded) << why;
  EXPECT_EQ(decoded->culprit, 3);
}

}  // namespace
}  // namespace collectives::transport
