// Argument checks every communicator makes before it issues a call, with one wording for all of
// them ("rank R: <collective>: ..."). Where a tensor may live is each backend's own check.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_CORE_ARGUMENTS_H_
#define COLLECTIVES_SRC_CORE_ARGUMENTS_H_

#include <string>

#include "collectives/types.h"

namespace collectives::core {

// "rank R: <collective>: ", the start of every argument error.
std::string ArgumentPrefix(int rank, const char* collective);

// "rank R: <collective>: <name> tensor ", the start of an error about one tensor.
std::string TensorPrefix(int rank, const char* collective, const char* name);

// Throws Error(kInvalidArgument) when `t`'s dtype is not a DataType or its data is null with
// count > 0, naming the tensor as TensorPrefix does. Builds no string unless it throws: it runs
// on every call.
void CheckTensorData(int rank, const char* collective, const char* name, const Tensor& t);

// Throws Error(kInvalidArgument) when send and recv have different dtypes; `prefix` as above.
void CheckSameDtype(const std::string& prefix, const Tensor& send, const Tensor& recv);

// Throws Error(kInvalidArgument) when `op` is not a ReduceOp; `prefix` as above.
void CheckReduceOp(const std::string& prefix, ReduceOp op);

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_ARGUMENTS_H_
