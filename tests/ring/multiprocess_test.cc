// RING across real processes on loopback: the test starts ring_worker N times with torchrun-style
// environment variables, checks every collective in every process, and shows that a rank killed
// in the middle of an all-reduce makes every other rank raise peer-lost within 10 seconds.
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

#include "collectives/errors.h"

namespace {

using Clock = std::chrono::steady_clock;

// A port nobody listens on right now (bound and released; good enough on a test machine).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

struct Worker {
  pid_t pid = -1;
  int out = -1;  // read end of the worker's stdout
  std::string output;
  int status = -1;
};

// Starts `size` ring_worker processes with the given arguments.
std::vector<Worker> Start(int size, const std::vector<std::string>& args) {
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
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      unsetenv("TF_CONFIG");
      std::vector<char*> argv = {const_cast<char*>(binary.c_str())};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
    close(pipe_fds[1]);
    fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
    workers[rank].pid = pid;
    workers[rank].out = pipe_fds[0];
  }
  return workers;
}

void Drain(Worker& w) {
  char buf[4096];
  ssize_t n;
  while ((n = read(w.out, buf, sizeof(buf))) > 0) w.output.append(buf, size_t(n));
}

// Waits until every worker in `which` has exited or `limit` passed; true if all exited.
bool WaitAll(std::vector<Worker>& workers, const std::vector<int>& which, Clock::duration limit) {
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

void KillAll(std::vector<Worker>& workers) {
  for (Worker& w : workers) {
    if (w.status == -1) {
      kill(w.pid, SIGKILL);
      waitpid(w.pid, &w.status, 0);
    }
    close(w.out);
  }
}

std::vector<int> All(int size) {
  std::vector<int> all;
  for (int i = 0; i < size; ++i) all.push_back(i);
  return all;
}

class MultiProcessTest : public ::testing::TestWithParam<int> {};

TEST_P(MultiProcessTest, EveryCollectiveIsExactInEveryProcess) {
  const int size = GetParam();
  std::vector<Worker> workers = Start(size, {"check", "1000003"});
  const bool finished = WaitAll(workers, All(size), std::chrono::seconds(240));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < size; ++rank) {
    const int status = workers[rank].status;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " status " << status << ": " << workers[rank].output;
    EXPECT_NE(workers[rank].output.find("0 wrong"), std::string::npos) << workers[rank].output;
  }
}

INSTANTIATE_TEST_SUITE_P(Ring, MultiProcessTest, ::testing::Values(2, 3, 4));

// A rank killed with SIGKILL in the middle of an all-reduce: every other rank raises peer-lost
// within 10 seconds and exits; none hangs.
TEST(PeerLossTest, KilledRankMakesEverySurvivorRaisePeerLost) {
  constexpr int kSize = 4;
  constexpr int kVictim = 2;
  std::vector<Worker> workers = Start(kSize, {"loop"});
  // Wait until every rank has finished one all-reduce, so the kill lands inside the loop.
  const auto ready_deadline = Clock::now() + std::chrono::seconds(60);
  bool ready = false;
  while (!ready && Clock::now() < ready_deadline) {
    ready = true;
    for (Worker& w : workers) {
      Drain(w);
      ready = ready && w.output.find("ready") != std::string::npos;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(ready) << "the workers never started their loop";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(workers[kVictim].pid, SIGKILL);
  const auto killed_at = Clock::now();

  std::vector<int> survivors;
  for (int r = 0; r < kSize; ++r) {
    if (r != kVictim) survivors.push_back(r);
  }
  const bool all_exited = WaitAll(workers, survivors, std::chrono::seconds(10));
  const auto elapsed = Clock::now() - killed_at;
  KillAll(workers);
  ASSERT_TRUE(all_exited) << "a survivor was still running 10 s after the kill";
  EXPECT_LT(elapsed, std::chrono::seconds(10));
  const int peer_lost = 20 + int(collectives::ErrorCode::kPeerLost);
  for (int r : survivors) {
    const int status = workers[r].status;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == peer_lost)
        << "rank " << r << " status " << status << ": " << workers[r].output;
    EXPECT_NE(workers[r].output.find("peer lost"), std::string::npos) << workers[r].output;
  }
}

}  // namespace
