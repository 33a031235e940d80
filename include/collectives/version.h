// The library's version and how it was built.
#ifndef COLLECTIVES_VERSION_H_
#define COLLECTIVES_VERSION_H_

namespace collectives {

// "0.1.0".
const char* Version();
// "Release", "Debug", ... (CMAKE_BUILD_TYPE of the library's build).
const char* BuildType();

}  // namespace collectives

#endif  // COLLECTIVES_VERSION_H_
