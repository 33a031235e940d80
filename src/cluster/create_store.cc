// The public factories of the TCP store and the store a ClusterSpec names.
#include <memory>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/job_token.h"
#include "src/cluster/tcp_store.h"

namespace collectives {

std::shared_ptr<Store> CreateTcpStore(const std::string& host, uint16_t port, bool is_server,
                                      std::chrono::milliseconds timeout,
                                      const std::string& job_token) {
  if (is_server) {
    return std::make_shared<cluster::TcpStoreServer>(cluster::StripBrackets(host), port,
                                                     job_token);
  }
  return std::make_shared<cluster::TcpStoreClient>(host, port, timeout, job_token);
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
  // With the world size and the rank, a job that sets no token gets one: rank 0 generates it
  // and the others enrol for it (tcp_store_auth.h).
  if (spec.rank == 0) {
    return std::make_shared<cluster::TcpStoreServer>(cluster::StripBrackets(spec.master_addr),
                                                     spec.master_port, job_token, spec.world_size);
  }
  return std::make_shared<cluster::TcpStoreClient>(spec.master_addr, spec.master_port, timeout,
                                                   job_token, spec.rank);
}

namespace cluster {

std::string StoreJobToken(const Store& store) {
  const auto* source = dynamic_cast<const JobTokenSource*>(&store);
  return source != nullptr ? source->JobToken() : std::string();
}

}  // namespace cluster

}  // namespace collectives
