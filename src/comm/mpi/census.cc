#include "comm/mpi/census.hh"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <nlohmann/json.hpp>

#include "comm/disagreement.hh"
#include "core/host_name.hh"
#include "core/log.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/version.hpp"

namespace moe_ep::comm::mpi {
namespace {

std::uint64_t own_pid_namespace() {
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_ino);
}

// Groups the ranks by a key of their facts, in rank order: "what" for each group.
template <class Key>
std::map<Key, std::vector<int>> ranks_by(const Census& census, Key (*key)(const RankFacts&)) {
  std::map<Key, std::vector<int>> groups;
  for (int r = 0; r < static_cast<int>(census.ranks.size()); ++r)
    groups[key(census.ranks[static_cast<size_t>(r)])].push_back(r);
  return groups;
}

std::string build_of(const RankFacts& f) { return fmt::format("moe-ep {} (provider ABI {})", f.version, f.provider_abi); }

// "host 'a' (ranks [0, 1]), host 'b' (ranks [2, 3])": every host with its ranks.
std::string hosts_text(const Census& census) {
  std::string text;
  for (const auto& [host, ranks] : census.host_members())
    text += fmt::format("{}{}", text.empty() ? "" : ", ", census.describe_host(ranks.front()));
  return text;
}

}  // namespace

RankFacts local_facts(MPI_Comm comm, int rank, int ranks_per_node) {
  RankFacts facts;
  facts.version = moe_ep::version();
  facts.provider_abi = MOE_EP_PROVIDER_ABI_VERSION;
  facts.ranks_per_node = ranks_per_node;
  facts.pid = getpid();
  facts.pid_namespace = own_pid_namespace();
  facts.host_name = core::host_name();
  std::lock_guard lock(mpi_mutex());
  MPI_Comm host_comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host_comm), "MPI_Comm_split_type", rank);
  MPI_Comm_size(host_comm, &facts.host_size);
  MPI_Group host_group, comm_group;
  MPI_Comm_group(host_comm, &host_group);
  MPI_Comm_group(comm, &comm_group);
  const int zero = 0;
  MPI_Group_translate_ranks(host_group, 1, &zero, comm_group, &facts.host);
  MPI_Group_free(&host_group);
  MPI_Group_free(&comm_group);
  MPI_Comm_free(&host_comm);
  return facts;
}

std::vector<std::byte> encode(const RankFacts& facts) {
  const nlohmann::json j{{"version", facts.version},
                         {"provider_abi", facts.provider_abi},
                         {"ranks_per_node", facts.ranks_per_node},
                         {"pid", facts.pid},
                         {"pid_namespace", facts.pid_namespace},
                         {"host_name", facts.host_name},
                         {"host", facts.host},
                         {"host_size", facts.host_size}};
  const std::string text = j.dump();
  const auto* bytes = reinterpret_cast<const std::byte*>(text.data());
  return {bytes, bytes + text.size()};
}

RankFacts decode(std::span<const std::byte> block, int from, int rank) {
  try {
    const auto j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(block.data()), block.size()));
    RankFacts f;
    // The version first: a rank of another build may not know the other fields.
    f.version = j.at("version").get<std::string>();
    f.provider_abi = j.value("provider_abi", std::uint32_t{0});
    f.ranks_per_node = j.value("ranks_per_node", 0);
    f.pid = j.value("pid", pid_t{0});
    f.pid_namespace = j.value("pid_namespace", std::uint64_t{0});
    f.host_name = j.value("host_name", std::string("?"));
    f.host = j.value("host", from);
    f.host_size = j.value("host_size", 1);
    return f;
  } catch (const nlohmann::json::exception& e) {
    throw StateError(fmt::format("[rank {}] mpi::make_group: rank {} sent {} bytes that are not a moe-ep census record "
                                 "({}): is it running moe-ep?",
                                 rank, from, block.size(), e.what()));
  }
}

std::string Census::describe_host(int rank) const {
  const int host = ranks[static_cast<size_t>(rank)].host;
  std::vector<int> members;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r)
    if (ranks[static_cast<size_t>(r)].host == host) members.push_back(r);
  return fmt::format("host '{}' (ranks [{}])", ranks[static_cast<size_t>(rank)].host_name, fmt::join(members, ", "));
}

std::map<int, std::vector<int>> Census::host_members() const {
  return ranks_by<int>(*this, [](const RankFacts& f) { return f.host; });
}

Census take_census(Messenger& messenger, int tag, const RankFacts& mine, int rank, int size, const Wait& wait) {
  std::vector<int> members(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) members[static_cast<size_t>(r)] = r;
  const std::vector<std::byte> bytes = encode(mine);
  const auto blocks = messenger.gather(members, tag, 1, bytes, wait);
  Census census;
  for (int r = 0; r < size; ++r) census.ranks.push_back(decode(blocks[static_cast<size_t>(r)], r, rank));
  return census;
}

