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
// Exit codes shared by the benchmarks: 0 success, 1 error, 2 finished but results were wrong.
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

// This process's rank as far as the environment tells before any bootstrap (0 if it does not),
// so that only one rank prints usage errors.
int RankFromEnvironment();

// Starts `world_size` ranks of this program (argv as given) on loopback and waits for them.
// When a rank fails (anything but kExitOk or kExitWrong), the others get two seconds to finish
// on their own, then SIGTERM, then two more seconds, then SIGKILL. Returns the first non-zero
// exit code. `program` prefixes its messages; `timeout` bounds the wait for rank 0's port.
int RunLocalLauncher(const char* program, int world_size, char** argv,
                     std::chrono::milliseconds timeout);

// In a rank started by RunLocalLauncher: rank 0 hosts the store and reports its port, the others
// read MASTER_PORT; all connect with `options`. The job id is `job_prefix`-port.
std::unique_ptr<CollectiveCommunication> ConnectLocalRank(const std::string& job_prefix,
                                                          int world_size,
                                                          const CommunicationOptions& options);

#ifdef COLLECTIVES_WITH_MPI
// Under an MPI launcher, MPI initialised: rank 0 hosts the store on a port the kernel picks and
// broadcasts it. The store's address is MASTER_ADDR if set, else 127.0.0.1 when every rank
// shares this host, else rank 0's host name. `launcher` gets a description for the header.
std::unique_ptr<CollectiveCommunication> ConnectMpiRank(const std::string& job_prefix,
                                                        const CommunicationOptions& options,
                                                        std::string* launcher);
#endif

}  // namespace collectives::perf

#endif  // COLLECTIVES_BENCH_LOCAL_LAUNCHER_H_
