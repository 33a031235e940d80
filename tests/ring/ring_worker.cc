// One rank of a multi-process test, started by multiprocess_test.cc with RANK, WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT in its environment.
//
//   ring_worker check [large]  runs the whole collective matrix and packed lists (blocking and
//                              asynchronous); exit 0 iff every element is right
//   ring_worker loop [collective [count [timeout_ms]]]
//                              runs the collective (all_reduce, broadcast, all_gather, reduce,
//                              gather, or send_recv: messages between ranks 2k and 2k+1; default
//                              all_reduce of 4 Mi floats = 16 MiB) in a loop, printing "ready"
//                              after the first (which runs under a 60 s deadline; timeout_ms
//                              applies to the later calls); on an Error prints
//                              "error <code> <message>" and exits 20 + code
//   ring_worker identity count...
//                              all-reduces random floats whose sum depends on the order of the
//                              additions (tests/ring/float_inputs.h), f32 with kSum and f16 with
//                              kAvg, of each count; prints per call "identity <dtype> <op>
//                              <count> <fingerprint of the result> <algorithm>", and "<k> far"
//                              for the elements not within rounding of the exact result; exit 0
//                              iff none is (the test compares the fingerprints across ranks).
//                              Each call is repeated in pieces (core::InternalCommunication, the
//                              packer's fused bucket: the same input cut into three tensors),
//                              which must give the same bits, counted as far where it does not
//   ring_worker abort_exit go_file
//                              rank 0 issues an all-reduce the others do not join yet, calls
//                              Abort while it is in flight and exits at once (exit code 0);
//                              the other ranks join once go_file exists (the test creates it
//                              when rank 0 has exited) and print "error <code> <message>"
//                              (exit 20 + code), or "joined" if theirs succeeded
//   ring_worker late timeout_ms late_ms pause_ms
//                              set-up under timeout_ms, rank 1 starting it late_ms late; then
//                              rank 1 waits pause_ms and every rank all-reduces once, printing
//                              "joined" (the set-up's deadline must not cut later calls short)
//   ring_worker mismatch collective
//                              one broadcast (root $RING_WORKER_ROOT, default 0), all_reduce
//                              or all_gather of $RING_WORKER_COUNT (default 1000) int32, or a
//                              reduce_scatter of blocks of count / size, out of place into a
//                              recv filled with -7, or one barrier; $RING_WORKER_COLLECTIVE, when
//                              set, names this rank's instead; prints "returned" or "error <code>
//                              <message>", then "recv untouched" or "recv written"
//   ring_worker rooted [large]
//                              runs reduce, gather, scatter and all-to-all over every dtype,
//                              op, count and root (tests/ring/rooted_checks.h), and messages
//                              around the ring of every dtype (13 elements and `large`); exit 0
//                              iff every element is right ("rank R: rooted 0 wrong")
//   ring_worker scale
//                              prints "rank R: setup connections C ms T" (the TCP connections
//                              this process holds once the communicator is built, and how long
//                              that took), then runs every collective at small sizes with the
//                              thresholds lowered so that each all-reduce algorithm runs
//                              (recursive doubling, halving-doubling, ring), an all-to-all and a
//                              message to a peer that is no set-up partner (rank ^ (size/2 + 1)),
//                              checked against the references of collective_checks.h and
//                              rooted_checks.h; prints "rank R: connections C" and
//                              "rank R: scale W wrong"; exit 0 iff W is 0
// RING_WORKER_IMPL=ring|auto (default auto) picks the implementation, RING_WORKER_ALGORITHM
// forces CommunicationOptions::algorithm; in check mode the worker
// also prints the all-reduce algorithm of the large size ("algorithm <name>").
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/collectives.h"
#include "src/core/internal_communication.h"
#include "src/ring/ring_communication.h"
#include "src/transport/tcp_fabric.h"
#include "tests/ring/collective_checks.h"
#include "tests/ring/float_inputs.h"
#include "tests/ring/rooted_checks.h"

using namespace collectives;