void check_same_build(const Census& census, int rank) {
  std::map<int, std::string> held;
  for (int r = 0; r < static_cast<int>(census.ranks.size()); ++r)
    held[r] = build_of(census.ranks[static_cast<size_t>(r)]);
  // A configuration to fix (InvalidArgument), not a peer's failure.
  if (auto e = comm::disagreement(fmt::format("[rank {}] mpi::make_group", rank), "the moe-ep build", held, rank,
                                  fmt::format("the ranks run on {}; every rank of a group must run the same moe-ep "
                                              "version and provider ABI",
                                              hosts_text(census))))
    throw InvalidArgument(e->what());
}

int agreed_ranks_per_node(const Census& census, int rank, int requested) {
  const int size = static_cast<int>(census.ranks.size());
  std::map<int, std::string> held;
  for (int r = 0; r < size; ++r) held[r] = std::to_string(census.ranks[static_cast<size_t>(r)].ranks_per_node);
  if (auto e = comm::disagreement(fmt::format("[rank {}] mpi::make_group", rank), "ranks_per_node", held, rank))
    throw *e;
  const auto hosts = census.host_members();
  int per_node = requested;
  if (per_node == 0) {
    const auto& [first_host, first_ranks] = *hosts.begin();
    per_node = static_cast<int>(first_ranks.size());
    for (const auto& [host, rs] : hosts)
      if (static_cast<int>(rs.size()) != per_node)
        throw InvalidArgument(fmt::format("[rank {}] mpi::make_group: the hosts run different numbers of ranks ({} runs "
                                          "{}, {} runs {}); a node is the ranks of one host unless ranks_per_node "
                                          "sets a smaller one that divides the ranks of every host",
                                          rank, census.describe_host(first_host), first_ranks.size(),
                                          census.describe_host(host), rs.size()));
  }
  if (size % per_node != 0)
    throw InvalidArgument(fmt::format("[rank {}] mpi::make_group: the communicator has {} ranks, not a multiple of "
                                      "ranks_per_node = {}",
                                      rank, size, per_node));
  for (int r = 0; r < size; ++r) {
    const int first = r / per_node * per_node;
    if (census.ranks[static_cast<size_t>(r)].host != census.ranks[static_cast<size_t>(first)].host)
      throw InvalidArgument(fmt::format("[rank {}] mpi::make_group: node {} (ranks {}..{}) spans two hosts: rank {} runs "
                                        "on {}, rank {} on {}; nodes share memory, so a node's ranks must be "
                                        "consecutive ranks of one host (place ranks in blocks per host, e.g. mpirun "
                                        "--map-by slot)",
                                        rank, r / per_node, first, first + per_node - 1, first,
                                        census.describe_host(first), r, census.describe_host(r)));
  }
  return per_node;
}

void check_nodes_share_memory(const Census& census, int rank, int ranks_per_node) {
  if (ranks_per_node <= 1) return;
  const int size = static_cast<int>(census.ranks.size());
  for (int first = 0; first < size; first += ranks_per_node) {
    const RankFacts& lead = census.ranks[static_cast<size_t>(first)];
    for (int r = first + 1; r < first + ranks_per_node; ++r) {
      const RankFacts& other = census.ranks[static_cast<size_t>(r)];
      if (other.pid_namespace == lead.pid_namespace && other.pid_namespace != 0) continue;
      throw InvalidArgument(fmt::format(
          "[rank {}] mpi::make_group: on {}, ranks {} and {} of node {} run in different pid namespaces ({} and {}), "
          "so they cannot map each other's memory: the processes of one node must share a pid namespace (they open "
          "each other's /proc/<pid>/fd); run them in one container or pid namespace, or set ranks_per_node = 1",
          rank, census.describe_host(first), first, r, first / ranks_per_node, lead.pid_namespace,
          other.pid_namespace));
    }
  }
}

std::shared_ptr<HostInfo> host_info(const Census& census, int rank) {
  auto info = std::make_shared<HostInfo>();
  const RankFacts& mine = census.ranks[static_cast<size_t>(rank)];
  for (int r = 0; r < static_cast<int>(census.ranks.size()); ++r) {
    const RankFacts& f = census.ranks[static_cast<size_t>(r)];
    info->host.push_back(f.host);
    // Liveness by pid needs the peer in this pid namespace (processes of one host in different
    // containers do not see each other): others are watched by the timeout alone.
    const bool visible = f.host == mine.host && f.pid_namespace == mine.pid_namespace && f.pid_namespace != 0;
    if (r != rank && f.host == mine.host && !visible)
      core::info(core::Subsys::kInit, "mpi::make_group: the process of rank {} on this host runs in another pid "
                 "namespace: its liveness is watched by the timeout alone", r);
    info->pids.push_back(r == rank || visible ? f.pid : 0);
  }
  info->host_size = mine.host_size;
  return info;
}

}  // namespace moe_ep::comm::mpi
