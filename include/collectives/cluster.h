// Who takes part in a job (ClusterSpec) and how the ranks find each other (Store).
//
// A ClusterSpec says this process's rank, the world size and where the rendezvous store lives.
// It comes from TensorFlow's TF_CONFIG, from torchrun-style RANK / WORLD_SIZE / MASTER_ADDR /
// MASTER_PORT, from mpirun (OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE, and its PMIx server when
// MASTER_PORT is not exported), from Slurm's srun (SLURM_PROCID, ...), or is filled in by code.
//
// Thread-safety: ClusterSpec is a plain value. Every Store may be called from any thread.
#ifndef COLLECTIVES_CLUSTER_H_
#define COLLECTIVES_CLUSTER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace collectives {

struct ClusterSpec {
  // This process's rank in [0, world_size).
  int rank = 0;
  // Number of ranks in the job.
  int world_size = 1;
  // Host name or address the rendezvous store (hosted by rank 0) listens on / is reached at: a
  // name, an IPv4 address, or an IPv6 address bare or in brackets ("::1", "[::1]"). No port (that
  // is master_port), '/', whitespace or control character: Validate refuses them.
  std::string master_addr = "127.0.0.1";
  // TCP port of the rendezvous store. 0 is only valid for world_size == 1.
  uint16_t master_port = 0;
  // Where rank 0's store listens, when not at master_addr: an address of rank 0's host, or
  // "0.0.0.0" / "::" for every interface (for a master_addr that is this host's name but
  // resolves to a loopback address here, as Debian's /etc/hosts makes it). Empty: master_addr.
  // Checked as master_addr is.
  // FromEnvironment takes it from COLLECTIVES_STORE_LISTEN_ADDRESS.
  std::string store_listen_address;
  // Per-rank "host:port" when the source lists them (TF_CONFIG does); empty otherwise. When
  // present, rank i binds its data listener to the host of addresses[i].
  std::vector<std::string> addresses;
  // TF_CONFIG task type and index of this process ("chief"/0, "worker"/3, "ps"/1,
  // "evaluator"/0), or "worker"/rank. The roles, as in TensorFlow:
  //   "chief"     worker 0 of the training (it writes checkpoints); the coordinator under
  //               ParameterServerStrategy. At most one.
  //   "worker"    a training worker.
  //   "ps"        a parameter server: only ParameterServerStrategy has them.
  //   "evaluator" evaluates the chief's checkpoints beside the training (SidecarEvaluator) and is
  //               not part of the training collective. At most one.
  // Strategies refuse a layout that does not fit them (strategy::CheckClusterLayout).
  std::string task_type = "worker";
  int task_index = 0;
  // Every task TF_CONFIG lists, by role ("chief", "worker", "ps", "evaluator"; a role with no
  // task is absent), each "host:port" as written, in list order. Empty for the other sources.
  std::map<std::string, std::vector<std::string>> cluster;
  // A name every rank of the job agrees on; keys in the store are prefixed with it, it travels
  // in the connection handshake so that two jobs sharing a host never cross, and a hash of it goes
  // into the shared-memory segment names. FromTfConfig takes it from TF_CONFIG's top-level
  // "job_id" (this library's own field), FromEnvironment from COLLECTIVES_JOB_ID.
  std::string job_id = "collectives";
  // The job's shared secret, proven on every connection (see CommunicationOptions::job_token,
  // which wins when set). FromEnvironment takes it from COLLECTIVES_JOB_TOKEN; it is never read
  // from TF_CONFIG, a variable that launchers and logs tend to print. Empty: none.
  std::string job_token;

  // Parses TensorFlow's TF_CONFIG JSON:
  //   {"cluster": {"chief": ["h0:p"], "worker": ["h1:p", "h2:p"], "ps": ["h3:p"],
  //                "evaluator": ["h4:p"]},
  //    "task": {"type": "worker", "index": 1}}
  // The training collective's ranks are the chief (if any) first, then the workers in list order;
  // rank 0's address hosts the store. A "ps" or "evaluator" task is a job of one rank of its own
  // (rank 0, world_size 1, master_port 0, no addresses: see InTrainingCollective), and `cluster`
  // tells it where the others are. An evaluator's TF_CONFIG may list only the evaluator; every
  // other task's needs a chief or a worker. Throws Error(kInvalidArgument) naming the offending
  // field: not JSON, a missing or mistyped key, an index out of range, duplicate addresses (over
  // every role), a bad "host:port", an unknown role, more than one chief or evaluator.
  static ClusterSpec FromTfConfig(std::string_view json);

