// Agreement: the first exchange of every collective call.
//
// Each rank publishes (a) whether its own arguments were valid, with the error message if not,
// (b) the operation name and named signature fields that every rank must agree on, and (c) a
// free-form payload (addresses, counts). After the exchange either every rank proceeds with the
// same view, or every rank throws: the rank whose arguments were invalid rethrows its own error,
// the others raise PeerError naming it; when signatures differ, every rank raises PeerError
// naming the field and which ranks hold which value. No rank is left waiting either way.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/tolerant_gather.hh"
#include "comm/transport.hh"
#include "moe_ep/dtype.hpp"

namespace moe_ep::comm {

class Agreement {
 public:
  Agreement(std::string_view context, std::string_view operation) : context_(context), operation_(operation) {}

  Agreement& field(const char* name, std::int64_t value) {
    fields_.push_back({name, value, false});
    return *this;
  }
  // A dtype field: messages name the dtypes ("bfloat16"), not their codes; nullopt reads "none".
  Agreement& field(const char* name, std::optional<DType> dtype) {
    fields_.push_back({name, dtype ? static_cast<std::int64_t>(*dtype) : -1, true});
    return *this;
  }
  // The first error of this rank (its arguments were rejected); may be null.
  Agreement& local_error(std::exception_ptr error) {
    error_ = std::move(error);
    return *this;
  }

  // Exchanges and checks. Returns every rank's payload. Failures of the checks happen on every
  // rank alike; a failure of the exchange itself (timeout, a rank left) does not, and leaves the
  // channel out of step: gathered() tells them apart.
  std::vector<std::span<const std::byte>> exchange(Transport& transport, Scope scope, const Wait& wait,
                                                   std::span<const std::byte> payload);
  // The same over a TolerantGather (shrink mode): the exchange and the checks among the ranks
  // this rank counts on (`live`); `result` gets who took part (the checks ran over them; the
  // others' payloads are empty). `rank`: this rank.
  std::vector<std::span<const std::byte>> exchange_among(TolerantGather& gather, const std::vector<char>& live,
                                                         double timeout_secs, std::span<const std::byte> payload,
                                                         TolerantGather::Result& result, int rank);
  bool gathered() const { return gathered_ok_; }

 private:
  struct Field {
    const char* name;
    std::int64_t value;
    bool is_dtype;
  };
  void build_block(std::span<const std::byte> payload);
  // The checks over the blocks of the ranks `present` marks (`first`: the rank of blocks[0]).
  std::vector<std::span<const std::byte>> check(const std::vector<std::span<const std::byte>>& blocks,
                                                const std::vector<char>& present, int first, int rank);

  std::string context_;
  std::string operation_;
  std::vector<Field> fields_;
  std::exception_ptr error_;
  std::vector<std::byte> block_;
  Gathered gathered_;
  bool gathered_ok_ = false;
};

}  // namespace moe_ep::comm
