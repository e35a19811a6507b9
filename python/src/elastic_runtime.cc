#include "elastic_runtime.hh"

namespace moe_ep::python {

ElasticRuntime::ElasticRuntime(std::shared_ptr<Group> group, const ElasticBufferConfig& config,
                               const dispatcher::ElasticProviderRequest& request, int device)
    : group_(std::move(group)), config_(config) {
  dispatcher::ElasticProvider made = dispatcher::make_elastic_backend(*group_, config, request);
  table_ = made.table;
  backend_ = std::move(made.backend);
  host_ = dispatcher::builtin_elastic_buffer(backend_.get());
  // The agreed provider is the CUDA one exactly where it was asked for.
  placement_.cuda = request.cuda;
  if (request.cuda) device_ = device;
  if (!request.cuda && !request.why_host.empty()) placement_.why_host = request.why_host;
}

ElasticRuntime::~ElasticRuntime() = default;

DispatchResult ElasticRuntime::dispatch(const DispatchArgs& args) {
  std::lock_guard lock(calls_);
  return backend_->dispatch(args);
}

CombineResult ElasticRuntime::combine(const CombineArgs& args) {
  std::lock_guard lock(calls_);
  return backend_->combine(args);
}

int ElasticRuntime::get_theoretical_num_sms(int e, int k, int so_k, double rdma, double nvl, double rd,
                                            double wr) const {
  return backend_->get_theoretical_num_sms(e, k, so_k, rdma, nvl, rd, wr);
}

int ElasticRuntime::get_theoretical_num_qps(int num_sms) const { return backend_->get_theoretical_num_qps(num_sms); }

void ElasticRuntime::barrier() {
  std::lock_guard lock(calls_);
  backend_->barrier();
}

void ElasticRuntime::destroy() {
  std::lock_guard lock(calls_);
  backend_->destroy();
}

}  // namespace moe_ep::python
