// A small MPI job for the failure tests (tests/mpi/failure_check.sh): every rank runs dispatch and
// combine in a loop on an ElasticBuffer. Mode "normal" exits cleanly; "kill" makes rank 1 kill
// itself (SIGKILL) after the first iteration; "absent" makes rank 1 stop calling (it sleeps past
// the timeout). Each surviving rank prints one line "rank R: OK" or "rank R: ERROR <message>".
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/mpi.hpp"

int main(int argc, char** argv) {
  using namespace moe_ep;
  const std::string mode = argc > 1 ? argv[1] : "normal";
  mpi::Session session(&argc, &argv);
  int rank = -1;
  try {
    auto group = mpi::make_group(MPI_COMM_WORLD);
    rank = group->rank();
    const double timeout = env::get_float("MOE_EP_TIMEOUT_SECS");
    const int T = 16, H = 256, k = 2, E = group->size() * 2;
    ElasticBuffer buffer(*group, {.num_max_tokens_per_rank = T, .hidden = H, .num_topk = k,
                                  .num_cpu_timeout_secs = timeout});
    Tensor x = Tensor::zeros({T, H}, DType::kBF16);
    Tensor topk = Tensor::empty({T, k}, DType::kInt64);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) topk.data_as<std::int64_t>()[t * k + j] = (rank + t + j * (E / 2)) % E;
    for (int iteration = 0; iteration < 3; ++iteration) {
      if (iteration == 1 && rank == 1 && mode == "kill") raise(SIGKILL);
      if (iteration == 1 && rank == 1 && mode == "absent") {
        sleep(static_cast<unsigned>(timeout) + 5);
        mpi::Session::abandon();
        std::printf("rank %d: ABSENT\n", rank);
        return 0;
      }
      DispatchResult d = buffer.dispatch({.x = x, .topk_idx = topk, .num_experts = E});
      CombineResult c = buffer.combine({.x = d.recv_x, .handle = d.handle});
    }
    std::printf("rank %d: OK\n", rank);
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    mpi::Session::abandon();
    std::string message = e.what();
    for (char& ch : message)
      if (ch == '\n') ch = ' ';
    std::printf("rank %d: ERROR %s\n", rank, message.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(1);  // peers may be gone: leave without MPI's collective finalization
  }
}
