#include "support/processes.hh"

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

namespace moe_ep::testing {
namespace {

bool write_all(int fd, const void* data, std::size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool write_string(int fd, const std::string& s) {
  const std::uint64_t n = s.size();
  return write_all(fd, &n, sizeof n) && write_all(fd, s.data(), s.size());
}

bool read_string(int fd, std::string* s) {
  std::uint64_t n = 0;
  if (!read_all(fd, &n, sizeof n)) return false;
  s->resize(n);
  return read_all(fd, s->data(), n);
}

}  // namespace

std::string describe(const std::vector<Child>& children) {
  std::string s;
  for (std::size_t r = 0; r < children.size(); ++r) {
    const Child& c = children[r];
    s += "rank " + std::to_string(r) + ": ";
    if (WIFEXITED(c.status))
      s += "exit " + std::to_string(WEXITSTATUS(c.status));
    else if (WIFSIGNALED(c.status))
      s += "signal " + std::to_string(WTERMSIG(c.status));
    s += c.failures.empty() ? "\n" : " (" + c.failures + ")\n";
  }
  return s;
}

std::vector<Child> run_processes(int size, const Body& body, const Rewrite& rewrite) {
  struct Pipes {
    int up[2], down[2], result[2];
  };
  std::vector<Pipes> pipes(static_cast<size_t>(size));
  for (auto& p : pipes)
    if (pipe(p.up) != 0 || pipe(p.down) != 0 || pipe(p.result) != 0) std::abort();
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const pid_t pid = fork();
    if (pid < 0) std::abort();
    if (pid == 0) {
      alarm(60);  // never hang the suite
      for (int q = 0; q < size; ++q) {
        Pipes& p = pipes[static_cast<size_t>(q)];
        close(p.up[0]);
        close(p.down[1]);
        close(p.result[0]);
        if (q != r) close(p.up[1]), close(p.down[0]), close(p.result[1]);
      }
      Pipes& mine = pipes[static_cast<size_t>(r)];
      int calls = 0;
      host::AllGather gather = [&](const std::string& block) {
        ++calls;
        if (!write_string(mine.up[1], block)) throw std::runtime_error("test all-gather: the parent is gone");
        std::uint64_t n = 0;
        if (!read_all(mine.down[0], &n, sizeof n)) throw std::runtime_error("test all-gather: a peer left");
        std::vector<std::string> all(n);
        for (auto& s : all)
          if (!read_string(mine.down[0], &s)) throw std::runtime_error("test all-gather: truncated");
        return all;
      };
      std::string failures, output;
      try {
        failures = body(r, size, gather, &output);
      } catch (const std::exception& e) {
        failures = std::string("uncaught exception: ") + e.what();
      }
      if (calls > 1) failures += "; all_gather was called " + std::to_string(calls) + " times";
      write_string(mine.result[1], failures);
      write_string(mine.result[1], output);
      _exit(failures.empty() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  for (auto& p : pipes) close(p.up[1]), close(p.down[0]), close(p.result[1]);
  // Gather rounds: one block from every child, then every block to every child.
  for (bool serving = true; serving;) {
    std::vector<std::string> blocks(static_cast<size_t>(size));
    for (int r = 0; r < size && serving; ++r) serving = read_string(pipes[static_cast<size_t>(r)].up[0], &blocks[static_cast<size_t>(r)]);
    if (!serving) break;
    if (rewrite) rewrite(blocks);
    for (int r = 0; r < size; ++r) {
      const int fd = pipes[static_cast<size_t>(r)].down[1];
      const std::uint64_t n = blocks.size();
      write_all(fd, &n, sizeof n);
      for (const auto& b : blocks) write_string(fd, b);
    }
  }
  for (auto& p : pipes) close(p.down[1]), close(p.up[0]);  // a child still in a gather learns it failed
  std::vector<Child> children(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    Child& c = children[static_cast<size_t>(r)];
    const int fd = pipes[static_cast<size_t>(r)].result[0];
    read_string(fd, &c.failures);
    read_string(fd, &c.output);
    close(fd);
    waitpid(pids[static_cast<size_t>(r)], &c.status, 0);
  }
  return children;
}

}  // namespace moe_ep::testing
