// This rank's communicators in collectives_perf: the one the sweep times, those timed beside it
// (--versus), and how the ranks were started. The bootstrap (bench/collectives_perf.cc) fills
// it; the runs time its communicators and the report names them.
#ifndef COLLECTIVES_BENCH_PERF_SESSION_H_
#define COLLECTIVES_BENCH_PERF_SESSION_H_

#include <memory>
#include <string>
#include <vector>

#include "collectives/collectives.h"

namespace collectives::perf {

// A configuration timed beside ours (--versus): its name and its communicator.
struct Versus {
  std::string name;
  std::unique_ptr<CollectiveCommunication> comm;
};

struct Session {
  std::unique_ptr<CollectiveCommunication> comm;
  // With --impl nccl: a RING communicator of the same job for the sweep's own bookkeeping on
  // host memory (the slowest rank's time, the wrong-element count), which NCCL does not take.
  std::unique_ptr<CollectiveCommunication> control;
  std::shared_ptr<Store> store;  // the job's, for --baseline nccl's unique id
  std::vector<Versus> versus;
  std::string launcher;  // how the ranks were started, for the header
  bool mpi = false;      // MPI is initialised and the MPI baseline is available
};
}  // namespace collectives::perf

#endif  // COLLECTIVES_BENCH_PERF_SESSION_H_
