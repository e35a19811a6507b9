// The C++ buffer behind a Python ElasticBuffer: a V2 backend of the provider every rank agreed on
// (dispatcher::make_elastic_backend): the built-in one (host tensors), or the CUDA provider
// (device tensors), as chosen in Python (docs/python.md, "CUDA tensors"; torch knows whether CUDA
// is usable and which device is current). Ranks that would use different providers, or a rank
// that cannot use the one it chose, fail on every rank. Every call and getter is answered by the
// backend, whichever provider made it; what only the built-in buffer offers (Engram storage, PP,
// all-gather sessions, HybridEP's combine) is reached through host_buffer(). Calls are serialised
// as ElasticBuffer's are (docs/semantics.md, "Concurrent calls"), by this object's lock.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/elastic_provider.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::python {

class ElasticRuntime {
 public:
  // Collective. `device`: with request.cuda, the device the buffer works on (torch's current one).
  ElasticRuntime(std::shared_ptr<Group> group, const ElasticBufferConfig& config,
                 const dispatcher::ElasticProviderRequest& request, int device);
  ~ElasticRuntime();
  ElasticRuntime(const ElasticRuntime&) = delete;
  ElasticRuntime& operator=(const ElasticRuntime&) = delete;

  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);
  int get_theoretical_num_sms(int e, int k, int so_k, double rdma, double nvl, double rd, double wr) const;
  int get_theoretical_num_qps(int num_sms) const;
  void barrier();
  void destroy();
  std::pair<int, int> get_physical_domain_size() const { return {group_->num_scaleout(), group_->num_scaleup()}; }
  std::pair<int, int> get_logical_domain_size() const { return backend_->get_logical_domain_size(); }
  int rank() const { return group_->rank(); }
  int num_ranks() const { return group_->size(); }
  std::int64_t num_bytes() const { return backend_->num_bytes(); }
  int num_max_tokens_per_rank() const { return config_.num_max_tokens_per_rank; }
  int num_allocated_qps() const { return backend_->num_allocated_qps(); }
  int num_scaleout_ranks() const { return get_logical_domain_size().first; }
  int num_scaleup_ranks() const { return get_logical_domain_size().second; }
  // This rank's place in the logical domain, and whether rows take two hops (as ElasticBuffer's).
  int scaleout_rank_idx() const { return rank() / num_scaleup_ranks(); }
  int scaleup_rank_idx() const { return rank() % num_scaleup_ranks(); }
  bool is_hybrid() const { return num_scaleout_ranks() > 1; }

  const char* provider() const { return table_->name; }  // "cpu" or "cuda"
  int device() const { return device_; }  // -1 for the built-in provider
  const Placement& placement() const { return placement_; }
  // The built-in buffer behind the backend, or null when another provider (CUDA) made it.
  ElasticBuffer* host_buffer() const { return host_; }

 private:
  std::shared_ptr<Group> group_;
  ElasticBufferConfig config_;
  const provider::Table* table_ = nullptr;
  std::unique_ptr<provider::ElasticBackend> backend_;
  ElasticBuffer* host_ = nullptr;
  std::mutex calls_;  // serialises the calls of backend_
  int device_ = -1;
  Placement placement_;
};

}  // namespace moe_ep::python
