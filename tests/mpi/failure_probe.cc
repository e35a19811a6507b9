// A small MPI job for the failure tests (tests/mpi/failure_check.sh): every rank runs dispatch and
// combine in a loop on an ElasticBuffer. Mode "normal" exits cleanly; "kill" makes rank 1 kill
// itself (SIGKILL) after the first iteration; "absent" makes rank 1 stop calling: it waits until
// every other rank has reported (a file each in the folder MOE_EP_PROBE_REPORTS names; at most
// the timeout + 60 s without one). Each surviving rank prints one line "rank R: OK" or
// "rank R: ERROR <message>", then leaves its file.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/mpi.hpp"

namespace {

// The folder where each reporting rank leaves a file (MOE_EP_PROBE_REPORTS; empty: none).
std::string reports_folder() {
  const char* folder = std::getenv("MOE_EP_PROBE_REPORTS");
  return folder ? folder : "";
}

void leave_report(int rank) {
  const std::string folder = reports_folder();
  if (folder.empty()) return;
  if (std::FILE* file = std::fopen((folder + "/rank-" + std::to_string(rank)).c_str(), "w")) std::fclose(file);
}

// The absent rank: back once every other rank has reported, or after timeout + 60 s.
void wait_for_reports(int rank, int ranks, double timeout) {
  namespace fs = std::filesystem;
  const std::string folder = reports_folder();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout + 60);
  while (std::chrono::steady_clock::now() < deadline) {
    int reported = 0;
    for (int r = 0; r < ranks; ++r)
      if (r != rank && !folder.empty() && fs::exists(folder + "/rank-" + std::to_string(r))) ++reported;
    if (reported == ranks - 1) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

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
        wait_for_reports(rank, group->size(), timeout);
        mpi::Session::abandon();
        std::printf("rank %d: ABSENT\n", rank);
        return 0;
      }
      DispatchResult d = buffer.dispatch({.x = x, .topk_idx = topk, .num_experts = E});
      CombineResult c = buffer.combine({.x = d.recv_x, .handle = d.handle});
    }
    std::printf("rank %d: OK\n", rank);
    std::fflush(stdout);
    leave_report(rank);
    return 0;
  } catch (const std::exception& e) {
    mpi::Session::abandon();
    std::string message = e.what();
    for (char& ch : message)
      if (ch == '\n') ch = ' ';
    std::printf("rank %d: ERROR %s\n", rank, message.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    leave_report(rank);
    _exit(1);  // peers may be gone: leave without MPI's collective finalization
  }
}
