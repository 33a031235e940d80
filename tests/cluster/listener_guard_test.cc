// The pieces a listener open to anyone shares (listener_guard.h): the once-a-second log and the
// spare descriptor that drops the connection at the head of a backlog.
#include "src/cluster/listener_guard.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <asio/error.hpp>
#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

namespace collectives::cluster {
namespace {

using std::chrono::milliseconds;

TEST(RateLimitedLogTest, WritesOneLineASecondAndCountsTheOnesLeftOut) {
  std::vector<std::string> lines;
  RateLimitedLog log([&](const std::string& text) { lines.push_back(text); });
  const RateLimitedLog::Clock::time_point t0{};
  log.Write("first", t0 + milliseconds(1000));
  log.Write("second", t0 + milliseconds(1200));
  log.Write("third", t0 + milliseconds(1999));
  log.Write("fourth", t0 + milliseconds(2000));
  log.Write("fifth", t0 + milliseconds(5000));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "collectives: first\n");
  EXPECT_EQ(lines[1], "collectives: fourth (2 more since the last such line)\n");
  EXPECT_EQ(lines[2], "collectives: fifth\n");
}

TEST(RateLimitedLogTest, AFloodInOneSecondIsOneLine) {
  std::vector<std::string> lines;
  RateLimitedLog log([&](const std::string& text) { lines.push_back(text); });
  const RateLimitedLog::Clock::time_point t0{};
  for (int i = 0; i < 10000; ++i) log.Write("refused a stranger", t0 + milliseconds(i / 20));
  EXPECT_EQ(lines.size(), 1u);
}

// A listening socket on loopback (port chosen by the kernel) and a client connected to it.
struct Backlog {
  int listener = -1;
  sockaddr_in address{};

  Backlog() {
    // Non-blocking, as an Asio acceptor's is: DropOne must not wait for a connection.
    listener = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        ::listen(listener, 8) != 0 ||
        ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ADD_FAILURE() << "cannot listen on loopback: errno " << errno;
    }
  }
  ~Backlog() { ::close(listener); }

  int Connect() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
    return fd;
  }
};

TEST(SpareDescriptorTest, DropsTheConnectionAtTheHeadOfTheBacklog) {
  Backlog backlog;
  SpareDescriptor spare;
  EXPECT_FALSE(ConnectionWaiting(backlog.listener));
  EXPECT_FALSE(spare.DropOne(backlog.listener)) << "nothing was waiting";

  const int client = backlog.Connect();
  EXPECT_TRUE(ConnectionWaiting(backlog.listener));
  EXPECT_TRUE(spare.DropOne(backlog.listener));
  EXPECT_FALSE(ConnectionWaiting(backlog.listener));
  // The client sees its connection closed.
  char byte = 0;
  EXPECT_EQ(::recv(client, &byte, 1, 0), 0);
  ::close(client);

  // The spare is back in reserve: it drops the next one too.
  const int second = backlog.Connect();
  EXPECT_TRUE(spare.DropOne(backlog.listener));
  ::close(second);
}

// The store server and the fabric's listener both act on this decision after a failed accept.
TEST(DecideAfterAcceptFailureTest, FreesADescriptorOnlyForAWaitingConnection) {
  Backlog backlog;
  SpareDescriptor spare;
  int evictions = 0;
  bool can_evict = true;
  const auto evict = [&] {
    ++evictions;
    return can_evict;
  };
  const auto decide = [&](const asio::error_code& ec) {
    return DecideAfterAcceptFailure(ec, backlog.listener, evict, spare);
  };
  // Not for want of descriptors: retry later, close nothing.
  EXPECT_EQ(decide(asio::error::connection_aborted), AfterAcceptFailure::kRetryShortly);
  // Out of descriptors with nothing waiting: wait for a connection, close nothing.
  EXPECT_EQ(decide(asio::error::no_descriptors), AfterAcceptFailure::kWaitForConnection);
  EXPECT_EQ(evictions, 0);

  // A connection waits: a stranger of the listener's is closed for it, and the connection stays.
  const int client = backlog.Connect();
  EXPECT_EQ(decide(asio::error::no_descriptors), AfterAcceptFailure::kAcceptAgain);
  EXPECT_EQ(evictions, 1);
  EXPECT_TRUE(ConnectionWaiting(backlog.listener));
  // With no stranger to close, the spare takes the connection off the backlog.
  can_evict = false;
  EXPECT_EQ(decide(asio::error::no_descriptors), AfterAcceptFailure::kAcceptAgain);
  EXPECT_EQ(evictions, 2);
  EXPECT_FALSE(ConnectionWaiting(backlog.listener));
  char byte = 0;
  EXPECT_EQ(::recv(client, &byte, 1, 0), 0);
  ::close(client);
}

// As Asio's accept reports them (its own system category).
TEST(OutOfDescriptorsTest, IsTrueForEmfileAndEnfileOnly) {
  EXPECT_TRUE(OutOfDescriptors(asio::error::no_descriptors));
  EXPECT_TRUE(OutOfDescriptors(asio::error_code(EMFILE, asio::system_category())));
  EXPECT_TRUE(OutOfDescriptors(asio::error_code(ENFILE, asio::system_category())));
  EXPECT_FALSE(OutOfDescriptors(asio::error::connection_aborted));
  EXPECT_FALSE(OutOfDescriptors(asio::error_code()));
}

}  // namespace
}  // namespace collectives::cluster
