// A fixed dispatch/combine case whose combined rows depend on the summation order of every
// reduction level of docs/semantics.md §4: tokens with three and four lanes on one rank (level 1),
// with three and four ranks of one node (level 2), and with three or four units at the final sum,
// on 8 ranks (one node, or two nodes of four). Expert outputs are chosen per lane so that a sum
// in ascending key order cancels exactly while another order keeps a small term (or the reverse):
// with B = 2^24 s, FP32 gives (B + s) - B = 0 but (-B + s) + B = s.
#pragma once

#include "reference/dense_reference.hh"

namespace moe_ep::reference {

// scaleout: 1 or 2 physical nodes; hybrid: allow_hybrid_mode; expand / multi: the layout and
// allow_multiple_reduction of the case.
CaseSpec order_sensitive_case(int scaleout, bool hybrid, bool expand, bool multi, int num_bias);

// Whether summing `level` (a CaseSpec::reversed_levels bit) in descending key order changes the
// reference combine result of some token of some rank.
bool order_matters(const CaseSpec& spec, int level);

}  // namespace moe_ep::reference
