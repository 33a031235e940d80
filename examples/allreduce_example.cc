// The smallest embedding: build a communicator from the environment (TF_CONFIG, torchrun-style
// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or mpirun's OMPI_COMM_WORLD_* with MASTER_*) and
// all-reduce a vector of gradients. Run alone it is a single rank.
//
//   RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 ./allreduce_example &
//   RANK=1 WORLD_SIZE=2 MASTER_PORT=29500 ./allreduce_example
#include <cstdio>
#include <vector>

#include "collectives/collectives.h"

int main() {
  try {
    auto comm = collectives::CreateCommunication(collectives::ClusterSpec::FromEnvironment());
    std::vector<float> gradients(1000, float(comm->rank() + 1));
    comm->AllReduce(collectives::Tensor{gradients.data(), gradients.size(),
                                        collectives::DataType::kFloat32},
                    collectives::ReduceOp::kAvg);
    std::printf("rank %d of %d: average gradient %.2f\n", comm->rank(), comm->size(),
                gradients[0]);
    return 0;
  } catch (const collectives::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
