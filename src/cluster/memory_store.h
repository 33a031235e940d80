// The in-memory Store: a map guarded by a mutex, with a condition variable for waiting Gets.
// Also the table behind the TCP store's server, which registers an observer to answer remote
// Gets when a key appears.
//
// Thread-safety: every method may be called from any thread.
#ifndef COLLECTIVES_SRC_CLUSTER_MEMORY_STORE_H_
#define COLLECTIVES_SRC_CLUSTER_MEMORY_STORE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

#include "collectives/cluster.h"

namespace collectives::cluster {

class MemoryStore : public Store {
 public:
  // Called after every Set and Add with the key that changed, on the caller's thread, outside
  // the lock. May be called concurrently from several threads.
  using Observer = std::function<void(const std::string& key)>;

  // `name` appears in error messages ("memory store").
  explicit MemoryStore(std::string name = "memory store", Observer observer = nullptr);

  void Set(const std::string& key, const std::string& value) override;
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

  // Copies the value of `key` into `*value` if it is set; never waits.
  bool TryGet(const std::string& key, std::string* value);

  const std::string& name() const { return name_; }

 private:
  const std::string name_;
  const Observer observer_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::unordered_map<std::string, std::string> values_;  // guarded by mu_
};

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_MEMORY_STORE_H_
