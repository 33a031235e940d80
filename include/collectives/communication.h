// The CollectiveCommunication interface, its options and its factory.
//
// Semantics follow NCCL and MPI:
//  - Every rank issues the same sequence of collectives with the same dtype, op, count and root.
//    The library checks this: a difference raises Error(kMismatch) on the ranks that see it.
//  - Calls run in the order they were issued, one at a time, on the communicator's progress
//    thread (RING and AUTO run a blocking call on the caller's when nothing is queued or
//    running), and their Works complete in that order. The async forms return at once with a Work
//    handle (NCCL's once the call is on its CUDA stream, which for the first can wait until every
//    rank has issued its own: see src/nccl/nccl_communication.h); the blocking forms are the async
//    ones waited on.
//  - Buffers are borrowed: the caller keeps them alive and untouched until the Work completes.
//  - In-place: AllReduce and Broadcast are in place when send.data == recv.data. AllGather is in
//    place when send.data == recv.data + rank * count elements; ReduceScatter when
//    recv.data == send.data + rank * count elements. Send and recv that overlap otherwise are
//    refused with Error(kInvalidArgument).
//  - The first failure (peer lost, mismatch, timeout) breaks the communicator: that call and
//    every later one raise the same Error until a new communicator is built.
//
// Thread-safety: a communicator may be called from any thread, but calls from different
// threads are ordered by the time they enter the library; every rank must issue the same order.
#ifndef COLLECTIVES_COMMUNICATION_H_
#define COLLECTIVES_COMMUNICATION_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "collectives/types.h"

namespace collectives {

// With kNccl, floating results can differ in the last bits from those of kRing and kAuto:
//  - kAvg of a floating type is NCCL's ncclAvg: each rank's input is multiplied by 1/n, itself
//    rounded to the element type, and the rounded products are summed. kRing and kAuto sum the
//    inputs and divide the sum once (a correctly rounded division).
//  - NCCL adds f16 and bf16 in the element type at each step. kRing and kAuto add them in f32
//    but round each step's result back to the element type, so neither carries more precision
//    from one step to the next; each implementation adds in the order of its own algorithm.
enum class Implementation {
  kRing,  // TCP between processes; ring algorithms, latency-optimal ones for small messages
  kNccl,  // NVIDIA NCCL on CUDA tensors (see above for kAvg)
  kAuto,  // chosen per call: shared memory inside a host, TCP across hosts (see CreateCommunication)
};
const char* ToString(Implementation impl);
Implementation ParseImplementation(const std::string& name);  // "ring", "nccl", "auto"

// implementation, chunk_bytes, small_message_bytes, medium_message_bytes and algorithm pick the
// algorithms and cut the frames: every rank must pass the same (0 counts as the default's value),
// else every rank's CreateCommunication raises Error(kInvalidArgument) naming the option. The
// others may differ from rank to rank.
struct CommunicationOptions {
  // Which implementation moves the data.
  // Default: kAuto.
  Implementation implementation = Implementation::kAuto;

  // Byte cap of one fusion bucket for MultiWorkerMirroredStrategy, whose all-reduces and
  // broadcasts between workers go through the packer. The communicator itself does not read it,
  // nor do packing::AllReduce and packing::Broadcast, which take their own bytes_per_pack argument.
  // The C API's coll_all_reduce_many has coll_options.bytes_per_pack for this. 0 picks
  // packing::DefaultBytesPerPack(comm), 1 MiB.
  // Default: 0.
  size_t bytes_per_pack = 0;

