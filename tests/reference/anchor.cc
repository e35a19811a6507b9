void moe_ep_reference_anchor() {}
