// What a collective call is, as every rank must agree on it: the descriptor that travels in
// every frame header so that a receiver can tell a frame of the call it is running from a frame
// of any other call, and name both sides when they differ.
//
// Thread-safety: plain values.
#ifndef COLLECTIVES_SRC_CORE_CALL_H_
#define COLLECTIVES_SRC_CORE_CALL_H_

#include <cstdint>
#include <string>

#include "collectives/types.h"

namespace collectives::core {

// Wire values: append, never renumber.
enum class CollectiveKind : uint8_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kAllGather = 3,
  kReduceScatter = 4,
  kBarrier = 5,
  // Split's exchange of (color, key): an all-gather of two int64 that no all-gather of the
  // caller's may stand in for.
  kSplit = 6,
  kReduce = 7,
  kGather = 8,
  kScatter = 9,
  kAllToAll = 10,
  // Point to point: the frames of a send and of its receive. Not a collective: such frames
  // carry a number of their own (kPointToPointSeqBit), not the collective sequence's.
  kSend = 11,
};
// The largest wire value, for decoders.
inline constexpr CollectiveKind kLastCollectiveKind = CollectiveKind::kSend;
const char* ToString(CollectiveKind kind);  // "all_reduce", "broadcast", ...

// Set in the seq of every point-to-point frame (below it: the message's number among those one
// rank sent to one peer), never in a collective's: the two numberings cannot meet.
inline constexpr uint64_t kPointToPointSeqBit = uint64_t{1} << 63;
// The seq a point-to-point call runs as (Fabric::SetCall): no frame carries it, so that the
// fabric leaves every frame to the receive that names it.
inline constexpr uint64_t kPointToPointCall = ~uint64_t{0};

// The collective's identity: kind, dtype, op, root and count (elements per rank, as the caller
// passed it: AllReduce/Broadcast/Reduce count, AllGather/Gather send count, ReduceScatter/Scatter
// recv count, a send's element count; 0 for an all-to-all, whose counts travel in its first
// frames). Fields that do not apply (op of a broadcast, root of an all-reduce) are zero. A
// send's root holds its tag when the tag fits in an int32 other than INT32_MIN, else INT32_MIN
// (the tag then travels in the message's first frame).
struct CallDescriptor {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  uint64_t count = 0;

  bool operator==(const CallDescriptor&) const = default;
  // "all_reduce(f32, sum, count=1000)", "broadcast(i8, root=2, count=7)".
  std::string ToString() const;
};

// One collective call: its position in the communicator's sequence and its descriptor.
struct CallTag {
  uint64_t seq = 0;
  CallDescriptor call;

  bool operator==(const CallTag&) const = default;
  // "#17 all_reduce(f32, sum, count=1000)"; a point-to-point frame's "message #3 send(f32,
  // tag=7, count=10)", a point-to-point call's "send(f32, tag=7, count=10)".
  std::string ToString() const;
};

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_CALL_H_