  // Longest a collective may take from the moment it starts running, and longest the
  // rendezvous and connection set-up may take, counted from this rank's call and for all of it
  // together (the store's rendezvous, the connections, AUTO's host records, shared memory and
  // calibration; a rank that comes early spends it waiting for the others). The TCP store keeps
  // it as its own limit per operation. A peer that is silent for longer raises
  // Error(kTimeout) naming it; RING and AUTO raise it once they have told the peers why, up to
  // about 200 ms after the deadline when a peer is not reading (busy outside the library).
  // Long enough for a 1 GiB all-reduce over a slow link. Must be positive (else
  // Error(kInvalidArgument)); anything above a year, milliseconds::max() for "never" included,
  // is read as a year.
  // Default: 300 s.
  std::chrono::milliseconds timeout{300'000};

  // Bytes per pipelined chunk of the ring algorithms: each ring step is cut into chunks of at
  // most this size so that sending, receiving and reducing overlap. Small values cost per-frame
  // overhead; large ones lose overlap and grow the staging area (4 chunks per communicator).
  // 0 picks the default (512 KiB): it keeps loopback TCP busy with 2 MiB of staging (see
  // docs/tuning.md).
  // At most 1 GiB (else Error(kInvalidArgument) when the communicator is built).
  // Default: 0.
  size_t chunk_bytes = 0;

  // All-reduces, broadcasts and all-gathers whose result, and reduce-scatters whose input, has
  // at most this many bytes use the latency-optimal algorithm (recursive doubling) rather than
  // the ring or the chain. 0 picks the default (64 KiB; see docs/tuning.md); SIZE_MAX forces it
  // always, 1 practically never.
  // Default: 0.
  size_t small_message_bytes = 0;

  // All-reduces larger than small_message_bytes and of at most this many bytes use
  // halving-doubling (Rabenseifner: 2 log2 p steps against the ring's 2(p-1), the same bytes)
  // when the world size is a power of two of at least 4; larger ones, and other world sizes,
  // use the ring. 0 picks the default (8 MiB: up to there it beats the ring on 4 ranks; see
  // docs/tuning.md); 1 never uses it; SIZE_MAX always does.
  // Default: 0.
  size_t medium_message_bytes = 0;

  // Forces the all-reduce algorithm, for measurements (NCCL_ALGO's role): "ring",
  // "recursive_doubling", "halving_doubling" (RING and AUTO), "shm" (AUTO with every rank on one
  // host), "two_level" (AUTO with several hosts, one of two ranks or more; every all-reduce then
  // runs in two levels, untimed). Under AUTO the first three also turn shared memory off: every
  // collective, not only the all-reduce, then runs over TCP as under RING. Empty: chosen per
  // call. An algorithm the communicator cannot run raises Error(kNotSupported) when it is built.
  // Default: "".
  std::string algorithm{};

  // How long a waiter polls before it sleeps, in microseconds. Polling cuts the latency of
  // small collectives (see docs/tuning.md) but steals a core a peer may need when there are
  // more polling threads than cores. -1 adapts: the thread driving the network polls when this
  // host has a core per rank of the job; the hand-off between a caller and the progress thread
  // (async calls) polls when it has two. At most 1,000,000.
  // Default: -1.
  int spin_us = -1;

  // After the spin above, how long a thread waiting for the network (TCP) keeps polling, with a
  // sched_yield between polls, before it sleeps, in microseconds. A sleeping waiter makes every
  // arriving segment a kernel wake-up (on a virtual machine, an interrupt to a halted core);
  // a yielding one is still runnable, and hands its core to any thread that has work, which
  // is what Open MPI does when cores are oversubscribed (mpi_yield_when_idle; see
  // docs/tuning.md). -1: $COLLECTIVES_YIELD_US if set (at most 1 s), else 10 ms; 0: sleep at
  // once when the spin ends. At most 1,000,000.
  // Default: -1.
  int yield_us = -1;

  // The job's shared secret. Every connection proves knowledge of it (HMAC-SHA256 over both
  // sides' nonces); it never travels. Empty: the ClusterSpec's job_token, else
  // COLLECTIVES_JOB_TOKEN, else the token the store's creator generated and each rank enrolled
  // for (CreateStoreFor; it travels once, in clear, to each rank), else none (a store that has
  // no token: the proof then only checks the job id).
  // Default: "".
  std::string job_token{};

  // The address this rank's data listener binds to. Empty: $COLLECTIVES_LISTEN_ADDRESS when set,
  // else the host the ClusterSpec names for this rank (TF_CONFIG's cluster addresses), else the
  // local address that routes toward master_addr: never every interface unless asked.
  // "0.0.0.0" or "::" asks for every interface (peers are then told this host's name). A host
  // name or address (IPv6 bare or in brackets) without a port; anything else (or such a
  // $COLLECTIVES_LISTEN_ADDRESS) raises Error(kInvalidArgument) naming it. When the default is a
  // name that resolves to loopback addresses only here (Debian maps a host's own name to
  // 127.0.1.1), the rank logs a line to stderr: other hosts cannot connect to it.
  // Default: "".
  std::string listen_address{};
};

// A handle on one asynchronous collective.
// Thread-safety: Wait and Done may be called from any thread, any number of times.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective completed; throws its Error if it failed.
  virtual void Wait() = 0;
  // True once the collective completed (successfully or not); never blocks.
  virtual bool Done() const = 0;
};

class CollectiveCommunication {
 public:
  // Runs every call still queued (each until it completes or fails, at most its timeout: a
  // call the peers never issue holds the destructor up to CommunicationOptions::timeout), then
  // closes the connections; peers still using them see kPeerLost. To leave at once, Abort
  // first. Must not run while another thread is still inside a call on this communicator,
  // Abort included: join a watchdog that aborts before destroying.
  virtual ~CollectiveCommunication() = default;
  CollectiveCommunication(const CollectiveCommunication&) = delete;
  CollectiveCommunication& operator=(const CollectiveCommunication&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Implementation implementation() const = 0;

  // recv[i] = op over ranks of send[i], on every rank. send and recv have the same count and
  // dtype; in place when send.data == recv.data.
  virtual std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv,
                                               ReduceOp op) = 0;
  // recv = root's send, on every rank. send is read on the root only (it may be empty
  // elsewhere); recv must have the count and dtype of root's send. In place when the root's
  // send.data == recv.data.
  virtual std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv,
                                               int root) = 0;
  // recv = concatenation over ranks of send; recv.count == size() * send.count.
  virtual std::shared_ptr<Work> AllGatherAsync(const Tensor& send, const Tensor& recv) = 0;
  // recv = block `rank` of (op over ranks of send); send.count == size() * recv.count.
  virtual std::shared_ptr<Work> ReduceScatterAsync(const Tensor& send, const Tensor& recv,
                                                   ReduceOp op) = 0;
  // Completes once every rank has entered it.
  virtual std::shared_ptr<Work> BarrierAsync() = 0;

