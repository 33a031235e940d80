// The one exception type of the C++ API and its closed set of error codes.
//
// Thread-safety: plain values. Copying an Error never throws: one failure is stored once and
// thrown to every waiter, under memory pressure too.
#ifndef COLLECTIVES_ERRORS_H_
#define COLLECTIVES_ERRORS_H_

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace collectives {

// What went wrong, in kinds a caller can act on. Closed: callers may switch over it.
enum class ErrorCode : int {
  kInvalidArgument = 1,  // a bad value from the caller: wrong size, null data, unknown name
  kInvalidUsage = 2,     // a call that is not allowed now (wrong thread, after Abort, ...)
  kSystem = 3,           // the operating system refused: bind, connect, file I/O
  kPeerLost = 4,         // a peer closed its connection or died
  kMismatch = 5,         // ranks issued different collectives, sizes, types, ops or roots
  kTimeout = 6,          // a deadline passed while waiting for a peer or the rendezvous
  kUnauthenticated = 7,  // a peer failed the job-token proof
  kAborted = 8,          // the communicator was aborted (by the caller or by a peer)
  kNotSupported = 9,     // the build or the machine lacks what the call needs
  kInternal = 10,        // a bug in this library
};

// "invalid argument", "peer lost", ...
const char* ToString(ErrorCode code);

// Every failure the library reports. The message names, where they are known, this rank, the
// peer, the collective and its sequence number.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  // Copies share the text; no move, so no Error is ever left without its message.
  Error(const Error&) noexcept = default;
  Error& operator=(const Error&) noexcept = default;

  ErrorCode code() const noexcept { return code_; }
  // The message without the "[code] " prefix that what() carries.
  const std::string& message() const noexcept { return *message_; }

 private:
  ErrorCode code_;
  std::shared_ptr<const std::string> message_;  // shared, as runtime_error's text is
};

static_assert(std::is_nothrow_copy_constructible_v<Error> &&
              std::is_nothrow_copy_assignable_v<Error>);

}  // namespace collectives

#endif  // COLLECTIVES_ERRORS_H_
