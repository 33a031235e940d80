// Sets (or unsets, with nullptr) an environment variable for the life of the object, then puts
// back what was there: for tests that read the process environment. Not for use while other
// threads read the environment (set it before starting them).
#ifndef COLLECTIVES_TESTS_SCOPED_ENV_H_
#define COLLECTIVES_TESTS_SCOPED_ENV_H_

#include <cstdlib>
#include <optional>
#include <string>

namespace collectives::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_SCOPED_ENV_H_