  // The rooted collectives and the all-to-all, as MPI and NCCL define them. Each is a
  // collective: every rank issues it, with the same root, dtype (and op) and counts that fit.
  // Buffers a rank does not use (recv off the root of a reduce or gather, send off the root of a
  // scatter) may be empty and are neither read nor written. Arguments one rank can tell are
  // wrong (a root outside [0, size()), counts that do not fit, buffers that overlap other than
  // in place) raise Error(kInvalidArgument) on that rank at the call. RING and AUTO check every
  // call against every other rank's: one that differs (another root, count, dtype, op or
  // collective) raises Error(kMismatch) on every rank, with no recv written. The default
  // implementations raise Error(kNotSupported); RING, AUTO and NCCL implement them.
  //
  // recv on `root` = op over ranks of send (kAvg as for AllReduce); recv.count == send.count
  // there. In place on the root when send.data == recv.data.
  virtual std::shared_ptr<Work> ReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op,
                                            int root);
  // recv on `root` = concatenation over ranks of send, in rank order; recv.count ==
  // size() * send.count there. In place on the root when send.data == recv.data + root * count
  // elements.
  virtual std::shared_ptr<Work> GatherAsync(const Tensor& send, const Tensor& recv, int root);
  // recv = block `rank` of root's send; send.count == size() * recv.count on the root. In place
  // on the root when recv.data == send.data + root * recv.count elements.
  virtual std::shared_ptr<Work> ScatterAsync(const Tensor& send, const Tensor& recv, int root);
  // Block j of recv = block `rank` of rank j's send. Blocks lie back to back in rank order. With
  // empty count vectors the blocks are equal: send.count == recv.count, a multiple of size().
  // Otherwise send_counts[j] elements go to rank j and recv_counts[j] come from rank j (size()
  // entries each, summing to send.count and recv.count; send_counts[rank] == recv_counts[rank]);
  // the two forms mix freely across ranks. Rank j's send_counts[rank] must equal this rank's
  // recv_counts[j]: RING and AUTO exchange every rank's counts before any data moves, and a
  // disagreement anywhere raises Error(kMismatch) on every rank, naming the pair, with no recv
  // written. send and recv must lie apart (no in-place form).
  virtual std::shared_ptr<Work> AllToAllAsync(const Tensor& send, const Tensor& recv,
                                              const std::vector<size_t>& send_counts = {},
                                              const std::vector<size_t>& recv_counts = {});

  // Point to point. Not collectives: only the two ranks take part, and neither takes a place in
  // the collective sequence. `tensor` goes to rank `peer` (another rank), whose
  // RecvAsync(…, this rank, tag) receives it. Between two ranks, the messages of one direction
  // are received in the order they were issued; tags are checked, not used to reorder. A
  // receive whose dtype, count or tag differ from the send's raises Error(kMismatch) on the
  // receiver before anything is written into its tensor, and breaks the communicator as every
  // mismatch does: the sender raises kMismatch at its send if that is still running, else at its
  // next call. Sends and receives run in issue order with the collectives of their rank, so a
  // send and its receive must not sit behind calls that wait for each other (over TCP, a
  // message that meets a collective raises kMismatch on the rank that receives it; a collective
  // that AUTO runs in shared memory never meets one). A send completes once its data has left
  // for the socket, so a large one waits for its receive: two ranks that send each other large
  // messages must not both send first. A receive that no send answers raises kTimeout at the
  // communicator's deadline.
  virtual std::shared_ptr<Work> SendAsync(const Tensor& tensor, int peer, int64_t tag = 0);
  virtual std::shared_ptr<Work> RecvAsync(const Tensor& tensor, int peer, int64_t tag = 0);

  // Blocking forms: the async call waited on. An implementation may run a blocking call on
  // the caller's thread when nothing else is queued, saving two thread hand-offs.
  virtual void AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op) {
    AllReduceAsync(send, recv, op)->Wait();
  }
  void AllReduce(const Tensor& inout, ReduceOp op) { AllReduce(inout, inout, op); }
  virtual void Broadcast(const Tensor& send, const Tensor& recv, int root) {
    BroadcastAsync(send, recv, root)->Wait();
  }
  void Broadcast(const Tensor& inout, int root) { Broadcast(inout, inout, root); }
  virtual void AllGather(const Tensor& send, const Tensor& recv) {
    AllGatherAsync(send, recv)->Wait();
  }
  virtual void ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op) {
    ReduceScatterAsync(send, recv, op)->Wait();
  }
  virtual void Barrier() { BarrierAsync()->Wait(); }
  virtual void Reduce(const Tensor& send, const Tensor& recv, ReduceOp op, int root) {
    ReduceAsync(send, recv, op, root)->Wait();
  }
  virtual void Gather(const Tensor& send, const Tensor& recv, int root) {
    GatherAsync(send, recv, root)->Wait();
  }
  virtual void Scatter(const Tensor& send, const Tensor& recv, int root) {
    ScatterAsync(send, recv, root)->Wait();
  }
  virtual void AllToAll(const Tensor& send, const Tensor& recv,
                        const std::vector<size_t>& send_counts = {},
                        const std::vector<size_t>& recv_counts = {}) {
    AllToAllAsync(send, recv, send_counts, recv_counts)->Wait();
  }
  virtual void Send(const Tensor& tensor, int peer, int64_t tag = 0) {
    SendAsync(tensor, peer, tag)->Wait();
  }
  virtual void Recv(const Tensor& tensor, int peer, int64_t tag = 0) {
    RecvAsync(tensor, peer, tag)->Wait();
  }

  // The name of the algorithm an all-reduce of `bytes` bytes runs on this communicator: "ring",
  // "recursive_doubling", "halving_doubling", "shm", "shm_small", "two_level", "nccl". Every
  // rank makes the same choice. For benchmarks and logs.
  virtual std::string AllReduceAlgorithm(size_t bytes) const {
    (void)bytes;
    return ToString(implementation());
  }

  // Splits this communicator as ncclCommSplit and MPI_Comm_split do. A collective: every rank
  // calls it, in the same place of the call sequence. The ranks that pass the same color >= 0
  // get a new communicator of their own, ranked by key (ties by rank in this one); a negative
  // color gets nullptr. The new communicator has its own connections (and shared memory), the
  // options of this one with its current timeout (SetTimeout's), and lives independently of it.
  // That timeout bounds each of the split's two steps: the exchange of colors and keys through
  // this communicator, then the new one's whole set-up.
  // An Abort of this one during the split (or any failure that breaks it) makes the split raise
  // that error on this rank: within about 50 ms while the new one's set-up waits for its
  // members (it polls for it), at the end of the step otherwise (AUTO's calibration, a few
  // collectives on the new communicator, runs to its end). The other members' splits learn of
  // it through the store, as of any member whose set-up failed, and raise Error(kAborted) naming
  // it and its reason within about 50 ms while theirs waits for its members (else at the end of
  // the step, as above). Implementations that cannot split throw Error(kNotSupported).
  virtual std::unique_ptr<CollectiveCommunication> Split(int color, int key);

  // Breaks the communicator now: calls in flight and every later call raise Error(kAborted),
  // and peers see this rank's connections close. RING and AUTO return once the peers have been
  // told (the abort, with this rank's reason, sent and the connections closed: a process may
  // exit right after), or after about a second when a call in flight is slow to let go. Safe
  // from any thread; idempotent. A call on another thread may raise kAborted before Abort has
  // returned: destroy the communicator only after Abort returned.
  virtual void Abort() = 0;

  // The deadline of every call issued after this one (a call already issued keeps its own):
  // CommunicationOptions::timeout until changed. For one slow call, set it, issue the call, and
  // set it back. Thread-safe. Throws Error(kInvalidArgument) for a timeout <= 0; one above a
  // year is read as a year.
  virtual void SetTimeout(std::chrono::milliseconds timeout) = 0;

 protected:
  CollectiveCommunication() = default;
};

