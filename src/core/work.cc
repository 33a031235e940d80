// WorkState: completion, error hand-over and the spin-then-sleep wait.
#include "src/core/work.h"

namespace collectives::core {

void WorkState::Wait() {
  if (!SpinUntil(spin_, [this] { return Done(); })) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return Done(); });
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) throw *error_;
}

void WorkState::Complete(const std::optional<Error>& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

}  // namespace collectives::core
