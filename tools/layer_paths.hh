// The MoE layer pushed through one API: V2 (ElasticBuffer), V1 normal mode, or V1 low-latency.
// One object per rank; `moe-ep run` times each phase and verifies the outputs.
#pragma once

#include <memory>
#include <string>

#include "moe_layer.hh"
#include "moe_ep/group.hpp"

namespace moe_ep::tools {

enum class Api { kV2, kV1, kV1LowLatency };

struct PathOptions {
  int workers = 0;  // V2: num_sms (0 = model); V1: worker threads (num_sms = 2 x workers, 0 = default config)
  bool async = false;
};

class LayerPath {
 public:
  virtual ~LayerPath() = default;
  virtual void barrier() = 0;
  virtual void dispatch() = 0;
  virtual void experts() = 0;
  virtual void combine() = 0;

  // After combine.
  virtual Tensor combined_x() const = 0;
  virtual Tensor combined_weights() const = 0;  // undefined for low-latency mode
  // After dispatch: rows carrying data (compact rows, or (token, expert) pairs).
  virtual std::int64_t received_rows() const = 0;
  virtual int workers() const = 0;
  // Writes the last iteration's tensors (docs/dump-format.md).
  virtual void dump(const std::string& dir) const = 0;
};

std::unique_ptr<LayerPath> make_path(Api api, Group& group, const LayerConfig& config, const ExpertParams& params,
                                     const RankBatch& batch, const PathOptions& options);

// Logical bytes per received row, as printed by the reports.
std::int64_t dispatch_row_bytes(Api api, const LayerConfig& config);
std::int64_t combine_row_bytes(Api api, const LayerConfig& config);
std::string dispatch_row_formula(Api api, const LayerConfig& config);
std::string combine_row_formula(Api api, const LayerConfig& config);
const char* api_name(Api api);

}  // namespace moe_ep::tools
