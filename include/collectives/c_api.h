/* The C API: a C ABI over the C++ library, with status codes instead of exceptions, for embedding
 * from C and from other languages (through their C foreign-function interfaces).
 *
 * Pure C99; also compiles as C++. Every function returns a coll_status (except the ones that
 * return a string); no exception ever crosses it. On failure, coll_last_error() gives the
 * library's message, which names the rank, the peer, the collective and its sequence number where
 * they are known.
 *
 * Semantics are those of the C++ API (collectives/communication.h), which follow NCCL and MPI:
 *  - Every rank issues the same sequence of collectives with the same dtype, op, count and root.
 *    The library checks this: a difference returns COLL_MISMATCH on the ranks that see it (the
 *    others see COLL_MISMATCH, COLL_ABORTED or COLL_PEER_LOST), never a hang.
 *  - A blocking collective returns once the result is in the receive buffer; its buffers are
 *    borrowed only for the duration of the call. An asynchronous one (coll_*_async) returns at
 *    once with a coll_work handle and borrows its buffers until the handle reports it complete.
 *    Either way collectives run in the order they were issued on the communicator.
 *  - The first failure of a communicator (peer lost, mismatch, timeout) breaks it: that call and
 *    every later one return the same status until it is destroyed and a new one is created.
 *  - Counts are elements, never bytes. A buffer is aligned to its element size (as a pointer to
 *    the element type is); one that is not returns COLL_INVALID_ARGUMENT.
 *
 * Thread-safety: one thread at a time per communicator (calls issued concurrently on one
 * communicator from different threads run in an order no other rank can know). The exception is
 * coll_comm_abort, which may be called from any thread at any time, e.g. from a watchdog while
 * another thread is blocked in a collective. coll_comm_destroy must not race with any other call
 * on the same communicator, coll_comm_abort included: join the watchdog (its abort returned)
 * before destroying. Different communicators are independent. coll_last_error is per
 * thread. A coll_work may be waited on or tested from any thread, also while its communicator
 * issues more calls; coll_work_free must not race with another call on the same handle.
 *
 * Example (error checks elided):
 *
 *   coll_comm* comm;
 *   coll_comm_create_from_env(NULL, &comm);       // TF_CONFIG, RANK/WORLD_SIZE, OMPI_*
 *   coll_all_reduce(comm, grad, grad, n, COLL_FLOAT32, COLL_AVG);
 *   coll_comm_destroy(comm);
 */
#ifndef COLLECTIVES_C_API_H_
#define COLLECTIVES_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Status codes. ----
 * The values equal collectives::ErrorCode's (append, never renumber). The *_FORCE_INT_ entries
 * are not values: they give each enum the width of int, so any int converts to it without
 * undefined behaviour in C++ (an unknown value is then reported as COLL_INVALID_ARGUMENT). */
typedef enum coll_status {
  COLL_OK = 0,
  COLL_INVALID_ARGUMENT = 1, /* a bad value from the caller: NULL pointer, wrong count, unknown
                                dtype or op, malformed TF_CONFIG */
  COLL_INVALID_USAGE = 2,    /* a call that is not allowed now */
  COLL_SYSTEM = 3,           /* the operating system refused (bind, connect, ...); also out of
                                memory */
  COLL_PEER_LOST = 4,        /* a peer closed its connection or died */
  COLL_MISMATCH = 5,         /* ranks issued different collectives, counts, dtypes, ops or roots */
  COLL_TIMEOUT = 6,          /* a deadline passed waiting for a peer or the rendezvous */
  COLL_UNAUTHENTICATED = 7,  /* a peer failed the job-token proof */
  COLL_ABORTED = 8,          /* the communicator was aborted, by this process or by a peer */
  COLL_NOT_SUPPORTED = 9,    /* what the call asks for is not available here, e.g.
                                COLL_IMPLEMENTATION_NCCL without NCCL (see below) */
  COLL_INTERNAL = 10,        /* a bug in this library (also: an unexpected C++ exception) */
  COLL_STATUS_FORCE_INT_ = 0x7fffffff
} coll_status;

