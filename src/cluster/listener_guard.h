// What a listener open to anyone needs to keep working when strangers flood it, shared by the TCP
// store's server (tcp_store_server.cc) and the fabric's data listener (src/transport): a spare
// descriptor that keeps the backlog moving when the process runs out of descriptors, and a log
// that writes at most one line a second.
//
// Thread-safety: each object belongs to the one thread that runs its listener.
#ifndef COLLECTIVES_SRC_CLUSTER_LISTENER_GUARD_H_
#define COLLECTIVES_SRC_CLUSTER_LISTENER_GUARD_H_

#include <chrono>
#include <functional>
#include <string>
#include <system_error>

namespace collectives::cluster {

// A descriptor held in reserve for when the process runs out (EMFILE, ENFILE). Accept then fails
// without taking the connection at the head of the backlog, and nothing moves: closing the spare
// lets one accept take that connection, only to close it.
class SpareDescriptor {
 public:
  SpareDescriptor();
  ~SpareDescriptor();
  SpareDescriptor(const SpareDescriptor&) = delete;
  SpareDescriptor& operator=(const SpareDescriptor&) = delete;

  // Takes the connection at the head of `listener`'s backlog and closes it; false if none was
  // there or no descriptor could be had.
  bool DropOne(int listener);

 private:
  int fd_;
};

// Whether a connection waits in `listener`'s backlog.
bool ConnectionWaiting(int listener);

// Whether a failed accept failed for want of descriptors (EMFILE, ENFILE).
// asio::error_code is std::error_code; the errno values must be in Asio's system category.
bool OutOfDescriptors(const std::error_code& ec);

// What a listener does after an accept failed.
enum class AfterAcceptFailure {
  kAcceptAgain,        // a descriptor was freed and a connection waits: accept at once
  kWaitForConnection,  // out of descriptors and the backlog is empty: accept when one arrives
  kRetryShortly,       // anything else: accept again after kAcceptRetryDelay, rather than spin
};

inline constexpr std::chrono::milliseconds kAcceptRetryDelay{20};

// Decides it for an accept on `listener` that failed with `ec`. Out of descriptors, accept asks
// for one before it looks at the backlog, so with nothing waiting the listener waits for a
// connection; with one waiting, `evict` (closes the listener's oldest stranger; false if it had
// none) or else `spare` frees a descriptor: the stranger's goes to the connection, or the spare
// takes the connection off the backlog so that the ones behind it move.
AfterAcceptFailure DecideAfterAcceptFailure(const std::error_code& ec, int listener,
                                            const std::function<bool()>& evict,
                                            SpareDescriptor& spare);

// Writes "collectives: <line>" to stderr, in one write so that ranks' lines do not interleave, at
// most once a second (a flood of strangers must not flood the log too); the next line written
// says how many were left out since the last.
class RateLimitedLog {
 public:
  using Clock = std::chrono::steady_clock;
  // Where the lines go; stderr when empty. Tests pass their own.
  using Sink = std::function<void(const std::string& text)>;

  explicit RateLimitedLog(Sink sink = {}) : sink_(std::move(sink)) {}

  void Write(const std::string& line) { Write(line, Clock::now()); }
  // As above, at `now` (tests).
  void Write(const std::string& line, Clock::time_point now);

 private:
  Sink sink_;
  bool written_ = false;
  Clock::time_point last_;
  long left_out_ = 0;
};

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_LISTENER_GUARD_H_
