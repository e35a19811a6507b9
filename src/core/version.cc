#include "moe_ep/version.hpp"

namespace moe_ep {

const char* version() { return MOE_EP_VERSION_STRING; }

}  // namespace moe_ep