  // Builds the spec from the environment, the first source present winning:
  //   1. TF_CONFIG (RANK / WORLD_SIZE beside it must agree with it: else ambiguous, refused);
  //   2. RANK and WORLD_SIZE (torchrun), MASTER_ADDR (default 127.0.0.1) and MASTER_PORT;
  //   3. OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (mpirun), MASTER_ADDR and MASTER_PORT
  //      when exported; without MASTER_PORT, rank 0 picks its address (MASTER_ADDR, else
  //      127.0.0.1 when every rank is on its host, else its first non-loopback IPv4 address), a
  //      free port and a job token, and every rank reads them through mpirun's PMIx server (one
  //      PMIx fence, done once per process: every rank must call this); job_id becomes
  //      "mpirun-<PMIx namespace>";
  //   4. SLURM_PROCID with SLURM_STEP_ID (an srun job step): SLURM_STEP_NUM_TASKS (else
  //      SLURM_NTASKS) ranks; the store on the first host of SLURM_STEP_NODELIST (else
  //      SLURM_JOB_NODELIST, SLURM_NODELIST; Slurm's compressed lists) at port 20000 + 4 x
  //      (SLURM_JOB_ID mod 10000) + step mod 4, unless MASTER_ADDR / MASTER_PORT are set; job_id
  //      "slurm-<job>.<step>";
  //   5. none of them: a single rank.
  // Then, whatever the source:
  // COLLECTIVES_JOB_ID gives job_id (it must not be empty, and must equal TF_CONFIG's "job_id"
  // when that names one other than the default), COLLECTIVES_JOB_TOKEN job_token, and
  // COLLECTIVES_STORE_LISTEN_ADDRESS store_listen_address. Throws Error(kInvalidArgument) naming
  // the variable that is malformed or missing.
  static ClusterSpec FromEnvironment();

  // The same, over an explicit variable map (for tests and for embedding).
  static ClusterSpec FromEnvironment(const std::map<std::string, std::string>& env);

  // Throws Error(kInvalidArgument) naming the field if the fields are inconsistent (a "ps" or
  // "evaluator" task with world_size > 1 included), task_type or a key of `cluster` is no role,
  // or master_addr, store_listen_address or an address is malformed.
  void Validate() const;

  // True for a "chief" or "worker" task: one of the ranks of the training collective. False for
  // a "ps" or "evaluator" task, whose spec is a job of one rank, so that a communicator it
  // creates never joins the training's.
  bool InTrainingCollective() const;
};

// A key-value store for rendezvous: ranks publish their addresses and read their peers'.
// Keys are written once; Get waits until the key exists.
class Store {
 public:
  virtual ~Store() = default;

  // Sets `key` to `value`, replacing any earlier value.
  virtual void Set(const std::string& key, const std::string& value) = 0;
  // Returns the value of `key`, waiting up to `timeout` for some rank to set it. Throws
  // Error(kTimeout) naming the key when it does not appear in time.
  virtual std::string Get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Atomically adds `delta` to the integer stored at `key` (0 if absent) and returns the sum.
  virtual int64_t Add(const std::string& key, int64_t delta) = 0;
};

// A store in this process's memory: for ranks that are threads of one process (tests).
std::shared_ptr<Store> CreateMemoryStore();

// A store of files in `directory` (a folder every rank can see, e.g. on a shared file system).
// The folder is created if missing. Values are written atomically (temp file, then rename).
// Keys outlive the job: give each run of a job an empty folder of its own (as PyTorch's
// FileStore needs a fresh file). In a folder an earlier run used, the ranks' communicator
// counters may differ (a rank of that run died early), and ranks then wait for each other under
// different keys, or read a dead rank's address, until their timeout.
// When the job sets no token, CreateCommunication proves the one in <directory>/.job-token,
// which the first rank creates (mode 0600, 32 random bytes in hex); a token file that another
// user owns or that group or others may read raises Error(kUnauthenticated).
std::shared_ptr<Store> CreateFileStore(const std::string& directory);

// A TCP store. With `is_server` this process hosts it on host:port (port 0 picks a free port;
// see TcpStorePort) and also uses it as a client. Clients retry the connection until `timeout`.
// Every connection proves `job_token` both ways (HMAC-SHA256 over fresh nonces; the token never
// travels) before its first request: a server logs and closes a connection that cannot, and a
// client raises Error(kUnauthenticated). An empty `job_token` is the key here (every job that
// sets none shares it); CreateStoreFor does better. Throws Error(kSystem) when the port cannot
// be bound, Error(kTimeout) when the server cannot be reached in time, or when the lookup of a
// host name (the server's too) has not answered within `timeout`.
std::shared_ptr<Store> CreateTcpStore(const std::string& host, uint16_t port, bool is_server,
                                      std::chrono::milliseconds timeout,
                                      const std::string& job_token = {});
// The port a TCP store created by this process listens on (useful after port 0). Throws
// Error(kInvalidArgument) if `store` is not a TCP store server.
uint16_t TcpStorePort(const Store& store);

// The store a ClusterSpec names: rank 0 hosts a TCP store at master_addr:master_port (listening
// at store_listen_address when set), the other ranks connect to it. A single-rank spec gets a
// memory store. Rank 0 logs a line to stderr when master_addr is a name that resolves to
// loopback addresses only (other hosts could not reach the store).
// `job_token` as for CreateTcpStore; when empty, the spec's job_token, else
// $COLLECTIVES_JOB_TOKEN. When all are empty, rank 0 generates a random
// token and each other rank enrols for it once, on its first connection (the token travels
// once, in clear, to each rank; a stranger who enrols first for a rank takes its place, and the
// real rank raises Error(kUnauthenticated) naming the rank). CreateCommunication proves that
// token on every connection. On a network you do not trust, set COLLECTIVES_JOB_TOKEN.
std::shared_ptr<Store> CreateStoreFor(const ClusterSpec& spec, std::chrono::milliseconds timeout,
                                      const std::string& job_token = {});

}  // namespace collectives

#endif  // COLLECTIVES_CLUSTER_H_
