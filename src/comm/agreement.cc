#include "comm/agreement.hh"

#include <fmt/format.h>

#include <cstring>
#include <map>

#include "comm/disagreement.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::comm {
namespace {

constexpr std::size_t kMessageBytes = 480;
constexpr std::size_t kOperationBytes = 32;

struct BlockHeader {
  std::uint32_t ok;
  std::uint32_t num_fields;
  char operation[kOperationBytes];
  char message[kMessageBytes];
};

}  // namespace

void Agreement::build_block(std::span<const std::byte> payload) {
  BlockHeader header{};
  header.ok = error_ ? 0 : 1;
  header.num_fields = static_cast<std::uint32_t>(fields_.size());
  std::strncpy(header.operation, operation_.c_str(), kOperationBytes - 1);
  if (error_) std::strncpy(header.message, message_of(error_).c_str(), kMessageBytes - 1);
  const std::size_t fields_bytes = fields_.size() * sizeof(std::int64_t);
  block_.resize(sizeof header + fields_bytes + payload.size());
  std::memcpy(block_.data(), &header, sizeof header);
  for (std::size_t i = 0; i < fields_.size(); ++i)
    std::memcpy(block_.data() + sizeof header + i * sizeof(std::int64_t), &fields_[i].value, sizeof(std::int64_t));
  if (!payload.empty()) std::memcpy(block_.data() + sizeof header + fields_bytes, payload.data(), payload.size());
}

std::vector<std::span<const std::byte>> Agreement::exchange(Transport& transport, Scope scope, const Wait& wait,
                                                            std::span<const std::byte> payload) {
  build_block(payload);
  gathered_ = transport.all_gather(block_, scope, wait);
  gathered_ok_ = true;
  std::vector<std::span<const std::byte>> blocks;
  for (int i = 0; i < gathered_.size(); ++i) blocks.push_back(gathered_[i]);
  const int first = scope == Scope::kWorld ? 0 : transport.node_first_rank();
  return check(blocks, std::vector<char>(blocks.size(), 1), first, transport.rank());
}

std::vector<std::span<const std::byte>> Agreement::exchange_among(TolerantGather& gather, const std::vector<char>& live,
                                                                  double timeout_secs,
                                                                  std::span<const std::byte> payload,
                                                                  TolerantGather::Result& result, int rank) {
  build_block(payload);
  result = gather.gather(block_, operation_, live, timeout_secs);
  gathered_ok_ = true;
  std::vector<std::span<const std::byte>> blocks;
  for (const auto& b : result.blocks) blocks.emplace_back(b.data(), b.size());
  return check(blocks, result.member, 0, rank);
}

// Long: the agreement's checks in the order the header states them, each with its message.
std::vector<std::span<const std::byte>> Agreement::check(const std::vector<std::span<const std::byte>>& blocks,
                                                         const std::vector<char>& present, int first, int rank) {
  const int n = static_cast<int>(blocks.size());
  auto header = [&](int i) { return reinterpret_cast<const BlockHeader*>(blocks[static_cast<size_t>(i)].data()); };

  // 0. Every peer is in an agreement too (not in some other collective).
  for (int i = 0; i < n; ++i) {
    if (!present[static_cast<size_t>(i)]) continue;
    const std::size_t size = blocks[static_cast<size_t>(i)].size();
    if (size < sizeof(BlockHeader) || size < sizeof(BlockHeader) + header(i)->num_fields * sizeof(std::int64_t))
      throw PeerError(fmt::format("{}: rank {} is in a different collective call than {}", context_, first + i,
                                  operation_),
                      {first + i});
  }

  // 1. Rejected arguments.
  std::vector<int> rejected;
  std::string reasons;
  for (int i = 0; i < n; ++i) {
    if (!present[static_cast<size_t>(i)] || header(i)->ok) continue;
    rejected.push_back(first + i);
    if (first + i != rank) reasons += fmt::format("; rank {}: {}", first + i, header(i)->message);
  }
  if (error_) std::rethrow_exception(error_);
  if (!rejected.empty())
    throw PeerError(fmt::format("{}: {} rejected its arguments{}", context_, rank_list(rejected), reasons), rejected);

  // 2. Same operation, same signature.
  std::map<int, std::string> operations;
  for (int i = 0; i < n; ++i)
    if (present[static_cast<size_t>(i)]) operations[first + i] = header(i)->operation;
  if (auto e = disagreement(context_, "the operation", operations, rank)) throw *e;
  for (int i = 0; i < n; ++i)
    if (present[static_cast<size_t>(i)] && header(i)->num_fields != fields_.size())
      throw PeerError(fmt::format("{}: rank {} sent {} signature fields, this rank {}", context_, first + i,
                                  header(i)->num_fields, fields_.size()),
                      {first + i});
  for (std::size_t f = 0; f < fields_.size(); ++f) {
    std::map<int, std::string> values;
    for (int i = 0; i < n; ++i) {
      if (!present[static_cast<size_t>(i)]) continue;
      std::int64_t v;
      std::memcpy(&v, blocks[static_cast<size_t>(i)].data() + sizeof(BlockHeader) + f * sizeof(std::int64_t), sizeof v);
      values[first + i] = fields_[f].is_dtype ? std::string(v < 0 ? "none" : dtype_name(static_cast<DType>(v)))
                                              : std::to_string(v);
    }
    if (auto e = disagreement(context_, fields_[f].name, values, rank)) throw *e;
  }

  const std::size_t skip = sizeof(BlockHeader) + fields_.size() * sizeof(std::int64_t);
  std::vector<std::span<const std::byte>> payloads(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    if (present[static_cast<size_t>(i)]) payloads[static_cast<size_t>(i)] = blocks[static_cast<size_t>(i)].subspan(skip);
  return payloads;
}

}  // namespace moe_ep::comm
