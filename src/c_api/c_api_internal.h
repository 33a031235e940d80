// What the C API's implementation shares with the tests: wrapping a C++ communicator the caller
// built (e.g. over a memory store, for ranks that are threads) into a coll_comm.
//
// Thread-safety: as for the coll_comm functions.
#ifndef COLLECTIVES_SRC_C_API_C_API_INTERNAL_H_
#define COLLECTIVES_SRC_C_API_C_API_INTERNAL_H_

#include <cstddef>
#include <memory>

#include "collectives/c_api.h"
#include "collectives/communication.h"

namespace collectives::c_api {

// Takes ownership of `comm` (non-null); release the result with coll_comm_destroy.
// `bytes_per_pack` plays the role of coll_options.bytes_per_pack.
coll_comm* WrapCommunication(std::unique_ptr<CollectiveCommunication> comm,
                             size_t bytes_per_pack = 0);

}  // namespace collectives::c_api

#endif  // COLLECTIVES_SRC_C_API_C_API_INTERNAL_H_
