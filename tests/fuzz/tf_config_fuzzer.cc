// Fuzz target: TF_CONFIG parsing. Any text either gives a ClusterSpec that passes Validate() or
// throws collectives::Error(kInvalidArgument); nothing else (no crash, no other exception).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "collectives/cluster.h"
#include "collectives/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const collectives::ClusterSpec spec = collectives::ClusterSpec::FromTfConfig(text);
    spec.Validate();
    if (spec.rank < 0 || spec.rank >= spec.world_size) {
      std::fprintf(stderr, "tf_config_fuzzer: rank %d outside a world of %d\n", spec.rank,
                   spec.world_size);
      std::abort();
    }
  } catch (const collectives::Error& e) {
    if (e.code() != collectives::ErrorCode::kInvalidArgument) {
      std::fprintf(stderr, "tf_config_fuzzer: unexpected code: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
