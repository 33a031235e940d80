// WorkState: completion, error hand-over and the spin-yield-sleep wait.
#include "src/core/work.h"

namespace collectives::core {

void WorkState::Wait() {
  const auto done = [this] { return Done(); };
  if (!Done()) {
    WorkHelper* helper = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (helper_ != nullptr && helper_->Enter()) helper = helper_;
    }
    if (helper != nullptr) {
      helper->RunOnWaiter(*this);
      helper->Leave();
    }
  }
  if (!SpinUntil(spin_, done) && !YieldUntil(yield_, kWaitYieldPolls, done)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, done);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) throw *error_;
}

void WorkState::Complete(const std::optional<Error>& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    helper_ = nullptr;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

}  // namespace collectives::core