namespace {

// The "scale" mode: every collective once or twice at small sizes, each checked.
int RunScaleChecks(CollectiveCommunication& comm) {
  const int n = comm.size();
  const int rank = comm.rank();
  size_t wrong = 0;
  std::string first;
  auto note = [&](size_t w, const std::string& what) {
    if (w > 0 && first.empty()) first = what;
    wrong += w;
  };
  auto run = [&](const std::string& c, DataType d, ReduceOp o, size_t count, bool in_place,
                 int root) {
    const testing::CheckResult r = testing::CheckCollective(comm, c, d, o, count, in_place, root);
    note(r.wrong, r.first);
  };
  // 7 floats: recursive doubling; 512: halving-doubling (a power-of-two world) or the ring;
  // 4099: the ring in chunks of 1 KiB.
  for (size_t count : {size_t{7}, size_t{512}, size_t{4099}}) {
    run("all_reduce", DataType::kFloat32, ReduceOp::kSum, count, false, 0);
  }
  run("all_reduce", DataType::kInt32, ReduceOp::kMax, 513, true, 0);
  run("all_reduce", DataType::kFloat64, ReduceOp::kAvg, 7, false, 0);
  run("reduce_scatter", DataType::kFloat32, ReduceOp::kSum, 3, false, 0);
  run("reduce_scatter", DataType::kInt64, ReduceOp::kMin, 300, true, 0);
  run("all_gather", DataType::kInt32, ReduceOp::kSum, 5, false, 0);
  run("all_gather", DataType::kFloat32, ReduceOp::kSum, 70, true, 0);
  run("broadcast", DataType::kFloat32, ReduceOp::kSum, 9, false, n - 1);
  run("broadcast", DataType::kInt8, ReduceOp::kSum, 3000, true, n / 3);
  testing::Failures f;
  testing::CheckReduce(comm, DataType::kFloat32, ReduceOp::kSum, 9, false, n / 2, f);
  testing::CheckReduce(comm, DataType::kInt32, ReduceOp::kMax, 600, true, 0, f);
  testing::CheckGather(comm, DataType::kInt64, 3, false, 1 % n, f);
  testing::CheckScatter(comm, DataType::kFloat32, 4, false, n - 1, f);
  testing::CheckAllToAll(comm, DataType::kInt32, 2, {}, f);
  testing::CheckPointToPointRing(comm, 5, f);
  // A message to a peer that is not a set-up partner: its connection is made now.
  const int partner = rank ^ (n / 2 + 1);
  if (n >= 8 && (n & (n - 1)) == 0) {
    std::vector<int32_t> out(11), in(11, -1);
    for (size_t i = 0; i < out.size(); ++i) out[i] = int32_t(rank * 100 + int(i));
    const Tensor out_t{out.data(), out.size(), DataType::kInt32};
    const Tensor in_t{in.data(), in.size(), DataType::kInt32};
    if (rank < partner) {
      comm.Send(out_t, partner, 7);
      comm.Recv(in_t, partner, 7);
    } else {
      comm.Recv(in_t, partner, 7);
      comm.Send(out_t, partner, 7);
    }
    for (size_t i = 0; i < in.size(); ++i) {
      f.Check("rank " + std::to_string(rank) + " message from rank " + std::to_string(partner), i,
              in[i], partner * 100 + int(i));
    }
  }
  comm.Barrier();
  note(f.wrong, f.first);
  if (!first.empty()) std::fprintf(stderr, "%s\n", first.c_str());
  std::printf("rank %d: connections %d\n", rank, transport::TcpConnectionsOpen());
  std::printf("rank %d: scale %zu wrong\n", rank, wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  try {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(60);
    if (const char* impl = std::getenv("RING_WORKER_IMPL")) {
      options.implementation = ParseImplementation(impl);
    }
    if (const char* algorithm = std::getenv("RING_WORKER_ALGORITHM")) {
      options.algorithm = algorithm;
    }
    const ClusterSpec spec = ClusterSpec::FromEnvironment();
    if (mode == "late") {
      options.timeout = std::chrono::milliseconds(std::stol(argv[2]));
      if (spec.rank == 1)
        std::this_thread::sleep_for(std::chrono::milliseconds(std::stol(argv[3])));
    }
    if (mode == "scale") {
      options.small_message_bytes = 256;
      options.medium_message_bytes = 4096;
      options.chunk_bytes = 1024;
    }
    const auto setup_start = std::chrono::steady_clock::now();
    auto comm = CreateCommunication(spec, options);
    if (mode == "scale") {
      const double setup_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - setup_start)
              .count();
      std::printf("rank %d: setup connections %d ms %.1f\n", comm->rank(),
                  transport::TcpConnectionsOpen(), setup_ms);
      std::fflush(stdout);
      return RunScaleChecks(*comm);
    }
    if (mode == "late") {
      if (comm->rank() == 1)
        std::this_thread::sleep_for(std::chrono::milliseconds(std::stol(argv[4])));
      std::vector<float> data(1000, 1.0f);
      comm->AllReduce(Tensor{data.data(), data.size(), DataType::kFloat32}, ReduceOp::kSum);
      std::printf("joined %s\n", data[999] == float(comm->size()) ? "right" : "wrong");
      return 0;
    }
    if (mode == "check") {
      const size_t large = argc > 2 ? std::stoul(argv[2]) : 0;
      std::vector<std::string> failures;
      const size_t wrong =
          testing::CheckMatrix(*comm, large, &failures) + testing::CheckPacked(*comm, &failures);
      for (const std::string& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
      std::printf("rank %d: algorithm %s\n", comm->rank(),
                  comm->AllReduceAlgorithm(large * sizeof(float)).c_str());
      std::printf("rank %d: %zu wrong\n", comm->rank(), wrong);
      return wrong == 0 ? 0 : 1;
    }
    if (mode == "rooted") {
      const size_t large = argc > 2 ? std::stoul(argv[2]) : 0;
      testing::Failures failures;
      testing::CheckRootedMatrix(*comm, large, failures);
      testing::CheckPointToPointRing(*comm, 13, failures);
      if (large > 0) testing::CheckPointToPointRing(*comm, large, failures);
      if (failures.wrong > 0) std::fprintf(stderr, "%s\n", failures.first.c_str());
      std::printf("rank %d: rooted %zu wrong\n", comm->rank(), failures.wrong);
      return failures.wrong == 0 ? 0 : 1;
    }
    if (mode == "identity") {
      const int n = comm->size();
      size_t far = 0;
      for (int a = 2; a < argc; ++a) {
        const size_t count = std::stoul(argv[a]);
        for (const auto& [dtype, op] : {std::pair{DataType::kFloat32, ReduceOp::kSum},
                                        std::pair{DataType::kFloat16, ReduceOp::kAvg}}) {
          std::vector<std::vector<uint8_t>> inputs;
          for (int r = 0; r < n; ++r) {
            inputs.push_back(testing::RandomFloats(dtype, count, r, count));
          }
          // In place for every other count, else out of place from a copy.
          std::vector<uint8_t> result = inputs[size_t(comm->rank())];
          if (a % 2 == 0) {
            comm->AllReduce(Tensor{result.data(), count, dtype}, op);
          } else {
            std::vector<uint8_t> send = result;
            comm->AllReduce(Tensor{send.data(), count, dtype}, Tensor{result.data(), count, dtype},
                            op);
          }
          for (size_t i = 0; i < count; ++i) {
            std::string why;
            if (!testing::CloseToExactSum(dtype, op, inputs, i,
                                          testing::FloatAt(dtype, result.data(), i), &why)) {
              if (far++ < 5) std::fprintf(stderr, "%s\n", why.c_str());
            }
          }
          // The same in pieces: [0, count / 3), [count / 3, count / 3 + 1), the rest.
          std::vector<uint8_t> pieces = inputs[size_t(comm->rank())];
          const size_t es = SizeOf(dtype);
          const size_t cuts[] = {0, count / 3, std::min(count, count / 3 + 1), count};
          std::vector<Tensor> tensors;
          for (int k = 0; k < 3; ++k) {
            tensors.push_back(Tensor{pieces.data() + cuts[k] * es, cuts[k + 1] - cuts[k], dtype});
          }
          core::Internal(*comm)->AllReduce(tensors, op, core::CallOptions{});
          if (pieces != result) {
            if (far++ < 5) {
              std::fprintf(stderr, "rank %d: %s %s of %zu in pieces: not the one-buffer bits\n",
                           comm->rank(), ToString(dtype), ToString(op), count);
            }
          }
          std::printf("rank %d: identity %s %s %zu %016" PRIx64 " %s\n", comm->rank(),
                      ToString(dtype), ToString(op), count,
                      testing::Fingerprint(result.data(), result.size()),
                      comm->AllReduceAlgorithm(result.size()).c_str());
        }
      }
      std::printf("rank %d: %zu far\n", comm->rank(), far);
      return far == 0 ? 0 : 1;
    }
    if (mode == "mismatch") {
      const char* collective_env = std::getenv("RING_WORKER_COLLECTIVE");
      const std::string collective = collective_env != nullptr ? collective_env
                                     : argc > 2                ? argv[2]
                                                               : "broadcast";
      const char* root_env = std::getenv("RING_WORKER_ROOT");
      const char* count_env = std::getenv("RING_WORKER_COUNT");
      const int root = root_env != nullptr ? std::atoi(root_env) : 0;
      const size_t count = count_env != nullptr ? std::stoul(count_env) : 1000;
      const size_t n = size_t(comm->size());
      std::vector<int32_t> send(count + 1, 100 + comm->rank());
      std::vector<int32_t> recv(collective == "all_gather" ? n * count + 1 : count + 1, -7);
      const Tensor in{send.data(), count, DataType::kInt32};
      try {
        if (collective == "broadcast") {
          comm->Broadcast(in, Tensor{recv.data(), count, DataType::kInt32}, root);
        } else if (collective == "all_reduce") {
          comm->AllReduce(in, Tensor{recv.data(), count, DataType::kInt32}, ReduceOp::kSum);
        } else if (collective == "reduce_scatter") {  // a block each of count / n
          comm->ReduceScatter(Tensor{send.data(), count / n * n, DataType::kInt32},
                              Tensor{recv.data(), count / n, DataType::kInt32}, ReduceOp::kSum);
        } else if (collective == "barrier") {
          comm->Barrier();
        } else {
          comm->AllGather(in, Tensor{recv.data(), n * count, DataType::kInt32});
        }
        std::printf("rank %d: returned\n", comm->rank());
      } catch (const Error& e) {
        std::printf("rank %d: error %d %s\n", comm->rank(), int(e.code()), e.what());
      }
      const bool untouched =
          std::all_of(recv.begin(), recv.end(), [](int32_t v) { return v == -7; });
      std::printf("rank %d: recv %s\n", comm->rank(), untouched ? "untouched" : "written");
      return 0;
    }
    if (mode == "abort_exit") {
      std::vector<float> data(1000, 1.0f);
      const Tensor tensor{data.data(), data.size(), DataType::kFloat32};
      comm->AllReduce(tensor, ReduceOp::kSum);  // every connection is up
      if (comm->rank() == 0) {
        auto work = comm->AllReduceAsync(tensor, tensor, ReduceOp::kSum);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the call blocks
        comm->Abort();  // the progress thread drives the call
        _exit(0);       // at once: no destructor runs, nothing more is sent
      }
      const std::string go_file = argc > 2 ? argv[2] : "";
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (access(go_file.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      comm->AllReduce(tensor, ReduceOp::kSum);
      std::printf("joined\n");
      return 0;
    }
    if (mode == "loop") {
      const std::string collective = argc > 2 ? argv[2] : "all_reduce";
      const size_t count = argc > 3 ? std::stoul(argv[3]) : size_t{4} << 20;
      std::vector<float> data(count, 1.0f);
      const bool gathers = collective == "all_gather" || collective == "gather";
      std::vector<float> gathered(gathers ? count * comm->size() : 0);
      std::vector<float> received(count, 0.0f);
      const Tensor tensor{data.data(), data.size(), DataType::kFloat32};
      for (long i = 0;; ++i) {
        if (collective == "all_reduce") {
          comm->AllReduce(tensor, ReduceOp::kMax);
        } else if (collective == "broadcast") {
          comm->Broadcast(tensor, int(i % comm->size()));
        } else if (collective == "all_gather") {
          comm->AllGather(tensor, Tensor{gathered.data(), gathered.size(), DataType::kFloat32});
        } else if (collective == "reduce") {
          comm->Reduce(tensor, Tensor{received.data(), count, DataType::kFloat32}, ReduceOp::kSum,
                       int(i % comm->size()));
        } else if (collective == "gather") {
          comm->Gather(tensor, Tensor{gathered.data(), gathered.size(), DataType::kFloat32},
                       int(i % comm->size()));
        } else if (collective == "send_recv") {  // ranks 2k and 2k+1 trade messages
          const int partner = comm->rank() ^ 1;
          const Tensor in{received.data(), count, DataType::kFloat32};
          if (partner < comm->size() && comm->rank() % 2 == 0) {
            comm->Send(tensor, partner, i);
            comm->Recv(in, partner, i);
          } else if (partner < comm->size()) {
            comm->Recv(in, partner, i);
            comm->Send(tensor, partner, i);
          }
        } else {
          std::fprintf(stderr, "unknown collective '%s'\n", collective.c_str());
          return 2;
        }
        if (i == 0) {
          // The loop's deadline applies to its collectives after the first: the set-up and the
          // first call keep the long timeout, so a worker that a loaded machine starts late, or
          // starves through its first call, still joins.
          if (argc > 4) comm->SetTimeout(std::chrono::milliseconds(std::stol(argv[4])));
          std::printf("ready\n");
          std::fflush(stdout);
        }
      }
    }
    std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
    return 2;
  } catch (const Error& e) {
    std::printf("error %d %s\n", int(e.code()), e.what());
    std::fflush(stdout);
    return 20 + int(e.code());
  }
}
