// The --help footer of the programs that build a communicator from their environment
// (collectives_perf, packing_perf, examples/train/train): how to launch their ranks, and what
// they read from the environment. Header only.
#ifndef COLLECTIVES_BENCH_LAUNCH_HELP_H_
#define COLLECTIVES_BENCH_LAUNCH_HELP_H_

#include <string>

namespace collectives::bench {

// How the ranks of `program` meet (the environment the library reads, and mpirun), then the
// library's own variables. `own_ways` comes first: the program's flags that start ranks (e.g.
// "--local N"), one per line, or nothing.
inline std::string LaunchHelp(const std::string& program, const std::string& own_ways = "") {
  std::string text = "Launching N ranks (alone, it is a single rank):\n" + own_ways;
  text += "  mpirun -np N -x MASTER_ADDR=HOST -x MASTER_PORT=PORT " + program + " ...\n";
  text += "  RANK=r WORLD_SIZE=N MASTER_ADDR=HOST MASTER_PORT=PORT " + program +
          " ...   (each rank r, as torchrun does)\n";
  text +=
      "  TF_CONFIG='{\"cluster\":{\"worker\":[\"h0:p\",...]},\"task\":{\"type\":\"worker\","
      "\"index\":r}}' " +
      program + " ...\n";
  text +=
      "Environment: TF_CONFIG; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE; "
      "mpirun's OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE; and the "
      "library's COLLECTIVES_JOB_ID, COLLECTIVES_JOB_TOKEN, COLLECTIVES_LISTEN_ADDRESS, "
      "COLLECTIVES_STORE_LISTEN_ADDRESS, COLLECTIVES_HOST_ID, COLLECTIVES_SHM, "
      "COLLECTIVES_SHM_SLOT_BYTES, COLLECTIVES_SOCKET_RCVBUF, COLLECTIVES_SOCKET_SNDBUF, "
      "COLLECTIVES_YIELD_US, COLLECTIVES_KERNEL_ISA (docs/tuning.md says what each does).";
  return text;
}

}  // namespace collectives::bench

#endif  // COLLECTIVES_BENCH_LAUNCH_HELP_H_
