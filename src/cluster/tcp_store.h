// The TCP store: rank 0 hosts a key-value server, the other ranks are its clients.
//
// Server: one thread runs an io_context with an async accept and, per connection, a session
// that reads a request (tcp_store_wire.h), answers it and reads the next. The table is a
// MemoryStore; a Get for a missing key parks the session with a timer and is answered when
// the key is set (by a remote client or by the hosting process) or when the timer fires; a
// client that closes (or talks) while its Get is parked is dropped at once. A malformed request
// closes that connection and is logged to stderr with the peer's address; it never stops the
// server, nor does an exception out of a handler (an allocation or RAND_bytes that fails): it is
// logged, and the server accepts again. The hosting process uses the table directly. The destructor
// stops the io_context, joins the thread and closes every socket, whether clients are connected or
// not.
//
// Authentication: every connection starts with a mutual proof of the job token
// (tcp_store_auth.h); a connection that fails it is logged with its address and closed, and
// the server goes on. A session that has not finished the proof within 10 s is closed too, and
// so is the oldest such session when 2 x world size + 16 of them are pending (or the process is
// out of descriptors), so that idle strangers cannot keep a rank out; a client closed before
// its verdict connects again.
// When the job sets no token, a server that knows the world size generates one and clients of
// a rank enrol for it (trust on first use, once per rank; tcp_store_auth.h); StoreJobToken then
// (job_token.h) gives the generated token to the communicator, so that the fabric proves it too.
//
// Client: a small pool of connections, so that a Get waiting on one connection never blocks a
// Set from another thread. Each call takes an idle connection (or opens one), runs its
// synchronous exchange on that connection's own io_context under a deadline (run_until; on the
// deadline the socket is closed), and returns the connection to the pool. Opening a connection
// retries with a backoff (10 ms doubling to 200 ms) until the store's timeout, because clients
// commonly start before rank 0; each attempt looks the host up again, on a thread of its own
// (name_lookups.h), by the attempt's deadline, and tries its addresses in turn, each but the last
// for 1 s at most (one that drops connection requests does not keep the others from being tried).
// Deadlines: a Set or an Add ends within the store's timeout (at least 1 s), opening a connection
// again included, or by the caller's deadline when sooner (SetBy, AddBy: a communicator's set-up);
// a Get within its own timeout and a grace of 2 s for the server's answer to start coming (a
// connection opened again, the request and the reply's header), and its value then gets the store's
// timeout to arrive, so that a set-up that gives a Get what is left of its deadline ends near that
// deadline even when the server does not answer. A timeout names the call, the key and the limit. A
// lost connection raises kPeerLost; the next call opens a new one.
//
// Thread-safety: both classes may be called from any thread.
#ifndef COLLECTIVES_SRC_CLUSTER_TCP_STORE_H_
#define COLLECTIVES_SRC_CLUSTER_TCP_STORE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "collectives/cluster.h"
#include "src/cluster/job_token.h"
#include "src/cluster/store_common.h"

namespace collectives::cluster {

class TcpStoreServer final : public Store, public JobTokenSource {
 public:
  // Resolves `host`, binds (SO_REUSEADDR) and listens on host:port (0: a free port), and starts
  // the server thread. A host name is looked up by `lookup_deadline` (name_lookups.h). Throws
  // Error(kSystem) when it cannot resolve or bind, Error(kTimeout) naming `timeout` when the
  // lookup has not answered by the deadline. Every connection must prove the job token
  // (tcp_store_auth.h) before its first request: `token`; when it is empty and `world_size` > 1,
  // 32 random bytes generated here, which ranks 1..world_size-1 may each enrol for once; when
  // both are unset, the empty token (no enrolment).
  TcpStoreServer(const std::string& host, uint16_t port, const std::string& token = {},
                 int world_size = 0, Clock::time_point lookup_deadline = Clock::time_point::max(),
                 std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  ~TcpStoreServer() override;
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  // The port it listens on.
  uint16_t port() const;
  // The token every connection proves (given, generated or empty, as above).
  std::string JobToken() const override;

  void Set(const std::string& key, const std::string& value) override;
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

class TcpStoreClient final : public Store, public JobTokenSource, public DeadlineStore {
 public:
  // Connects to host:port, retrying until `timeout`, and proves `token` (tcp_store_auth.h).
  // With an empty `token` and `rank` >= 0, it first enrols for `rank` and receives the token
  // the server generated; it proves that token on every later connection (reconnects never
  // enrol again). With an empty token and no rank, it proves the empty token. Throws
  // Error(kTimeout) naming the address and the last error when the server cannot be reached in
  // time, Error(kUnauthenticated) when the proofs fail either way or the enrolment is refused
  // (the message names the rank and, when another peer enrolled for it first, that peer).
  TcpStoreClient(const std::string& host, uint16_t port, std::chrono::milliseconds timeout,
                 const std::string& token = {}, int rank = -1);
  ~TcpStoreClient() override;
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  void Set(const std::string& key, const std::string& value) override;
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;
  // Set and Add ending by `deadline` when it comes before the store's timeout (a communicator's
  // set-up: store_common.h).
  void SetBy(const std::string& key, const std::string& value, Clock::time_point deadline) override;
  int64_t AddBy(const std::string& key, int64_t delta, Clock::time_point deadline) override;

  // The token this client proves: the one given, else the one it enrolled for, else empty.
  std::string JobToken() const override;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_TCP_STORE_H_
