#include "moe_ep/convert.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/arith.hh"
#include "core/checks.hh"
#include "core/fp8_rows.hh"
#include "core/nvfp4_rows.hh"

namespace moe_ep {
namespace {

constexpr std::string_view kQuantize = "quantize_fp8";

}  // namespace

float fp8_block_scale_inv(float amax, bool round_scale) { return core::fp8_block_scales(amax, round_scale).scale_inv; }

Fp8Tensor quantize_fp8(const TensorView& x, Fp8Options options) {
  if (x.dtype() != DType::kBF16 && x.dtype() != DType::kFP32)
    core::fail(kQuantize, "x has dtype {}, expected bfloat16 or float32", dtype_name(x.dtype()));
  core::expect_tensor(kQuantize, "x", x, x.dtype(), {-1, -1});
  core::expect_rows_contiguous(kQuantize, "x", x);
  if (options.use_ue8m0 && !options.round_scale)
    core::fail(kQuantize, "use_ue8m0=true requires round_scale=true");
  const std::int64_t n = x.size(0), h = x.size(1);
  if (h % kFp8BlockSize != 0)
    core::fail(kQuantize, "hidden size {} is not a multiple of the FP8 block size {}", h, kFp8BlockSize);
  const std::int64_t blocks = h / kFp8BlockSize;
  Fp8Tensor out;
  out.data = Tensor::empty({n, h}, DType::kFP8E4M3);
  out.scales = options.use_ue8m0 ? Tensor::zeros({n, core::ceil_div(blocks, 4)}, DType::kInt32)
                                 : Tensor::empty({n, blocks}, DType::kFP32);
  const std::size_t es = element_size(x.dtype());
  const std::size_t scale_row_bytes = out.scales.nbytes() / static_cast<std::size_t>(std::max<std::int64_t>(n, 1));
  for (std::int64_t t = 0; t < n; ++t) {
    const auto* row = static_cast<const std::byte*>(x.data()) + t * x.stride(0) * static_cast<std::int64_t>(es);
    auto* q = out.data.data_as<std::uint8_t>() + t * h;
    auto* s = static_cast<std::byte*>(out.scales.data()) + static_cast<std::size_t>(t) * scale_row_bytes;
    if (x.dtype() == DType::kBF16) {
      core::cast_row_fp8(reinterpret_cast<const std::uint16_t*>(row), h, options.round_scale, options.use_ue8m0, q, s);
    } else {
      core::cast_row_fp8(reinterpret_cast<const float*>(row), h, options.round_scale, options.use_ue8m0, q, s);
    }
  }
  return out;
}

Nvfp4Tensor quantize_nvfp4(const TensorView& x, const Nvfp4Options& options) {
  constexpr std::string_view kContext = "quantize_nvfp4";
  core::expect_tensor(kContext, "x", x, DType::kBF16, {-1, -1});
  core::expect_rows_contiguous(kContext, "x", x);
  const std::int64_t n = x.size(0), h = x.size(1);
  if (h % 16 != 0) core::fail(kContext, "hidden size {} is not a multiple of the NVFP4 block size 16", h);
  if (!options.use_ue8m0_for_sf && !(std::isfinite(options.global_scale) && options.global_scale > 0.0f))
    core::fail(kContext, "global_scale = {} must be a positive finite number", options.global_scale);
  const core::Nvfp4Cast cast{.global_scale = options.global_scale, .ue8m0 = options.use_ue8m0_for_sf,
                             .rounding = core::nvfp4_rounding(options.rounding)};
  Nvfp4Tensor out{Tensor::empty({n, h / 2}, DType::kUInt8), Tensor::empty({n, h / 16}, DType::kUInt8)};
  for (std::int64_t t = 0; t < n; ++t)
    core::cast_row_nvfp4(x.data_as<const std::uint16_t>() + t * x.stride(0), h, cast,
                         out.data.data_as<std::uint8_t>() + t * (h / 2), out.scales.data_as<std::uint8_t>() + t * (h / 16));
  return out;
}

Tensor dequantize_nvfp4(const TensorView& data, const TensorView& scales, float global_scale, bool use_ue8m0_for_sf) {
  constexpr std::string_view kContext = "dequantize_nvfp4";
  core::expect_tensor(kContext, "data", data, DType::kUInt8, {-1, -1});
  core::expect_rows_contiguous(kContext, "data", data);
  const std::int64_t n = data.size(0), h = 2 * data.size(1);
  core::expect_tensor(kContext, "scales", scales, DType::kUInt8, {n, h / 16});
  core::expect_rows_contiguous(kContext, "scales", scales);
  if (h % 16 != 0) core::fail(kContext, "data has {} bytes per row; NVFP4 rows hold a multiple of 8", h / 2);
  Tensor out = Tensor::empty({n, h}, DType::kFP32);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t i = 0; i < h; ++i) {
      const std::uint8_t byte = data.data_as<const std::uint8_t>()[t * data.stride(0) + i / 2];
      const float v = e2m1_to_float(static_cast<std::uint8_t>(i % 2 ? byte >> 4 : byte & 15));
      const std::uint8_t sf = scales.data_as<const std::uint8_t>()[t * scales.stride(0) + i / 16];
      out.data_as<float>()[t * h + i] = use_ue8m0_for_sf ? std::ldexp(v, static_cast<int>(sf) - 127)
                                                         : v * fp8_e4m3_to_float(sf) / global_scale;
    }
  return out;
}

