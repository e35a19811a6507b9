// The network alone, beside `moe-ep bench --transport mpi` across hosts: every rank sends a given
// number of bytes to the ranks of the other nodes (split evenly among them) and receives as many,
// with one MPI_Isend/MPI_Irecv pair per peer from buffers allocated once, and does nothing else:
// no packing, no routing, no reduction. Given the bytes that one of moe-ep's calls put on the
// network, its time is what moving those bytes alone costs on this transport, measured in the same
// run: a floor that no implementation sending those bytes can beat, since each must send them.
// Completion is polled within MOE_EP_TIMEOUT_SECS: a rank that never takes part is a TimeoutError.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe_ep::bench {

class ScaleoutAlone {
 public:
  // comm: every rank of the job; ranks_per_node: consecutive ranks that form a node; bytes: what
  // this rank sends per call (at most INT_MAX per peer).
  ScaleoutAlone(MPI_Comm comm, int ranks_per_node, std::uint64_t bytes);
  ~ScaleoutAlone();
  ScaleoutAlone(const ScaleoutAlone&) = delete;
  ScaleoutAlone& operator=(const ScaleoutAlone&) = delete;

  void exchange();  // one call: sends and receives every peer's share, returns when all completed

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  std::vector<int> peers_;  // the ranks of the other nodes
  std::vector<int> shares_;  // [rank] the bytes that rank sends to each of its peers
  std::vector<std::byte> send_, recv_;
};

}  // namespace moe_ep::bench
