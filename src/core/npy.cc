#include "core/npy.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "core/arith.hh"
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
    case DType::kFP16:
      return "<f2";
    case DType::kInt8:
      return "|i1";
    case DType::kInt16:
      return "<i2";
  }
  return "|u1";
}

}  // namespace

void write_npy(const std::string& path, const TensorView& t) {
  if (!t.is_contiguous()) throw InvalidArgument(fmt::format("write_npy({}): tensor is not contiguous", path));
  std::string shape = t.ndim() == 1 ? fmt::format("({},)", t.size(0)) : fmt::format("({})", fmt::join(t.shape(), ", "));
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr(t.dtype()), shape);
  const std::size_t preamble = 10;
  const std::size_t total = round_up(preamble + header.size() + 1, 64);
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

namespace {

constexpr std::size_t kPreamble = 10;  // magic (6), version (2), header length (2)

[[noreturn]] void bad_file(const std::string& name, const std::string& what) {
  throw Error(fmt::format("read_npy: {}: {}", name, what));
}

// The header length from the preamble (the first min(10, file size) bytes), checked against the
// size of the file.
std::size_t header_length(const std::string& name, std::span<const char> preamble, std::uint64_t file_bytes) {
  if (preamble.size() < kPreamble)
    bad_file(name, fmt::format("it has {} bytes, fewer than the 10 of a .npy preamble", preamble.size()));
  if (std::memcmp(preamble.data(), "\x93NUMPY", 6) != 0)
    bad_file(name, "not a .npy file (no \\x93NUMPY magic)");
  if (preamble[6] != 1 || preamble[7] != 0)
    bad_file(name, fmt::format("format version {}.{}; only 1.0 (what write_npy writes) is read",
                               static_cast<int>(static_cast<unsigned char>(preamble[6])),
                               static_cast<int>(static_cast<unsigned char>(preamble[7]))));
  const std::size_t len = static_cast<unsigned char>(preamble[8]) | (static_cast<unsigned char>(preamble[9]) << 8);
  if (kPreamble + len > file_bytes)
    bad_file(name, fmt::format("its header of {} bytes runs past the end of the file ({} bytes)", len, file_bytes));
  return len;
}

// The header: a Python dict literal with the keys 'descr', 'fortran_order' and 'shape'.
class HeaderParser {
 public:
  HeaderParser(const std::string& name, std::string_view text) : name_(name), text_(text) {}

  std::vector<std::int64_t> parse(DType as) {
    std::optional<std::vector<std::int64_t>> shape;
    bool have_descr = false, have_order = false;
    expect('{', "the header is not a dict");
    while (!eat('}')) {
      const std::string_view key = string_literal("a quoted key");
      expect(':', fmt::format("no ':' after the key '{}'", key));
      if (key == "descr" && !have_descr) {
        have_descr = true;
        const std::string_view d = string_literal("a quoted dtype for 'descr'");
        if (d != descr(as))
          fail(fmt::format("it holds '{}' data, not {} (stored as '{}')", d, dtype_name(as), descr(as)));
      } else if (key == "fortran_order" && !have_order) {
        have_order = true;
        if (word("True")) fail("it is in Fortran order (column-major); only C order is read");
        if (!word("False")) fail("'fortran_order' is neither True nor False");
      } else if (key == "shape" && !shape) {
        shape = tuple();
      } else {
        fail(fmt::format("the header has {} key '{}'", key == "descr" || key == "fortran_order" || key == "shape"
                                                             ? "a repeated" : "an unknown", key));
      }
      if (!eat(',')) {
        expect('}', "the header dict is not closed by '}'");
        break;
      }
    }
    skip_space();
    if (pos_ != text_.size()) fail("the header has text after its dict");
    if (!have_descr) fail("the header has no 'descr'");
    if (!have_order) fail("the header has no 'fortran_order'");
    if (!shape) fail("the header has no 'shape'");
    return *shape;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { bad_file(name_, what); }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c, const std::string& what) {
    if (!eat(c)) fail(what);
  }
  bool word(std::string_view w) {
    skip_space();
    if (text_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }
  std::string_view string_literal(const char* what) {
    skip_space();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"'))
      fail(fmt::format("the header has no {} where one is expected", what));
    const char quote = text_[pos_];
    const std::size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) fail("the header has an unterminated string");
    const std::string_view s = text_.substr(pos_ + 1, end - pos_ - 1);
    if (s.find('\\') != std::string_view::npos) fail("the header has an escape sequence in a string");
    pos_ = end + 1;
    return s;
  }
  // A tuple of non-negative integers: "()", "(3,)", "(3, 4)", "(3, 4,)".
  std::vector<std::int64_t> tuple() {
    skip_space();
    const std::size_t start = pos_;
    auto shown = [&] {  // the shape's text, for messages
      const std::size_t close = text_.find(')', start);
      const std::size_t end = close == std::string_view::npos ? text_.size() : close + 1;
      return std::string(text_.substr(start, std::min<std::size_t>(end - start, 80)));
    };
    auto not_a_shape = [&]() -> std::vector<std::int64_t> {
      fail(fmt::format("'shape' is not a tuple of non-negative integers: {}", shown()));
    };
    if (!eat('(')) return not_a_shape();
    std::vector<std::int64_t> dims;
    bool comma = false;
    while (!eat(')')) {
      skip_space();
      if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') return not_a_shape();
      std::int64_t value = 0;
      const std::size_t digits = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        if (__builtin_mul_overflow(value, 10, &value) || __builtin_add_overflow(value, text_[pos_] - '0', &value)) {
          while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
          fail(fmt::format("shape {} has a size ({}) that does not fit in 64 bits", shown(),
                           text_.substr(digits, pos_ - digits)));
        }
        ++pos_;
      }
      dims.push_back(value);
      comma = eat(',');
      if (!comma) {
        if (!eat(')')) return not_a_shape();
        break;
      }
    }
    if (dims.size() == 1 && !comma) fail(fmt::format("'shape' {} is not a tuple (one size needs a trailing comma)", shown()));
    return dims;
  }

