// CollectiveCall: a collective call of ElasticBuffer's Engram, PP and barrier methods, run as an
// engine operation (engine/operation.hh) from a few functions.
//
// Guarantees: the call starts with an agreement over every rank, after this rank's queued
// asynchronous work. This rank's checks (validate) and a rejection the caller made before the
// call travel through it, as do the fields every rank must share (describe) and an operation
// number, so a rank with bad arguments raises its own InvalidArgument, every other rank a
// PeerError naming it, ranks in different calls or with different fields raise PeerError naming
// the field and who holds which value, and the buffer stays usable. Then every rank runs `run`
// with every rank's payload: a failure inside in_step() is raised by every rank alike (checks of
// the gathered payloads) and leaves the buffer usable; any other failure of run leaves the ranks
// out of step and breaks the buffer (Engine::leave).
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "comm/agreement.hh"
#include "engine/engine.hh"

namespace moe_ep::elastic {

using Payloads = std::vector<std::span<const std::byte>>;
using InStep = std::function<void(const std::function<void()>&)>;

struct CollectiveCall {
  std::string rejection;  // as DispatchArgs::rejection
  std::function<void(const std::string& context)> validate;  // this rank's checks
  std::function<void(comm::Agreement&)> describe;            // fields every rank must share
  std::function<std::vector<std::byte>()> publish;           // this rank's payload (after validate)
  std::function<void(const Payloads& payloads, const InStep& in_step)> run;
};

// Runs `call` as `operation` ("barrier", "engram_write", ...) on every rank, synchronously.
void run_collective(engine::Engine& engine, const char* operation, CollectiveCall call);

}  // namespace moe_ep::elastic
