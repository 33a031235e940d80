// The RING implementation of CollectiveCommunication: validates calls on the caller's thread,
// queues them, and runs them in order on one progress thread that owns the fabric.
//
// Thread-safety: every public method may be called from any thread (see communication.h).
#ifndef COLLECTIVES_SRC_RING_RING_COMMUNICATION_H_
#define COLLECTIVES_SRC_RING_RING_COMMUNICATION_H_

#include <memory>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/transport/connection.h"

namespace collectives::ring {

// Defaults behind the 0 values of CommunicationOptions (see there for the reasons).
inline constexpr size_t kDefaultChunkBytes = 512 * 1024;
inline constexpr size_t kDefaultSmallMessageBytes = 64 * 1024;
inline constexpr size_t kDefaultMediumMessageBytes = 8 * 1024 * 1024;
inline constexpr int kDefaultSpinUs = 50;

// Takes over `fabric` (already connected). `store` is kept alive as long as the communicator
// (rank 0 may host it); it may be null.
std::unique_ptr<CollectiveCommunication> CreateRingCommunication(
    std::unique_ptr<transport::Fabric> fabric, std::shared_ptr<Store> store,
    const CommunicationOptions& options);

}  // namespace collectives::ring

#endif  // COLLECTIVES_SRC_RING_RING_COMMUNICATION_H_
