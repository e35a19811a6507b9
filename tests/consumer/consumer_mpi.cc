// Consumer of an installed moe-ep's MPI transport (moe_ep::mpi / moe_ep_mpi.pc): every MPI process
// is a rank; the ElasticBuffer case of consumer_case.hpp runs over MPI_COMM_WORLD. Prints
// "consumer_mpi: OK" on rank 0 and exits 0 on every rank when all ranks' results match.
#include <cstdio>
#include <exception>

#include <mpi.h>
#include <moe_ep/mpi.hpp>

#include "consumer_case.hpp"

int main(int argc, char** argv) {
  moe_ep::mpi::Session session(&argc, &argv);
  int mismatches = 0, size = 0, rank = 0;
  try {
    auto group = moe_ep::mpi::make_group(MPI_COMM_WORLD);
    mismatches = consumer::run_case(*group);
    rank = group->rank();
    size = group->size();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer_mpi: %s\n", e.what());
    moe_ep::mpi::Session::abandon();
    return 1;
  }
  int total = 0;
  MPI_Allreduce(&mismatches, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (total != 0) {
    if (rank == 0) std::fprintf(stderr, "consumer_mpi: %d mismatching elements\n", total);
    return 1;
  }
  if (rank == 0) std::printf("consumer_mpi: %d MPI ranks, dispatch + combine: OK\n", size);
  return 0;
}
