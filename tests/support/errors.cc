#include "support/errors.hh"

#include "moe_ep/error.hpp"

namespace moe_ep::testing {

Caught catch_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const TimeoutError& e) {
    return {"TimeoutError", e.what(), e.ranks()};
  } catch (const PeerError& e) {
    return {"PeerError", e.what(), e.ranks()};
  } catch (const CapacityError& e) {
    return {"CapacityError", e.what(), {}};
  } catch (const InvalidArgument& e) {
    return {"InvalidArgument", e.what(), {}};
  } catch (const StateError& e) {
    return {"StateError", e.what(), {}};
  } catch (const ResourceError& e) {
    return {"ResourceError", e.what(), {}};
  } catch (const std::exception& e) {
    return {"other", e.what(), {}};
  }
  return {};
}

}  // namespace moe_ep::testing
