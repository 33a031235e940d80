// How the ranks of a benchmark binary (collectives_perf, packing_perf) start and connect, shared
// by those binaries. Only the public API is used.
//
//   --local N  RunLocalLauncher: this process starts N copies of itself on loopback and waits
//              for them. Rank 0 hosts the rendezvous store on a port the kernel picks and hands
//              it back through a pipe; the launcher then starts ranks 1..N-1 with MASTER_PORT
//              set. Each copy calls ConnectLocalRank.
//   mpirun     built with COLLECTIVES_WITH_MPI: after MPI_Init, ConnectMpiRank: rank 0 hosts the
//              store on a free port and MPI_Bcast's it. Built without: ClusterSpec::
//              FromEnvironment, which reads OMPI_COMM_WORLD_* and needs MASTER_ADDR / _PORT.
//
// Exit codes shared by the benchmarks: 0 success, 1 error (a bad command line too), 2 finished
// but results were wrong.
//
// Thread-safety: call from the main thread, before other threads exist (fork).
#ifndef COLLECTIVES_BENCH_LOCAL_LAUNCHER_H_
#define COLLECTIVES_BENCH_LOCAL_LAUNCHER_H_

#include <chrono>
#include <memory>
#include <string>

#include "collectives/collectives.h"

namespace collectives::perf {

inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;
inline constexpr int kExitWrong = 2;

// Set by the --local launcher in its children: the child's rank, and (rank 0 only) the pipe on
// which it reports the store's port.
inline constexpr const char* kLocalRankEnv = "COLLECTIVES_PERF_LOCAL_RANK";
inline constexpr const char* kPortFdEnv = "COLLECTIVES_PERF_PORT_FD";

// True in a rank that RunLocalLauncher started.
bool IsLocalChild();

// True when an MPI launcher (mpirun, srun with PMI) started this process.
bool UnderMpiLauncher();

// Says on stderr, in one line, that `program` runs a single rank since neither --local nor a
// launcher's environment (mpirun's, RANK / WORLD_SIZE, TF_CONFIG) gives it more, and how to get
// more. Silent where such an environment is set. For the bootstrap from the environment only.
void SayWhenSingleRankByDefault(const char* program);

// This process's rank as far as the environment tells before any bootstrap (0 if it does not),
// so that only one rank prints usage errors.
int RankFromEnvironment();

// Starts `world_size` ranks of this program (argv as given) on loopback and waits for them.
// When a rank fails (anything but kExitOk or kExitWrong), the others get two seconds to finish
// on their own, then SIGTERM, then two more seconds, then SIGKILL. Returns the first non-zero
// exit code. `program` prefixes its messages; `timeout` bounds the wait for rank 0's port.
// Each rank connects `communicators` communicators (a TCP connection to every other rank each):
// before any rank starts, the limit on open files is raised towards what rank 0 needs (up to the
// hard limit), and where that limit or the system's (fs.file-max) cannot be enough, no rank
// starts and the message names it (kExitError).
int RunLocalLauncher(const char* program, int world_size, char** argv,
                     std::chrono::milliseconds timeout, int communicators = 1);

// This rank's place in a job and the job's store: enough to build communicators, the first and
// any later ones (each in its own key space of the store, e.g. with other options, to time them
// against the first in the same run).
struct Job {
  ClusterSpec spec;
  std::shared_ptr<Store> store;
  std::string job_token;  // the token the store was built with

  // A communicator of this job with `options` (its job_token replaced by the job's). Every
  // rank must connect the same communicators in the same order.
  std::unique_ptr<CollectiveCommunication> Connect(CommunicationOptions options) const {
    options.job_token = job_token;
    return CreateCommunication(spec, store, options);
  }
};

// In a rank started by RunLocalLauncher: rank 0 hosts the store and reports its port, the others
// read MASTER_PORT. The job id is `job_prefix`-port; the store uses `options`' timeout and token.
Job JoinLocalJob(const std::string& job_prefix, int world_size,
                 const CommunicationOptions& options);
inline std::unique_ptr<CollectiveCommunication> ConnectLocalRank(
    const std::string& job_prefix, int world_size, const CommunicationOptions& options) {
  return JoinLocalJob(job_prefix, world_size, options).Connect(options);
}

#ifdef COLLECTIVES_WITH_MPI
// Under an MPI launcher, MPI initialised: rank 0 hosts the store on a port the kernel picks and
// broadcasts it. The store's address is MASTER_ADDR if set, else 127.0.0.1 when every rank
// shares this host, else rank 0's host name. `launcher` gets a description for the header.
Job JoinMpiJob(const std::string& job_prefix, const CommunicationOptions& options,
               std::string* launcher);
inline std::unique_ptr<CollectiveCommunication> ConnectMpiRank(
    const std::string& job_prefix, const CommunicationOptions& options, std::string* launcher) {
  return JoinMpiJob(job_prefix, options, launcher).Connect(options);
}
#endif

}  // namespace collectives::perf

#endif  // COLLECTIVES_BENCH_LOCAL_LAUNCHER_H_
