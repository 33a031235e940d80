// The RING implementation's algorithms. Each one runs one collective to completion on the
// calling thread (the one that holds the communicator's fabric), moving frames through the
// transport's Connection interface; none of them knows about sockets.
//
// Memory: besides the caller's buffers, an algorithm uses only the Context's staging area,
// which holds at most kStagingSlots chunks, plus, for the two algorithms meant for bounded sizes,
// their partial results: recursive doubling two copies of the (small) message, halving-doubling
// half of the (medium) message, and the small forms built on recursive doubling one copy more
// of their (small) result. The ring algorithms and the chain reduce never hold more than the
// chunks; gather, scatter, all-to-all and point-to-point messages move frames straight between
// the callers' buffers (the all-to-all's count round holds 2 x size^2 counts).
//
// Thread-safety: a Context is used by one thread.
#ifndef COLLECTIVES_SRC_RING_ALGORITHMS_H_
#define COLLECTIVES_SRC_RING_ALGORITHMS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "collectives/types.h"
#include "src/core/aligned_bytes.h"
#include "src/core/call.h"
#include "src/core/runs.h"
#include "src/transport/connection.h"

namespace collectives::ring {

// The peers `rank` connects to when its communicator is set up, in a world of `size`: its ring
// neighbours and its partners in recursive doubling, halving-doubling and the binomial tree
// rooted at rank 0 (rank ^ 2^k, and the virtual ranks' partners of a world that is not a power
// of two): at most 2 ceil(log2 size) + 3, and symmetric (a lists b iff b lists a). Every other
// connection (all-to-all, gather and scatter, other roots, messages) is made at its first use.
std::vector<int> PeersAtSetUp(int rank, int size);

// Receives that may be posted ahead of the one being waited on, and thus the number of
// chunk-sized staging slots.
inline constexpr size_t kStagingSlots = 4;

// A growable scratch buffer owned by the communicator and reused by every call.
class Staging {
 public:
  // A buffer of at least `bytes`, 64-byte aligned; the contents are unspecified.
  uint8_t* Get(size_t bytes);
  size_t capacity() const { return bytes_; }

 private:
  core::AlignedBytes data_;
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
// The same in place on a message in runs (the packer's bucket: its tensors, no fusion buffer),
// the same frames on the wire and the same bits: frames are gathered from the runs and scattered
// into them, and the reductions run over the spans the runs and the staging have in common.
void RingAllReduce(Context& ctx, const core::Runs& message, size_t count, DataType dtype,
                   ReduceOp op);

// The same result in ceil(log2 p) + 2 exchanges of the whole message (recursive doubling, with
// a fold for non-powers of two): for small messages, where latency dominates. Its partial
// results use 2 x the message bytes of `scratch`, or of ctx.staging when null.
void RecursiveDoublingAllReduce(Context& ctx, const void* send, void* recv, size_t count,
                                DataType dtype, ReduceOp op, uint8_t* scratch = nullptr);

// The same result in 2 log2(p) steps that move as many bytes as the ring's 2(p-1): reduce-scatter
// by recursive halving, then all-gather by recursive doubling (Rabenseifner). Fewer steps than
// the ring pays at medium sizes, where each step's latency still counts. Needs a power-of-two
// world size.
void HalvingDoublingAllReduce(Context& ctx, const void* send, void* recv, size_t count,
                              DataType dtype, ReduceOp op);
// In place on a message in runs, as RingAllReduce above.
void HalvingDoublingAllReduce(Context& ctx, const core::Runs& message, size_t count, DataType dtype,
                              ReduceOp op);

// recv (count elements) = block `rank` of op over ranks of send (size * count elements).
void RingReduceScatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                       ReduceOp op);

// Every rank sends an empty frame carrying the call's tag to every other and receives theirs, so
// every rank compares its call with every other's directly (with two ranks a data frame may stand
// in for one, see Pair). For the algorithms that write the caller's buffer before a frame checked
// through every rank has reached them (all-gather and the broadcasts; the all-reduces and
// reduce-scatter need none, see algorithms.cc): the constructor posts the round and the algorithm
// goes on sending from the caller's read-only `send`; Wait() returns once every peer's call matched
// (it throws kMismatch otherwise), and the algorithm calls it before its first write into `recv`.
// The peers' data queues behind their empty frames meanwhile, so the round costs about one hop that
// overlaps the first transfer.
// A rank that aborts on a mismatch may then hold our data unread; the TCP fabric's shutdown
// drains it so that its abort frame is not lost to a connection reset.
// COLLECTIVES_UNSAFE_SKIP_CALL_CHECK=1 (a measurement switch) turns the round off.
class CallAgreement {
 public:
  // With two ranks, a data frame that the algorithm sends first on the one connection carries
  // the same call descriptor as the empty frame would, and the receiver checks it before it
  // writes anything: it stands in for the empty frame in that direction. kDataOut: this rank's
  // first frame to the peer is data (a broadcast's root); kDataIn: the peer's first frame to this
  // rank is data and this rank writes nothing into recv before it has it (a broadcast's
  // receiver); kDataBothWays: both (all-gather). The choice depends only on what the call
  // descriptor holds (kind, root), so ranks whose calls match choose consistently, and ranks
  // whose calls differ find a frame of the other call where they expect theirs.
  enum class Pair { kEmptyFrames, kDataOut, kDataIn, kDataBothWays };
  explicit CallAgreement(Context& ctx, Pair pair = Pair::kEmptyFrames);
  CallAgreement(const CallAgreement&) = delete;
  CallAgreement& operator=(const CallAgreement&) = delete;
  // Idempotent.
  void Wait();