/* ---- Element types and reduction operators. ----
 * Values equal collectives::DataType and collectives::ReduceOp. */
typedef enum coll_dtype {
  COLL_FLOAT32 = 0,
  COLL_FLOAT64 = 1,
  COLL_FLOAT16 = 2,  /* IEEE 754 binary16 bits in a uint16_t; reduced in float */
  COLL_BFLOAT16 = 3, /* bfloat16 bits in a uint16_t; reduced in float */
  COLL_INT8 = 4,
  COLL_UINT8 = 5,
  COLL_INT32 = 6,
  COLL_INT64 = 7,
  COLL_DTYPE_FORCE_INT_ = 0x7fffffff
} coll_dtype;

typedef enum coll_op {
  COLL_SUM = 0,
  COLL_PROD = 1,
  COLL_MIN = 2,
  COLL_MAX = 3,
  COLL_AVG = 4, /* a sum, then one division by the number of ranks (truncating for integers);
                 integer sums wrap before the division, f16 partial sums overflow to inf once
                 one reaches 65520 (see ReduceOp in collectives/types.h) */
  COLL_OP_FORCE_INT_ = 0x7fffffff
} coll_op;

/* Which implementation moves the data. Values equal collectives::Implementation. */
typedef enum coll_implementation {
  COLL_IMPLEMENTATION_RING = 0, /* TCP between processes */
  COLL_IMPLEMENTATION_NCCL = 1, /* NVIDIA NCCL, on CUDA device memory only (a host buffer gives
                                   COLL_INVALID_ARGUMENT); where NCCL or a GPU is missing, creating
                                   a communicator with it returns COLL_NOT_SUPPORTED before any
                                   rendezvous. RING and AUTO take CUDA device memory too
                                   (every collective and send/recv), staged through pinned
                                   host memory; see docs/gpu.md */
  COLL_IMPLEMENTATION_AUTO = 2, /* chosen per call: shared memory inside a host, TCP across */
  COLL_IMPLEMENTATION_FORCE_INT_ = 0x7fffffff
} coll_implementation;

/* ---- Options. ----
 * Always fill with coll_options_init first, then change the fields you need:
 *
 *   coll_options options;
 *   coll_options_init(&options);
 *   options.timeout_ms = 30000;
 *
 * Growing: new fields are only ever appended. struct_size records how large the caller's struct
 * is (sizeof as the caller's header saw it, which coll_options_init passes to the library); the
 * library writes only that many bytes and reads a field only if it lies within struct_size,
 * using the field's default otherwise, so a program built against an older header keeps working
 * with a newer library. A struct_size larger than the library knows (a header newer than the
 * library) is rejected with COLL_INVALID_ARGUMENT rather than silently ignoring settings, as is
 * a struct_size smaller than this first version (e.g. an uninitialised struct).
 *
 * Wherever a `const coll_options*` is taken, NULL means all defaults. */
