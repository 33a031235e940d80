// A ClusterSpec for a job whose ranks meet through a TCP store on this machine's loopback
// address: rank `rank` of `world_size`, store at 127.0.0.1:`port`, no token, no addresses.
#ifndef COLLECTIVES_TESTS_LOOPBACK_SPEC_H_
#define COLLECTIVES_TESTS_LOOPBACK_SPEC_H_

#include <cstdint>

#include "collectives/cluster.h"

namespace collectives::testing {

inline ClusterSpec LoopbackSpec(int rank, int world_size, uint16_t port) {
  ClusterSpec spec;
  spec.rank = rank;
  spec.world_size = world_size;
  spec.master_addr = "127.0.0.1";
  spec.master_port = port;
  return spec;
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_LOOPBACK_SPEC_H_
