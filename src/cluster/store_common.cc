// Limits, deadlines, counters and error wording shared by the stores (see store_common.h).
#include "src/cluster/store_common.h"

#include <fcntl.h>

#include <charconv>

#include "collectives/errors.h"
#include "src/core/arguments.h"

namespace collectives::cluster {

void CheckKey(std::string_view store, const std::string& key) {
  if (key.empty()) {
    throw StoreFailure(ErrorCode::kInvalidArgument, std::string(store) + ": the key is empty");
  }
  if (key.size() > kMaxKeyBytes) {
    throw StoreFailure(ErrorCode::kInvalidArgument, std::string(store) + ": key " + QuoteKey(key) +
                                                        " is " + std::to_string(key.size()) +
                                                        " bytes, more than the limit of " +
                                                        std::to_string(kMaxKeyBytes));
  }
}

void CheckValue(std::string_view store, const std::string& key, const std::string& value) {
  if (value.size() > kMaxValueBytes) {
    throw StoreFailure(ErrorCode::kInvalidArgument,
                       std::string(store) + ": the value of key " + QuoteKey(key) + " is " +
                           std::to_string(value.size()) + " bytes, more than the limit of " +
                           std::to_string(kMaxValueBytes));
  }
}

std::chrono::milliseconds ClampTimeout(std::chrono::milliseconds timeout) {
  if (timeout < std::chrono::milliseconds::zero()) return std::chrono::milliseconds::zero();
  if (timeout > core::kMaxTimeout) return core::kMaxTimeout;
  return timeout;
}

Clock::time_point DeadlineAfter(std::chrono::milliseconds timeout) {
  return Clock::now() + ClampTimeout(timeout);
}

std::string AddToCounter(std::string_view store, const std::string& key, const std::string* current,
                         int64_t delta, int64_t* sum) {
  int64_t value = 0;
  if (current != nullptr) {
    const char* begin = current->data();
    const char* end = begin + current->size();
    auto [ptr, ec] = std::from_chars(begin, end, value);
    if (current->empty() || ec != std::errc() || ptr != end) {
      throw StoreFailure(ErrorCode::kInvalidArgument, std::string(store) + ": Add on key " +
                                                          QuoteKey(key) +
                                                          ", whose value is not a decimal integer");
    }
  }
  if (__builtin_add_overflow(value, delta, sum)) {
    throw StoreFailure(ErrorCode::kInvalidArgument,
                       std::string(store) + ": Add of " + std::to_string(delta) + " to key " +
                           QuoteKey(key) + " (= " + std::to_string(value) + ") overflows int64");
  }
  return std::to_string(*sum);
}

std::string QuoteKey(std::string_view key) {
  constexpr size_t kShown = 200;
  std::string out = "'";
  static const char kHex[] = "0123456789abcdef";
  for (size_t i = 0; i < key.size() && i < kShown; ++i) {
    unsigned char c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (key.size() > kShown) out += "...";
  out += "'";
  return out;
}

void SetCloseOnExec(int fd) {
  int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

void SetBy(Store& store, const std::string& key, const std::string& value,
           Clock::time_point deadline) {
  if (auto* bounded = dynamic_cast<DeadlineStore*>(&store)) {
    return bounded->SetBy(key, value, deadline);
  }
  store.Set(key, value);
}

int64_t AddBy(Store& store, const std::string& key, int64_t delta, Clock::time_point deadline) {
  if (auto* bounded = dynamic_cast<DeadlineStore*>(&store)) {
    return bounded->AddBy(key, delta, deadline);
  }
  return store.Add(key, delta);
}

bool IsNotSet(const Error& error) {
  return error.code() == ErrorCode::kTimeout &&
         dynamic_cast<const StoreFailure*>(&error) == nullptr;
}

void ThrowGetTimeout(std::string_view store, const std::string& key,
                     std::chrono::milliseconds timeout) {
  throw Error(ErrorCode::kTimeout, std::string(store) + ": key " + QuoteKey(key) +
                                       std::string(kNotSetWithin) +
                                       std::to_string(timeout.count()) + " ms");
}

}  // namespace collectives::cluster