typedef struct coll_options {
  /* sizeof(coll_options); set by coll_options_init. */
  size_t struct_size;

  /* Which implementation moves the data: COLL_IMPLEMENTATION_AUTO, COLL_IMPLEMENTATION_RING or
   * COLL_IMPLEMENTATION_NCCL (CUDA device memory only; COLL_NOT_SUPPORTED without NCCL and a GPU).
   * Default: COLL_IMPLEMENTATION_AUTO. */
  coll_implementation implementation;

  /* Longest a collective may take once it runs, and longest the rendezvous and connection set-up
   * may take; a silent peer then gives COLL_TIMEOUT naming it (once the peers have been told
   * why: up to about 200 ms after the deadline when a peer is not reading). Must be positive;
   * above a year (INT64_MAX for "never" included) it is read as a year.
   * Default: 300000 (5 minutes: long enough for a 1 GiB all-reduce over a slow link). */
  int64_t timeout_ms;

  /* Byte cap of one fusion bucket of coll_all_reduce_many and coll_broadcast_many when the
   * call's own bytes_per_pack argument is 0. 0 picks the library's default for the
   * communicator (collectives::packing::DefaultBytesPerPack(comm): 1 MiB).
   * Default: 0. */
  size_t bytes_per_pack;

  /* The job's shared secret: every connection proves knowledge of it (HMAC; it never travels).
   * NULL or "": the environment variable COLLECTIVES_JOB_TOKEN; when that is unset or empty,
   * rank 0's rendezvous store generates a random token and every other rank enrols for it on its
   * first connection to the store (the token then travels once, in clear, to each rank: trust on
   * first use; a stranger who enrols first for a rank takes its place, and that rank gets
   * COLL_UNAUTHENTICATED). On a network you do not trust, set a token. Copied during creation;
   * need not outlive the call.
   * Default: NULL. */
  const char* job_token;
} coll_options;

/* Fills the first struct_size bytes of *options with the defaults above and sets
 * options->struct_size to struct_size, the caller's sizeof(coll_options): nothing past the
 * caller's struct is written, whatever the library's own size. A struct_size smaller than this
 * first version or larger than the library knows (a header newer than the library) returns
 * COLL_INVALID_ARGUMENT naming both sizes, as does a NULL options; nothing is written then.
 * Call it through coll_options_init, which passes the size; a foreign-function interface, which
 * cannot call an inline function, passes the size of its own declaration of the struct. */
coll_status coll_options_init_sized(coll_options* options, size_t struct_size);

/* Fills *options with the defaults above and sets struct_size: coll_options_init_sized with
 * sizeof(coll_options) as this header sees it (inline, so that the size is the caller's, not
 * the library's). Returns COLL_INVALID_ARGUMENT if options is NULL. */
static inline coll_status coll_options_init(coll_options* options) {
  return coll_options_init_sized(options, sizeof(coll_options));
}

/* ---- Communicators. ---- */

/* An opaque communicator: one rank's membership in a job, with its connections to every peer and
 * a progress thread. Created by one of the coll_comm_create* functions, released by
 * coll_comm_destroy. */
typedef struct coll_comm coll_comm;

/* Creates this process's communicator from the environment, the first source present winning:
 *   1. TF_CONFIG (TensorFlow's cluster JSON; rank 0's address hosts the rendezvous);
 *   2. RANK and WORLD_SIZE (torchrun), with MASTER_ADDR (default 127.0.0.1) and MASTER_PORT
 *      (required when WORLD_SIZE > 1);
 *   3. OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (mpirun), with MASTER_ADDR / MASTER_PORT,
 *      or, without MASTER_PORT, rank 0's store address agreed through mpirun's PMIx server;
 *   4. SLURM_PROCID with SLURM_STEP_ID (srun), the store on the step's first node;
 *   5. none of them: a single rank.
 * (ClusterSpec::FromEnvironment in cluster.h has the details.)
 * COLLECTIVES_JOB_ID, when set, names the job (every rank must set the same); when
 * COLLECTIVES_STORE_LISTEN_ADDRESS is set, rank 0's store listens there instead of on the
 * address the other ranks connect to. Blocks until every rank has connected or the
 * timeout passed (COLL_TIMEOUT). A malformed or missing variable gives COLL_INVALID_ARGUMENT
 * naming it. On success *out is the new communicator; on failure *out is set to NULL. */
coll_status coll_comm_create_from_env(const coll_options* options, coll_comm** out);

