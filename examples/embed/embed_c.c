/* Embedding from C: the training loop of embed_cpp.cc (a linear regression fitted by full-batch
 * gradient descent on synthetic data, each rank with its own shard), in C99 through the C API
 * (collectives/c_api.h). The library calls are marked "collectives:"; every one is checked, and
 * a failure prints the status and coll_last_error().
 *
 * The job comes from the environment, as for embed_cpp: alone it is a single rank; or
 *   RANK=1 WORLD_SIZE=2 MASTER_PORT=29500 ./embed_c &
 *   RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 ./embed_c
 *   mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT=29500 ./embed_c
 *
 * Rank 0 prints the loss every 20 steps; every rank prints a checksum of its final weights, which
 * must be equal on every rank. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "collectives/c_api.h"

enum { FEATURES = 8, SAMPLES_PER_RANK = 256, STEPS = 200, PRINT_EVERY = 20 };
static const float kLearningRate = 0.1f;

/* Uniform floats in [-1, 1); the same generator as embed_cpp.cc. */
static float next_random(uint64_t* state) {
  *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)(*state >> 40) / (float)(1 << 24) * 2.0f - 1.0f;
}

/* FNV-1a over bytes. */
static uint64_t fnv1a(uint64_t hash, const void* data, size_t bytes) {
  size_t i;
  for (i = 0; i < bytes; ++i) hash = (hash ^ ((const unsigned char*)data)[i]) * 1099511628211ULL;
  return hash;
}

/* Runs `call`; on failure prints why and leaves main through `fail`. */
#define CHECK(call)                                                                       \
  do {                                                                                    \
    coll_status status_ = (call);                                                         \
    if (status_ != COLL_OK) {                                                             \
      fprintf(stderr, "embed_c: %s failed: %s: %s\n", #call, coll_status_string(status_), \
              coll_last_error());                                                         \
      goto fail;                                                                          \
    }                                                                                     \
  } while (0)

static float x[SAMPLES_PER_RANK][FEATURES], y[SAMPLES_PER_RANK];

/* --help: how to launch the ranks and what the library reads from the environment. */
static const char kUsage[] =
    "usage: embed_c   (no arguments: the job comes from the environment)\n"
    "Launching N ranks (alone, it is a single rank):\n"
    "  mpirun -np N -x MASTER_ADDR=HOST -x MASTER_PORT=PORT embed_c\n"
    "  RANK=r WORLD_SIZE=N MASTER_ADDR=HOST MASTER_PORT=PORT embed_c   (each rank r)\n"
    "  TF_CONFIG='{\"cluster\": ..., \"task\": ...}' embed_c   (each rank its task)\n"
    "Environment: TF_CONFIG; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; mpirun's\n"
    "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE; the library's COLLECTIVES_* variables\n"
    "(COLLECTIVES_JOB_TOKEN, COLLECTIVES_SHM, ...: docs/tuning.md).\n";

int main(int argc, char** argv) {
  coll_comm* comm = NULL;
  coll_work* loss_work = NULL;
  int rank = 0, size = 1, step, s, j;
  uint64_t random_state;
  float w[FEATURES] = {0}, grad_w[FEATURES], b = 0.0f, grad_b;
  void* gradients[2];
  size_t counts[2] = {FEATURES, 1};

  if (argc > 1) { /* no arguments but --help */
    const int help = strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0;
    fputs(kUsage, help ? stdout : stderr);
    return help ? 0 : 2;
  }

  /* collectives: join the job described by the environment. */
  CHECK(coll_comm_create_from_env(NULL, &comm));
  CHECK(coll_comm_rank(comm, &rank));
  CHECK(coll_comm_size(comm, &size));

  /* The trainer's shard: y = x . w_true + b_true + noise, drawn with a per-rank seed. */
  random_state = (uint64_t)rank + 1;
  for (s = 0; s < SAMPLES_PER_RANK; ++s) {
    float target = 0.5f;
    for (j = 0; j < FEATURES; ++j) {
      const float w_true = (j % 2 == 0 ? 1.0f : -1.0f) * (0.25f + 0.125f * (float)j);
      x[s][j] = next_random(&random_state);
      target += w_true * x[s][j];
    }
    y[s] = target + 0.01f * next_random(&random_state);
  }

  gradients[0] = grad_w;
  gradients[1] = &grad_b;
  for (step = 0; step <= STEPS; ++step) {
    float loss = 0.0f; /* borrowed by loss_work until it is freed, in this iteration */
    for (j = 0; j < FEATURES; ++j) grad_w[j] = 0.0f;
    grad_b = 0.0f;
    for (s = 0; s < SAMPLES_PER_RANK; ++s) {
      float prediction = b, error;
      for (j = 0; j < FEATURES; ++j) prediction += w[j] * x[s][j];
      error = prediction - y[s];
      loss += error * error / SAMPLES_PER_RANK;
      for (j = 0; j < FEATURES; ++j) grad_w[j] += 2.0f * error * x[s][j] / SAMPLES_PER_RANK;
      grad_b += 2.0f * error / SAMPLES_PER_RANK;
    }

    if (step % PRINT_EVERY == 0) {
      /* collectives: the loss over every shard, for the log, issued asynchronously: it travels
       * while this rank goes on to the gradient all-reduce and the update. */
      CHECK(coll_all_reduce_async(comm, &loss, &loss, 1, COLL_FLOAT32, COLL_AVG, &loss_work));
    }
    if (step < STEPS) {
      /* collectives: average the gradient list over the ranks (fused into one bucket). */
      CHECK(coll_all_reduce_many(comm, gradients, counts, 2, COLL_FLOAT32, COLL_AVG, 0));
      for (j = 0; j < FEATURES; ++j) w[j] -= kLearningRate * grad_w[j];
      b -= kLearningRate * grad_b;
    }
    if (loss_work != NULL) {
      /* collectives: wait for the loss (coll_work_free waits, then releases the handle). */
      coll_work* issued = loss_work;
      loss_work = NULL;
      CHECK(coll_work_free(issued));
      if (rank == 0) printf("step %3d  loss %.6f\n", step, (double)loss);
    }
  }

  if (rank == 0) {
    printf("w =");
    for (j = 0; j < FEATURES; ++j) printf(" %.4f", (double)w[j]);
    printf("  b = %.4f\n", (double)b);
  }
  printf("rank %d of %d: final weights checksum %016" PRIx64 "\n", rank, size,
         fnv1a(fnv1a(14695981039346656037ULL, w, sizeof(w)), &b, sizeof(b)));
  {
    coll_comm* done = comm;
    comm = NULL; /* not destroyed twice if destroying fails */
    CHECK(coll_comm_destroy(done));
  }
  return 0;

fail:
  coll_comm_destroy(comm); /* finishes a collective still in flight */
  coll_work_free(loss_work);
  return 1;
}
