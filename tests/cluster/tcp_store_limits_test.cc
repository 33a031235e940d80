// The TCP store's server against strangers who hold connections open, in a child process whose
// descriptors are few (RLIMIT_NOFILE 64): idle connections must not keep a rank's client out
// (the server closes the oldest unproven one when there are too many, or when accept runs out of
// descriptors), and with no descriptor left at all the backlog still moves. And an enrolment
// whose reply never reached the client (it reset the connection) is undone, so that the rank's
// retry is not refused as taken. And a client's Get against a server whose process is stopped
// ends soon after its own wait. And an accept that throws (an allocation fails) does not stop
// the server accepting: this binary replaces the global operator new, whose next call a test's
// server process can make fail.
#include <arpa/inet.h>
#include <errno.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/errors.h"
#include "src/cluster/store_common.h"
#include "src/cluster/tcp_store.h"
#include "src/cluster/tcp_store_auth.h"
#include "tests/replaced_operator_new.h"
#include "tests/time_scale.h"
#include "tests/transport/idle_connections.h"

namespace {
// While true, the next allocation fails with std::bad_alloc (and clears it).
std::atomic<bool> fail_next_allocation{false};

void FailTheNextAllocationIfAsked() {
  if (fail_next_allocation.load(std::memory_order_relaxed) &&
      fail_next_allocation.exchange(false)) {
    throw std::bad_alloc();
  }
}
}  // namespace

