// How a store hands a communicator the job token when the job sets none (no
// CommunicationOptions::job_token, ClusterSpec::job_token or COLLECTIVES_JOB_TOKEN): the TCP
// store's creator generates one and the other ranks enrol for it (tcp_store_auth.h); the file
// store keeps one in <dir>/.job-token (file_store.cc). CreateCommunication then proves that
// token on every fabric connection instead of the empty token every stranger knows.
//
// Thread-safety: JobToken may be called from any thread.
#ifndef COLLECTIVES_SRC_CLUSTER_JOB_TOKEN_H_
#define COLLECTIVES_SRC_CLUSTER_JOB_TOKEN_H_

#include <string>

#include "collectives/cluster.h"

namespace collectives::cluster {

// Implemented by the stores that can give a job its token, beside the Store interface (which
// stays as it is for users who write their own store).
class JobTokenSource {
 public:
  // The token this store's connections prove, or the one it keeps for the job; may be empty.
  virtual std::string JobToken() const = 0;

 protected:
  ~JobTokenSource() = default;
};

// store.JobToken() for a JobTokenSource (TCP and file stores), empty for every other store.
// Throws what JobToken throws (the file store: Error(kUnauthenticated) for a token file another
// user owns or others may read).
std::string StoreJobToken(const Store& store);

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_JOB_TOKEN_H_
