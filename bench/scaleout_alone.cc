#include "scaleout_alone.hh"

#include <fmt/format.h>

#include <climits>

#include "comm/wait.hh"
#include "core/timeout.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::bench {
namespace {

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw StateError(fmt::format("network-alone exchange: {} failed (error {})", call, rc));
}

}  // namespace

ScaleoutAlone::ScaleoutAlone(MPI_Comm comm, int ranks_per_node, std::uint64_t bytes) {
  int size = 1;
  check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size);
  if (ranks_per_node < 1 || size % ranks_per_node != 0)
    throw InvalidArgument(fmt::format("[rank {}] ranks_per_node = {}: must divide the {} ranks", rank_, ranks_per_node, size));
  for (int r = 0; r < size; ++r)
    if (r / ranks_per_node != rank_ / ranks_per_node) peers_.push_back(r);
  const std::uint64_t share = peers_.empty() ? 0 : bytes / peers_.size();
  if (share > static_cast<std::uint64_t>(INT_MAX))
    throw InvalidArgument(fmt::format("[rank {}] bytes per peer = {}: at most {} (MPI's int counts)", rank_, share, INT_MAX));
  // What each rank sends to each of its peers, so that every receive matches its send.
  const int mine = static_cast<int>(share);
  shares_.assign(static_cast<std::size_t>(size), 0);
  check(MPI_Allgather(&mine, 1, MPI_INT, shares_.data(), 1, MPI_INT, comm_), "MPI_Allgather");
  std::size_t received = 0;
  for (int p : peers_) received += static_cast<std::size_t>(shares_[static_cast<std::size_t>(p)]);
  send_.assign(share * peers_.size(), std::byte{1});
  recv_.assign(received, std::byte{0});
}

ScaleoutAlone::~ScaleoutAlone() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void ScaleoutAlone::exchange() {
  std::vector<MPI_Request> requests(2 * peers_.size(), MPI_REQUEST_NULL);
  const std::size_t mine = static_cast<std::size_t>(shares_[static_cast<std::size_t>(rank_)]);
  std::size_t offset = 0;
  for (std::size_t p = 0; p < peers_.size(); ++p) {
    const int theirs = shares_[static_cast<std::size_t>(peers_[p])];
    check(MPI_Irecv(recv_.data() + offset, theirs, MPI_BYTE, peers_[p], 0, comm_, &requests[p]), "MPI_Irecv");
    offset += static_cast<std::size_t>(theirs);
  }
  for (std::size_t p = 0; p < peers_.size(); ++p)
    check(MPI_Isend(send_.data() + p * mine, static_cast<int>(mine), MPI_BYTE, peers_[p], 0, comm_,
                    &requests[peers_.size() + p]),
          "MPI_Isend");
  comm::Backoff backoff(core::timeout_from_env());
  for (;;) {
    int done = 0;
    check(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) return;
    if (!backoff.pause())
      throw TimeoutError(fmt::format("[rank {}] network-alone exchange did not complete within {:.1f} s: some rank did "
                                     "not take part",
                                     rank_, backoff.elapsed_secs()),
                         {});
  }
}

}  // namespace moe_ep::bench