namespace collectives {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A TcpStoreServer in a child process. The child reports the server's port on a pipe, then
// waits until the parent closes its end of another (or dies), and exits. `prepare` runs in the
// child before the server starts, `after_start` once it runs (both must not use gtest).
class ServerProcess {
 public:
  ServerProcess(rlim_t descriptors, const std::string& token, int world_size,
                const std::function<void()>& after_start = nullptr) {
    int report[2];
    int hold[2];
    if (pipe(report) != 0 || pipe(hold) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(report[0]);
      close(hold[1]);
      const rlimit limit{descriptors, descriptors};
      if (descriptors > 0 && setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(2);
      uint16_t port = 0;
      std::optional<cluster::TcpStoreServer> server;
      try {
        server.emplace("127.0.0.1", 0, token, world_size);
        port = server->port();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "server process: %s\n", e.what());
        _exit(3);
      }
      if (after_start) after_start();
      if (write(report[1], &port, sizeof(port)) != sizeof(port)) _exit(4);
      char byte;
      while (read(hold[0], &byte, 1) > 0) {
      }
      _exit(0);  // no destructors: the parent's objects are not this process's to clean
    }
    close(report[1]);
    close(hold[0]);
    hold_ = hold[1];
    if (pid_ > 0) {
      pollfd entry{report[0], POLLIN, 0};
      if (poll(&entry, 1, 30'000) == 1 && read(report[0], &port_, sizeof(port_)) != sizeof(port_)) {
        port_ = 0;
      }
    }
    close(report[0]);
  }

  ~ServerProcess() {
    if (hold_ >= 0) close(hold_);
    if (pid_ > 0) {
      kill(pid_, SIGCONT);  // in case a test left it stopped
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

  pid_t pid() const { return pid_; }
  uint16_t port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int hold_ = -1;
  uint16_t port_ = 0;
};

// A blocking connection to 127.0.0.1:port; -1 if it failed.
int Connect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    return fd;
  }
  if (fd >= 0) close(fd);
  return -1;
}

// Whether the peer closed (or reset) `fd` before `deadline`; bytes it sent are dropped.
bool ClosedByPeerBefore(int fd, Clock::time_point deadline) {
  char buffer[256];
  while (Clock::now() < deadline) {
    pollfd entry{fd, POLLIN, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (poll(&entry, 1, std::max<int>(1, int(left.count()))) <= 0) continue;
    if (recv(fd, buffer, sizeof(buffer), 0) <= 0) return true;
  }
  return false;
}

// 80 strangers connect and say nothing; the server has 64 descriptors. A client with the token
// must still get in at once, not after the strangers' 10 s to prove the token run out. With a
// world size of 2 the server closes the oldest stranger past 2 * 2 + 16 unproven connections;
// with 100 that bound (216) is past the descriptors, and accept's EMFILE makes the room instead.
class IdleStrangersTest : public ::testing::TestWithParam<int> {};

TEST_P(IdleStrangersTest, DoNotKeepARankOut) {
  const int world_size = GetParam();
  testing::IdleConnections strangers;  // closed after the server's process ended: no line each
  ServerProcess server(64, "the token", world_size);
  ASSERT_GT(server.port(), 0) << "the server process did not start";
  ASSERT_EQ(strangers.Open("127.0.0.1:" + std::to_string(server.port()), 80), 80u);
  if (world_size == 2) {
    // All but the newest 2 * 2 + 16 are closed as the next ones come, long before their 10 s.
    const size_t closed = strangers.WaitClosed(80 - 20, Clock::now() + 8s);
    EXPECT_GE(closed, 80u - 20u) << "more than 20 unproven connections were kept open";
  }
  const auto start = Clock::now();
  try {
    cluster::TcpStoreClient client("127.0.0.1", server.port(), 60'000ms, "the token");
    client.Set("key", "value");
    EXPECT_EQ(client.Get("key", 60'000ms), "value");
  } catch (const Error& e) {
    FAIL() << e.what();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Milliseconds normally; the strangers' own limit is 10 s.
  EXPECT_LT(seconds, test_time::Scaled(8.0)) << "the client waited behind the idle strangers";
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, IdleStrangersTest, ::testing::Values(2, 100));

// With no descriptor left in the server's process, accept cannot take a connection, and without
// the spare descriptor the backlog would sit there: every connection waits until its client
// gives up. The server drops them instead (the spare taken for a moment), so they see a close.
TEST(TcpStoreOutOfDescriptorsTest, TheBacklogStillMoves) {
  std::vector<int>* held = nullptr;  // in the child only
  ServerProcess server(64, "the token", 2, [&held] {
    held = new std::vector<int>();
    for (;;) {
      const int fd = dup(2);
      if (fd < 0) break;
      held->push_back(fd);
    }
  });
  ASSERT_GT(server.port(), 0) << "the server process did not start";
  testing::IdleConnections waiting;  // closed before the server's process ends: dropped already
  ASSERT_EQ(waiting.Open("127.0.0.1:" + std::to_string(server.port()), 5), 5u);
  const auto deadline = Clock::now() + 20s;
  for (int fd : waiting.fds()) {
    EXPECT_TRUE(ClosedByPeerBefore(fd, deadline)) << "a connection stayed in the backlog";
  }
}

// Stops the server's process and waits until every thread of it has stopped.
void StopProcess(pid_t pid) {
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  int status = 0;  // kill only asks
  ASSERT_EQ(waitpid(pid, &status, WUNTRACED), pid);
  ASSERT_TRUE(WIFSTOPPED(status));
}

// A Get waits for its key as long as it is asked to (a communicator's set-up asks for what is
// left of its deadline), and for the server's answer only a short grace after that, not the
// store's whole timeout again: a server that does not answer (its process stopped, its host
// gone) ends the Get about two seconds after its wait, with an error that names the store, the
// key and what did not come.
TEST(TcpStoreStoppedServerTest, AGetEndsAGraceAfterItsWaitNotAWholeTimeoutLater) {
  ServerProcess server(0, "the token", 2);
  ASSERT_GT(server.port(), 0) << "the server process did not start";
  cluster::TcpStoreClient client("127.0.0.1", server.port(), 6'000ms, "the token");
  client.Set("warm", "1");  // a connection in the pool
  StopProcess(server.pid());
  const auto start = Clock::now();
  try {
    client.Get("never", 200ms);
    ADD_FAILURE() << "a stopped server answered";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    const std::string text = e.message();
    EXPECT_NE(text.find("127.0.0.1:" + std::to_string(server.port())), std::string::npos) << text;
    EXPECT_NE(text.find("'never'"), std::string::npos) << text;
    EXPECT_NE(text.find("200 ms"), std::string::npos) << text;
    EXPECT_FALSE(cluster::IsNotSet(e)) << "a server that does not answer is no key that is unset";
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, test_time::Scaled(4.5))
      << "the Get waited the store's 6 s timeout beyond its own 200 ms";
  kill(server.pid(), SIGCONT);
}

// The server's half of the connection from `client_port` to `server_port` on loopback, as
// /proc/net/tcp lists it: whether it is still there (a reset removes it).
bool ServerSideListed(uint16_t server_port, uint16_t client_port) {
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // the heading
  char local[64];
  char remote[64];
  while (std::getline(table, line)) {
    if (std::sscanf(line.c_str(), "%*s %63s %63s", local, remote) != 2) continue;
    const std::string l = local;
    const std::string r = remote;
    const auto port_of = [](const std::string& address) {
      return static_cast<uint16_t>(std::stoul(address.substr(address.find(':') + 1), nullptr, 16));
    };
    if (port_of(l) == server_port && port_of(r) == client_port) return true;
  }
  return false;
}

// A stranger (or a rank) that asks to enrol and resets the connection before the reply: the
// server's reply write fails, and the enrolment is undone, so that rank 2's own client enrols.
// The server's process is stopped while the request and the reset arrive, so that it reads the
// request only once the connection is already reset.
TEST(TcpStoreEnrolResetTest, AnEnrolmentWhoseReplyFailedIsUndone) {
  ServerProcess server(0, "", 3);
  ASSERT_GT(server.port(), 0) << "the server process did not start";
  const int fd = Connect(server.port());
  ASSERT_GE(fd, 0);
  std::array<uint8_t, cluster::auth::kChallengeBytes> challenge{};
  size_t got = 0;
  while (got < challenge.size()) {
    const ssize_t n = recv(fd, challenge.data() + got, challenge.size() - got, 0);
    ASSERT_GT(n, 0) << "no challenge";
    got += size_t(n);
  }
  sockaddr_in self{};
  socklen_t length = sizeof(self);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&self), &length), 0);
  const uint16_t client_port = ntohs(self.sin_port);

  ASSERT_EQ(kill(server.pid(), SIGSTOP), 0);
  int status = 0;  // kill only asks: wait until every thread of it has stopped
  ASSERT_EQ(waitpid(server.pid(), &status, WUNTRACED), server.pid());
  ASSERT_TRUE(WIFSTOPPED(status));
  const cluster::auth::Response request = cluster::auth::EncodeEnrolment(2);
  ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
  const linger reset{1, 0};
  ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset)), 0);
  close(fd);  // a reset
  const auto until = Clock::now() + 20s;
  while (ServerSideListed(server.port(), client_port) && Clock::now() < until) {
    std::this_thread::yield();
  }
  ASSERT_FALSE(ServerSideListed(server.port(), client_port)) << "the reset did not arrive";
  ASSERT_EQ(kill(server.pid(), SIGCONT), 0);

  try {
    cluster::TcpStoreClient rank2("127.0.0.1", server.port(), 30'000ms, "", 2);
    rank2.Set("k", "v");
    EXPECT_EQ(rank2.Get("k", 30'000ms), "v");
  } catch (const Error& e) {
    FAIL() << e.what();
  }
}

// An exception out of the server's accept (here the first allocation after a connection comes
// in fails; RAND_bytes may fail too) costs that connection only: the server accepts the next.
// The server's process arms the failure once it runs, when nothing but its io thread allocates.
// A later client is served, not left in the backlog until its timeout (kTimeout).
TEST(TcpStoreAcceptFailureTest, TheServerGoesOnAccepting) {
  ServerProcess server(0, "the token", 2, [] {
    testing::before_allocation = FailTheNextAllocationIfAsked;
    fail_next_allocation = true;
  });
  ASSERT_GT(server.port(), 0) << "the server process did not start";
  const int first = Connect(server.port());  // the accept that throws
  ASSERT_GE(first, 0);
  try {
    cluster::TcpStoreClient client("127.0.0.1", server.port(), 3s, "the token");
    client.Set("k", "v");
    EXPECT_EQ(client.Get("k", 1s), "v");
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
  close(first);
}

}  // namespace
}  // namespace collectives
