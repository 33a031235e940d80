// What every Store implementation shares: the limits on keys and values, deadline arithmetic
// that cannot overflow, the integer encoding Add uses, and the wording of errors.
//
// Limits (all stores, so that code tested on the memory store behaves the same over TCP): a key
// is 1..4 KiB bytes of any content, a value at most 16 MiB. Add keeps its counter as the value's
// decimal text ("42"), so Get of an Add-ed key returns that text.
//
// Thread-safety: plain functions.
#ifndef COLLECTIVES_SRC_CLUSTER_STORE_COMMON_H_
#define COLLECTIVES_SRC_CLUSTER_STORE_COMMON_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "collectives/cluster.h"
#include "collectives/errors.h"

namespace collectives::cluster {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxKeyBytes = 4 * 1024;
constexpr size_t kMaxValueBytes = 16 * 1024 * 1024;

// Throws StoreFailure(kInvalidArgument) when `key` is empty or longer than kMaxKeyBytes. `store`
// names the store in the message ("TCP store at 10.0.0.1:29500").
void CheckKey(std::string_view store, const std::string& key);
// Throws StoreFailure(kInvalidArgument) when `value` is longer than kMaxValueBytes.
void CheckValue(std::string_view store, const std::string& key, const std::string& value);

// now + timeout, with negative timeouts read as 0 and very long ones capped (a year), so that
// time_point arithmetic never overflows.
Clock::time_point DeadlineAfter(std::chrono::milliseconds timeout);
// The timeout clamped the same way, in milliseconds.
std::chrono::milliseconds ClampTimeout(std::chrono::milliseconds timeout);

// `current` (an Add counter's decimal text, or nullptr when the key is absent) plus `delta`, as
// decimal text. Throws StoreFailure(kInvalidArgument) when the current value is not a decimal
// int64 or the sum overflows.
std::string AddToCounter(std::string_view store, const std::string& key, const std::string* current,
                         int64_t delta, int64_t* sum);

// The key for messages: quoted, non-printable bytes as \xNN, long keys shortened.
std::string QuoteKey(std::string_view key);

// Implemented by the stores whose Set and Add can end by a deadline of the caller's rather than
// by a limit of their own (the TCP store's client gives each its whole timeout, reconnection
// included, which a server that is gone takes to the end), beside the Store interface (which
// stays as it is for users who write their own store). A communicator's set-up calls its store
// through SetBy and AddBy, so that its Sets and Adds end by its deadline.
class DeadlineStore {
 public:
  // As Store::Set and Store::Add, ending by `deadline` (Error(kTimeout) past it).
  virtual void SetBy(const std::string& key, const std::string& value,
                     Clock::time_point deadline) = 0;
  virtual int64_t AddBy(const std::string& key, int64_t delta, Clock::time_point deadline) = 0;

 protected:
  ~DeadlineStore() = default;
};

// store.SetBy / store.AddBy for a DeadlineStore; store.Set / store.Add, under the store's own
// limits, for every other store.
void SetBy(Store& store, const std::string& key, const std::string& value,
           Clock::time_point deadline);
int64_t AddBy(Store& store, const std::string& key, int64_t delta, Clock::time_point deadline);

// Marks a descriptor close-on-exec (Asio does not), so that a child the process starts does
// not inherit the store's sockets: an inherited listener would keep the port, an inherited
// connection would keep a peer from seeing the close.
void SetCloseOnExec(int fd);

// What a Get's timeout says between the key and the time ("... key 'k' was not set within
// 500 ms"): a store that waits in slices (CancellableStore) finds the time in it to name the
// whole wait.
inline constexpr std::string_view kNotSetWithin = " was not set within ";

// The Error our own stores throw for a failure of the store itself rather than a key's absence:
// a TCP store that could not connect, got no reply in time, lost its connection or was refused;
// a file store that could not read, write or lock its files, or refused its token file; and any
// of them refusing an operation, kInvalidArgument (a key or value past the limits, an Add on a
// value that is no decimal integer or that would overflow, the TCP server's reply saying so). A
// Store says that a key was not set within a Get's wait with a plain Error(kTimeout) (cluster.h),
// as stores that users write do, whatever their wording; so a caller that must tell the two apart
// (CancellableStore's slices, the TCP fabric naming a rank that never published) does it by
// type, not by searching the message; a communicator's set-up names the rank before its message.
// Callers outside the library see an Error.
class StoreFailure final : public Error {
 public:
  using Error::Error;
};

// Whether `error`, from a Get, says that the key was not set within the wait: a kTimeout that is
// no StoreFailure.
bool IsNotSet(const Error& error);

// Throws Error(kTimeout): "<store>: key '<key>' was not set within <timeout> ms".
[[noreturn]] void ThrowGetTimeout(std::string_view store, const std::string& key,
                                  std::chrono::milliseconds timeout);

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_STORE_COMMON_H_
