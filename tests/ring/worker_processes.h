// Starts ring_worker processes for the multi-process tests (torchrun-style RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT in their environment), reads their stdout, waits with a deadline, and
// kills what is left. Used by multiprocess_test.cc and fault_test.cc.
#ifndef COLLECTIVES_TESTS_RING_WORKER_PROCESSES_H_
#define COLLECTIVES_TESTS_RING_WORKER_PROCESSES_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/free_port.h"

namespace collectives::testing {

using Clock = std::chrono::steady_clock;


struct Worker {
  pid_t pid = -1;
  int out = -1;  // read end of the worker's stdout
  std::string output;
  int status = -1;
};

// Where and how the workers run: by default on loopback; the network-namespace test runs each
// rank inside `ip netns exec <namespace>` with the master's address in that network.
struct Placement {
  std::string master_addr = "127.0.0.1";
  std::vector<std::string> namespaces;  // one per rank, or empty
  // COLLECTIVES_HOST_ID of each rank (pretend hosts), or empty for the real host's identity.
  std::vector<std::string> host_ids;
  // RING_WORKER_IMPL: "ring" (TCP only) or "auto" (shared memory inside a host).
  std::string implementation = "auto";
  // RING_WORKER_ALGORITHM (CommunicationOptions::algorithm), or empty to let AUTO choose.
  std::string algorithm;
  // The rank started with COLLECTIVES_SHM=0, or -1 for none.
  int shm_off_rank = -1;
  // COLLECTIVES_SHM_SLOT_BYTES of each rank (empty: unset), or empty for none.
  std::vector<std::string> slot_bytes;
  // More of each rank's environment: "NAME=value" entries per rank, or empty for none.
  std::vector<std::vector<std::string>> env;
  // A command each rank runs under (its words before ring_worker's path), or empty for none.
  std::vector<std::vector<std::string>> wrappers;
};

// Starts `size` ring_worker processes with the given arguments.
inline std::vector<Worker> Start(int size, const std::vector<std::string>& args,
                                 const Placement& placement = {}) {
  const std::string port = std::to_string(FreePort());
  const std::string binary = std::string(COLLECTIVES_TEST_BIN_DIR) + "/ring_worker";
  std::vector<Worker> workers(size);
  for (int rank = 0; rank < size; ++rank) {
    int pipe_fds[2];
    EXPECT_EQ(pipe(pipe_fds), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(pipe_fds[1], STDOUT_FILENO);
      close(pipe_fds[0]);
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
      setenv("MASTER_ADDR", placement.master_addr.c_str(), 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      unsetenv("TF_CONFIG");
      setenv("RING_WORKER_IMPL", placement.implementation.c_str(), 1);
      if (rank == placement.shm_off_rank) setenv("COLLECTIVES_SHM", "0", 1);
      if (!placement.algorithm.empty()) {
        setenv("RING_WORKER_ALGORITHM", placement.algorithm.c_str(), 1);
      }
      if (!placement.slot_bytes.empty() && !placement.slot_bytes[size_t(rank)].empty()) {
        setenv("COLLECTIVES_SHM_SLOT_BYTES", placement.slot_bytes[size_t(rank)].c_str(), 1);
      }
      if (!placement.host_ids.empty()) {
        setenv("COLLECTIVES_HOST_ID", placement.host_ids[size_t(rank)].c_str(), 1);
      }
      if (!placement.env.empty()) {
        for (const std::string& entry : placement.env[size_t(rank)]) {
          const size_t eq = entry.find('=');
          setenv(entry.substr(0, eq).c_str(), entry.substr(eq + 1).c_str(), 1);
        }
      }
      std::vector<std::string> command;
      if (!placement.namespaces.empty()) {
        command = {"ip", "netns", "exec", placement.namespaces[size_t(rank)]};
      }
      if (!placement.wrappers.empty()) {
        const std::vector<std::string>& wrapper = placement.wrappers[size_t(rank)];
        command.insert(command.end(), wrapper.begin(), wrapper.end());
      }
      command.push_back(binary);
      command.insert(command.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (std::string& a : command) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      _exit(127);
    }
    close(pipe_fds[1]);
    fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
    workers[rank].pid = pid;
    workers[rank].out = pipe_fds[0];
  }
  return workers;
}

inline void Drain(Worker& w) {
  char buf[4096];
  ssize_t n;
  while ((n = read(w.out, buf, sizeof(buf))) > 0) w.output.append(buf, size_t(n));
}

// Waits until every worker in `which` has exited or `limit` passed; true if all exited.
inline bool WaitAll(std::vector<Worker>& workers, const std::vector<int>& which, Clock::duration limit) {
  const auto deadline = Clock::now() + limit;
  for (;;) {
    bool all = true;
    for (int i : which) {
      Worker& w = workers[i];
      Drain(w);
      if (w.status == -1) {
        int status;
        if (waitpid(w.pid, &status, WNOHANG) == w.pid) {
          w.status = status;
          Drain(w);
        } else {
          all = false;
        }
      }
    }
    if (all) return true;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

inline void KillAll(std::vector<Worker>& workers) {
  for (Worker& w : workers) {
    if (w.status == -1) {
      kill(w.pid, SIGKILL);
      waitpid(w.pid, &w.status, 0);
    }
    close(w.out);
  }
}

inline std::vector<int> All(int size) {
  std::vector<int> all;
  for (int i = 0; i < size; ++i) all.push_back(i);
  return all;
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_RING_WORKER_PROCESSES_H_
