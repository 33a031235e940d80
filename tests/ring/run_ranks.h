// Runs N ranks as threads of the test process, each with its own communicator, over the
// in-process transport, over real loopback TCP (RING), or through AUTO (shared memory, as the
// ranks share a host), with rendezvous through a memory store: shared by the ring and packing
// tests.
#ifndef COLLECTIVES_TESTS_RING_RUN_RANKS_H_
#define COLLECTIVES_TESTS_RING_RUN_RANKS_H_

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/ring/ring_communication.h"
#include "src/transport/inproc_fabric.h"

namespace collectives::testing {

enum class Transport { kInProcess, kTcp, kAuto };

inline const char* TransportName(Transport t) {
  return t == Transport::kInProcess ? "inproc" : t == Transport::kTcp ? "tcp" : "auto";
}

// Builds `size` communicators (one per thread) and runs `body` on each, in parallel. An exception
// escaping body is reported as a gtest failure of that rank.
inline void RunRanks(Transport transport, int size, const CommunicationOptions& options,
                     const std::function<void(CollectiveCommunication&)>& body) {
  std::vector<std::unique_ptr<transport::Fabric>> fabrics;
  std::shared_ptr<collectives::Store> store;
  if (transport == Transport::kInProcess) {
    fabrics = transport::CreateInProcessFabrics(size);
  } else {
    store = CreateMemoryStore();
  }
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        std::unique_ptr<CollectiveCommunication> comm;
        if (transport == Transport::kInProcess) {
          comm = ring::CreateRingCommunication(std::move(fabrics[rank]), nullptr, options);
        } else {
          ClusterSpec spec;
          spec.rank = rank;
          spec.world_size = size;
          spec.master_port = 1;  // unused: the store is given
          CommunicationOptions chosen = options;
          chosen.implementation =
              transport == Transport::kTcp ? Implementation::kRing : Implementation::kAuto;
          comm = CreateCommunication(spec, store, chosen);
        }
        body(*comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_RING_RUN_RANKS_H_
