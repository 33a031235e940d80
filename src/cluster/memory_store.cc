// The in-memory Store (see memory_store.h).
#include "src/cluster/memory_store.h"

#include <utility>

#include "src/cluster/store_common.h"

namespace collectives {
namespace cluster {

MemoryStore::MemoryStore(std::string name, Observer observer)
    : name_(std::move(name)), observer_(std::move(observer)) {}

void MemoryStore::Set(const std::string& key, const std::string& value) {
  CheckKey(name_, key);
  CheckValue(name_, key, value);
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
  }
  changed_.notify_all();
  if (observer_) observer_(key);
}

std::string MemoryStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  CheckKey(name_, key);
  Clock::time_point deadline = DeadlineAfter(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto it = values_.find(key);
    if (it != values_.end()) return it->second;
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout &&
        values_.find(key) == values_.end()) {
      ThrowGetTimeout(name_, key, ClampTimeout(timeout));
    }
  }
}

int64_t MemoryStore::Add(const std::string& key, int64_t delta) {
  CheckKey(name_, key);
  int64_t sum = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = values_.find(key);
    std::string updated =
        AddToCounter(name_, key, it == values_.end() ? nullptr : &it->second, delta, &sum);
    values_[key] = std::move(updated);
  }
  changed_.notify_all();
  if (observer_) observer_(key);
  return sum;
}

bool MemoryStore::TryGet(const std::string& key, std::string* value) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = values_.find(key);
  if (it == values_.end()) return false;
  *value = it->second;
  return true;
}

}  // namespace cluster

std::shared_ptr<Store> CreateMemoryStore() { return std::make_shared<cluster::MemoryStore>(); }

}  // namespace collectives