 private:
  std::vector<std::pair<transport::Connection*, uint64_t>> receives_;
  std::vector<std::pair<transport::Connection*, uint64_t>> sends_;
  bool done_ = false;
};

// recv (size * count elements) = the ranks' send blocks (count elements each) in rank order.
// With `agreement`, its Wait() comes before the first write into recv.
void RingAllGather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                   CallAgreement* agreement = nullptr);

// recv = root's send (bytes each), pipelined in chunks along the chain root, root+1, ...
// `agreement` as for RingAllGather.
void ChainBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root,
                    CallAgreement* agreement = nullptr);
// In place on a message in runs (the root's runs hold it), as RingAllReduce above.
void ChainBroadcast(Context& ctx, const core::Runs& message, int root,
                    CallAgreement* agreement = nullptr);

// The same along a binomial tree, whole message per hop: for small messages.
void TreeBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root,
                   CallAgreement* agreement = nullptr);

// Broadcast and all-gather of small messages, where the agreement round above would cost as
// much as the transfer: each rank contributes a vector of the result's size holding what it
// owns (the root its message; a rank its block) and zeros elsewhere, and a recursive-doubling
// all-reduce of those bytes with max (max(b, 0) = b for unsigned bytes) leaves exactly the
// result on every rank. It inherits that all-reduce's safety: no round, and a mismatched call
// writes nothing. ceil(log2 p) (+ 2) exchanges of the whole result.
void SmallBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root);
void SmallAllGather(Context& ctx, const void* send, void* recv, size_t block_bytes);

// Reduce-scatter of a small `send`: the recursive-doubling all-reduce of all of it into a
// scratch vector, of which rank r keeps block r. Its n - 1 unneeded blocks cost little where
// latency dominates (ceil(log2 p) exchanges instead of the ring's p - 1 steps), and recv is
// written only once the all-reduce has succeeded.
void SmallReduceScatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                        ReduceOp op);

// Returns once every rank has entered (recursive doubling of empty frames).
void Barrier(Context& ctx);

// The rooted collectives. Off the root, `recv` of a reduce or gather and `send` of a scatter
// are neither read nor written (they may be null). Each has a small form for latency-bound
// sizes, which inherits the recursive-doubling all-reduce's safety (a mismatched call writes
// nothing, with no agreement round), and a large one that takes an `agreement` (constructed by
// the caller, kEmptyFrames): the root waits for it before its first write into recv, every other
// rank before it returns, so that every rank learns of a mismatch.

