// The RING implementation's algorithms. Each one runs one collective to completion on the
// calling thread (the communicator's progress thread), moving frames through the transport's
// Connection interface; none of them knows about sockets.
//
// Memory: besides the caller's buffers, an algorithm uses only the Context's staging area,
// which holds at most kStagingSlots chunks (plus one small-message buffer). No algorithm ever
// copies a whole tensor.
//
// Thread-safety: a Context is used by one thread.
#ifndef COLLECTIVES_SRC_RING_ALGORITHMS_H_
#define COLLECTIVES_SRC_RING_ALGORITHMS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "collectives/types.h"
#include "src/core/call.h"
#include "src/transport/connection.h"

namespace collectives::ring {

// Receives that may be posted ahead of the one being waited on, and thus the number of
// chunk-sized staging slots.
inline constexpr size_t kStagingSlots = 4;

// A growable scratch buffer owned by the communicator and reused by every call.
class Staging {
 public:
  // A buffer of at least `bytes`; the contents are unspecified.
  uint8_t* Get(size_t bytes);
  size_t capacity() const { return bytes_; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t bytes_ = 0;
};

// What an algorithm works with: the fabric, the call being run, and the chunking.
struct Context {
  transport::Fabric& fabric;
  core::CallTag tag;
  // Largest payload of one pipelined frame.
  size_t chunk_bytes;
  Staging& staging;
  // When the call must be done (the fabric throws past it; other transports check it too).
  transport::Clock::time_point deadline = transport::Clock::time_point::max();

  int rank() const { return fabric.rank(); }
  int size() const { return fabric.size(); }
  transport::Connection& peer(int r) { return fabric.connection(r); }
  transport::Connection& right() { return peer((rank() + 1) % size()); }
  transport::Connection& left() { return peer((rank() + size() - 1) % size()); }
};

// recv = op over ranks of send (count elements each). Reduce-scatter then all-gather around the
// ring; see the prose in algorithms.cc.
void RingAllReduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                   ReduceOp op);

// The same result in ceil(log2 p) + 2 exchanges of the whole message (recursive doubling, with
// a fold for non-powers of two): for small messages, where latency dominates.
void RecursiveDoublingAllReduce(Context& ctx, const void* send, void* recv, size_t count,
                                DataType dtype, ReduceOp op);

// The same result in 2 log2(p) steps that move as many bytes as the ring's 2(p-1): reduce-scatter
// by recursive halving, then all-gather by recursive doubling (Rabenseifner). Fewer steps than
// the ring pays at medium sizes, where each step's latency still counts. Needs a power-of-two
// world size.
void HalvingDoublingAllReduce(Context& ctx, const void* send, void* recv, size_t count,
                              DataType dtype, ReduceOp op);

// recv (count elements) = block `rank` of op over ranks of send (size * count elements).
void RingReduceScatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                       ReduceOp op);

// recv (size * count elements) = the ranks' send blocks (count elements each) in rank order.
void RingAllGather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype);

// recv = root's send (bytes each), pipelined in chunks along the chain root, root+1, ...
void ChainBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root);

// The same along a binomial tree, whole message per hop: for small messages.
void TreeBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root);

// Returns once every rank has entered (recursive doubling of empty frames).
void Barrier(Context& ctx);

// Every rank sends an empty frame carrying the call's tag to every other and receives theirs:
// every rank compares its call with every other's directly, so a mismatch raises on every rank
// before an algorithm that writes the caller's buffer early (the ring, halving-doubling, the
// broadcasts, all-gather, reduce-scatter) has written anything. One round of empty frames,
// completed before the algorithm sends anything: a rank that aborts on a mismatch then has no
// data of ours unread, which would make its kernel reset the connection and drop its abort
// frame (overlapping the round with the first chunks gave peer-lost instead of mismatch).
// COLLECTIVES_UNSAFE_SKIP_CALL_CHECK=1 (a measurement switch) turns it off.
void AgreeOnCall(Context& ctx);

}  // namespace collectives::ring

#endif  // COLLECTIVES_SRC_RING_ALGORITHMS_H_
