// Names of collective calls, for error messages.
#include "src/core/call.h"

namespace collectives::core {

const char* ToString(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kSplit: return "split";
  }
  return "unknown_collective";
}

std::string CallDescriptor::ToString() const {
  std::string out = core::ToString(kind);
  if (kind == CollectiveKind::kBarrier) return out + "()";
  out += "(";
  out += collectives::ToString(dtype);
  if (kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduceScatter) {
    out += ", ";
    out += collectives::ToString(op);
  }
  if (kind == CollectiveKind::kBroadcast) out += ", root=" + std::to_string(root);
  out += ", count=" + std::to_string(count) + ")";
  return out;
}

std::string CallTag::ToString() const {
  // Appended piece by piece: GCC 12 warns (-Wrestrict, a known false positive) on
  // "literal" + std::string temporaries here.
  std::string out = "#";
  out += std::to_string(seq);
  out += ' ';
  out += call.ToString();
  return out;
}

}  // namespace collectives::core
