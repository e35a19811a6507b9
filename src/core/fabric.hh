// Facts about the scale-out fabric that bound how transfers are issued.
//
// On EFA (FI_PROVIDER=efa, or a device /sys/class/infiniband/rdmap*) each peer's request ring has
// 128 slots, so at most 128 transfers per peer may be in flight; elsewhere there is no such cap.
#pragma once

namespace moe_ep::core {

bool fabric_is_efa();
// The largest number of in-flight transfers per peer the fabric allows (INT_MAX: no cap).
int fabric_inflight_cap();
// `requested` capped by the fabric.
int cap_inflight(int requested);

}  // namespace moe_ep::core
