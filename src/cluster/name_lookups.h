// Name lookups that end by a deadline: getaddrinfo, which cannot be cancelled, runs on a thread
// of its own, and a caller that stops waiting leaves it to end there. Used by the TCP fabric's
// set-up (src/transport) for its bind host and its peers' names, by the checks of the set-up
// that look a name up before it (host_port.h, LocalAddressToward), and by the TCP store's server
// and client (tcp_store.h) for the store's host.
//
// Thread-safety: see each class and function.
#ifndef COLLECTIVES_SRC_CLUSTER_NAME_LOOKUPS_H_
#define COLLECTIVES_SRC_CLUSTER_NAME_LOOKUPS_H_

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>
// A standard header (above) comes before <asio.hpp>: see tcp_store_server.cc.
#include <asio.hpp>

#include "src/cluster/store_common.h"

namespace collectives::cluster {

// Looks host names up on threads of their own, so that a slow name server neither stalls the
// set-up's event loop (accepts, handshakes, cancellation) nor holds the set-up past its deadline:
// getaddrinfo cannot be cancelled, and asio's async_resolve runs it on one thread that the
// io_context's destructor joins. A lookup still running when Close is called (or the owner is
// gone) ends on its thread, and its answer is dropped. Lookups of one name share one thread.
// Used by the thread that runs `io` (the answers are posted to it). Shared by the TCP fabric's
// set-up and LookUpBy.
class NameLookups {
 public:
  using Done =
      std::function<void(const asio::error_code&, const asio::ip::tcp::resolver::results_type&)>;

  explicit NameLookups(asio::io_context& io) : shared_(std::make_shared<Shared>()) {
    shared_->io = &io;
  }
  ~NameLookups() { Close(); }
  NameLookups(const NameLookups&) = delete;
  NameLookups& operator=(const NameLookups&) = delete;

  // Looks `host` up (the answers' ports are 0); `done` runs on the io_context unless Close comes
  // first.
  void Resolve(const std::string& host, Done done) {
    if (shared_->io == nullptr) return;  // closed
    auto [entry, first] = shared_->waiting.try_emplace(host, asio::make_work_guard(*shared_->io));
    entry->second.done.push_back(std::move(done));
    if (!first) return;  // a lookup of this name is under way
    try {
      std::thread([shared = shared_, host] {
        // Nothing may escape this thread (it would end the process): a failure is an answer.
        asio::error_code ec;
        asio::ip::tcp::resolver::results_type results;
        try {
          asio::io_context io;  // the resolver's; its blocking resolve blocks this thread only
          results = asio::ip::tcp::resolver(io).resolve(host, "0", ec);
        } catch (const std::system_error& error) {
          ec = error.code();
        } catch (const std::bad_alloc&) {
          ec = asio::error::no_memory;
        }
        std::lock_guard<std::mutex> lock(shared->mutex);
        if (shared->io == nullptr) return;
        try {
          asio::post(*shared->io, [=] { Answer(*shared, host, ec, results); });
        } catch (const std::bad_alloc&) {  // no answer: the set-up's deadline ends the wait
        }
      }).detach();
    } catch (const std::system_error& error) {  // no thread: an answer that says so
      const asio::error_code ec(error.code().value(), asio::system_category());
      asio::post(*shared_->io, [shared = shared_, host, ec] {
        Answer(*shared, host, ec, asio::ip::tcp::resolver::results_type());
      });
    }
  }

  // Drops every answer not delivered yet.
  void Close() {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->io = nullptr;
    shared_->waiting.clear();
  }

 private:
  struct Waiting {
    // Keeps the io_context from running out of work (and stopping) while the lookup runs.
    explicit Waiting(asio::executor_work_guard<asio::io_context::executor_type> guard)
        : work(std::move(guard)) {}
    asio::executor_work_guard<asio::io_context::executor_type> work;
    std::vector<Done> done;
  };
  struct Shared {
    std::mutex mutex;
    asio::io_context* io = nullptr;  // null once closed; written under `mutex`, on io's thread
    std::map<std::string, Waiting> waiting;  // by name; only on io's thread, empty once closed
  };

  static void Answer(Shared& shared, const std::string& host, const asio::error_code& ec,
                     const asio::ip::tcp::resolver::results_type& results) {
    if (shared.io == nullptr) return;  // closed since it was posted
    auto node = shared.waiting.extract(host);
    for (auto& done : node.mapped().done) done(ec, results);
  }

  std::shared_ptr<Shared> shared_;
};

// Looks `host` up (NameLookups, on a thread of its own) and waits for the answer until
// `deadline`: nullopt when it has not come by then, the addresses otherwise (none when the name
// does not resolve; the resolver's error then in `*error` when given). Any thread.
inline std::optional<asio::ip::tcp::resolver::results_type> LookUpBy(
    const std::string& host, Clock::time_point deadline, asio::error_code* error = nullptr) {
  asio::io_context io;
  NameLookups lookups(io);
  std::optional<asio::ip::tcp::resolver::results_type> answer;
  lookups.Resolve(host, [&answer, error](const asio::error_code& ec,
                                         const asio::ip::tcp::resolver::results_type& results) {
    if (error != nullptr) *error = ec;
    answer = ec ? asio::ip::tcp::resolver::results_type() : results;
  });
  while (!answer && io.run_one_until(deadline) > 0) {
  }
  return answer;
}

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_NAME_LOOKUPS_H_
