// Version and build type, baked in by CMake.
#include "collectives/version.h"

namespace collectives {

const char* Version() { return COLLECTIVES_VERSION_STRING; }
const char* BuildType() { return COLLECTIVES_BUILD_TYPE; }

}  // namespace collectives
