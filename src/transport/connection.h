// The transport interface the algorithms see: a Fabric of point-to-point Connections, one per
// peer, that move frames. Algorithms never see sockets; TCP (tcp_fabric.h) and an in-process
// transport for tests (inproc_fabric.h) implement it.
//
// A frame is a header (frame.h) and a payload. Every frame carries the CallTag of the
// collective it belongs to; a receiver names the tag and the exact payload size it expects, and
// a frame that carries anything else is a mismatch (Error kMismatch, naming both calls) -- never
// a silent copy. Sends and receives on one connection complete in the order they were posted.
//
// Errors: Wait* throw collectives::Error (kPeerLost, kMismatch, kTimeout, kAborted, kSystem)
// naming this rank and the peer. After the first error the fabric is broken: every later Post*
// or Wait* throws the same error.
//
// Thread-safety: a Fabric and its Connections are used by one thread at a time (the one
// running the communicator's call); only Abort() may be called from any thread.
#ifndef COLLECTIVES_SRC_TRANSPORT_CONNECTION_H_
#define COLLECTIVES_SRC_TRANSPORT_CONNECTION_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "collectives/errors.h"
#include "src/core/call.h"
#include "src/core/runs.h"

namespace collectives::transport {

using Clock = std::chrono::steady_clock;

class Connection {
 public:
  virtual ~Connection() = default;

  // The peer's rank.
  virtual int peer() const = 0;

  // Queues one frame of `bytes` payload (0 allowed) tagged `tag`. `data` is borrowed until the
  // send completes. Returns a ticket: 1 for the first send on this connection, then 2, 3, ...
  virtual uint64_t PostSend(const core::CallTag& tag, const void* data, size_t bytes) = 0;

  // Posts a receive of the next frame, which must carry `tag` and exactly `bytes` of payload,
  // written straight into `data` (borrowed until the receive completes). Returns a ticket
  // numbered like PostSend's, independently.
  virtual uint64_t PostRecv(const core::CallTag& tag, void* data, size_t bytes) = 0;

  // The same with the message bytes [offset, offset + bytes) of `runs`: one frame, whose payload
  // is gathered from the runs (scattered into them), the same frame on the wire as from (into)
  // one buffer, so either end may use either form. `runs` is borrowed until the operation
  // completes; offset + bytes <= runs.bytes().
  virtual uint64_t PostSend(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                            size_t bytes) = 0;
  virtual uint64_t PostRecv(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                            size_t bytes) = 0;

  // Block until the send / receive with this ticket (and all before it) completed, making
  // progress on every connection of the fabric meanwhile. Throw on error or past the deadline.
  virtual void WaitSend(uint64_t ticket) = 0;
  virtual void WaitRecv(uint64_t ticket) = 0;

  // Whether the send / receive with this ticket already completed; makes progress without
  // blocking. Throws like Wait*.
  virtual bool TestSend(uint64_t ticket) = 0;
  virtual bool TestRecv(uint64_t ticket) = 0;
};

class Fabric {
 public:
  virtual ~Fabric() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // The connection to `peer` (peer != rank()).
  virtual Connection& connection(int peer) = 0;

  // Every Wait* from now on throws Error(kTimeout) once `deadline` passes, naming the peer and
  // the tag of the frame it waited for ("#17 all_reduce(f32, sum, count=1000)"). Set by the
  // communicator when a collective starts, before SetCall.
  virtual void SetDeadline(Clock::time_point deadline) = 0;

  // The call now running, set by the communicator with its deadline: a frame of this call's
  // number that names another call (another collective, count, dtype, op or root) breaks the
  // fabric with Error(kMismatch) once its header is read (while this rank drives the fabric),
  // whether or not a receive is posted on its connection (a peer that runs another call may
  // send where this rank never posts one); a header read before is checked here, and SetCall
  // throws that error. Frames of other numbers are left to the receives that name them. A
  // fabric may ignore it.
  virtual void SetCall(const core::CallTag& call) { (void)call; }

  // How long a Wait* polls before it sleeps in the kernel (`spin`; 0: never polls), and how
  // long after that it goes on polling with a sched_yield between polls (`yield`; 0: none).
  virtual void SetSpin(std::chrono::microseconds spin, std::chrono::microseconds yield) = 0;

  // Breaks the fabric with `error`: tells every peer (best effort: an abort frame carrying the
  // code and message, then closing the connections), and makes every pending and later call
  // throw `error`. Safe from any thread; the first error wins. While another thread is driving
  // the fabric, telling the peers is left to that thread's next wait, and Abort returns once it
  // has (within about a second); if its call was returning and it drives no more, the owner
  // calls Abort again once that call ended (RingCommunication::Execute does).
  virtual void Abort(const Error& error) = 0;

  // Drives the fabric for up to `wait`, with no call running, and returns its error if it is
  // broken by then (an abort frame came in), else nullopt. A set-up step that fails on the
  // store asks it: a peer that raised an error and exited may have taken the store down with it,
  // and its abort frame, which names the rank at fault, is the error to raise. A fabric may
  // return nullopt at once.
  virtual std::optional<Error> ErrorWithin(Clock::duration wait) {
    (void)wait;
    return std::nullopt;
  }
};

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_CONNECTION_H_
