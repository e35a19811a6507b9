// EngramStore: the Engram table of an ElasticBuffer (docs/engram-pp.md). Every rank holds one
// shard of num_entries rows in num_cpu_bytes of symmetric memory of its own; any rank fetches rows
// by global index g (owner g / num_entries, row g % num_entries) without its peers taking part.
//
// Guarantees:
//  - write() is collective (an engine operation, elastic/collective_call.hh): every rank's shape,
//    dtype and scales must agree, else every rank raises. It copies this rank's shard into its
//    storage between two barriers over all ranks, so no fetch of an earlier write overlaps it and
//    every fetch after it sees every rank's new shard. With ranks on more than one node, it also
//    puts each shard into a replica region of every rank of the other nodes ((ranks of other
//    nodes) x shard bytes per rank, allocated by the write), so fetches stay one-sided: node
//    peers' shards are read in place (inside a peer-read section), other nodes' from the replicas.
//  - fetch() reads only: it returns new tensors and never waits on a peer.
//  - The storage and the replicas stay mapped until release() after a collective that every rank
//    passed, or for good (retire()) when that cannot be known.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "comm/transport.hh"
#include "engine/engine.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::elastic {

class EngramStore {
 public:
  // Collective when num_cpu_bytes > 0 (a channel and the storage); nothing is allocated otherwise.
  EngramStore(engine::Engine& engine, std::int64_t num_cpu_bytes);
  ~EngramStore();
  EngramStore(const EngramStore&) = delete;
  EngramStore& operator=(const EngramStore&) = delete;

  // (gpu, cpu) bytes of DeepEP's formula; InvalidArgument for negative or overflowing sizes.
  static std::pair<std::int64_t, std::int64_t> size_hint(std::int64_t num_entries, std::int64_t hidden,
                                                          std::int64_t num_max_tokens_per_rank, DType dtype);

  // Collective. `sf` is kept by reference (its storage stays alive; its contents are read by fetches).
  void write(const TensorView& storage, const Tensor& sf, const std::string& rejection);
  EngramFetchResult fetch(const TensorView& indices, int num_qps, bool col_major_sf);

  bool holds_memory() const { return storage_ != nullptr; }
  // Keeps the memory mapped until the process exits (peers may still read it).
  void retire();

 private:
  struct Layout {
    std::int64_t num_entries = 0;
    int hidden = 0;
    DType dtype = DType::kBF16;
    std::int64_t row_bytes = 0;
  };
  void store(const TensorView& storage, const Layout& layout);
  void replicate(std::int64_t shard_bytes);
  const std::byte* shard_of(int owner);
  // The replica slot of `source`'s shard in `receiver`'s replica region.
  std::int64_t replica_slot(int source, int receiver) const;
  void check_indices(const std::string& context, const TensorView& indices) const;
  Tensor gather_scales(const TensorView& indices, bool col_major) const;

  engine::Engine& engine_;
  std::int64_t capacity_ = 0;
  std::unique_ptr<comm::Transport> channel_;
  std::unique_ptr<comm::SymmetricMemory> storage_;
  std::unique_ptr<comm::SymmetricMemory> replicas_;  // other nodes' shards; with several nodes only
  std::vector<std::uint64_t> replica_signals_;       // signals expected per source on channel_
  std::optional<Layout> layout_;
  Tensor sf_;
};

}  // namespace moe_ep::elastic
