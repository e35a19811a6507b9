#include "core/npy.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <regex>

#include "moe_ep/error.hpp"

namespace moe_ep::core {
namespace {

std::string_view descr(DType t) {
  switch (t) {
    case DType::kBool:
      return "|b1";
    case DType::kUInt8:
    case DType::kFP8E4M3:
      return "|u1";
    case DType::kInt32:
      return "<i4";
    case DType::kInt64:
      return "<i8";
    case DType::kBF16:
      return "<u2";
    case DType::kFP32:
      return "<f4";
  }
  return "|u1";
}

}  // namespace

void write_npy(const std::string& path, const TensorView& t) {
  if (!t.is_contiguous()) throw InvalidArgument(fmt::format("write_npy({}): tensor is not contiguous", path));
  std::string shape = t.ndim() == 1 ? fmt::format("({},)", t.size(0)) : fmt::format("({})", fmt::join(t.shape(), ", "));
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr(t.dtype()), shape);
  const std::size_t preamble = 10;
  const std::size_t total = (preamble + header.size() + 1 + 63) / 64 * 64;
  header.append(total - preamble - header.size() - 1, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) throw Error(fmt::format("write_npy: cannot open {} for writing", path));
  const char magic[] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.write(magic, sizeof magic);
  const auto len = static_cast<std::uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  out.write(len_bytes, 2);
  out << header;
  out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  if (!out) throw Error(fmt::format("write_npy: writing {} failed", path));
}

Tensor read_npy(const std::string& path, DType as) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("read_npy: cannot open {}", path));
  char magic[10];
  in.read(magic, 10);
  if (!in || std::memcmp(magic, "\x93NUMPY", 6) != 0 || magic[6] != 1)
    throw Error(fmt::format("read_npy: {} is not a version-1 .npy file", path));
  const std::size_t len = static_cast<unsigned char>(magic[8]) | (static_cast<unsigned char>(magic[9]) << 8);
  std::string header(len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(len));
  std::smatch m;
  if (!std::regex_search(header, m, std::regex("'descr': '([^']*)'")) || m[1] != std::string(descr(as)))
    throw Error(fmt::format("read_npy: {} does not hold {} data (header {})", path, dtype_name(as), header));
  if (header.find("'fortran_order': False") == std::string::npos)
    throw Error(fmt::format("read_npy: {} is in Fortran order", path));
  if (!std::regex_search(header, m, std::regex("'shape': \\(([^)]*)\\)")))
    throw Error(fmt::format("read_npy: {} has no shape", path));
  std::vector<std::int64_t> shape;
  const std::string dims = m[1];
  const std::regex number("[0-9]+");
  for (std::sregex_iterator it(dims.begin(), dims.end(), number), end; it != end; ++it)
    shape.push_back(std::stoll(it->str()));
  Tensor t = Tensor::empty(shape, as);
  in.read(static_cast<char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  if (!in) throw Error(fmt::format("read_npy: {} is truncated", path));
  return t;
}

}  // namespace moe_ep::core
