// The name of this host, as gethostname(2) gives it (read once per process; "unknown-host" when
// it cannot be read): the host in log prefixes, in the host transport's exchange of who runs
// where, and in benchmark records.
#pragma once

#include <string>

namespace moe_ep::core {

const std::string& host_name();

}  // namespace moe_ep::core