/* Creates rank `rank` of a job of `world_size` ranks. Rank 0 hosts the rendezvous store on
 * master_addr:master_port (it must be free there); the other ranks connect to it, retrying until
 * the timeout. master_addr NULL means "127.0.0.1"; otherwise a host name or address (IPv6 bare
 * or in brackets), without a port: "10.0.0.1:29500" gives COLL_INVALID_ARGUMENT. master_port 0
 * is valid only when world_size == 1; world_size is at most 1048576 (2^20: every rank connects to
 * every other), else COLL_INVALID_ARGUMENT. Blocks until every rank has connected. On failure
 * *out is set to NULL. */
coll_status coll_comm_create(int rank, int world_size, const char* master_addr,
                             uint16_t master_port, const coll_options* options, coll_comm** out);

/* Creates this process's communicator from a TF_CONFIG JSON text (as TensorFlow's), e.g.
 *   {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
 *    "task": {"type": "worker", "index": 1}}
 * Ranks are the chief (if any) first, then the workers in list order. Malformed JSON, a missing
 * or mistyped field, an index out of range or an unsupported role give COLL_INVALID_ARGUMENT
 * naming the field. On failure *out is set to NULL. */
coll_status coll_comm_create_from_tf_config(const char* tf_config_json, const coll_options* options,
                                            coll_comm** out);

/* Releases the communicator: closes its connections and joins its progress thread. Peers still
 * using it see COLL_PEER_LOST. NULL is allowed (and returns COLL_OK). Must not race with any
 * other call on `comm`. */
coll_status coll_comm_destroy(coll_comm* comm);

/* Breaks the communicator now: a collective in flight on another thread and every later call
 * return COLL_ABORTED, and peers see this rank's connections close. With RING and AUTO it
 * returns once the peers have been told (within about a second): the process may exit right
 * after. The one call that may run concurrently with another call on the same communicator,
 * coll_comm_split included (on this rank, a split whose new communicator still waits for its
 * members then returns COLL_ABORTED within about 50 ms). Idempotent. The communicator must
 * still be destroyed with coll_comm_destroy. */
coll_status coll_comm_abort(coll_comm* comm);

/* Splits the communicator, as ncclCommSplit and MPI_Comm_split do. A collective: every rank calls
 * it, at the same place of its call sequence. The ranks that pass the same color >= 0 get a new
 * communicator in *out, ranked by key (ties by rank in this one), with its own connections and
 * the options of this one; a negative color gets *out = NULL (and COLL_OK). The new communicator
 * lives independently of this one and is destroyed with coll_comm_destroy. On failure *out is
 * set to NULL. */
coll_status coll_comm_split(coll_comm* comm, int color, int key, coll_comm** out);

/* The timeout of every collective issued after this call (one already issued keeps its own);
 * coll_options.timeout_ms until changed. For one slow collective: set it, issue the collective,
 * set it back. Must be positive; above a year (INT64_MAX included) it is read as a year. May be
 * called from any thread. */
coll_status coll_comm_set_timeout(coll_comm* comm, int64_t timeout_ms);

/* *rank = this process's rank, in [0, size). */
coll_status coll_comm_rank(const coll_comm* comm, int* rank);

/* *size = the number of ranks of the communicator. */
coll_status coll_comm_size(const coll_comm* comm, int* size);

/* ---- Collectives. ----
 * Blocking (asynchronous forms below). Buffers hold host (CPU) memory. A buffer may be NULL only
 * when its count is 0. */

/* recvbuff[i] = op over all ranks of sendbuff[i], for i in [0, count), on every rank.
 * sendbuff and recvbuff hold `count` elements of `dtype` each. In place iff sendbuff == recvbuff;
 * otherwise the two must not overlap. */
coll_status coll_all_reduce(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                            coll_dtype dtype, coll_op op);

/* recvbuff = root's sendbuff (`count` elements of `dtype`), on every rank. sendbuff is read on
 * the root only and may be NULL on other ranks. In place iff the root's sendbuff == recvbuff. */
coll_status coll_broadcast(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                           coll_dtype dtype, int root);

