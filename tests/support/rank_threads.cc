#include "support/rank_threads.hh"

#include <fmt/format.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace moe_ep::testing {
namespace {

// Turn i goes to the thread that asks for it once turns 0 .. i-1 have passed.
class Turnstile {
 public:
  void wait_for(int turn) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return next_ == turn; });
  }
  void pass() {
    {
      std::lock_guard lock(mutex_);
      ++next_;
    }
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int next_ = 0;
};

}  // namespace

std::vector<std::string> run_rank_threads(int threads, int rounds, bool take_turns,
                                          const std::function<void(int, int, std::vector<std::string>&)>& body) {
  Turnstile turns;
  std::vector<std::vector<std::string>> problems(static_cast<std::size_t>(threads));
  std::vector<std::thread> started;
  for (int t = 0; t < threads; ++t)
    started.emplace_back([&, t] {
      std::vector<std::string>& mine = problems[static_cast<std::size_t>(t)];
      for (int r = 0; r < rounds; ++r) {
        if (take_turns) turns.wait_for(r * threads + t);
        const Caught c = catch_error([&] { body(t, r, mine); });
        if (take_turns) turns.pass();
        if (!c.type.empty()) mine.push_back(fmt::format("thread {} round {}: {}: {}", t, r, c.type, c.message));
      }
    });
  for (std::thread& t : started) t.join();
  std::vector<std::string> all;
  for (auto& mine : problems) all.insert(all.end(), mine.begin(), mine.end());
  return all;
}

bool ranks_disagreed(const Caught& caught) {
  return caught.type == "PeerError" && caught.message.find("disagree") != std::string::npos;
}

}  // namespace moe_ep::testing
