// The names of the dispatcher's enumerations, both ways: one table per enumeration gives a
// value's name (its first spelling) and the value of every accepted spelling, so the library,
// the Python module and the tool read and print the same words.
#include <fmt/format.h>

#include <string>
#include <string_view>

#include "moe_ep/dispatcher.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep {
namespace {

template <class Enum>
struct Spelling {
  const char* name;
  Enum value;
};

constexpr Spelling<Generation> kGenerations[] = {{"V1", Generation::kV1}, {"V2", Generation::kV2}};
constexpr Spelling<DispatchMode> kModes[] = {
    {"normal", DispatchMode::kNormal}, {"low_latency", DispatchMode::kLowLatency}, {"auto", DispatchMode::kAuto}};
constexpr Spelling<OutputFormat> kFormats[] = {{"normal", OutputFormat::kNormal},
                                               {"low_latency", OutputFormat::kLowLatency},
                                               {"v2_expanded", OutputFormat::kV2Expanded},
                                               {"hybrid_ep", OutputFormat::kHybridEp}};
constexpr Spelling<V2NormalLayout> kV2NormalLayouts[] = {{"compact", V2NormalLayout::kCompact},
                                                         {"expanded", V2NormalLayout::kExpanded},
                                                         {"hybrid_ep", V2NormalLayout::kHybridEp}};
constexpr Spelling<WireDType> kWireDTypes[] = {
    {"bf16", WireDType::kBF16}, {"bfloat16", WireDType::kBF16}, {"fp8", WireDType::kFP8}, {"nvfp4", WireDType::kNVFP4}};
constexpr Spelling<BatchKind> kBatchKinds[] = {
    {"prefill", BatchKind::kPrefill}, {"extend", BatchKind::kPrefill}, {"decode", BatchKind::kDecode}};

template <class Enum, std::size_t N>
const char* name_in(const Spelling<Enum> (&table)[N], Enum value) {
  for (const Spelling<Enum>& s : table)
    if (s.value == value) return s.name;
  return "?";
}

template <class Enum, std::size_t N>
Enum parse_in(const Spelling<Enum> (&table)[N], std::string_view value, std::string_view argument) {
  std::string accepted;
  for (const Spelling<Enum>& s : table) {
    if (value == s.name) return s.value;
    accepted += accepted.empty() ? s.name : fmt::format(" | {}", s.name);
  }
  throw InvalidArgument(fmt::format("{} = '{}' is not one of {}", argument, value, accepted));
}

}  // namespace

const char* generation_name(Generation g) { return name_in(kGenerations, g); }
const char* mode_name(DispatchMode m) { return name_in(kModes, m); }
const char* format_name(OutputFormat f) { return name_in(kFormats, f); }
const char* wire_dtype_name(WireDType d) { return name_in(kWireDTypes, d); }
const char* batch_kind_name(BatchKind k) { return name_in(kBatchKinds, k); }
const char* v2_normal_layout_name(V2NormalLayout l) { return name_in(kV2NormalLayouts, l); }

DispatchMode parse_mode(std::string_view value, std::string_view argument) { return parse_in(kModes, value, argument); }
WireDType parse_wire_dtype(std::string_view value, std::string_view argument) {
  return parse_in(kWireDTypes, value, argument);
}
BatchKind parse_batch_kind(std::string_view value, std::string_view argument) {
  return parse_in(kBatchKinds, value, argument);
}
V2NormalLayout parse_v2_normal_layout(std::string_view value, std::string_view argument) {
  return parse_in(kV2NormalLayouts, value, argument);
}

}  // namespace moe_ep
