// A small MPI job for the failure tests (tests/mpi/failure_check.sh on one host,
// tests/hosts/failure_check.sh across pretend hosts): every rank runs dispatch and combine in a
// loop on an ElasticBuffer. Mode "normal" exits cleanly. In the other modes the victim
// (MOE_EP_PROBE_VICTIM, default rank 1) fails after the first iteration: "kill" kills itself
// (SIGKILL); "stop" stops itself (SIGSTOP; the check script kills it once the others reported);
// "exit" leaves the process at once (_exit(0), without a word to its peers); "absent" stops
// calling: it waits until every other rank has reported (a file each in the folder
// MOE_EP_PROBE_REPORTS names; at most the timeout + 60 s without one). Just before, the victim
// writes the time (CLOCK_REALTIME, seconds) into the file "victim" of that folder. Each surviving
// rank prints one line "rank R: OK" or "rank R: ERROR at <time> <type and ranks it names>: <message>",
// then leaves its file.
#include <signal.h>
#include <unistd.h>

#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
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

double now_secs() {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// The victim's time of failure, for the check script.
void note_victim_time() {
  const std::string folder = reports_folder();
  if (folder.empty()) return;
  if (std::FILE* file = std::fopen((folder + "/victim").c_str(), "w")) {
    std::fprintf(file, "%.3f\n", now_secs());
    std::fclose(file);
  }
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
  const char* victim_text = std::getenv("MOE_EP_PROBE_VICTIM");
  const int victim = victim_text ? std::atoi(victim_text) : 1;
  mpi::Session session(&argc, &argv);
  int rank = -1;
  // Outside the try: the error is printed as the call that failed returns it, before anything is
  // destroyed (the process then leaves without destroying them).
  std::unique_ptr<Group> group;
  std::optional<ElasticBuffer> buffer;
  try {
    group = mpi::make_group(MPI_COMM_WORLD);
    rank = group->rank();
    const double timeout = env::get_float("MOE_EP_TIMEOUT_SECS");
    const int T = 16, H = 256, k = 2, E = group->size() * 2;
    buffer.emplace(*group, ElasticBufferConfig{.num_max_tokens_per_rank = T, .hidden = H, .num_topk = k,
                                               .num_cpu_timeout_secs = timeout});
    Tensor x = Tensor::zeros({T, H}, DType::kBF16);
    Tensor topk = Tensor::empty({T, k}, DType::kInt64);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) topk.data_as<std::int64_t>()[t * k + j] = (rank + t + j * (E / 2)) % E;
    for (int iteration = 0; iteration < 3; ++iteration) {
      if (iteration == 1 && rank == victim && mode != "normal") note_victim_time();
      if (iteration == 1 && rank == victim && mode == "kill") raise(SIGKILL);
      if (iteration == 1 && rank == victim && mode == "stop") raise(SIGSTOP);
      if (iteration == 1 && rank == victim && mode == "exit") _exit(0);
      if (iteration == 1 && rank == victim && mode == "absent") {
        wait_for_reports(rank, group->size(), timeout);
        mpi::Session::abandon();
        std::printf("rank %d: ABSENT\n", rank);
        return 0;
      }
      DispatchResult d = buffer->dispatch({.x = x, .topk_idx = topk, .num_experts = E});
      CombineResult c = buffer->combine({.x = d.recv_x, .handle = d.handle});
    }
    std::printf("rank %d: OK\n", rank);
    std::fflush(stdout);
    leave_report(rank);
    return 0;
  } catch (const std::exception& e) {
    mpi::Session::abandon();
    std::string named = "error";
    if (const auto* peer = dynamic_cast<const PeerError*>(&e)) {
      named = dynamic_cast<const TimeoutError*>(&e) ? "TimeoutError naming [" : "PeerError naming [";
      for (std::size_t i = 0; i < peer->ranks().size(); ++i) named += (i ? ", " : "") + std::to_string(peer->ranks()[i]);
      named += "]";
    }
    std::string message = named + ": " + e.what();
    for (char& ch : message)
      if (ch == '\n') ch = ' ';
    std::printf("rank %d: ERROR at %.3f %s\n", rank, now_secs(), message.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    leave_report(rank);
    _exit(1);  // peers may be gone: leave without MPI's collective finalization
  }
}