// The job token a communicator built with `options` proves on every connection, the store's
// included: options.job_token, else $COLLECTIVES_JOB_TOKEN, else empty (CreateCommunication
// then proves the token its store generated or enrolled for, if any). For callers that create
// the store themselves (CreateTcpStore) and pass it to CreateCommunication.
std::string ResolveJobToken(const CommunicationOptions& options);
// The same for a communicator of `spec`: options.job_token, else spec.job_token, else
// $COLLECTIVES_JOB_TOKEN, else empty.
std::string ResolveJobToken(const ClusterSpec& spec, const CommunicationOptions& options);

// Builds a communicator for this process's rank of `spec`, rendezvousing through the store the spec
// names (CreateStoreFor). Blocks until every rank has connected or options.timeout passed. RING
// connects every pair of ranks over TCP. AUTO does too, and also groups the ranks by host (host
// name and boot id, or $COLLECTIVES_HOST_ID): the ranks of one host share a POSIX shared-memory
// segment. With every rank on one host, AUTO runs every collective there. With several hosts of as
// many ranks each (two or more), broadcast and all-gather always run in two levels (across hosts
// among the ranks of one local index, over TCP; inside each host, through shared memory); an
// all-reduce runs in two levels when that is the cheaper plan for its size, by timings taken right
// after connecting (8 B and 4 MiB all-reduces under both plans, the median of 3 rounds, the slowest
// rank's), else flat over TCP; reduce-scatter and barrier run flat over TCP. With hosts of
// different rank counts, the all-reduce is chosen the same way (its two levels cross hosts in as
// many lanes as the smallest host of several ranks has; a rank alone on its host takes part in
// every lane), broadcast in two levels too, and every other collective runs flat over TCP. One rank
// per host runs everything over TCP. COLLECTIVES_SHM=0 on any rank turns shared memory off for
// every rank; so does options.algorithm naming a TCP algorithm, and so does a rank that shares its
// host with others and cannot use shared memory at all (no /dev/shm, one mounted read-only or not
// writable: it says so once on stderr).
std::unique_ptr<CollectiveCommunication> CreateCommunication(
    const ClusterSpec& spec, const CommunicationOptions& options = {});

// The same, through a store the caller made (a memory store for ranks that are threads, a file
// store on a shared folder, ...). spec.Validate() still applies: with world_size > 1,
// master_port must not be 0 although the store is given (master_addr picks the listen address).
std::unique_ptr<CollectiveCommunication> CreateCommunication(
    const ClusterSpec& spec, std::shared_ptr<Store> store,
    const CommunicationOptions& options = {});

}  // namespace collectives

#endif  // COLLECTIVES_COMMUNICATION_H_
