// The public factories of the TCP store and the store a ClusterSpec names.
#include <cstdlib>
#include <memory>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/job_token.h"
#include "src/cluster/store_common.h"
#include "src/cluster/tcp_store.h"

namespace collectives {
namespace {

// The server or a client; with the job's world size and this client's rank, a job that sets no
// token gets one (rank 0's server generates it and the clients enrol for it, tcp_store_auth.h).
// The server looks a host name up by `deadline` (the end of `timeout` from when the caller
// began).
std::shared_ptr<Store> MakeTcpStore(const std::string& host, uint16_t port, bool is_server,
                                    std::chrono::milliseconds timeout, const std::string& job_token,
                                    int world_size, int rank, cluster::Clock::time_point deadline) {
  if (is_server) {
    return std::make_shared<cluster::TcpStoreServer>(cluster::StripBrackets(host), port, job_token,
                                                     world_size, deadline,
                                                     cluster::ClampTimeout(timeout));
  }
  return std::make_shared<cluster::TcpStoreClient>(host, port, timeout, job_token, rank);
}

}  // namespace

std::shared_ptr<Store> CreateTcpStore(const std::string& host, uint16_t port, bool is_server,
                                      std::chrono::milliseconds timeout,
                                      const std::string& job_token) {
  return MakeTcpStore(host, port, is_server, timeout, job_token, /*world_size=*/0, /*rank=*/-1,
                      cluster::DeadlineAfter(timeout));
}

uint16_t TcpStorePort(const Store& store) {
  const auto* server = dynamic_cast<const cluster::TcpStoreServer*>(&store);
  if (server == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "TcpStorePort: the store is not a TCP store server");
  }
  return server->port();
}

std::shared_ptr<Store> CreateStoreFor(const ClusterSpec& spec, std::chrono::milliseconds timeout,
                                      const std::string& job_token) {
  spec.Validate();
  if (spec.world_size == 1) return CreateMemoryStore();
  const cluster::Clock::time_point deadline = cluster::DeadlineAfter(timeout);
  std::string token = !job_token.empty() ? job_token : spec.job_token;
  if (token.empty()) {
    if (const char* env = std::getenv("COLLECTIVES_JOB_TOKEN")) token = env;
  }
  // Rank 0 serves at store_listen_address when one is set, else at master_addr.
  const bool server = spec.rank == 0;
  std::string host = spec.master_addr;
  if (server && !spec.store_listen_address.empty()) {
    host = spec.store_listen_address;
  } else if (server) {
    cluster::WarnIfLoopbackOnly(spec.rank, "the store", host,
                                "set MASTER_ADDR (or TF_CONFIG's chief) to this host's address, "
                                "or COLLECTIVES_STORE_LISTEN_ADDRESS to it or to 0.0.0.0",
                                deadline);
  }
  return MakeTcpStore(host, spec.master_port, server, timeout, token, spec.world_size, spec.rank,
                      deadline);
}

namespace cluster {

std::string StoreJobToken(const Store& store) {
  const auto* source = dynamic_cast<const JobTokenSource*>(&store);
  return source != nullptr ? source->JobToken() : std::string();
}

}  // namespace cluster

}  // namespace collectives
