// Runs N ranks as threads of the test process, each with its own communicator, over the
// in-process transport, over real loopback TCP (RING; directly, or through relays that split
// the bytes into pieces), or through AUTO (shared memory, as the ranks share a host), with
// rendezvous through a memory store: shared by the ring and packing tests.
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
#include "tests/transport/piece_relay.h"

namespace collectives::testing {

// kTcpInPieces: RING over TCP with every connection through a PieceRelay
// (tests/transport/piece_relay.h), which hands the bytes on in pieces of random length.
enum class Transport { kInProcess, kTcp, kAuto, kTcpInPieces };

inline const char* TransportName(Transport t) {
  switch (t) {
    case Transport::kInProcess:
      return "inproc";
    case Transport::kTcp:
      return "tcp";
    case Transport::kAuto:
      return "auto";
    case Transport::kTcpInPieces:
      return "tcp_in_pieces";
  }
  return "?";
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
    if (transport == Transport::kTcpInPieces) {
      store = std::make_shared<RelayingStore>(store, /*seed=*/size);
    }
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
              transport == Transport::kAuto ? Implementation::kAuto : Implementation::kRing;
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
