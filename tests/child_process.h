// For the tests that run a case in a forked child: one with a mount namespace of its own (a
// private /etc/hosts, /etc/resolv.conf or /dev/shm; needs root), or a capped address space, which
// reports back through its exit status or a pipe.
#ifndef COLLECTIVES_TESTS_CHILD_PROCESS_H_
#define COLLECTIVES_TESTS_CHILD_PROCESS_H_

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "collectives/errors.h"

namespace collectives::testing {

// Reads `fd` until end of file (every writer closed it) or an error, closes it, and returns what
// was read.
inline std::string ReadToEndAndClose(int fd) {
  std::string text;
  char buffer[512];
  for (ssize_t got; (got = read(fd, buffer, sizeof buffer)) > 0;) text.append(buffer, size_t(got));
  close(fd);
  return text;
}

// Moves the calling (child) process into a mount namespace of its own whose mounts do not
// propagate back; false where that cannot be done (not root).
inline bool EnterAPrivateMountNamespace() {
  return unshare(CLONE_NEWNS) == 0 &&
         mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0;
}

// Runs `body` in a child process that sees `contents` at `target` (/etc/hosts, /etc/resolv.conf:
// a bind mount in a mount namespace of its own), and waits for it at most 5 s (then kills it).
// Returns what `body` returns (0 when what it checks holds; it says why not on stderr), 77 where
// such a process cannot be made (needs root), or -1 when it was still running after 5 s.
inline int InAMountNamespace(const std::string& target, const std::string& contents,
                             const std::function<int()>& body) {
  const std::string file = (std::filesystem::temp_directory_path() /
                            ("collectives_test_etc_" + std::to_string(getpid())))
                               .string();
  std::ofstream(file) << contents;
  const pid_t child = fork();
  if (child < 0) return 77;
  if (child == 0) {
    if (!EnterAPrivateMountNamespace() ||
        mount(file.c_str(), target.c_str(), nullptr, MS_BIND, nullptr) != 0) {
      _exit(77);
    }
    _exit(body());
  }
  int status = 0;
  pid_t done = 0;
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
       done == 0 && std::chrono::steady_clock::now() < until;) {
    done = waitpid(child, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  std::filesystem::remove(file);
  if (done == 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// `body` in a child process where a name lookup does not answer: its /etc/resolv.conf names a
// local UDP socket that reads nothing and has the resolver wait 30 s. 78 when the lookups did
// not ask that server; otherwise as InAMountNamespace.
inline int WithANameServerThatDoesNotAnswer(const std::function<int()>& body) {
  // A loopback address of this test's own, so that parallel runs do not share the server.
  const std::string server =
      "127.53." + std::to_string((getpid() >> 8) % 256) + "." + std::to_string(1 + getpid() % 250);
  return InAMountNamespace(
      "/etc/resolv.conf", "nameserver " + server + "\noptions timeout:30 attempts:1\n",
      [&server, &body] {
        const int silent = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_port = htons(53);
        if (silent < 0 || inet_pton(AF_INET, server.c_str(), &address.sin_addr) != 1 ||
            bind(silent, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
          return 77;
        }
        const int status = body();
        char byte;
        if (recv(silent, &byte, 1, MSG_DONTWAIT | MSG_PEEK) < 0) return 78;  // never asked
        return status;
      });
}

// Whether `run` raises kTimeout whose message holds `part` within 3 s: 0 if so, else 1 after
// saying what happened on stderr.
inline int TimesOutSaying(const std::function<void()>& run, const std::string& part) {
  const auto start = std::chrono::steady_clock::now();
  std::optional<Error> error;
  try {
    run();
  } catch (const Error& e) {
    error = e;
  }
  const auto took = std::chrono::steady_clock::now() - start;
  if (error && error->code() == ErrorCode::kTimeout &&
      error->message().find(part) != std::string::npos && took <= std::chrono::seconds(3)) {
    return 0;
  }
  std::fprintf(
      stderr, "after %lld ms: %s\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
      error ? error->what() : "no error");
  return 1;
}

// For a test whose body ran under WithANameServerThatDoesNotAnswer and a 1 s timeout: skips where
// the child could not be made or the lookups did not ask the silent server, else expects 0.
inline void ExpectEndedOnTime(int status) {
  if (status == 77) GTEST_SKIP() << "cannot make a mount namespace or bind port 53 (needs root)";
  if (status == 78) GTEST_SKIP() << "the name lookup did not ask the private name server";
  EXPECT_EQ(status, 0) << (status == -1 ? "still running after 5 s with a timeout of 1 s"
                                        : "did not time out on time naming the lookup (above)");
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_CHILD_PROCESS_H_
