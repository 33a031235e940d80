// The packer: fuses many small tensors into a few buckets so that a model with hundreds of small
// gradients costs a few large collectives instead of hundreds of small ones.
//
// Planning is a pure function (tensor descriptions and a byte cap -> buckets of indices), apart
// from the copying: a bucket holds tensors of one dtype and one device, in the order given, and
// at most `bytes_per_pack` bytes; a tensor larger than the cap is alone in its bucket.
//
// Thread-safety: PlanBuckets is pure. AllReduce / Broadcast of a list call the communicator from
// the calling thread and, like any collective, must be issued in the same order on every rank
// with the same list of (dtype, device, count) and the same bytes_per_pack. A list or a cap that
// differs is caught before anything moves (one 32-byte all-reduce of a hash of the list and of
// its buckets comes first in every call, even one that moves nothing; every rank then raises
// kMismatch, nothing written).
#ifndef COLLECTIVES_PACKING_H_
#define COLLECTIVES_PACKING_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "collectives/communication.h"
#include "collectives/types.h"

namespace collectives::packing {

// The byte cap PlanBuckets uses when bytes_per_pack is 0: 1 MiB. See the README for the
// measurement behind it.
size_t DefaultBytesPerPack();

// The byte cap AllReduce, Broadcast and their async forms use on `comm` when bytes_per_pack is
// 0: DefaultBytesPerPack(), on every communicator. (It was 256 KiB where comm's all-reduces run
// in shared memory while fused buckets were copied there; they go in pieces now, and 1 MiB is
// the faster cap there too. See the README for the measurements.)
size_t DefaultBytesPerPack(const CollectiveCommunication& comm);

// What the planner needs to know of a tensor.
struct TensorSpec {
  DataType dtype = DataType::kFloat32;
  Device device = Device::Cpu();
  size_t count = 0;
};

// One bucket: indices into the planned list, in increasing order.
using Bucket = std::vector<size_t>;

// Splits `tensors` into buckets: consecutive tensors of one (dtype, device) are added to the
// open bucket of that (dtype, device) while it stays within `bytes_per_pack` (0: the default);
// a tensor that does not fit closes it and opens the next. A tensor larger than the cap gets a
// bucket of its own. Zero-size tensors join the open bucket of their kind. Buckets are returned
// in the order of their first tensor. Every index appears in exactly one bucket. Throws
// Error(kInvalidArgument) for a dtype that is not a DataType.
std::vector<Bucket> PlanBuckets(const std::vector<TensorSpec>& tensors, size_t bytes_per_pack);

// All-reduces every tensor of `tensors` in place, through buckets (tensors that share memory are
// refused, Error(kInvalidArgument): each would be reduced once per bucket it sits in): each bucket
// is packed into a fusion buffer, all-reduced in one collective, and unpacked; with RING and AUTO
// (on one host and across hosts), a bucket is all-reduced as one message straight from its
// tensors instead (no fusion buffer, and the bits of the packed bucket). With at least two
// cores per local rank, bucket k+1 is packed while bucket k is on the wire (at most two buckets in
// flight, two fusion buffers of at most bytes_per_pack each; the calling thread keeps them for its
// later calls, up to 64 MiB each); on fewer cores the buckets run one after another, which measured
// faster there. A tensor alone in its bucket is all-reduced in place without a copy. CPU tensors
// only for now (others: kNotSupported). The result is that of one AllReduce per tensor, bit for
// bit whenever the reduction is exact (integers; float min and max up to the sign of a zero
// compared with a zero, and which NaN comes back); for float sums the order of additions
// depends on the algorithm, which is chosen by message size, so the last bits may differ (every
// rank still gets the same bits). Throws what the collectives throw. An allocation that fails
// once the call has begun issuing aborts `comm` with the error thrown (kSystem, "... out of
// memory while issuing the call's 3 collectives ..."), which the other ranks then receive.
void AllReduce(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, ReduceOp op,
               size_t bytes_per_pack = 0);

// Broadcasts every tensor of `tensors` in place from `root`, through buckets as above (the
// strategy layer uses it to make initial weights identical on every rank).
void Broadcast(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, int root,
               size_t bytes_per_pack = 0);

// AllReduce and Broadcast of a list that return at once, for overlapping the gradients' reduction
// with other work (as Horovod's and DDP's buckets do). Every collective of the call is issued
// before it returns, in order, from the calling thread (so the calls made after it on `comm`
// follow them on every rank): the list check, then each bucket, fused buckets packed first into
// a buffer of the call's own. That buffer holds a copy of every fused tensor (not of a tensor
// alone in its bucket, which goes in place) until the call finishes. Wait (or a Done that
// returns true) finishes the call: it unpacks the fused buckets and gives the buffer back to a
// process-wide pool for later calls (at most two buffers of at most 64 MiB each are kept).
// Until then the tensors must be neither read nor written. Results and argument checks are
// AllReduce's and Broadcast's; argument errors are thrown here, the collectives' errors by Wait.
// Lists that differ across ranks raise kMismatch in Wait on every rank. With RING and AUTO every
// bucket runs only once the list check, queued first, has found the lists alike (on every rank
// alike), so nothing is written; with NCCL and other communicators no fused tensor is written, but
// a tensor alone in its bucket was issued before the check's answer came, and holds what its
// collective left. With RING and AUTO a bucket that does not run takes no call number, so the
// communicator works on after lists or caps that cut into different numbers of buckets; with
// other communicators the ranks are left at different call numbers, and the next call raises
// kMismatch. A Work dropped unfinished waits in
// its destructor for the collectives still in flight (they write its buffer). An allocation that
// fails once part of the call is issued aborts `comm` with the error thrown here (kSystem,
// "... out of memory after 1 of the call's 3 collectives were queued ..."), which the other
// ranks then receive, rather than leave them waiting for the rest.
std::shared_ptr<Work> AllReduceAsync(CollectiveCommunication& comm,
                                     const std::vector<Tensor>& tensors, ReduceOp op,
                                     size_t bytes_per_pack = 0);
std::shared_ptr<Work> BroadcastAsync(CollectiveCommunication& comm,
                                     const std::vector<Tensor>& tensors, int root,
                                     size_t bytes_per_pack = 0);

}  // namespace collectives::packing

#endif  // COLLECTIVES_PACKING_H_
