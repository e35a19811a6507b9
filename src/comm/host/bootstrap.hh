// The host transport's bootstrap: the one JSON record each process publishes through the
// caller's all-gather (rank, pid, host identity = hostname + boot_id, ranks_per_node request, the
// descriptors of its first channel), and the checks every process runs on all of them. Each check
// gives every process the same answer from the same records, so either all ranks go on or all
// fail with the same error (PeerError naming the ranks that disagree, InvalidArgument otherwise).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moe_ep/host.hpp"

namespace moe_ep::comm::host {

// What a peer needs to map one rank's part of a channel.
struct ChannelFds {
  std::int32_t control;
  std::int32_t data;
  std::int32_t shared;
};

// A rank's bootstrap record.
struct Record {
  int rank = 0;
  int size = 0;
  pid_t pid = 0;
  std::string host;  // hostname (boot boot_id)
  int ranks_per_node = 0;
  ChannelFds fds{};
  std::uint64_t control_ino = 0;
};

// make_group's own arguments (before anything is published).
void check_arguments(int rank, int size, const moe_ep::host::AllGather& all_gather);
// This process's record; `control_fd` is the memfd whose inode peers check (check_visible).
nlohmann::json bootstrap_record(int rank, int size, int ranks_per_node, int control_fd, int data_fd, int shared_fd);
// Every rank's record from the all-gather's blocks, checked to be indexed by rank.
std::vector<Record> parse_records(const std::vector<std::string>& blocks, int rank, int size);
// All processes run on one host (hostname and boot id).
void check_one_host(const std::vector<Record>& records, int rank);
// The ranks per logical node every rank asked for (0 = all), checked to divide the size.
int agreed_ranks_per_node(const std::vector<Record>& records, int rank, int size, int requested);
// The process of rank `from` is visible from this one: /proc/<pid>/fd/<fd> is its control memfd.
void check_visible(const Record& peer, int from, int rank);

}  // namespace moe_ep::comm::host
