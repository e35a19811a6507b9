#include "elastic/collective_call.hh"

#include <cstdint>
#include <memory>
#include <utility>

#include "core/checks.hh"

namespace moe_ep::elastic {
namespace {

class CallOperation final : public engine::Operation {
 public:
  CallOperation(const engine::EngineFacts& facts, const char* operation, std::uint64_t sequence, CollectiveCall call)
      : Operation(facts.context(operation), operation, operation), sequence_(sequence), call_(std::move(call)) {}
  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override {}

 private:
  void validate() override {
    if (!call_.rejection.empty()) core::fail(context(), "{}", call_.rejection);
    if (call_.validate) call_.validate(context());
  }
  std::vector<std::byte> prepare() override { return call_.publish ? call_.publish() : std::vector<std::byte>{}; }
  void describe(comm::Agreement& agreement) const override {
    agreement.field("operation number", static_cast<std::int64_t>(sequence_));
    if (call_.describe) call_.describe(agreement);
  }
  void run(const Payloads& payloads, const std::function<void()>&) override {
    if (call_.run) call_.run(payloads, [this](const std::function<void()>& fn) { in_step(fn); });
  }

  std::uint64_t sequence_;
  CollectiveCall call_;
};

}  // namespace

void run_collective(engine::Engine& engine, const char* operation, CollectiveCall call) {
  engine.check_usable(operation);
  engine.run_sync(std::make_shared<CallOperation>(engine.facts, operation, engine.next_sequence(), std::move(call)));
}

}  // namespace moe_ep::elastic
