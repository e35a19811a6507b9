// The census of mpi::make_group: what every rank tells the others before a group exists, and the
// checks every rank runs on the same answers, so that all ranks go on or all fail with the same
// error, naming the hosts and the rule.
//
// Each rank says which build it runs (moe-ep version, provider ABI), the ranks per node it asks
// for, its process (pid, pid namespace), its host as MPI sees it (the lowest rank of its
// MPI_COMM_TYPE_SHARED group, and that group's size) and the host's name. The checks:
//  - every rank runs the same version and provider ABI (the ranks exchange raw structs and
//    records whose layout is the build's);
//  - every rank asks for the same ranks per node (0: the ranks of each host, which then must be
//    the same number on every host);
//  - every node's ranks are consecutive ranks of one host (a logical node never spans hosts:
//    nodes share memory; so ranks per node divides the ranks of every host);
//  - the ranks of one node share a pid namespace: they map each other's memory through
//    /proc/<pid>/fd, by pid (MPI may see processes of one host that cannot: containers).
// Refusals are InvalidArgument (PeerError for disagreeing requests, naming the ranks).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/mpi/messenger.hh"

namespace moe_ep::comm::mpi {

// One rank's answers.
struct RankFacts {
  std::string version;
  std::uint32_t provider_abi = 0;
  int ranks_per_node = 0;   // requested; 0 = per host
  pid_t pid = 0;
  std::uint64_t pid_namespace = 0;  // inode of /proc/self/ns/pid (0: unknown)
  std::string host_name;
  int host = 0;       // the host as MPI sees it: the lowest rank of its MPI_COMM_TYPE_SHARED group
  int host_size = 0;  // ranks on that host
};

// This process's answers (the host facts from MPI_Comm_split_type over `comm`).
RankFacts local_facts(MPI_Comm comm, int rank, int ranks_per_node);
// A rank's answers as bytes, and back (StateError naming `from` for a malformed block).
std::vector<std::byte> encode(const RankFacts& facts);
RankFacts decode(std::span<const std::byte> block, int from, int rank);

// Every rank's answers, by rank.
struct Census {
  std::vector<RankFacts> ranks;
  // "host 'name' (ranks [..])" of the host that runs `rank`, for errors.
  std::string describe_host(int rank) const;
  // The ranks of each host, by host id (ascending ranks).
  std::map<int, std::vector<int>> host_members() const;
};

// The answers of every rank of the messenger's communicator (one gather).
Census take_census(Messenger& messenger, int tag, const RankFacts& mine, int rank, int size, const Wait& wait);

// The checks (see the top of this file); each throws the same error on every rank.
void check_same_build(const Census& census, int rank);
// The agreed ranks per node (the request, or the ranks of each host).
int agreed_ranks_per_node(const Census& census, int rank, int requested);
void check_nodes_share_memory(const Census& census, int rank, int ranks_per_node);

// What the transport keeps of the census: pids (0 where not visible from here: liveness of such a
// rank is watched by the timeout alone) and hosts.
std::shared_ptr<HostInfo> host_info(const Census& census, int rank);

}  // namespace moe_ep::comm::mpi