/* recvbuff = the concatenation, in rank order, of every rank's sendbuff. sendbuff holds
 * count_per_rank elements; recvbuff holds size * count_per_rank elements. In place iff
 * sendbuff == recvbuff + rank * count_per_rank elements. */
coll_status coll_all_gather(coll_comm* comm, const void* sendbuff, void* recvbuff,
                            size_t count_per_rank, coll_dtype dtype);

/* recvbuff = block `rank` of (op over all ranks of sendbuff). recvbuff holds recv_count
 * elements; sendbuff holds size * recv_count elements, block r being elements
 * [r * recv_count, (r + 1) * recv_count). In place iff
 * recvbuff == sendbuff + rank * recv_count elements. */
coll_status coll_reduce_scatter(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                size_t recv_count, coll_dtype dtype, coll_op op);

/* Returns once every rank has entered the barrier. */
coll_status coll_barrier(coll_comm* comm);

/* All-reduces n buffers in place, buffers[i] holding counts[i] elements of `dtype`, fused into
 * buckets of at most bytes_per_pack bytes (0: the communicator's coll_options.bytes_per_pack,
 * and if that is 0 too the library's default) so that many small tensors cost a few large
 * collectives. The result equals one coll_all_reduce per buffer (bit for bit for integers, min
 * and max; float sums may differ in the last bits, identically on every rank). Every rank passes
 * the same n, the same counts and the same bytes_per_pack (else COLL_MISMATCH on every rank,
 * nothing written). buffers and counts may be NULL when n == 0; buffers[i] may be NULL when
 * counts[i] == 0. Every call, n == 0 included, is a collective. An allocation that fails once
 * the call has begun issuing returns COLL_SYSTEM and aborts the communicator with that error,
 * which the other ranks' calls then return (so does coll_broadcast_many). */
coll_status coll_all_reduce_many(coll_comm* comm, void* const* buffers, const size_t* counts,
                                 size_t n, coll_dtype dtype, coll_op op, size_t bytes_per_pack);

/* Broadcasts n buffers in place from `root`, buffers[i] holding counts[i] elements of `dtype`,
 * fused into buckets as coll_all_reduce_many does (bytes_per_pack likewise): afterwards every
 * rank's buffers hold the root's, bit for bit, as with one coll_broadcast per buffer. Unlike
 * coll_broadcast, every rank passes its buffers (the root's are read, the others' written).
 * Buffers that overlap, and a root outside [0, size), return COLL_INVALID_ARGUMENT. Every rank
 * passes the same n, counts and bytes_per_pack (else COLL_MISMATCH on every rank, nothing
 * written) and the same root (else a mismatch as for any collective: see the top of this file).
 * buffers and counts may be NULL when n == 0; buffers[i] may be NULL when counts[i] == 0. Every
 * call, n == 0 included, is a collective. */
coll_status coll_broadcast_many(coll_comm* comm, void* const* buffers, const size_t* counts,
                                size_t n, coll_dtype dtype, int root, size_t bytes_per_pack);

/* ---- Rooted collectives, all-to-all, and point to point. ----
 * As collectives/communication.h defines them (MPI's and NCCL's semantics). A buffer a rank does
 * not use (recvbuff off the root of a reduce or a gather, sendbuff off the root of a scatter) is
 * neither read nor written, and may be NULL. A root or peer outside [0, size) returns
 * COLL_INVALID_ARGUMENT. */

/* recvbuff on `root` = op over all ranks of sendbuff, `count` elements of `dtype` each. In place
 * iff the root's sendbuff == recvbuff; otherwise the two must not overlap. */
coll_status coll_reduce(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                        coll_dtype dtype, coll_op op, int root);

/* recvbuff on `root` = the concatenation, in rank order, of every rank's sendbuff. sendbuff holds
 * count_per_rank elements; the root's recvbuff holds size * count_per_rank. In place iff the
 * root's sendbuff == recvbuff + root * count_per_rank elements. */
