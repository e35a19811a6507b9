#include "comm/host/bootstrap.hh"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <fstream>
#include <map>

#include "comm/disagreement.hh"
#include "core/host_name.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::comm::host {

void check_arguments(int rank, int size, const moe_ep::host::AllGather& all_gather) {
  if (size < 1)
    throw InvalidArgument(fmt::format("[rank {}] host::make_group: size = {}, expected at least 1", rank, size));
  if (rank < 0 || rank >= size)
    throw InvalidArgument(fmt::format("[rank {}] host::make_group: rank = {} is outside [0, {}) (size = {})", rank,
                                      rank, size, size));
  if (!all_gather) throw InvalidArgument(fmt::format("[rank {}] host::make_group: all_gather is empty", rank));
}

namespace {

std::string read_boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

Record parse_record(const std::string& text, int from, int rank) {
  try {
    const auto j = nlohmann::json::parse(text);
    Record r;
    r.rank = j.at("rank").get<int>();
    r.size = j.at("size").get<int>();
    r.pid = j.at("pid").get<pid_t>();
    r.host = fmt::format("{} (boot {})", j.at("hostname").get<std::string>(), j.at("boot_id").get<std::string>());
    r.ranks_per_node = j.at("ranks_per_node").get<int>();
    r.fds.control = j.at("control_fd").get<std::int32_t>();
    r.fds.data = j.at("data_fd").get<std::int32_t>();
    r.fds.shared = j.at("shared_fd").get<std::int32_t>();
    r.control_ino = j.at("control_ino").get<std::uint64_t>();
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw StateError(fmt::format("[rank {}] host::make_group: block {} of the all-gather ({} bytes) is not a host "
                                 "bootstrap record: {}",
                                 rank, from, text.size(), e.what()));
  }
}

}  // namespace

// Whether /proc/<pid>/fd/<fd> is the memfd with inode `ino`: the pid names the peer's process in
// this pid namespace.
void check_visible(const Record& peer, int from, int rank) {
  const std::string path = fmt::format("/proc/{}/fd/{}", peer.pid, peer.fds.control);
  struct stat st {};
  std::string what;
  if (kill(peer.pid, 0) != 0 && errno == ESRCH)
    what = fmt::format("there is no process {} here", peer.pid);
  else if (stat(path.c_str(), &st) != 0)
    what = fmt::format("cannot open {}: {}", path, std::strerror(errno));
  else if (static_cast<std::uint64_t>(st.st_ino) != peer.control_ino)
    what = fmt::format("{} is another file: pid {} names another process here", path, peer.pid);
  else
    return;
  throw StateError(fmt::format("[rank {}] host::make_group: the process of rank {} (pid {}) is not visible from this "
                               "one ({}): the processes run in different pid namespaces (e.g. containers) or cannot "
                               "open each other's /proc/<pid>/fd; the host transport needs the processes of one pid "
                               "namespace that may open each other's /proc entries",
                               rank, from, peer.pid, what));
}

nlohmann::json bootstrap_record(int rank, int size, int ranks_per_node, int control_fd, int data_fd, int shared_fd) {
  struct stat st {};
  fstat(control_fd, &st);
  return {{"rank", rank},
          {"size", size},
          {"pid", static_cast<int>(getpid())},
          {"hostname", core::host_name()},
          {"boot_id", read_boot_id()},
          {"ranks_per_node", ranks_per_node},
          {"control_fd", control_fd},
          {"control_ino", static_cast<std::uint64_t>(st.st_ino)},
          {"data_fd", data_fd},
          {"shared_fd", shared_fd}};
}

std::vector<Record> parse_records(const std::vector<std::string>& blocks, int rank, int size) {
  if (static_cast<int>(blocks.size()) != size)
    throw StateError(fmt::format("[rank {}] host::make_group: all_gather returned {} blocks, expected size = {} (one "
                                 "per process, indexed by rank)",
                                 rank, blocks.size(), size));
  std::vector<Record> records;
  for (int r = 0; r < size; ++r) {
    records.push_back(parse_record(blocks[static_cast<size_t>(r)], r, rank));
    const Record& rec = records.back();
    if (rec.rank != r || rec.size != size)
      throw StateError(fmt::format("[rank {}] host::make_group: block {} of the all-gather comes from rank {} of a "
                                   "group of {}, expected rank {} of {} (all_gather must return the blocks indexed "
                                   "by rank)",
                                   rank, r, rec.rank, rec.size, r, size));
  }
  return records;
}

void check_one_host(const std::vector<Record>& records, int rank) {
  std::map<std::string, std::vector<int>> by_host;
  for (int r = 0; r < static_cast<int>(records.size()); ++r) by_host[records[static_cast<size_t>(r)].host].push_back(r);
  if (by_host.size() > 1) {
    std::string hosts;
    for (const auto& [host, rs] : by_host)
      hosts += fmt::format("{}host {} runs {}", hosts.empty() ? "" : "; ", host, comm::rank_list(rs));
    throw InvalidArgument(fmt::format("[rank {}] host::make_group: the processes run on {} hosts ({}); the host "
                                      "transport connects processes of one host: use the MPI transport "
                                      "(moe_ep::mpi::make_group) across hosts",
                                      rank, by_host.size(), hosts));
  }
}

int agreed_ranks_per_node(const std::vector<Record>& records, int rank, int size, int requested) {
  std::map<int, std::string> held;
  for (int r = 0; r < size; ++r) held[r] = std::to_string(records[static_cast<size_t>(r)].ranks_per_node);
  if (auto e = comm::disagreement(fmt::format("[rank {}] host::make_group", rank), "ranks_per_node", held, rank))
    throw *e;
  if (requested < 0)
    throw InvalidArgument(fmt::format("[rank {}] host::make_group: ranks_per_node = {} is negative (0 = all ranks "
                                      "one node)",
                                      rank, requested));
  const int per_node = requested == 0 ? size : requested;
  if (size % per_node != 0)
    throw InvalidArgument(fmt::format("[rank {}] host::make_group: ranks_per_node = {} does not divide size = {}",
                                      rank, per_node, size));
  return per_node;
}

}  // namespace moe_ep::comm::host
