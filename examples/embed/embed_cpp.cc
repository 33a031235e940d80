// Embedding from C++: someone else's training loop (a linear regression fitted by plain
// full-batch gradient descent on synthetic data, no strategy layer) made data-parallel with the
// library in a few lines, marked "collectives:" below: join the job, then average the gradient
// list over the ranks every step. Each rank holds its own shard of the data; since the shards
// are equally large, the averaged gradient is the gradient over all shards, and every rank
// applies the same update to the same weights.
//
// The job comes from the environment (see ClusterSpec::FromEnvironment): run alone it is a
// single rank; with torchrun-style variables
//   RANK=1 WORLD_SIZE=2 MASTER_PORT=29500 ./embed_cpp &
//   RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 ./embed_cpp
// or under mpirun, which sets OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE:
//   mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT=29500 ./embed_cpp
//
// Rank 0 prints the loss every 20 steps; every rank prints a checksum of its final weights, which
// must be equal on every rank. embed_c.c is the same program in C through c_api.h.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "collectives/collectives.h"

namespace {

constexpr int kFeatures = 8;
constexpr int kSamplesPerRank = 256;
constexpr int kSteps = 200;
constexpr int kPrintEvery = 20;
constexpr float kLearningRate = 0.1f;

// A seeded generator (PCG's LCG step): uniform floats in [-1, 1). The same as in embed_c.c.
struct Random {
  uint64_t state;
  float Next() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return float(state >> 40) / float(1 << 24) * 2.0f - 1.0f;
  }
};

// FNV-1a over the bytes of the weights: equal bits give equal checksums.
uint64_t Checksum(const std::vector<float>& w, float b) {
  uint64_t hash = 14695981039346656037ULL;
  auto add = [&hash](const void* data, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) {
      hash = (hash ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ULL;
    }
  };
  add(w.data(), w.size() * sizeof(float));
  add(&b, sizeof(b));
  return hash;
}

}  // namespace

// --help: how to launch the ranks and what the library reads from the environment.
constexpr const char* kUsage =
    "usage: embed_cpp   (no arguments: the job comes from the environment)\n"
    "Launching N ranks (alone, it is a single rank):\n"
    "  mpirun -np N -x MASTER_ADDR=HOST -x MASTER_PORT=PORT embed_cpp\n"
    "  RANK=r WORLD_SIZE=N MASTER_ADDR=HOST MASTER_PORT=PORT embed_cpp   (each rank r)\n"
    "  TF_CONFIG='{\"cluster\": ..., \"task\": ...}' embed_cpp   (each rank its task)\n"
    "Environment: TF_CONFIG; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; mpirun's\n"
    "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE; the library's COLLECTIVES_* variables\n"
    "(COLLECTIVES_JOB_TOKEN, COLLECTIVES_SHM, ...: docs/tuning.md).\n";

int main(int argc, char** argv) {
  if (argc > 1) {  // no arguments but --help
    const bool help = std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0;
    std::fputs(kUsage, help ? stdout : stderr);
    return help ? 0 : 2;
  }
  try {
    // collectives: join the job described by the environment.
    auto comm = collectives::CreateCommunication(collectives::ClusterSpec::FromEnvironment());
    const int rank = comm->rank();

    // The trainer's shard of data: y = x . w_true + b_true + noise, drawn with a per-rank seed.
    Random random{uint64_t(rank) + 1};
    std::vector<float> x(size_t(kSamplesPerRank) * kFeatures), y(kSamplesPerRank);
    for (int s = 0; s < kSamplesPerRank; ++s) {
      float target = 0.5f;  // b_true
      for (int j = 0; j < kFeatures; ++j) {
        const float w_true = (j % 2 == 0 ? 1.0f : -1.0f) * (0.25f + 0.125f * float(j));
        x[size_t(s) * kFeatures + j] = random.Next();
        target += w_true * x[size_t(s) * kFeatures + j];
      }
      y[s] = target + 0.01f * random.Next();
    }

    // The model, its gradients, and plain gradient descent on the mean squared error.
    std::vector<float> w(kFeatures, 0.0f), grad_w(kFeatures);
    float b = 0.0f, grad_b = 0.0f;
    for (int step = 0; step <= kSteps; ++step) {
      float loss = 0.0f;
      grad_w.assign(kFeatures, 0.0f);
      grad_b = 0.0f;
      for (int s = 0; s < kSamplesPerRank; ++s) {
        const float* xs = &x[size_t(s) * kFeatures];
        float prediction = b;
        for (int j = 0; j < kFeatures; ++j) prediction += w[j] * xs[j];
        const float error = prediction - y[s];
        loss += error * error / kSamplesPerRank;
        for (int j = 0; j < kFeatures; ++j) grad_w[j] += 2.0f * error * xs[j] / kSamplesPerRank;
        grad_b += 2.0f * error / kSamplesPerRank;
      }

      if (step % kPrintEvery == 0) {
        // collectives: the loss over every shard, for the log.
        comm->AllReduce(collectives::Tensor{&loss, 1, collectives::DataType::kFloat32},
                        collectives::ReduceOp::kAvg);
        if (rank == 0) std::printf("step %3d  loss %.6f\n", step, double(loss));
      }
      if (step == kSteps) break;

      // collectives: average the gradient list over the ranks (fused into one bucket).
      collectives::packing::AllReduce(
          *comm,
          {{grad_w.data(), grad_w.size(), collectives::DataType::kFloat32},
           {&grad_b, 1, collectives::DataType::kFloat32}},
          collectives::ReduceOp::kAvg);

      for (int j = 0; j < kFeatures; ++j) w[j] -= kLearningRate * grad_w[j];
      b -= kLearningRate * grad_b;
    }

    if (rank == 0) {
      std::printf("w =");
      for (float v : w) std::printf(" %.4f", double(v));
      std::printf("  b = %.4f\n", double(b));
    }
    std::printf("rank %d of %d: final weights checksum %016" PRIx64 "\n", rank, comm->size(),
                Checksum(w, b));
    return 0;
  } catch (const collectives::Error& e) {
    std::fprintf(stderr, "embed_cpp: %s\n", e.what());
    return 1;
  }
}
