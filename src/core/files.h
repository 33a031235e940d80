// Small POSIX file helpers shared by the file store (src/cluster) and the checkpoints
// (src/strategy): an owning descriptor and a write of a whole buffer. Errors are left in errno
// for the caller to word.
//
// Thread-safety: a UniqueFd belongs to one thread at a time; WriteAll is as safe as write(2).
#ifndef COLLECTIVES_SRC_CORE_FILES_H_
#define COLLECTIVES_SRC_CORE_FILES_H_

#include <unistd.h>

#include <cstddef>
#include <utility>

namespace collectives::core {

// Closes its descriptor when it goes out of scope.
class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  // Closes now, returning close()'s result (0, or -1 with errno).
  int Close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

// Writes all `bytes`, retrying short writes and EINTR. False with errno set on failure.
bool WriteAll(int fd, const void* data, size_t bytes);

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_FILES_H_
