#include "elastic_runtime.hh"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "comm/agreement.hh"
#include "core/timeout.hh"
#include "dispatcher/provider_registry.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::python {
namespace {

constexpr std::size_t kWhyBytes = 240;

// What each rank publishes in the provider agreement.
struct Published {
  std::int32_t cuda;
  std::int32_t device;
  char why_host[kWhyBytes];  // (truncated) why a rank without cuda has none
};

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += fmt::format("{}{}", s.empty() ? "" : ", ", r);
  return fmt::format("{} [{}]", ranks.size() == 1 ? "rank" : "ranks", s);
}

// Every rank learns every rank's choice; a rank's refusal raises on every rank (its own error
// here, PeerError naming it elsewhere), and so do ranks that chose different providers.
void agree(Group& group, const ElasticBufferConfig& config, const ProviderChoice& choice, std::exception_ptr local) {
  const std::string ctx = fmt::format("[rank {}] ElasticBuffer (Python): provider choice", group.rank());
  if (!local && !choice.refusal.empty()) local = std::make_exception_ptr(InvalidArgument(choice.refusal));
  Published mine{};
  mine.cuda = choice.cuda ? 1 : 0;
  mine.device = choice.device;
  std::strncpy(mine.why_host, choice.why_host.c_str(), kWhyBytes - 1);
  comm::Agreement agreement(ctx, "ElasticBuffer provider");
  agreement.local_error(local);
  const double timeout = core::checked_timeout(ctx, "num_cpu_timeout_secs", config.num_cpu_timeout_secs);
  const auto blocks = agreement.exchange(group.transport(), comm::Scope::kWorld, {"ElasticBuffer: provider", timeout},
                                         {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  std::map<int, std::vector<int>> by_choice;
  std::string why;
  for (std::size_t r = 0; r < blocks.size(); ++r) {
    Published p;
    std::memcpy(&p, blocks[r].data(), sizeof p);
    by_choice[p.cuda].push_back(static_cast<int>(r));
    if (p.cuda == 0 && why.empty()) why = fmt::format("rank {}: {}", r, std::string(p.why_host, strnlen(p.why_host, kWhyBytes)));
  }
  if (by_choice.size() < 2) return;
  const std::vector<int>& others = by_choice[choice.cuda ? 0 : 1];
  throw PeerError(fmt::format("{}: ranks would use different providers: 'cuda' on {}, 'cpu' on {} ({}); every rank "
                              "needs torch.cuda and the CUDA provider, or none",
                              ctx, ranks_text(by_choice[1]), ranks_text(by_choice[0]), why),
                  others);
}

}  // namespace

ElasticRuntime::ElasticRuntime(std::shared_ptr<Group> group, const ElasticBufferConfig& config,
                               const ProviderChoice& choice, const std::string& path_list)
    : group_(std::move(group)), config_(config) {
  const provider::Table* table = nullptr;
  std::exception_ptr local;
  if (choice.cuda && choice.refusal.empty()) {
    const dispatcher::DeviceProvider found = dispatcher::find_cuda_provider(path_list);
    table = found.table;
    if (table == nullptr)
      local = std::make_exception_ptr(StateError(fmt::format("[rank {}] ElasticBuffer: the CUDA provider is not usable: {}",
                                                             group_->rank(), found.reason)));
  }
  agree(*group_, config, choice, local);
  if (table == nullptr) {
    cpu_ = std::make_unique<ElasticBuffer>(*group_, config);
    placement_.why_host = choice.why_host.empty() ? placement_.why_host : choice.why_host;
    return;
  }
  cuda_.reset(table->create_elastic(*group_, config));
  device_ = choice.device;
  placement_.cuda = true;
}

ElasticRuntime::~ElasticRuntime() = default;

// The built-in buffer serialises its calls itself; the provider's backend is serialised here.
DispatchResult ElasticRuntime::dispatch(const DispatchArgs& args) {
  if (cpu_) return cpu_->dispatch(args);
  std::lock_guard lock(cuda_calls_);
  return cuda_->dispatch(args);
}

CombineResult ElasticRuntime::combine(const CombineArgs& args) {
  if (cpu_) return cpu_->combine(args);
  std::lock_guard lock(cuda_calls_);
  return cuda_->combine(args);
}

// The CUDA provider sizes its launches itself: 0 (= its choice) for SMs and queue pairs.
int ElasticRuntime::get_theoretical_num_sms(int e, int k, int so_k, double rdma, double nvl, double rd,
                                            double wr) const {
  return cpu_ ? cpu_->get_theoretical_num_sms(e, k, so_k, rdma, nvl, rd, wr) : 0;
}

int ElasticRuntime::get_theoretical_num_qps(int num_sms) const {
  return cpu_ ? cpu_->get_theoretical_num_qps(num_sms) : 0;
}

void ElasticRuntime::barrier() {
  if (cpu_) return cpu_->barrier();
  std::lock_guard lock(cuda_calls_);
  group_->barrier(config_.num_cpu_timeout_secs);
}

void ElasticRuntime::destroy() {
  if (cpu_) return cpu_->destroy();
  std::lock_guard lock(cuda_calls_);
  cuda_->destroy();
}

std::pair<int, int> ElasticRuntime::get_physical_domain_size() const {
  return cpu_ ? cpu_->get_physical_domain_size() : std::pair{group_->num_scaleout(), group_->num_scaleup()};
}

// The CUDA provider's path is always the direct one (one node, no hybrid forwarding).
std::pair<int, int> ElasticRuntime::get_logical_domain_size() const {
  return cpu_ ? cpu_->get_logical_domain_size() : std::pair{1, group_->size()};
}

std::int64_t ElasticRuntime::num_bytes() const { return cpu_ ? cpu_->num_bytes() : cuda_->num_bytes(); }

int ElasticRuntime::num_max_tokens_per_rank() const {
  return cpu_ ? cpu_->num_max_tokens_per_rank() : config_.num_max_tokens_per_rank;
}

int ElasticRuntime::num_allocated_qps() const { return cpu_ ? cpu_->num_allocated_qps() : config_.num_allocated_qps; }

}  // namespace moe_ep::python