Tensor dequantize_fp8(const TensorView& data, const TensorView& scales) {
  constexpr std::string_view kContext = "dequantize_fp8";
  core::expect_tensor(kContext, "data", data, DType::kFP8E4M3, {-1, -1});
  core::expect_rows_contiguous(kContext, "data", data);
  const std::int64_t n = data.size(0), h = data.size(1);
  if (h % kFp8BlockSize != 0)
    core::fail(kContext, "hidden size {} is not a multiple of the FP8 block size {}", h, kFp8BlockSize);
  const std::int64_t blocks = h / kFp8BlockSize;
  const bool ue8m0 = scales.dtype() == DType::kInt32;
  if (ue8m0) {
    core::expect_tensor(kContext, "scales", scales, DType::kInt32, {n, core::ceil_div(blocks, 4)});
  } else {
    core::expect_tensor(kContext, "scales", scales, DType::kFP32, {n, blocks});
  }
  Tensor out = Tensor::empty({n, h}, DType::kFP32);
  for (std::int64_t t = 0; t < n; ++t) {
    const auto* q = data.data_as<const std::uint8_t>() + t * data.stride(0);
    float* o = out.data_as<float>() + t * h;
    for (std::int64_t b = 0; b < blocks; ++b) {
      float scale_inv;
      if (ue8m0) {
        const auto* word = scales.data_as<const std::int32_t>() + t * scales.stride(0) + (b / 4) * scales.stride(1);
        const std::uint32_t byte = (static_cast<std::uint32_t>(*word) >> (8 * (b % 4))) & 0xffu;
        scale_inv = bits_float(byte << 23);
      } else {
        scale_inv = scales.data_as<const float>()[t * scales.stride(0) + b * scales.stride(1)];
      }
      for (std::int64_t i = b * kFp8BlockSize; i < (b + 1) * kFp8BlockSize; ++i)
        o[i] = fp8_e4m3_to_float(q[i]) * scale_inv;
    }
  }
  return out;
}

Tensor to_bf16(const TensorView& x) {
  constexpr std::string_view kContext = "to_bf16";
  if (x.dtype() != DType::kFP32 && x.dtype() != DType::kBF16)
    core::fail(kContext, "x has dtype {}, expected float32 or bfloat16", dtype_name(x.dtype()));
  core::expect_contiguous(kContext, "x", x);
  Tensor out = Tensor::empty(x.shape(), DType::kBF16);
  const std::int64_t n = x.numel();
  auto* o = out.data_as<std::uint16_t>();
  if (x.dtype() == DType::kBF16) {
    if (n > 0) std::memcpy(o, x.data(), x.nbytes());  // an empty view may have no data pointer
  } else {
    const float* in = x.data_as<const float>();
    for (std::int64_t i = 0; i < n; ++i) o[i] = float_to_bf16(in[i]);
  }
  return out;
}

Tensor to_fp32(const TensorView& x) {
  constexpr std::string_view kContext = "to_fp32";
  core::expect_contiguous(kContext, "x", x);
  Tensor out = Tensor::empty(x.shape(), DType::kFP32);
  const std::int64_t n = x.numel();
  float* o = out.data_as<float>();
  switch (x.dtype()) {
    case DType::kBF16:
      for (std::int64_t i = 0; i < n; ++i) o[i] = bf16_to_float(x.data_as<const std::uint16_t>()[i]);
      break;
    case DType::kFP8E4M3:
      for (std::int64_t i = 0; i < n; ++i) o[i] = fp8_e4m3_to_float(x.data_as<const std::uint8_t>()[i]);
      break;
    case DType::kFP32:
      if (n > 0) std::memcpy(o, x.data(), x.nbytes());  // an empty view may have no data pointer
      break;
    default:
      core::fail(kContext, "x has dtype {}, expected bfloat16, float32 or float8_e4m3fn", dtype_name(x.dtype()));
  }
  return out;
}

}  // namespace moe_ep
