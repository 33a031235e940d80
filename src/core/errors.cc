// collectives::Error and the names of its codes.
#include "collectives/errors.h"

namespace collectives {

const char* ToString(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kInvalidUsage: return "invalid usage";
    case ErrorCode::kSystem: return "system error";
    case ErrorCode::kPeerLost: return "peer lost";
    case ErrorCode::kMismatch: return "mismatch";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kUnauthenticated: return "unauthenticated";
    case ErrorCode::kAborted: return "aborted";
    case ErrorCode::kNotSupported: return "not supported";
    case ErrorCode::kInternal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string("[") + ToString(code) + "] " + message),
      code_(code),
      message_(std::make_shared<const std::string>(message)) {}

}  // namespace collectives