// recv on `root` = op over ranks of send (count elements). Chain: partial results flow from rank
// root-1 down through root-2, ..., root+1 to the root; root-1 sends its chunks, each rank between
// reduces every chunk it receives with its own (in a staging slot) and passes it on, and the root
// reduces the last hop into recv. Every link carries the message once, pipelined in chunks.
void ChainReduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                 ReduceOp op, int root, CallAgreement& agreement);
// The same through a recursive-doubling all-reduce into staging (the root into recv).
void SmallReduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                 ReduceOp op, int root);

// recv on `root` (size * block_bytes) = the ranks' send blocks in rank order. Direct: each rank
// sends its block to the root in frames of at most chunk_bytes, and the root receives every
// block straight into its place.
void DirectGather(Context& ctx, const void* send, void* recv, size_t block_bytes, int root,
                  CallAgreement& agreement);
// The same through SmallAllGather (into staging off the root).
void SmallGather(Context& ctx, const void* send, void* recv, size_t block_bytes, int root);

// recv (block_bytes) = block `rank` of root's send (size * block_bytes). Direct: the root sends
// each block to its rank in frames of at most chunk_bytes.
void DirectScatter(Context& ctx, const void* send, void* recv, size_t block_bytes, int root,
                   CallAgreement& agreement);
// The same through SmallBroadcast of the root's whole send into staging.
void SmallScatter(Context& ctx, const void* send, void* recv, size_t block_bytes, int root);

// Block j of recv (recv_counts[j] elements) = block `rank` of rank j's send (send_counts holds
// this rank's: send_counts[j] elements go to rank j). First a round in which every rank sends
// both its count vectors to every other, so that every rank checks every pair of the whole
// matrix (rank i's send_counts[j] == rank j's recv_counts[i]) before anything moves: a
// disagreement anywhere raises kMismatch on every rank, naming the pair, and writes nothing.
// The round stands in for a CallAgreement (its frames carry the call's tag). Then pairwise
// exchange: the block for rank + k and the one from rank - k, for k = 1 .. size - 1, in frames
// of at most chunk_bytes straight from send into recv, all posted at once.
void PairwiseAllToAll(Context& ctx, const void* send, void* recv, DataType dtype,
                      const std::vector<size_t>& send_counts,
                      const std::vector<size_t>& recv_counts);

// Point to point: message number `number` (the count of earlier messages from this rank to
// `peer`; kPointToPointSeqBit is added) of `count` elements of `dtype` to / from `peer`, in frames
// of at most chunk_bytes, each carrying {kSend, dtype, count, tag} (PointToPointDescriptor).
// The receiver's transport checks each frame against its own receive before writing any of it:
// another dtype, count or tag is Error(kMismatch) naming both; a tag outside (INT32_MIN,
// INT32_MAX] travels in a first frame of 8 bytes, which the receiver compares
// (kMismatch, naming both tags) before it posts a receive into `data`. The send returns once its
// frames have left (into the socket), not once they have been received.
void SendMessage(Context& ctx, int peer, uint64_t number, const void* data, size_t count,
                 DataType dtype, int64_t tag);
void RecvMessage(Context& ctx, int peer, uint64_t number, void* data, size_t count, DataType dtype,
                 int64_t tag);
// The same for frames [first, last) of such a message only, `data` holding their bytes (from
// frame first's offset, MessageFrameOffset): a message staged through a smaller buffer goes in
// runs of whole frames, and the peer sees the frames of one SendMessage / RecvMessage. The tag's
// frame goes with frame 0.
void SendMessageFrames(Context& ctx, int peer, uint64_t number, const void* data, size_t count,
                       DataType dtype, int64_t tag, size_t first, size_t last);
void RecvMessageFrames(Context& ctx, int peer, uint64_t number, void* data, size_t count,
                       DataType dtype, int64_t tag, size_t first, size_t last);
// The frames of a message of `bytes` bytes with frames of at most `chunk_bytes`, and the offset
// of frame f (f == frames: `bytes`).
size_t MessageFrames(size_t chunk_bytes, size_t bytes);
size_t MessageFrameOffset(size_t chunk_bytes, size_t bytes, size_t f);
// The descriptor of a point-to-point message (core::CallDescriptor says how the tag is held).
core::CallDescriptor PointToPointDescriptor(DataType dtype, size_t count, int64_t tag);

}  // namespace collectives::ring

#endif  // COLLECTIVES_SRC_RING_ALGORITHMS_H_
