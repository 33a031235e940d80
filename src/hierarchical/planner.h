// AUTO's planner: groups the ranks by host, builds this host's shared-memory group, and decides per
// call whether a collective runs in shared memory (every rank on one host), in two levels (several
// hosts: inside each host, then across hosts among one rank of each, then inside again), or on the
// ring over TCP. Hosts of different rank counts run all-reduces in two levels too, in as many lanes
// across hosts as the smallest host of several ranks has (a rank alone on its host takes part in
// every lane), broadcasts in two levels too, and their other collectives on the ring. Reduce, and
// gather up to 16 MiB, run in shared memory on one host, on the ring otherwise; scatter and
// all-to-all always on the ring (point-to-point messages never reach the planner). CUDA tensors
// take device_plan.h's plan: NCCL inside a host, the staged ring across hosts.
//
// Thread-safety: as ring::Planner.
#ifndef COLLECTIVES_SRC_HIERARCHICAL_PLANNER_H_
#define COLLECTIVES_SRC_HIERARCHICAL_PLANNER_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/ring/ring_communication.h"

namespace collectives::hierarchical {

// Where every rank lives: the hosts in order of their lowest rank, and each rank's host and
// index inside it.
struct Topology {
  std::vector<std::vector<int>> hosts;  // the ranks of each host, ascending
  std::vector<int> host_of;             // rank -> host
  std::vector<int> local_index;         // rank -> position among its host's ranks

  // From every rank's host identity (rank order).
  static Topology FromIdentities(const std::vector<std::string>& identities);
  // Every host has the same number of ranks.
  bool Uniform() const;
};

// Collective over the ranks: publishes this rank's HostIdentity() under "<key_prefix>/host/R",
// reads everyone's, and builds the shared-memory group of this host when COLLECTIVES_SHM is not
// "0" on any rank, every rank can use shared memory (SharedMemoryUnavailable: where one cannot,
// every rank runs over TCP, and a rank whose host has several says so once per process on
// stderr), and some host has two ranks or more (a rank alone on its host builds no group; one
// rank per host runs every collective on the flat TCP ring). Throws Error(kNotSupported) when
// options.algorithm names a plan this topology cannot run. With several hosts, the planner runs
// all-reduces on the flat ring, by the ring's own choice per size, until Calibrate.
// A step of the communicator's set-up: it waits until `deadline` at most (what is left of
// options.timeout, which bounds the set-up as a whole), and its Error(kTimeout) names
// options.timeout.
std::unique_ptr<ring::Planner> CreatePlanner(int rank, int size, Store& store,
                                             const std::string& job_id,
                                             const std::string& key_prefix,
                                             const CommunicationOptions& options,
                                             std::chrono::steady_clock::time_point deadline,
                                             std::shared_ptr<Store> lasting_store = nullptr);

// With several hosts, one of two ranks or more (and no algorithm forced): measures the cost model
// AUTO decides all-reduces by (cost_model.h), through `comm` (the communicator `planner` belongs
// to; a collective call, made once right after it is built): the time of each candidate, the
// two-level plan and the flat ring's recursive doubling, halving-doubling (on 4, 8, ... ranks)
// and ring, end to end at each of kCalibrationBytes (the slowest rank's time), so that the links'
// latency and bandwidth, oversubscribed cores and shared links count as they will. Every rank
// then holds the same figures and makes the same choice per size. A no-op for other planners.
// The last step of the communicator's set-up: its calls end by `deadline`, their Error(kTimeout)
// names `timeout` (the set-up's), and the calls after it run under `timeout` again.
void Calibrate(ring::Planner& planner, CollectiveCommunication& comm,
               std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout);

}  // namespace collectives::hierarchical

#endif  // COLLECTIVES_SRC_HIERARCHICAL_PLANNER_H_
