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

// The byte cap PlanBuckets uses when bytes_per_pack is 0: 1 MiB, the fastest cap both for lists
// of small tensors and for lists of large ones (see docs/tuning.md).
size_t DefaultBytesPerPack();

// The byte cap AllReduce, Broadcast and their async forms use on `comm` when bytes_per_pack is
// 0: DefaultBytesPerPack(), whatever the implementation, shared memory included (see
// docs/tuning.md).
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

// All-reduces every tensor of `tensors` in place, through buckets. The result is that of one
// AllReduce per tensor: bit for bit where the reduction is exact (integers; float min and max up
// to the sign of a zero and which NaN comes back); a float sum's last bits follow the algorithm,
// which the message size picks, and are the same on every rank.
// A tensor alone in its bucket goes in place. A fused bucket goes as one message straight from
// its tensors with RING and AUTO, and through a fusion buffer (packed, reduced, unpacked)
// elsewhere. With two cores per local rank bucket k+1 is packed while bucket k is on the wire (at
// most two in flight; the calling thread keeps its two fusion buffers, up to 64 MiB each); with
// fewer, buckets run one after another, the faster schedule there (see docs/tuning.md).
// CPU tensors, and CUDA tensors on RING and AUTO (each bucket staged through pinned host memory
// in segments, as the collectives stage them); a CUDA tensor elsewhere: kNotSupported. Tensors
// that share memory: kInvalidArgument (each would be reduced once per bucket it sits in). Throws
// what the collectives throw; an allocation that fails once the call has begun issuing aborts
// `comm` with that error (kSystem), which the other ranks then receive.
void AllReduce(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, ReduceOp op,
               size_t bytes_per_pack = 0);

// Broadcasts every tensor of `tensors` in place from `root`, through buckets as above (the
// strategy layer uses it to make initial weights identical on every rank).
void Broadcast(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, int root,
               size_t bytes_per_pack = 0);

// AllReduce and Broadcast of a list that return at once, for overlapping the reduction with other
// work (as Horovod's and DDP's buckets do). Every collective of the call is issued, in order, from
// the calling thread before it returns: the list check, then each bucket; calls made after it on
// `comm` follow them on every rank. The tensors must be neither read nor written until Wait (or a
// Done that returns true) finishes the call. Results and argument checks are AllReduce's and
// Broadcast's; argument errors are thrown here, the collectives' errors by Wait. A Work dropped
// unfinished waits in its destructor for the collectives still in flight.
// Lists that differ across ranks raise kMismatch in Wait on every rank. With RING and AUTO every
// bucket goes straight from its tensors and is gated: it runs only if the list check, queued
// first, found the lists alike, so nothing is written, and a bucket that does not run takes no
// call number, so `comm` works on. Elsewhere (NCCL) buckets are not gated: fused buckets go
// through a buffer of the call's own (from a process-wide pool of at most two 64 MiB buffers) that
// Wait unpacks only if the lists agree, a tensor alone in its bucket holds what its collective
// left, and ranks whose lists cut into different numbers of buckets raise kMismatch on the next
// call. An allocation that fails once part of the call is issued aborts `comm` with that error
// (kSystem), which the other ranks then receive rather than wait for the rest.
std::shared_ptr<Work> AllReduceAsync(CollectiveCommunication& comm,
                                     const std::vector<Tensor>& tensors, ReduceOp op,
                                     size_t bytes_per_pack = 0);
std::shared_ptr<Work> BroadcastAsync(CollectiveCommunication& comm,
                                     const std::vector<Tensor>& tensors, int root,
                                     size_t bytes_per_pack = 0);

}  // namespace collectives::packing

#endif  // COLLECTIVES_PACKING_H_
