// What an expression throws, for tests of error paths: the moe-ep error type, its message and the
// ranks it names. One helper for every test binary.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace moe_ep::testing {

// The error an expression throws: type name and message ("" when it does not throw).
struct Caught {
  std::string type;  // TimeoutError, PeerError, CapacityError, InvalidArgument, StateError, ResourceError or other
  std::string message;
  std::vector<int> ranks;  // PeerError and TimeoutError
};
Caught catch_error(const std::function<void()>& fn);

// Only the message ("" when nothing is thrown).
inline std::string error_of(const std::function<void()>& fn) { return catch_error(fn).message; }

}  // namespace moe_ep::testing