  const std::string& name_;
  std::string_view text_;
  std::size_t pos_ = 0;
};

std::string python_tuple(const std::vector<std::int64_t>& shape) {
  return shape.size() == 1 ? fmt::format("({},)", shape[0]) : fmt::format("({})", fmt::join(shape, ", "));
}

// The shape the header declares, checked against the dtype and the bytes that follow it.
std::vector<std::int64_t> parse_header(const std::string& name, std::string_view header, DType as,
                                       std::uint64_t data_bytes) {
  std::vector<std::int64_t> shape = HeaderParser(name, header).parse(as);
  if (shape.empty() || shape.size() > static_cast<std::size_t>(TensorView::kMaxDims))
    bad_file(name, fmt::format("shape {} has {} dimensions; 1 to {} are supported", python_tuple(shape), shape.size(),
                               TensorView::kMaxDims));
  std::int64_t bytes = static_cast<std::int64_t>(element_size(as));
  bool empty = false;
  for (std::int64_t size : shape) empty |= size == 0;
  if (empty) {
    bytes = 0;
  } else {
    for (std::int64_t size : shape)
      if (__builtin_mul_overflow(bytes, size, &bytes))
        bad_file(name, fmt::format("shape {} of '{}' needs more bytes than fit in 64 bits", python_tuple(shape),
                                   descr(as)));
  }
  if (static_cast<std::uint64_t>(bytes) != data_bytes)
    bad_file(name, fmt::format("it holds {} bytes of data after its header; shape {} of '{}' needs {}", data_bytes,
                               python_tuple(shape), descr(as), bytes));
  return shape;
}

}  // namespace

Tensor read_npy(const std::string& path, DType as) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("read_npy: cannot open {}", path));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(0, std::ios::beg);
  if (size < 0 || !in) throw Error(fmt::format("read_npy: {}: cannot determine its size", path));
  const auto file_bytes = static_cast<std::uint64_t>(size);
  char preamble[kPreamble] = {};
  const auto got = static_cast<std::size_t>(std::min<std::uint64_t>(file_bytes, kPreamble));
  in.read(preamble, static_cast<std::streamsize>(got));
  if (!in) throw Error(fmt::format("read_npy: {}: reading failed", path));
  const std::size_t len = header_length(path, std::span<const char>(preamble, got), file_bytes);
  std::string header(len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(len));
  if (!in) throw Error(fmt::format("read_npy: {}: reading its header failed", path));
  const std::uint64_t data_bytes = file_bytes - kPreamble - len;
  Tensor t = Tensor::empty(parse_header(path, header, as, data_bytes), as);
  in.read(static_cast<char*>(t.data()), static_cast<std::streamsize>(data_bytes));
  if (!in) throw Error(fmt::format("read_npy: {}: reading its {} bytes of data failed", path, data_bytes));
  return t;
}

Tensor read_npy(std::span<const std::byte> bytes, DType as, const std::string& name) {
  const auto* chars = reinterpret_cast<const char*>(bytes.data());
  const std::size_t len =
      header_length(name, std::span<const char>(chars, std::min(bytes.size(), kPreamble)), bytes.size());
  const std::uint64_t data_bytes = bytes.size() - kPreamble - len;
  Tensor t = Tensor::empty(parse_header(name, std::string_view(chars + kPreamble, len), as, data_bytes), as);
  if (data_bytes > 0) std::memcpy(t.data(), chars + kPreamble + len, static_cast<std::size_t>(data_bytes));
  return t;
}

}  // namespace moe_ep::core
