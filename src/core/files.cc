// POSIX file helpers (see files.h).
#include "src/core/files.h"

#include <cerrno>

namespace collectives::core {

bool WriteAll(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace collectives::core
