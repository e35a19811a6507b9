// The shape of one dispatch or combine call, as its validation settled it: the sizes every
// operation of both generations reasons about, under one name each. Plain data; the operation
// that fills it guarantees the values are validated (positive where a size must be).
#pragma once

namespace moe_ep::engine {

struct CallShape {
  int tokens = 0;         // this rank's tokens in the call
  int hidden = 0;         // elements per row
  int topk = 0;           // experts per token (columns of topk_idx)
  int experts = 0;        // global expert count
  int local_experts = 1;  // experts per rank: experts / ranks
  int max_tokens = 0;     // tokens per rank the call is sized for (num_max_tokens_per_rank)
  int alignment = 1;      // expert block alignment of expanded layouts
  int scale_columns = 0;  // FP8 scale columns per row (0 without scales)
};

}  // namespace moe_ep::engine
