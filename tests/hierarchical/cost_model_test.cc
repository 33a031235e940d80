// AUTO's cost model (src/hierarchical/cost_model.h) on synthetic figures: the curves' arithmetic
// against values worked out by hand, and the choice per size on figures shaped like an alpha-beta
// model of each plan on a given layout and link (computed here, independently of the library).
#include "src/hierarchical/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

namespace collectives::hierarchical {
namespace {

constexpr size_t KiB = size_t{1} << 10;
constexpr size_t MiB = size_t{1} << 20;

TEST(CostCurveTest, InterpolatesBetweenMeasuredSizes) {
  const CostCurve curve({{8, 10e-6}, {64 * KiB, 110e-6}, {4 * MiB, 4110e-6}});
  EXPECT_DOUBLE_EQ(curve.Seconds(8), 10e-6);
  EXPECT_DOUBLE_EQ(curve.Seconds(64 * KiB), 110e-6);
  EXPECT_DOUBLE_EQ(curve.Seconds(4 * MiB), 4110e-6);
  // Halfway along the first segment (8 B to 64 KiB): halfway between its times.
  EXPECT_NEAR(curve.Seconds(8 + (64 * KiB - 8) / 2), 60e-6, 1e-12);
  // Halfway along the second.
  EXPECT_NEAR(curve.Seconds(64 * KiB + (4 * MiB - 64 * KiB) / 2), 2110e-6, 1e-12);
}

TEST(CostCurveTest, ExtrapolatesByTheLastSegmentsBandwidth) {
  // 4000 us over 4 MiB - 64 KiB: past 4 MiB the same seconds per byte.
  const CostCurve curve({{8, 10e-6}, {64 * KiB, 110e-6}, {4 * MiB, 4110e-6}});
  const double per_byte = 4000e-6 / double(4 * MiB - 64 * KiB);
  EXPECT_NEAR(curve.Seconds(64 * MiB), 4110e-6 + per_byte * double(60 * MiB), 1e-9);
}

TEST(CostCurveTest, BelowTheSmallestSizeAndOnePointAreFlat) {
  const CostCurve curve({{8, 10e-6}, {64 * KiB, 110e-6}});
  EXPECT_DOUBLE_EQ(curve.Seconds(0), 10e-6);
  EXPECT_DOUBLE_EQ(curve.Seconds(4), 10e-6);
  const CostCurve one({{4 * MiB, 3e-3}});
  EXPECT_DOUBLE_EQ(one.Seconds(8), 3e-3);
  EXPECT_DOUBLE_EQ(one.Seconds(64 * MiB), 3e-3);
}

TEST(CostCurveTest, ASegmentMeasuredFallingCostsItsStartAcross) {
  // Noise made 64 KiB faster than 8 B: the curve does not promise less than 8 B's time.
  const CostCurve curve({{8, 50e-6}, {64 * KiB, 40e-6}, {4 * MiB, 1e-3}});
  EXPECT_DOUBLE_EQ(curve.Seconds(32 * KiB), 50e-6);
  EXPECT_GT(curve.Seconds(1 * MiB), 40e-6);
}

TEST(CostModelTest, NothingSetChoosesNothing) { EXPECT_FALSE(CostModel().Choose(8).has_value()); }

TEST(CostModelTest, TiesGoToTheEarlierCandidate) {
  CostModel model;
  model.Set(Candidate::kRing, CostCurve({{8, 1e-5}}));
  model.Set(Candidate::kTwoLevel, CostCurve({{8, 1e-5}}));
  EXPECT_EQ(model.Choose(8), Candidate::kTwoLevel);
}

TEST(CostModelTest, ACandidateNotMeasuredIsNeverChosen) {
  CostModel model;
  model.Set(Candidate::kRing, CostCurve({{8, 1.0}}));  // slow, but the only one measured
  for (size_t bytes : {size_t{0}, size_t{8}, 64 * MiB}) {
    EXPECT_EQ(model.Choose(bytes), Candidate::kRing) << bytes;
  }
}

// The time of one all-reduce of `bytes` by each plan on `hosts` hosts of `per_host` ranks, whose
// links each carry `link_bps` bytes per second per direction (shared by the host's ranks) with
// `link_latency` seconds per message, and whose ranks inside a host exchange at `local_bps` with
// `local_latency` (the alpha-beta model of each schedule, worked out for this test):
//   recursive doubling: log2(p) steps of the whole message; the steps of distance >= per_host
//     cross hosts, with every rank of a host sending at once;
//   halving-doubling: the same steps with halves, quarters, ..., twice (reduce-scatter and
//     all-gather);
//   ring: 2(p - 1) steps of bytes / p; each host link carries one rank's stream;
//   two levels: a reduce inside the host and a broadcast back (shared memory, two local steps
//     of the whole message), and across hosts per_host lanes, each a ring of `hosts` over
//     bytes / per_host, all lanes sharing the host's link.
double Modelled(Candidate plan, int hosts, int per_host, double link_latency, double link_bps,
                double local_latency, double local_bps, double bytes) {
  const int p = hosts * per_host;
  const int steps = int(std::lround(std::log2(double(p))));
  double t = 0;
  switch (plan) {
    case Candidate::kRecursiveDoubling:
      for (int distance = 1; distance < p; distance *= 2) {
        t += distance >= per_host ? link_latency + per_host * bytes / link_bps
                                  : local_latency + bytes / local_bps;
      }
      return t;
    case Candidate::kHalvingDoubling: {
      double piece = bytes / 2;
      for (int distance = p / 2, s = 0; s < steps; distance /= 2, ++s, piece /= 2) {
        t += 2 * (distance >= per_host ? link_latency + per_host * piece / link_bps
                                       : local_latency + piece / local_bps);
      }
      return t;
    }
    case Candidate::kRing:
      return 2 * (p - 1) * (link_latency + bytes / p / link_bps);
    case Candidate::kTwoLevel:
      return 2 * (local_latency + bytes / local_bps) +
             2 * (hosts - 1) * (link_latency + per_host * (bytes / per_host / hosts) / link_bps);
  }
  return 0;
}

// A model calibrated as Calibrate does (each candidate at kCalibrationBytes) from the figures
// above.
CostModel Calibrated(int hosts, int per_host, double link_latency, double link_bps,
                     double local_latency, double local_bps) {
  CostModel model;
  for (Candidate plan : {Candidate::kTwoLevel, Candidate::kRecursiveDoubling,
                         Candidate::kHalvingDoubling, Candidate::kRing}) {
    std::vector<std::pair<size_t, double>> points;
    for (size_t bytes : kCalibrationBytes) {
      points.emplace_back(bytes, Modelled(plan, hosts, per_host, link_latency, link_bps,
                                          local_latency, local_bps, double(bytes)));
    }
    model.Set(plan, CostCurve(std::move(points)));
  }
  return model;
}

// The cheapest plan by the model itself at `bytes`, for comparison.
Candidate Cheapest(int hosts, int per_host, double link_latency, double link_bps,
                   double local_latency, double local_bps, size_t bytes) {
  Candidate best = Candidate::kTwoLevel;
  double best_t = 1e300;
  for (Candidate plan : {Candidate::kTwoLevel, Candidate::kRecursiveDoubling,
                         Candidate::kHalvingDoubling, Candidate::kRing}) {
    const double t = Modelled(plan, hosts, per_host, link_latency, link_bps, local_latency,
                              local_bps, double(bytes));
    if (t < best_t) {
      best = plan;
      best_t = t;
    }
  }
  return best;
}

struct Link {
  const char* name;
  double latency;
  double bps;
};

// On every preset's link and the 4 x 2 layout, the plan chosen at every size from 8 B to 64 MiB
// costs at most 10% more than the cheapest there (the figures are straight lines between the
// calibration sizes only approximately: the recursive-doubling steps of a two-level host
// cross at a rate the curves interpolate).
TEST(CostModelTest, OnShapedLinksTheChoiceIsWithinTenPercentOfTheCheapest) {
  const double local_latency = 2e-6, local_bps = 5e9;  // shared memory
  for (const Link& link : {Link{"10g", 5e-6, 1.25e9}, Link{"1g", 5e-6, 0.125e9},
                           Link{"10g+25us", 30e-6, 1.25e9}, Link{"1g+100us", 105e-6, 0.125e9}}) {
    const CostModel model = Calibrated(4, 2, link.latency, link.bps, local_latency, local_bps);
    for (size_t bytes = 8; bytes <= 64 * MiB; bytes *= 2) {
      const Candidate chosen = *model.Choose(bytes);
      const Candidate best =
          Cheapest(4, 2, link.latency, link.bps, local_latency, local_bps, bytes);
      const double t_chosen =
          Modelled(chosen, 4, 2, link.latency, link.bps, local_latency, local_bps, double(bytes));
      const double t_best =
          Modelled(best, 4, 2, link.latency, link.bps, local_latency, local_bps, double(bytes));
      EXPECT_LE(t_chosen, 1.10 * t_best) << link.name << " at " << bytes << " B: chose "
                                         << NameOf(chosen) << ", cheapest " << NameOf(best);
    }
  }
}

// The shapes the choice should take on a slow link with two ranks per host: recursive doubling
// (fewest messages) for the smallest messages, two levels (each byte crosses a host's link the
// fewest times) for the largest.
TEST(CostModelTest, SmallMessagesTakeRecursiveDoublingLargeOnesTwoLevels) {
  const CostModel model = Calibrated(4, 2, 105e-6, 0.125e9, 2e-6, 5e9);
  EXPECT_EQ(model.Choose(8), Candidate::kRecursiveDoubling);
  EXPECT_EQ(model.Choose(64 * MiB), Candidate::kTwoLevel);
}

// Figures as an oversubscribed machine gives them (every plan's time dominated by the ranks'
// turns on the cores, not by bytes): whatever measured fastest at a size is chosen there, even
// where the link model would say otherwise.
TEST(CostModelTest, MeasuredFiguresWinOverWhatTheLinkWouldSay) {
  CostModel model;
  model.Set(Candidate::kTwoLevel, CostCurve({{8, 900e-6}, {64 * KiB, 1200e-6}, {4 * MiB, 40e-3}}));
  model.Set(Candidate::kRecursiveDoubling,
            CostCurve({{8, 300e-6}, {64 * KiB, 2000e-6}, {4 * MiB, 90e-3}}));
  model.Set(Candidate::kHalvingDoubling,
            CostCurve({{8, 700e-6}, {64 * KiB, 1500e-6}, {4 * MiB, 45e-3}}));
  model.Set(Candidate::kRing, CostCurve({{8, 2000e-6}, {64 * KiB, 2500e-6}, {4 * MiB, 38e-3}}));
  EXPECT_EQ(model.Choose(8), Candidate::kRecursiveDoubling);
  EXPECT_EQ(model.Choose(64 * KiB), Candidate::kTwoLevel);
  EXPECT_EQ(model.Choose(4 * MiB), Candidate::kRing);
  // Past 4 MiB: ring's last segment rises by (38 - 2.5) ms over 4 MiB - 64 KiB, two levels' by
  // (40 - 1.2) ms: ring stays ahead.
  EXPECT_EQ(model.Choose(64 * MiB), Candidate::kRing);
}

}  // namespace
}  // namespace collectives::hierarchical