coll_status coll_gather(coll_comm* comm, const void* sendbuff, void* recvbuff,
                        size_t count_per_rank, coll_dtype dtype, int root);

/* recvbuff = block `rank` of root's sendbuff. recvbuff holds count_per_rank elements; the root's
 * sendbuff holds size * count_per_rank, block r being elements
 * [r * count_per_rank, (r + 1) * count_per_rank). In place iff the root's
 * recvbuff == sendbuff + root * count_per_rank elements. */
coll_status coll_scatter(coll_comm* comm, const void* sendbuff, void* recvbuff,
                         size_t count_per_rank, coll_dtype dtype, int root);

/* Block j of recvbuff = block `rank` of rank j's sendbuff; blocks lie back to back in rank order.
 * With send_counts and recv_counts both NULL the blocks are equal: each buffer holds
 * size * count_per_rank elements. Otherwise both are arrays of size entries (count_per_rank must
 * then be 0): send_counts[j] elements go to rank j, recv_counts[j] come from rank j, and each
 * buffer holds the sum of its array. Rank j's send_counts[rank] must equal this rank's
 * recv_counts[j], else COLL_MISMATCH on every rank, nothing written (a rank's own entries must
 * agree too: COLL_INVALID_ARGUMENT). sendbuff and recvbuff must not overlap. The arrays are read
 * during the call only (also by the _async form). */
coll_status coll_all_to_all(coll_comm* comm, const void* sendbuff, void* recvbuff,
                            size_t count_per_rank, const size_t* send_counts,
                            const size_t* recv_counts, coll_dtype dtype);

/* Point to point: not collectives; only the two ranks take part and neither takes a place in the
 * sequence of collectives. coll_send sends `count` elements of `dtype` from sendbuff to rank
 * `peer` (another rank: this one's own is COLL_INVALID_ARGUMENT), whose
 * coll_recv(..., this rank, tag) receives them into recvbuff. Between two ranks, sends are
 * received in the order they were issued; a receive whose dtype, count or tag differs from its
 * send's returns COLL_MISMATCH, writing nothing, and breaks the communicator, so the sender sees
 * it too (at that send or a later call). Sends and receives run in issue order with the rank's
 * collectives, and a send may wait for its receive: two ranks that both send first, and receive
 * after, can wait for each other until the timeout. */
coll_status coll_send(coll_comm* comm, const void* sendbuff, size_t count, coll_dtype dtype,
                      int peer, int64_t tag);
coll_status coll_recv(coll_comm* comm, void* recvbuff, size_t count, coll_dtype dtype, int peer,
                      int64_t tag);

/* ---- Asynchronous collectives. ----
 * Each coll_*_async function takes the arguments of its blocking form and checks them, queues the
 * collective behind those already issued on the communicator, and returns at once with *work set
 * to a handle; the collective runs on the communicator's progress thread. Its buffers stay
 * borrowed (not to be read, written or freed) until coll_work_wait returned, or coll_work_test
 * set *done, for it. This is how a trainer overlaps communication with computation: issue the
 * all-reduce of one layer's gradients, compute the next layer's, wait before the update.
 *
 * A bad argument is returned by the coll_*_async function itself, with *work set to NULL and
 * nothing queued; every other failure (one met while the collective runs, which breaks the
 * communicator as for a blocking call, or a communicator broken before) is returned by
 * coll_work_wait and coll_work_test. An allocation that fails while a coll_*_many_async call
 * issues its collectives returns COLL_SYSTEM there, *work NULL; if part of them were queued, the
 * communicator is aborted with that error, which the other ranks' calls then return (rather than
 * wait for the rest). Every handle must be released with coll_work_free, in any order. A handle
 * stays valid after its communicator is destroyed (coll_comm_destroy first finishes every
 * collective issued on it). */

/* An opaque handle on one asynchronous collective. */
typedef struct coll_work coll_work;

