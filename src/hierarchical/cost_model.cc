// AUTO's cost model: interpolated curves per candidate and the cheapest per size.
#include "src/hierarchical/cost_model.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "src/core/algorithm_names.h"

namespace collectives::hierarchical {

std::string_view NameOf(Candidate candidate) {
  switch (candidate) {
    case Candidate::kTwoLevel:
      return core::algorithm::kTwoLevel;
    case Candidate::kRecursiveDoubling:
      return core::algorithm::kRecursiveDoubling;
    case Candidate::kHalvingDoubling:
      return core::algorithm::kHalvingDoubling;
    case Candidate::kRing:
      return core::algorithm::kRing;
  }
  return "?";
}

CostCurve::CostCurve(std::vector<std::pair<size_t, double>> points) : points_(std::move(points)) {
  for (size_t i = 1; i < points_.size(); ++i) {
    if (points_[i].first <= points_[i - 1].first) {
      std::fprintf(stderr, "%s:%d: cost curve sizes not ascending: %zu after %zu\n", __FILE__,
                   __LINE__, points_[i].first, points_[i - 1].first);
      std::abort();
    }
  }
}

double CostCurve::Seconds(size_t bytes) const {
  if (points_.empty()) return 0;
  // Below the smallest size, or one size only: no slope to go by.
  if (bytes <= points_.front().first || points_.size() == 1) return points_.front().second;
  // The segment that holds `bytes`, or the last one past the largest size.
  size_t i = 1;
  while (i + 1 < points_.size() && bytes > points_[i].first) ++i;
  const auto [x0, y0] = points_[i - 1];
  const auto [x1, y1] = points_[i];
  // A segment measured as falling (noise) costs the same across it, never less than its start.
  const double slope = std::max(0.0, (y1 - y0) / double(x1 - x0));
  return y0 + slope * double(bytes - x0);
}

std::optional<Candidate> CostModel::Choose(size_t bytes) const {
  std::optional<Candidate> best;
  double best_seconds = 0;
  for (size_t c = 0; c < kCandidates; ++c) {
    if (curves_[c].empty()) continue;
    const double seconds = curves_[c].Seconds(bytes);
    if (!best || seconds < best_seconds) {
      best = Candidate(c);
      best_seconds = seconds;
    }
  }
  return best;
}

}  // namespace collectives::hierarchical
