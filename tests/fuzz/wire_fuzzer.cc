// Fuzz target: every decoder of bytes that arrive from the network before anything is trusted:
// the frame header, the abort payload, the fixed part of the handshake hello, the TCP store's
// request and reply headers, and the store's enrolment request and reply header. A decoder may
// refuse input (with a reason) but never crash, read out of bounds or accept something it cannot
// re-encode to the same bytes.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "src/cluster/tcp_store_auth.h"
#include "src/cluster/tcp_store_wire.h"
#include "src/transport/frame.h"
#include "src/transport/handshake.h"

using namespace collectives;

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "wire_fuzzer: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string why;
  if (size >= transport::kFrameHeaderBytes) {
    if (auto header = transport::DecodeHeader(data, &why)) {
      const transport::EncodedHeader again = transport::EncodeHeader(*header);
      if (std::memcmp(again.data(), data, transport::kFrameHeaderBytes) != 0) {
        Fail("a decoded frame header does not re-encode to the same bytes");
      }
    } else if (why.empty()) {
      Fail("a refused frame header has no reason");
    }
  }
  why.clear();
  if (auto payload = transport::DecodeAbortPayload(data, size, &why)) {
    const std::string again = transport::EncodeAbortPayload(*payload);
    std::string why2;
    auto twice = transport::DecodeAbortPayload(reinterpret_cast<const uint8_t*>(again.data()),
                                               again.size(), &why2);
    if (!twice || twice->code != payload->code || twice->culprit != payload->culprit) {
      Fail("a decoded abort payload does not survive a round trip");
    }
  }
  if (size >= transport::kHelloFixedBytes) {
    size_t job_id_bytes = 0;
    why.clear();
    if (auto hello = transport::DecodeHelloFixed(data, &job_id_bytes, &why)) {
      if (job_id_bytes > transport::kMaxJobIdBytes) Fail("a hello's job id length is unbounded");
    } else if (why.empty()) {
      Fail("a refused hello has no reason");
    }
  }
  if (size >= cluster::wire::kHeaderBytes) {
    cluster::wire::HeaderBytes bytes;
    std::memcpy(bytes.data(), data, bytes.size());
    const cluster::wire::Header header = cluster::wire::Decode(bytes);
    if (cluster::wire::CheckRequest(header).empty()) {
      if (header.key_bytes == 0 || header.key_bytes > cluster::kMaxKeyBytes ||
          header.value_bytes > cluster::kMaxValueBytes) {
        Fail("a store request with unbounded sizes passed the check");
      }
    }
    const bool header_ok = cluster::wire::CheckReplyHeader(header).empty();
    for (const auto op :
         {cluster::wire::Op::kSet, cluster::wire::Op::kGet, cluster::wire::Op::kAdd}) {
      if (cluster::wire::CheckReply(header, op).empty() && !header_ok) {
        Fail("a store reply passed the check for one request but not the header check");
      }
    }
    if (cluster::wire::Encode(header) != bytes) Fail("a store header does not round-trip");
  }
  if (size >= cluster::auth::kResponseBytes) {
    cluster::auth::Response response;
    std::memcpy(response.data(), data, response.size());
    uint32_t rank = 0;
    if (cluster::auth::ClassifyResponse(response, &rank) ==
            cluster::auth::ResponseKind::kEnrolment &&
        cluster::auth::EncodeEnrolment(rank) != response) {
      Fail("an enrolment request does not re-encode to the same bytes");
    }
  }
  if (size >= cluster::auth::kEnrolReplyHeaderBytes) {
    std::array<uint8_t, cluster::auth::kEnrolReplyHeaderBytes> reply;
    std::memcpy(reply.data(), data, reply.size());
    if (cluster::auth::CheckEnrolReply(reply).empty() &&
        reply[2] > cluster::auth::kMaxEnrolPayloadBytes) {
      Fail("an enrolment reply with an unbounded payload passed the check");
    }
  }
  return 0;
}
