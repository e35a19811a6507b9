// The built-in provider "cpu": this library's Buffer and ElasticBuffer behind the provider
// interfaces.
#include "moe_ep/provider.hpp"

#include "moe_ep/elastic_provider.hpp"

namespace moe_ep::provider {
namespace {

class CpuLegacy final : public LegacyBackend {
 public:
  CpuLegacy(Group& group, const BufferConfig& config) : buffer_(group, config) {}
  DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts) override {
    return buffer_.get_dispatch_layout(topk_idx, num_experts);
  }
  LegacyDispatchResult dispatch(const LegacyDispatchArgs& args) override { return buffer_.dispatch(args); }
  CombineResult combine(const LegacyCombineArgs& args) override { return buffer_.combine(args); }
  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args) override {
    return buffer_.low_latency_dispatch(args);
  }
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args) override {
    return buffer_.low_latency_combine(args);
  }
  void clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) override {
    buffer_.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts);
  }
  void destroy() override { buffer_.destroy(); }

 private:
  Buffer buffer_;
};

class CpuElastic final : public ElasticBackend {
 public:
  CpuElastic(Group& group, const ElasticBufferConfig& config) : buffer_(group, config) {}
  DispatchResult dispatch(const DispatchArgs& args) override { return buffer_.dispatch(args); }
  CombineResult combine(const CombineArgs& args) override { return buffer_.combine(args); }
  std::int64_t num_bytes() const override { return buffer_.num_bytes(); }
  void destroy() override { buffer_.destroy(); }
  void barrier() override { buffer_.barrier(); }
  std::pair<int, int> get_logical_domain_size() const override { return buffer_.get_logical_domain_size(); }
  int num_allocated_qps() const override { return buffer_.num_allocated_qps(); }
  int get_theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk, double rdma_gbs, double nvlink_gbs,
                              double sm_read_gbs, double sm_write_gbs) const override {
    return buffer_.get_theoretical_num_sms(num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs,
                                           sm_write_gbs);
  }
  int get_theoretical_num_qps(int num_sms) const override { return buffer_.get_theoretical_num_qps(num_sms); }
  moe_ep::ElasticBuffer& buffer() { return buffer_; }

 private:
  moe_ep::ElasticBuffer buffer_;
};

const Table kCpu = {
    .abi_version = kAbiVersion,
    .table_bytes = sizeof(Table),
    .name = "cpu",
    .init = []() -> const char* { return nullptr; },
    .create_legacy = [](Group& group, const BufferConfig& config) -> LegacyBackend* {
      return new CpuLegacy(group, config);
    },
    .create_elastic = [](Group& group, const ElasticBufferConfig& config) -> ElasticBackend* {
      return new CpuElastic(group, config);
    },
    .low_latency_rdma_size_hint = &Buffer::get_low_latency_rdma_size_hint,
};

}  // namespace

const Table& builtin() { return kCpu; }

}  // namespace moe_ep::provider

namespace moe_ep::dispatcher {

ElasticBuffer* builtin_elastic_buffer(provider::ElasticBackend* backend) {
  auto* cpu = dynamic_cast<provider::CpuElastic*>(backend);
  return cpu ? &cpu->buffer() : nullptr;
}

}  // namespace moe_ep::dispatcher
