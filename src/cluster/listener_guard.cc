// The header (standard headers first) comes before Asio's: see tcp_store_server.cc.
#include "src/cluster/listener_guard.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <asio/error_code.hpp>
#include <cerrno>
#include <cstdio>
#include <utility>

namespace collectives::cluster {
namespace {

int OpenSpare() { return ::open("/dev/null", O_RDONLY | O_CLOEXEC); }

}  // namespace

SpareDescriptor::SpareDescriptor() : fd_(OpenSpare()) {}

SpareDescriptor::~SpareDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

bool SpareDescriptor::DropOne(int listener) {
  if (fd_ >= 0) ::close(fd_);
  const int taken = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (taken >= 0) ::close(taken);
  fd_ = OpenSpare();
  return taken >= 0;
}

bool ConnectionWaiting(int listener) {
  pollfd entry{listener, POLLIN, 0};
  return ::poll(&entry, 1, 0) > 0 && (entry.revents & POLLIN) != 0;
}

bool OutOfDescriptors(const std::error_code& ec) {
  // Asio reports errno values in a category of its own, not std::system_category().
  return ec == asio::error_code(EMFILE, asio::system_category()) ||
         ec == asio::error_code(ENFILE, asio::system_category());
}

AfterAcceptFailure DecideAfterAcceptFailure(const std::error_code& ec, int listener,
                                            const std::function<bool()>& evict,
                                            SpareDescriptor& spare) {
  if (!OutOfDescriptors(ec)) return AfterAcceptFailure::kRetryShortly;
  if (!ConnectionWaiting(listener)) return AfterAcceptFailure::kWaitForConnection;
  if (evict() || spare.DropOne(listener)) return AfterAcceptFailure::kAcceptAgain;
  return AfterAcceptFailure::kRetryShortly;  // no descriptor at all
}

void RateLimitedLog::Write(const std::string& line, Clock::time_point now) {
  if (written_ && now - last_ < std::chrono::seconds(1)) {
    ++left_out_;
    return;
  }
  std::string text = "collectives: " + line;
  if (left_out_ > 0) text += " (" + std::to_string(left_out_) + " more since the last such line)";
  text += "\n";
  if (sink_) {
    sink_(text);
  } else {
    std::fwrite(text.data(), 1, text.size(), stderr);
  }
  written_ = true;
  last_ = now;
  left_out_ = 0;
}

}  // namespace collectives::cluster
