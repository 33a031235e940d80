// Ranks of a C API test as threads of one process: each gets its own coll_comm (rendezvous
// through one memory store) and runs the test's body on it; the communicators are destroyed at
// the end.
#ifndef COLLECTIVES_TESTS_C_API_C_API_RANKS_H_
#define COLLECTIVES_TESTS_C_API_C_API_RANKS_H_

#include <gtest/gtest.h>

#include <cstddef>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "collectives/c_api.h"
#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/c_api/c_api_internal.h"

namespace collectives::testing {

// Runs `size` ranks made with `options`, each in a thread of its own, and `body(comm, rank)` on
// each in parallel. `bytes_per_pack` is the packer's bucket (0: its default). A rank that cannot
// connect is a test failure and runs no body.
inline void RunCApiRanks(int size, const CommunicationOptions& options,
                         const std::function<void(coll_comm*, int)>& body,
                         size_t bytes_per_pack = 0) {
  auto store = CreateMemoryStore();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      coll_comm* comm = nullptr;
      try {
        ClusterSpec spec;
        spec.rank = rank;
        spec.world_size = size;
        spec.master_port = 1;  // unused: the store is given
        comm = c_api::WrapCommunication(CreateCommunication(spec, store, options), bytes_per_pack);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " could not connect: " << e.what();
        return;
      }
      body(comm, rank);
      EXPECT_EQ(coll_comm_destroy(comm), COLL_OK) << coll_last_error();
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_C_API_C_API_RANKS_H_
