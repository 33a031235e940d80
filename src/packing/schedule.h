// How packing::AllReduce / Broadcast walk their buckets (private: the public calls choose
// automatically; tests run each schedule explicitly).
//
//   kOverlapped  bucket k+1 is packed and issued (async) while bucket k is on the wire, and
//                bucket k is unpacked while k+1 is on the wire: at most two buckets in flight,
//                two fusion buffers. Needs a free core for the communicator's progress thread
//                while the caller packs.
//   kSerial      pack k, blocking collective on k (which may run on the caller's thread, no
//                hand-off), unpack k; one fusion buffer.
//   kAuto        kOverlapped when this host has at least two cores per local rank, else kSerial
//                (see AutoSchedule in packing.cc for the measurement behind it).
//
// Thread-safety: as packing.h.
#ifndef COLLECTIVES_SRC_PACKING_SCHEDULE_H_
#define COLLECTIVES_SRC_PACKING_SCHEDULE_H_

#include <cstddef>
#include <vector>

#include "collectives/communication.h"
#include "collectives/packing.h"
#include "collectives/types.h"

namespace collectives::packing::internal {

enum class Schedule { kAuto, kOverlapped, kSerial };

// What kAuto picks on this host for a communicator of `world_size` ranks: kOverlapped when
// there are two cores for each of this host's ranks (core::CoresFor(core::LocalRanks(...), 2)),
// else kSerial.
Schedule AutoSchedule(int world_size);

// packing::AllReduce / Broadcast with a given schedule.
void AllReduce(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, ReduceOp op,
               size_t bytes_per_pack, Schedule schedule);
void Broadcast(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, int root,
               size_t bytes_per_pack, Schedule schedule);

// packing::AllReduce whose collectives reduce with `op` and are checked against the other ranks
// as `checked_as` (core::CallOptions::checked_as): for the strategy layer, whose kAvg crosses
// workers as a kSum it divides itself, so that a worker that sums where another averages is a
// mismatch.
void AllReduce(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, ReduceOp op,
               ReduceOp checked_as, size_t bytes_per_pack);

}  // namespace collectives::packing::internal

#endif  // COLLECTIVES_SRC_PACKING_SCHEDULE_H_