coll_status coll_all_reduce_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                  size_t count, coll_dtype dtype, coll_op op, coll_work** work);
coll_status coll_broadcast_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                 size_t count, coll_dtype dtype, int root, coll_work** work);
coll_status coll_all_gather_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                  size_t count_per_rank, coll_dtype dtype, coll_work** work);
coll_status coll_reduce_scatter_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                      size_t recv_count, coll_dtype dtype, coll_op op,
                                      coll_work** work);
coll_status coll_barrier_async(coll_comm* comm, coll_work** work);
/* coll_all_reduce_many's buckets, all issued before it returns, behind a check that every rank
 * passed the same counts and bytes_per_pack. Each bucket goes straight from its buffers, with no
 * fusion buffer, and runs only if that check found the lists alike. Lists that differ across
 * ranks: COLL_MISMATCH from coll_work_wait on every rank, no buffer written; a bucket that does
 * not run takes no sequence number, so the communicator stays usable. */
coll_status coll_all_reduce_many_async(coll_comm* comm, void* const* buffers, const size_t* counts,
                                       size_t n, coll_dtype dtype, coll_op op,
                                       size_t bytes_per_pack, coll_work** work);

/* coll_broadcast_many's buckets, issued and checked as coll_all_reduce_many_async's: straight
 * from the buffers, with no fusion buffer; lists that differ across ranks give COLL_MISMATCH from
 * coll_work_wait on every rank, no buffer written, and the communicator stays usable. A root
 * that differs across ranks breaks the communicator, as any mismatch does. */
coll_status coll_broadcast_many_async(coll_comm* comm, void* const* buffers, const size_t* counts,
                                      size_t n, coll_dtype dtype, int root, size_t bytes_per_pack,
                                      coll_work** work);

coll_status coll_reduce_async(coll_comm* comm, const void* sendbuff, void* recvbuff, size_t count,
                              coll_dtype dtype, coll_op op, int root, coll_work** work);
coll_status coll_gather_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                              size_t count_per_rank, coll_dtype dtype, int root, coll_work** work);
coll_status coll_scatter_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                               size_t count_per_rank, coll_dtype dtype, int root, coll_work** work);
coll_status coll_all_to_all_async(coll_comm* comm, const void* sendbuff, void* recvbuff,
                                  size_t count_per_rank, const size_t* send_counts,
                                  const size_t* recv_counts, coll_dtype dtype, coll_work** work);
coll_status coll_send_async(coll_comm* comm, const void* sendbuff, size_t count, coll_dtype dtype,
                            int peer, int64_t tag, coll_work** work);
coll_status coll_recv_async(coll_comm* comm, void* recvbuff, size_t count, coll_dtype dtype,
                            int peer, int64_t tag, coll_work** work);

/* Blocks until the collective completed (at most its communicator's timeout after it started)
 * and returns its status: COLL_OK, or the failure, with coll_last_error naming it. May be called
 * any number of times; each call returns the same status. */
coll_status coll_work_wait(coll_work* work);

/* Never blocks: *done = 1 if the collective completed, else 0. When *done is 1 the return value
 * is the collective's status, as from coll_work_wait; while it is 0, COLL_OK. */
coll_status coll_work_test(coll_work* work, int* done);

/* Releases the handle. A collective that has not completed yet is waited for first (its
 * buffers are borrowed until then). Returns the collective's status, as coll_work_wait; the
 * handle is released whatever it is. NULL is allowed (and returns COLL_OK). */
coll_status coll_work_free(coll_work* work);

/* ---- Errors. ---- */

/* The message of the last failed call on the calling thread ("" if none has failed yet). Not
 * cleared by successful calls (like errno). The pointer is valid until the next failing call on
 * this thread. */
const char* coll_last_error(void);

/* A static name for a status: "ok", "invalid argument", "peer lost", ...; "unknown status" for a
 * value that is not one. */
const char* coll_status_string(coll_status status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* COLLECTIVES_C_API_H_ */
