// Helpers for transport tests: build the fabrics of a group (in-process, or TCP with every rank
// a thread and an in-memory store), run one body per rank on its own thread, and collect what
// each rank threw.
#ifndef COLLECTIVES_TESTS_TRANSPORT_FABRIC_TEST_UTIL_H_
#define COLLECTIVES_TESTS_TRANSPORT_FABRIC_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/core/call.h"
#include "src/transport/connection.h"
#include "src/transport/inproc_fabric.h"
#include "src/transport/tcp_fabric.h"
#include "tests/transport/piece_relay.h"

namespace collectives::transport::testing {

// kTcpInPieces: TCP with every connection through a PieceRelay (piece_relay.h), so that every
// header, payload and handshake message may arrive split at any byte.
enum class Kind { kInProcess, kTcp, kTcpInPieces };

inline const char* KindName(Kind kind) {
  return kind == Kind::kTcp ? "tcp" : kind == Kind::kTcpInPieces ? "tcp_in_pieces" : "inproc";
}

// Connects `size` TCP ranks, each on its own thread, through `store`. Rank r's options are
// `options(r)`. Returns the fabrics, or what each rank threw.
struct TcpGroup {
  std::vector<std::unique_ptr<Fabric>> fabrics;
  std::vector<std::optional<Error>> errors;
};

inline TcpGroup ConnectTcpGroup(int size, Store& store,
                                const std::function<TcpFabricOptions(int)>& options) {
  TcpGroup group;
  group.fabrics.resize(size);
  group.errors.resize(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        group.fabrics[rank] = ConnectTcpFabric(rank, size, store, options(rank));
      } catch (const Error& error) {
        group.errors[rank] = error;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return group;
}

// The fabrics of a group of `size`. Over TCP, *store receives the store they were built through,
// which must outlive them (with kTcpInPieces it owns the relays).
inline std::vector<std::unique_ptr<Fabric>> MakeFabrics(Kind kind, int size,
                                                        std::shared_ptr<Store>* store) {
  if (kind == Kind::kInProcess) return CreateInProcessFabrics(size);
  *store = CreateMemoryStore();
  if (kind == Kind::kTcpInPieces) {
    *store = std::make_shared<collectives::testing::RelayingStore>(*store, /*seed=*/size);
  }
  auto group = ConnectTcpGroup(size, **store, [](int) {
    TcpFabricOptions options;
    options.timeout = std::chrono::milliseconds(20'000);
    return options;
  });
  for (int rank = 0; rank < size; ++rank) {
    if (group.errors[rank]) ADD_FAILURE() << group.errors[rank]->what();
  }
  return std::move(group.fabrics);
}

// Runs body(rank) on one thread per rank; returns what each threw (nullopt: returned).
inline std::vector<std::optional<Error>> RunRanks(int size, const std::function<void(int)>& body) {
  std::vector<std::optional<Error>> errors(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const Error& error) {
        errors[rank] = error;
      } catch (const std::exception& error) {
        errors[rank] = Error(ErrorCode::kInternal, std::string("test body threw: ") + error.what());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return errors;
}

inline core::CallTag Tag(uint64_t seq, uint64_t count,
                         core::CollectiveKind kind = core::CollectiveKind::kAllReduce) {
  core::CallTag tag;
  tag.seq = seq;
  tag.call.kind = kind;
  tag.call.dtype = DataType::kFloat32;
  tag.call.op = ReduceOp::kSum;
  tag.call.count = count;
  return tag;
}

// Deterministic bytes for frame `index` from `from` to `to`.
inline std::vector<uint8_t> Pattern(int from, int to, size_t index, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  uint32_t x = static_cast<uint32_t>(from * 7919 + to * 104729 + index * 131 + 17);
  for (size_t i = 0; i < bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<uint8_t>(x >> 24);
  }
  return out;
}

}  // namespace collectives::transport::testing

#endif  // COLLECTIVES_TESTS_TRANSPORT_FABRIC_TEST_UTIL_H_
