// Names of collective calls, for error messages.
#include "src/core/call.h"

#include <cstdint>

namespace collectives::core {

const char* ToString(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kSplit: return "split";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kGather: return "gather";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kSend: return "send";
  }
  return "unknown_collective";
}

std::string CallDescriptor::ToString() const {
  std::string out = core::ToString(kind);
  if (kind == CollectiveKind::kBarrier) return out + "()";
  if (kind == CollectiveKind::kAllToAll) return out + "(" + collectives::ToString(dtype) + ")";
  out += "(";
  out += collectives::ToString(dtype);
  if (kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduceScatter ||
      kind == CollectiveKind::kReduce) {
    out += ", ";
    out += collectives::ToString(op);
  }
  if (kind == CollectiveKind::kBroadcast || kind == CollectiveKind::kReduce ||
      kind == CollectiveKind::kGather || kind == CollectiveKind::kScatter) {
    out += ", root=" + std::to_string(root);
  }
  if (kind == CollectiveKind::kSend) {
    out += root == INT32_MIN ? std::string(", tag=(in the first frame)")
                             : ", tag=" + std::to_string(root);
  }
  out += ", count=" + std::to_string(count) + ")";
  return out;
}

std::string CallTag::ToString() const {
  // Appended piece by piece: GCC 12 warns (-Wrestrict, a known false positive) on
  // "literal" + std::string temporaries here.
  std::string out;
  if (seq == kPointToPointCall) return call.ToString();
  if ((seq & kPointToPointSeqBit) != 0) {
    out += "message #";
    out += std::to_string(seq & ~kPointToPointSeqBit);
  } else {
    out += "#";
    out += std::to_string(seq);
  }
  out += ' ';
  out += call.ToString();
  return out;
}

}  // namespace collectives::core
