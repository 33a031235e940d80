// AUTO's plan for CUDA tensors: NCCL among the ranks of a host, the staged ring over TCP across
// hosts (src/ring/staged.h), chosen by the tensor's device (CPU tensors never come here).
//
// The schedules, with H hosts of L ranks (a host's leader is its first rank):
//  - One host: the collective is NCCL's, over every rank.
//  - all_reduce, in lanes where every host has L ranks and L divides the count: NCCL
//    reduce-scatters send into this rank's slice of recv (L slices), the ranks of each local
//    index (one per host, a lane) all-reduce their slice in place over TCP through staging, every
//    lane at once, and NCCL all-gathers the slices into recv. Elsewhere through the leader: NCCL
//    reduces to the leader (into recv), the leaders all-reduce recv in place over TCP through
//    staging, NCCL broadcasts recv from the leader. kAvg: NCCL's average inside and the average
//    across, exact only where every host has as many ranks, so kAvg runs there only for
//    floating dtypes (elsewhere on the staged ring).
//  - broadcast: the root, and the leader of every other host, broadcast over TCP through staging
//    into recv; NCCL then broadcasts recv inside each host from the rank that received it.
//  - all_gather (hosts of as many ranks each): NCCL gathers the host's blocks into their places
//    in recv (one all-gather where the host's ranks are consecutive, one broadcast per member
//    elsewhere); the leaders all-gather the hosts' blocks over TCP through staging; NCCL
//    broadcasts the whole recv from the leader.
//  - reduce_scatter (hosts of as many ranks each, not kAvg): NCCL reduces send to the leader
//    into device scratch; the leaders reduce-scatter the hosts' blocks over TCP through staging;
//    NCCL scatters the host's blocks from the leader.
// A rank alone on its host takes no NCCL step: its staged copies read send and write recv.
// Elsewhere (kAvg as above, hosts of different sizes for all_gather and reduce_scatter) the
// call runs on the staged ring over TCP between every pair, as RING's.
//
// The choice of NCCL is made once, at the first CUDA call, by every rank alike from an
// all-gather over TCP of what each says: whether NCCL loads here (nccl_loader.h) and
// COLLECTIVES_AUTO_NCCL is not "0", and the PCI bus id of its GPU. NCCL runs only where it is
// usable on every rank and no two ranks of a host share a GPU (NCCL needs one per rank); else
// every CUDA call runs on the staged ring, and each process says so once on stderr, naming why.
// With NCCL, the host's NCCL communicator is made then too, on the tensor's device, through the
// store under "<key_prefix>/auto_nccl/<host>": a rank's later CUDA calls must use that device
// (Error(kInvalidArgument) otherwise). The staging of the crossing is the plan's own: two slots
// of COLLECTIVES_CUDA_STAGING_BYTES pinned on each rank that crosses, beside the ring's, and
// a leader's reduce-scatter takes (world + host's ranks) x recv.count elements of device scratch,
// kept for later calls. NCCL checks nothing across ranks: a call that differs between ranks of a
// host is undefined there (typically a hang until the timeout), not Error(kMismatch). The
// planner announces each CUDA call to the host's shared-memory group (Planner::RunningOnRing),
// so a member waiting there in a CPU call of another descriptor raises kMismatch; one of the
// same descriptor (the device is not part of it) waits until its timeout.
//
// Thread-safety: the Body factories on the caller's thread; the bodies on the thread that runs
// the call, one at a time; Abort from any thread.
#ifndef COLLECTIVES_SRC_HIERARCHICAL_DEVICE_PLAN_H_
#define COLLECTIVES_SRC_HIERARCHICAL_DEVICE_PLAN_H_

#include <memory>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/ring/ring_communication.h"

namespace collectives::hierarchical {

struct DevicePlanLayout {
  int rank = 0;
  std::vector<std::vector<int>> hosts;  // the ranks of each host, ascending
  std::vector<int> host_of;             // rank -> host
  std::vector<int> local_index;         // rank -> position among its host's ranks
};

class DevicePlan {
 public:
  using Body = ring::Planner::Body;
  virtual ~DevicePlan() = default;
  virtual Body AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op, Body staged) = 0;
  virtual Body Broadcast(const Tensor& send, const Tensor& recv, int root, Body staged) = 0;
  virtual Body AllGather(const Tensor& send, const Tensor& recv, Body staged) = 0;
  virtual Body ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op, Body staged) = 0;
  virtual void Abort(const Error& error) = 0;
};

// The plan for `layout`, rendezvousing through `store` (kept alive) under `key_prefix`, NCCL's
// set-up and calls bounded by the call's deadline. In a build without NCCL, every call keeps its
// staged body (and the first says why once on stderr).
std::unique_ptr<DevicePlan> CreateDevicePlan(DevicePlanLayout layout, std::shared_ptr<Store> store,
                                             const std::string& key_prefix,
                                             const CommunicationOptions& options);

// How many NCCL collectives AUTO's device plans of this process have issued (for tests: that a
// CUDA call went through NCCL).
uint64_t DevicePlanNcclCalls();

}  // namespace collectives::hierarchical

#endif  // COLLECTIVES_SRC_HIERARCHICAL_DEVICE_PLAN_H_
