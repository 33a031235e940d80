// The smallest embedding: build a communicator from the environment (TF_CONFIG, torchrun-style
// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, mpirun, or srun) and
// all-reduce a vector of gradients. Run alone it is a single rank.
//
//   RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 ./allreduce_example &
//   RANK=1 WORLD_SIZE=2 MASTER_PORT=29500 ./allreduce_example
#include <cstdio>
#include <cstring>
#include <vector>

#include "collectives/collectives.h"

// --help: how to launch the ranks and what the library reads from the environment.
constexpr const char* kUsage =
    "usage: allreduce_example   (no arguments: the job comes from the environment)\n"
    "Launching N ranks (alone, it is a single rank):\n"
    "  mpirun -np N allreduce_example\n"
    "  srun -n N allreduce_example\n"
    "  RANK=r WORLD_SIZE=N MASTER_ADDR=HOST MASTER_PORT=PORT allreduce_example   (each rank r)\n"
    "  TF_CONFIG='{\"cluster\": ..., \"task\": ...}' allreduce_example   (each rank its task)\n"
    "Environment: TF_CONFIG; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; mpirun's\n"
    "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (and its PMIx server); srun's SLURM_PROCID,\n"
    "SLURM_NTASKS, SLURM_STEP_NODELIST, SLURM_JOB_ID; the library's COLLECTIVES_* variables\n"
    "(COLLECTIVES_JOB_TOKEN, COLLECTIVES_SHM, ...: docs/tuning.md).\n";

int main(int argc, char** argv) {
  if (argc > 1) {  // no arguments but --help
    const bool help = std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0;
    std::fputs(kUsage, help ? stdout : stderr);
    return help ? 0 : 2;
  }
  try {
    auto comm = collectives::CreateCommunication(collectives::ClusterSpec::FromEnvironment());
    std::vector<float> gradients(1000, float(comm->rank() + 1));
    comm->AllReduce(
        collectives::Tensor{gradients.data(), gradients.size(), collectives::DataType::kFloat32},
        collectives::ReduceOp::kAvg);
    std::printf("rank %d of %d: average gradient %.2f\n", comm->rank(), comm->size(), gradients[0]);
    return 0;
  } catch (const collectives::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
