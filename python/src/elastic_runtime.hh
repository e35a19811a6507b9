// The C++ buffer behind a Python ElasticBuffer: the built-in ElasticBuffer (host tensors), or the
// CUDA provider's backend (device tensors), chosen at construction (docs/python.md, "CUDA
// tensors"). The choice is made in Python (torch knows whether CUDA is usable and which device is
// current) and agreed by every rank before a buffer is built: ranks that would use different
// providers, or a rank that cannot use the one chosen, fail on every rank. Calls are serialised as
// ElasticBuffer's are (docs/semantics.md, "Concurrent calls"): the built-in buffer by its own call
// lock, the CUDA provider's backend by this object's.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::python {

struct ProviderChoice {
  bool cuda = false;     // the CUDA provider (else the built-in one)
  int device = -1;       // with cuda: the device the buffer works on (torch's current device)
  std::string why_host;  // without cuda: why (named when CUDA tensors are refused)
  std::string refusal;   // non-empty: this rank cannot build the buffer (raised here, PeerError elsewhere)
};

class ElasticRuntime {
 public:
  // Collective. `path_list`: where the CUDA provider is looked for (dispatcher::find_cuda_provider).
  ElasticRuntime(std::shared_ptr<Group> group, const ElasticBufferConfig& config, const ProviderChoice& choice,
                 const std::string& path_list);
  ~ElasticRuntime();
  ElasticRuntime(const ElasticRuntime&) = delete;
  ElasticRuntime& operator=(const ElasticRuntime&) = delete;

  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);
  int get_theoretical_num_sms(int e, int k, int so_k, double rdma, double nvl, double rd, double wr) const;
  int get_theoretical_num_qps(int num_sms) const;
  void barrier();
  void destroy();
  std::pair<int, int> get_physical_domain_size() const;
  std::pair<int, int> get_logical_domain_size() const;
  int rank() const { return group_->rank(); }
  int num_ranks() const { return group_->size(); }
  std::int64_t num_bytes() const;
  int num_max_tokens_per_rank() const;
  int num_allocated_qps() const;
  int num_scaleout_ranks() const { return get_logical_domain_size().first; }
  int num_scaleup_ranks() const { return get_logical_domain_size().second; }
  int scaleout_rank_idx() const { return cpu_ ? cpu_->scaleout_rank_idx() : 0; }
  int scaleup_rank_idx() const { return cpu_ ? cpu_->scaleup_rank_idx() : group_->rank(); }
  bool is_hybrid() const { return cpu_ ? cpu_->is_hybrid() : false; }

  const char* provider() const { return cpu_ ? "cpu" : "cuda"; }
  int device() const { return device_; }  // -1 for the built-in provider
  const Placement& placement() const { return placement_; }
  // The built-in buffer (host tensors; Engram, PP, all-gather sessions and HybridEP's combine), or
  // null when the CUDA provider backs this one.
  ElasticBuffer* host_buffer() const { return cpu_.get(); }

 private:
  std::shared_ptr<Group> group_;
  ElasticBufferConfig config_;
  std::unique_ptr<ElasticBuffer> cpu_;
  std::unique_ptr<provider::ElasticBackend> cuda_;
  std::mutex cuda_calls_;  // serialises the calls of cuda_
  int device_ = -1;
  Placement placement_;
};

}  // namespace moe_ep::python
