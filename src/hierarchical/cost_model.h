// AUTO's cost model for all-reduces across hosts: for each candidate plan (the two-level plan and
// the flat ring's three algorithms), the time of one call at a few sizes measured at set-up, end
// to end on the links the job has; the plan for a size is the cheapest candidate there. Between
// measured sizes a candidate's time is interpolated linearly in bytes (each segment a latency
// and a bandwidth term of its own, so a plan whose protocol changes between sizes is not forced
// onto one line); past the largest it grows by the last segment's seconds per byte (the
// bandwidth term); below the smallest it is the smallest's (one size only: that size's, at every
// size).
//
// Thread-safety: a CostModel is a value; const methods may be called from any thread.
#ifndef COLLECTIVES_SRC_HIERARCHICAL_COST_MODEL_H_
#define COLLECTIVES_SRC_HIERARCHICAL_COST_MODEL_H_

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

namespace collectives::hierarchical {

// The all-reduce plans AUTO chooses among on several hosts, in the order ties go.
enum class Candidate { kTwoLevel, kRecursiveDoubling, kHalvingDoubling, kRing };
inline constexpr size_t kCandidates = 4;

// The name of a candidate, as CommunicationOptions::algorithm spells it.
std::string_view NameOf(Candidate candidate);

// The sizes calibration measures, ascending: a latency-bound one, one where the ring's
// small-message algorithms give way, and a bandwidth-bound one.
inline constexpr std::array<size_t, 3> kCalibrationBytes = {8, size_t{64} << 10, size_t{4} << 20};

// One candidate's seconds per call at measured sizes, as described above.
class CostCurve {
 public:
  CostCurve() = default;
  // `points`: (bytes, seconds), sizes ascending and distinct; at least one.
  explicit CostCurve(std::vector<std::pair<size_t, double>> points);
  bool empty() const { return points_.empty(); }
  double Seconds(size_t bytes) const;

 private:
  std::vector<std::pair<size_t, double>> points_;
};

class CostModel {
 public:
  // The candidate's curve; a candidate never set is never chosen.
  void Set(Candidate candidate, CostCurve curve) { curves_[size_t(candidate)] = std::move(curve); }
  // The cheapest candidate for an all-reduce of `bytes` (ties: the earlier in Candidate's order);
  // nullopt when none is set.
  std::optional<Candidate> Choose(size_t bytes) const;

 private:
  std::array<CostCurve, kCandidates> curves_;
};

}  // namespace collectives::hierarchical

#endif  // COLLECTIVES_SRC_HIERARCHICAL_COST_MODEL_H_
