// SubFabric: some ranks of a fabric seen as a fabric of their own. Private to src/hierarchical.
#ifndef COLLECTIVES_SRC_HIERARCHICAL_SUB_FABRIC_H_
#define COLLECTIVES_SRC_HIERARCHICAL_SUB_FABRIC_H_

#include <chrono>
#include <cstddef>
#include <vector>

#include "src/transport/connection.h"

namespace collectives::hierarchical {

// A view of some ranks of a fabric as a fabric of their own (a lane across hosts, the hosts'
// leaders, a broadcast's crossers). Connections are the parent's, so frames still carry the
// parent's call tags. `ranks` maps a rank of the view to the parent's and must outlive the view.
class SubFabric final : public transport::Fabric {
 public:
  SubFabric(transport::Fabric& parent, const std::vector<int>& ranks, int me)
      : parent_(parent), ranks_(ranks), me_(me) {}
  int rank() const override { return me_; }
  int size() const override { return int(ranks_.size()); }
  transport::Connection& connection(int peer) override {
    return parent_.connection(ranks_[size_t(peer)]);
  }
  void SetDeadline(transport::Clock::time_point deadline) override {
    parent_.SetDeadline(deadline);
  }
  void SetCall(const core::CallTag& call) override { parent_.SetCall(call); }
  void SetSpin(std::chrono::microseconds spin, std::chrono::microseconds yield) override {
    parent_.SetSpin(spin, yield);
  }
  void Abort(const Error& error) override { parent_.Abort(error); }

 private:
  transport::Fabric& parent_;
  const std::vector<int>& ranks_;
  const int me_;
};

}  // namespace collectives::hierarchical

#endif  // COLLECTIVES_SRC_HIERARCHICAL_SUB_FABRIC_H_
