// AUTO's planner: groups the ranks by host, builds this host's shared-memory group, and decides
// per call whether a collective runs in shared memory (every rank on one host), in two levels
// (several hosts of as many ranks each: inside each host, then across hosts among the ranks of
// the same local index, then inside again), or on the ring over TCP.
//
// Thread-safety: as ring::Planner.
#ifndef COLLECTIVES_SRC_HIERARCHICAL_PLANNER_H_
#define COLLECTIVES_SRC_HIERARCHICAL_PLANNER_H_

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

// The cost model AUTO decides with across hosts: latency (s) and bandwidth (bytes/s) of the TCP
// link between hosts and of shared memory, measured once when the communicator is built (the
// slowest rank's figures, so that every rank holds the same ones).
struct LinkCosts {
  double net_latency = 0, net_bandwidth = 1;
  double shm_latency = 0, shm_bandwidth = 1;
};

// Estimated seconds of an all-reduce of `bytes` over `topology`: flat over TCP (with the ring's
// algorithm for that size) and in two levels.
double FlatAllReduceCost(const LinkCosts& costs, const Topology& topology, size_t bytes,
                         size_t small_message_bytes, size_t medium_message_bytes);
double TwoLevelAllReduceCost(const LinkCosts& costs, const Topology& topology, size_t bytes,
                             size_t slot_bytes, size_t small_bytes);

// Collective over the ranks: publishes this rank's HostIdentity() under "<key_prefix>/host/R",
// reads everyone's, and builds the shared-memory group of this host when it has two ranks or
// more and COLLECTIVES_SHM is not "0". With several hosts of as many ranks each, it measures the
// LinkCosts (ping-pong with the rank of the same local index on a neighbouring host over
// `fabric`, barriers and a copy in shared memory) and decides each all-reduce between the flat
// ring and the two-level plan by them. Throws Error(kNotSupported) when options.algorithm names
// a plan this topology cannot run.
std::unique_ptr<ring::Planner> CreatePlanner(int rank, int size, transport::Fabric& fabric,
                                             Store& store,
                                             const std::string& job_id,
                                             const std::string& key_prefix,
                                             const CommunicationOptions& options);

}  // namespace collectives::hierarchical

#endif  // COLLECTIVES_SRC_HIERARCHICAL_PLANNER_H_
