// The names of the all-reduce algorithms, as CommunicationOptions::algorithm takes them and
// CollectiveCommunication::AllReduceAlgorithm returns them, defined once for the library, its
// tests and its benchmarks. "nccl" is also the name of the NCCL implementation, whose
// AllReduceAlgorithm is ToString(Implementation::kNccl).
//
// Thread-safety: constants.
#ifndef COLLECTIVES_SRC_CORE_ALGORITHM_NAMES_H_
#define COLLECTIVES_SRC_CORE_ALGORITHM_NAMES_H_

#include <string_view>

namespace collectives::core::algorithm {

// RING's (and AUTO's over TCP): src/ring/algorithms.h.
inline constexpr std::string_view kRing = "ring";
inline constexpr std::string_view kRecursiveDoubling = "recursive_doubling";
inline constexpr std::string_view kHalvingDoubling = "halving_doubling";
// AUTO's: shared memory on one host (kShmSmall, the small-message form, is reported, never
// forced), and the two-level plan across hosts (src/hierarchical/planner.h).
inline constexpr std::string_view kShm = "shm";
inline constexpr std::string_view kShmSmall = "shm_small";
inline constexpr std::string_view kTwoLevel = "two_level";
// NCCL's own choice.
inline constexpr std::string_view kNccl = "nccl";

}  // namespace collectives::core::algorithm

#endif  // COLLECTIVES_SRC_CORE_ALGORITHM_NAMES_H_
