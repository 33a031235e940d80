// A Fabric for ranks that are threads of one process: each direction of each pair is a queue
// of frames guarded by a mutex. A send copies the payload into the peer's queue and completes
// at once; a receive waits for the next frame, checks its tag and size exactly as TCP does,
// and copies it out. Destroying or aborting one rank's fabric makes its peers' waits throw
// kPeerLost / kAborted, as a closed socket would.
//
// Thread-safety: see connection.h; the fabrics of one group are used by different threads.
#ifndef COLLECTIVES_SRC_TRANSPORT_INPROC_FABRIC_H_
#define COLLECTIVES_SRC_TRANSPORT_INPROC_FABRIC_H_

#include <memory>
#include <vector>

#include "src/transport/connection.h"

namespace collectives::transport {

// One fabric per rank of a group of `size`; hand element i to the thread of rank i.
std::vector<std::unique_ptr<Fabric>> CreateInProcessFabrics(int size);

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_INPROC_FABRIC_H_
