// CancellableStore: the wrapped store's operations, polling `cancelled` before each and
// between the slices of a Get's wait. DeadlineBoundStore: its Sets and Adds by the deadline.
#include "src/cluster/cancellable_store.h"

#include <algorithm>
#include <utility>

#include "collectives/errors.h"
#include "src/cluster/store_common.h"

namespace collectives::cluster {

CancellableStore::CancellableStore(std::shared_ptr<Store> store, std::function<bool()> cancelled,
                                   std::string why, std::chrono::milliseconds poll)
    : store_(std::move(store)),
      cancelled_(std::move(cancelled)),
      why_(std::move(why)),
      poll_(std::max(poll, std::chrono::milliseconds(1))) {
  if (!cancelled_) {
    throw Error(ErrorCode::kInvalidArgument, "CancellableStore: the cancel predicate is empty");
  }
}

void CancellableStore::ThrowIfCancelled() const {
  if (cancelled_()) throw Error(ErrorCode::kAborted, why_);
}

void CancellableStore::Set(const std::string& key, const std::string& value) {
  ThrowIfCancelled();
  store_->Set(key, value);
}

int64_t CancellableStore::Add(const std::string& key, int64_t delta) {
  ThrowIfCancelled();
  return store_->Add(key, delta);
}

std::string CancellableStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = DeadlineAfter(timeout);
  for (;;) {
    ThrowIfCancelled();
    const auto left =
        std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                 std::chrono::milliseconds(0));
    try {
      return store_->Get(key, std::min(left, poll_));
    } catch (const Error& error) {
      // Only the key's absence at the end of the slice is worth another slice: the store's own
      // failure (a TCP store that could not connect or did not answer in time) already took its
      // own limit and ends the Get.
      if (!IsNotSet(error)) throw;
      if (left > poll_) continue;
      // The last slice's message names the slice: say the whole wait, as one Get would (a
      // store of the user's that words its timeout otherwise is left as it is).
      const std::string& text = error.message();
      const size_t at = text.rfind(kNotSetWithin);
      if (at == std::string::npos) throw;
      throw Error(ErrorCode::kTimeout, text.substr(0, at) + std::string(kNotSetWithin) +
                                           std::to_string(ClampTimeout(timeout).count()) + " ms");
    }
  }
}

DeadlineBoundStore::DeadlineBoundStore(std::shared_ptr<Store> store, Clock::time_point deadline)
    : store_(std::move(store)), deadline_(deadline) {}

void DeadlineBoundStore::Set(const std::string& key, const std::string& value) {
  SetBy(*store_, key, value, deadline_);
}

std::string DeadlineBoundStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  return store_->Get(key, timeout);
}

int64_t DeadlineBoundStore::Add(const std::string& key, int64_t delta) {
  return AddBy(*store_, key, delta, deadline_);
}

}  // namespace collectives::cluster
