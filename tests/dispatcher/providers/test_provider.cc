// A provider library for the dispatcher tests: this library's own buffers behind a table whose
// name, generations, init result, ABI version and entry symbol are chosen at compile time, so
// each variant is a real shared library that the probe loads with dlopen. TEST_PROVIDER_WRAP_ELASTIC
// puts the V2 buffer behind a backend class of this library (not the built-in one).
#include <cstdint>
#include <memory>

#include "moe_ep/error.hpp"
#include "moe_ep/provider.hpp"

#ifndef TEST_PROVIDER_NAME
#error "TEST_PROVIDER_NAME is required"
#endif
#ifndef TEST_PROVIDER_ABI
#define TEST_PROVIDER_ABI moe_ep::provider::kAbiVersion
#endif

namespace {

using moe_ep::provider::builtin;
using moe_ep::provider::Table;

const char* init() {
#ifdef TEST_PROVIDER_INIT_FAILURE
  return TEST_PROVIDER_INIT_FAILURE;
#else
  return nullptr;
#endif
}

#ifdef TEST_PROVIDER_WRAP_ELASTIC
// A backend of this library only, not the built-in one: the dispatcher reaches it through the
// provider interface alone (as it would another implementation's).
class Forwarding final : public moe_ep::provider::ElasticBackend {
 public:
  explicit Forwarding(moe_ep::provider::ElasticBackend* inner) : inner_(inner) {}
  moe_ep::DispatchResult dispatch(const moe_ep::DispatchArgs& args) override { return inner_->dispatch(args); }
  moe_ep::CombineResult combine(const moe_ep::CombineArgs& args) override { return inner_->combine(args); }
  std::int64_t num_bytes() const override { return inner_->num_bytes(); }
  void destroy() override { inner_->destroy(); }
  void barrier() override { inner_->barrier(); }
  std::pair<int, int> get_logical_domain_size() const override { return inner_->get_logical_domain_size(); }
  int num_allocated_qps() const override { return inner_->num_allocated_qps(); }
  int get_theoretical_num_sms(int e, int k, int so_k, double rdma, double nvl, double rd, double wr) const override {
    return inner_->get_theoretical_num_sms(e, k, so_k, rdma, nvl, rd, wr);
  }
  int get_theoretical_num_qps(int num_sms) const override { return inner_->get_theoretical_num_qps(num_sms); }

 private:
  std::unique_ptr<moe_ep::provider::ElasticBackend> inner_;
};
#endif

moe_ep::provider::ElasticBackend* create_elastic(moe_ep::Group& group, const moe_ep::ElasticBufferConfig& config) {
#ifdef TEST_PROVIDER_FAIL_HIDDEN
  // A constructor that fails for one shape (as a device out of memory would), on every rank.
  if (config.hidden == TEST_PROVIDER_FAIL_HIDDEN)
    throw moe_ep::CapacityError("test provider: cannot allocate the buffer for this shape", 1LL << 40, 1LL << 30);
#endif
#ifdef TEST_PROVIDER_WRAP_ELASTIC
  return new Forwarding(builtin().create_elastic(group, config));
#else
  return builtin().create_elastic(group, config);
#endif
}

Table make_table() {
  Table t = builtin();
  t.abi_version = TEST_PROVIDER_ABI;
  t.name = TEST_PROVIDER_NAME;
  t.init = &init;
  t.create_elastic = &create_elastic;
#ifndef TEST_PROVIDER_V1
  t.create_legacy = nullptr;
#endif
#ifndef TEST_PROVIDER_V2
  t.create_elastic = nullptr;
#endif
  return t;
}

}  // namespace

#ifdef TEST_PROVIDER_ENTRY
extern "C" __attribute__((visibility("default"))) const Table* TEST_PROVIDER_ENTRY() {
  static const Table table = make_table();
  return &table;
}
#else
// No entry symbol: a shared library that is not a provider.
extern "C" __attribute__((visibility("default"))) int test_provider_not_a_provider() { return make_table().abi_version; }
#endif
