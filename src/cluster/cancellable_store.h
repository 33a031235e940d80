// The stores a communicator's set-up calls its store through.
//
// CancellableStore gives up when asked: every operation first polls `cancelled`, and a Get waits
// in slices of `poll` so that it polls between them. A split's child is set up through one, so
// that an Abort of the parent ends the set-up within a poll instead of at its timeout.
//
// DeadlineBoundStore ends every Set and Add by the set-up's deadline, where the wrapped store
// can (SetBy and AddBy, store_common.h): a TCP store whose server is gone would take the
// store's whole timeout for each. Its Get is the wrapped store's: the set-up gives each Get what
// is left of its deadline.
//
// Thread-safety: as the wrapped store; `cancelled` must be callable from any thread.
#ifndef COLLECTIVES_SRC_CLUSTER_CANCELLABLE_STORE_H_
#define COLLECTIVES_SRC_CLUSTER_CANCELLABLE_STORE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "collectives/cluster.h"
#include "src/cluster/store_common.h"

namespace collectives::cluster {

class CancellableStore final : public Store {
 public:
  // `why` is the message of the Error(kAborted) an operation throws once `cancelled()` is true.
  // `cancelled` must not be empty (Error(kInvalidArgument)).
  CancellableStore(std::shared_ptr<Store> store, std::function<bool()> cancelled, std::string why,
                   std::chrono::milliseconds poll);

  void Set(const std::string& key, const std::string& value) override;
  // Errors as the wrapped store's; a timeout names the whole `timeout`, not the last slice. A
  // slice that fails for another reason (a TCP store's connection or reply timeout) ends the Get.
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

 private:
  void ThrowIfCancelled() const;

  const std::shared_ptr<Store> store_;
  const std::function<bool()> cancelled_;
  const std::string why_;
  const std::chrono::milliseconds poll_;
};

class DeadlineBoundStore final : public Store {
 public:
  DeadlineBoundStore(std::shared_ptr<Store> store, Clock::time_point deadline);

  void Set(const std::string& key, const std::string& value) override;
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

 private:
  const std::shared_ptr<Store> store_;
  const Clock::time_point deadline_;
};

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_CANCELLABLE_STORE_H_
