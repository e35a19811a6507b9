#include "moe_ep/dtype.hpp"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <iterator>
#include <limits>

#include "moe_ep/error.hpp"

namespace moe_ep {

namespace {

struct DTypeName {
  DType dtype;
  std::string_view name;
};

// In the order of docs/python.md's list of the dtypes moe-ep moves.
constexpr DTypeName kNames[] = {
    {DType::kBF16, "bfloat16"}, {DType::kFP16, "float16"}, {DType::kFP32, "float32"},
    {DType::kFP8E4M3, "float8_e4m3fn"}, {DType::kInt8, "int8"}, {DType::kInt16, "int16"},
    {DType::kInt32, "int32"}, {DType::kInt64, "int64"}, {DType::kUInt8, "uint8"},
    {DType::kBool, "bool"}};

constexpr std::array<DType, std::size(kNames)> kAll = [] {
  std::array<DType, std::size(kNames)> all{};
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = kNames[i].dtype;
  return all;
}();

// Every enumerator (kBool .. kInt16, the last one) has its name.
constexpr bool names_every_dtype() {
  for (int code = 0; code <= static_cast<int>(DType::kInt16); ++code) {
    bool named = false;
    for (const DTypeName& n : kNames) named = named || n.dtype == static_cast<DType>(code);
    if (!named) return false;
  }
  return true;
}
static_assert(names_every_dtype(), "a DType without a name in kNames");

}  // namespace

std::span<const DType> all_dtypes() { return kAll; }

std::string_view dtype_name(DType t) {
  for (const DTypeName& n : kNames)
    if (n.dtype == t) return n.name;
  return "?";
}

std::string dtype_names() {
  std::string list;
  for (std::size_t i = 0; i < std::size(kNames); ++i)
    list += fmt::format("{}{}", i == 0 ? "" : i + 1 == std::size(kNames) ? " or " : ", ", kNames[i].name);
  return list;
}

DType parse_dtype(std::string_view name, std::string_view context) {
  for (const DTypeName& n : kNames)
    if (n.name == name) return n.dtype;
  throw InvalidArgument(fmt::format("{}: dtype '{}' is not one of {}", context, name, dtype_names()));
}

float fp8_e4m3_to_float(std::uint8_t code) {
  const bool negative = code & 0x80;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 7;
  float magnitude;
  if (exponent == 0xf && mantissa == 7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return negative ? -magnitude : magnitude;
}

}  // namespace moe_ep
