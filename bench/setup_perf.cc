// setup_perf: what building a communicator costs a rank, by world size: the set-up's wall time,
// the descriptors it opened (sockets: the listener and the data connections), and the first and
// a steady all-reduce of 4 bytes after it. One line per run, printed by rank 0:
//
//   setup_perf --local 64 [--impl ring] [-n 20]
//   # ranks 64 impl ring connect on-demand
//   setup_ms max 812.4 median 640.2  fds max 10 median 9  first_us 2210  allreduce_us 540
//
// Every rank starts its set-up at once, after a barrier through the store. fds: the descriptors
// the rank holds after CreateCommunication minus those before, over ranks 1..n-1 (the listener,
// the data connections and the event loop's own three). Run it
// with COLLECTIVES_CONNECT=all for the full mesh (the default connects on demand). The steady
// all-reduce is the median of -n calls of the slowest rank. Only the public API is used.
#include <dirent.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/local_launcher.h"
#include "collectives/collectives.h"

namespace {

using namespace collectives;
using namespace collectives::perf;
using Clock = std::chrono::steady_clock;

int OpenDescriptors() {
  int count = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir) != nullptr) ++count;
    closedir(dir);
  }
  return count;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int local = 0;
  int iters = 20;
  std::string impl = "ring";
  CLI::App app{"setup_perf: a communicator's set-up time and descriptors per rank"};
  app.add_option("--local", local, "Start this many ranks as processes on loopback")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--impl", impl, "ring or auto")->check(CLI::IsMember({"ring", "auto"}));
  app.add_option("-n,--iters", iters, "Timed 4-byte all-reduces after the first")
      ->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);
  if (!IsLocalChild()) {
    return RunLocalLauncher("setup_perf", local, argv, std::chrono::seconds(120));
  }
  try {
    CommunicationOptions options;
    options.implementation = ParseImplementation(impl);
    options.timeout = std::chrono::seconds(120);
    const Job job = JoinLocalJob("setup_perf", local, options);
    // Every rank starts its set-up once all have started (a process started late would
    // otherwise count in every rank's time): a barrier through the store.
    if (job.store->Add("setup_perf/started", 1) == local) job.store->Set("setup_perf/go", "1");
    job.store->Get("setup_perf/go", std::chrono::seconds(120));
    const int fds_before = OpenDescriptors();
    const auto start = Clock::now();
    auto comm = job.Connect(options);
    const double setup_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    const int fds = OpenDescriptors() - fds_before;

    float one = 1;
    const Tensor tensor{&one, 1, DataType::kFloat32};
    auto time_call = [&] {
      const auto t0 = Clock::now();
      comm->AllReduce(tensor, ReduceOp::kMax);
      return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    };
    const double first_us = time_call();
    std::vector<double> steady;
    for (int i = 0; i < iters; ++i) steady.push_back(time_call());

    // Gather every rank's figures at rank 0: set-up ms, descriptors, first, steady.
    const int n = comm->size();
    std::vector<double> mine = {setup_ms, double(fds), first_us, Median(steady)};
    std::vector<double> all(mine.size() * size_t(n));
    comm->AllGather(Tensor{mine.data(), mine.size(), DataType::kFloat64},
                    Tensor{all.data(), all.size(), DataType::kFloat64});
    if (comm->rank() == 0) {
      std::vector<double> setup, descriptors;
      double first = 0, allreduce = 0;
      for (int r = 0; r < n; ++r) {
        setup.push_back(all[size_t(r) * 4]);
        if (r > 0 || n == 1) descriptors.push_back(all[size_t(r) * 4 + 1]);
        first = std::max(first, all[size_t(r) * 4 + 2]);
        allreduce = std::max(allreduce, all[size_t(r) * 4 + 3]);
      }
      const char* connect = std::getenv("COLLECTIVES_CONNECT");
      std::printf("# ranks %d impl %s connect %s\n", n, impl.c_str(),
                  connect != nullptr && std::string(connect) == "all" ? "all" : "on-demand");
      std::printf(
          "setup_ms max %.1f median %.1f  fds max %.0f median %.0f  first_us %.0f  "
          "allreduce_us %.0f\n",
          *std::max_element(setup.begin(), setup.end()), Median(setup),
          *std::max_element(descriptors.begin(), descriptors.end()), Median(descriptors), first,
          allreduce);
    }
    return kExitOk;
  } catch (const Error& e) {
    std::fprintf(stderr, "setup_perf: %s\n", e.what());
    return kExitError;
  }
}
