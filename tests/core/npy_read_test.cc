// .npy files that are not what write_npy writes: every problem is a moe_ep error that names the
// file and what is wrong; nothing is allocated for a shape the file does not hold.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "core/npy.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"
#include "support/text.hh"

namespace moe_ep {
namespace {

// A version-1 .npy file written byte by byte: magic, header length (`declared`, or the real
// length), the header as given, then `data_bytes` bytes of data.
class NpyFile {
 public:
  explicit NpyFile(const std::string& tag)
      : path_((std::filesystem::temp_directory_path() / ("moe_ep_npy_" + tag + "_" + std::to_string(getpid()) + ".npy"))
                  .string()) {}
  ~NpyFile() { std::remove(path_.c_str()); }
  const std::string& write(const std::string& header, std::size_t data_bytes, long declared = -1,
                           char version = 1) {
    return write_data(header, std::string(data_bytes, '\x01'), declared, version);
  }
  const std::string& write_data(const std::string& header, const std::string& data, long declared = -1,
                                char version = 1) {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    const char magic[] = {'\x93', 'N', 'U', 'M', 'P', 'Y', version, 0};
    out.write(magic, sizeof magic);
    const auto len = static_cast<std::uint16_t>(declared >= 0 ? declared : static_cast<long>(header.size()));
    const char len_bytes[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
    out.write(len_bytes, 2);
    out << header << data;
    return path_;
  }

 private:
  std::string path_;
};

std::string dict(const std::string& descr, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }\n";
}

// The message of the moe_ep::Error read_npy throws ("" if none; other exception types say so).
std::string read_error(const std::string& path, DType as) {
  try {
    core::read_npy(path, as);
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a moe_ep error: ") + e.what();
  }
  return "";
}

using testing::contains;

TEST(NpyRead, MalformedFilesAreErrorsNamingTheFile) {
  NpyFile file("malformed");
  struct Case {
    std::string what;
    std::string header;
    std::size_t data_bytes;
    DType as;
    std::string expected;  // part of the message besides the path
    long declared = -1;
  };
  const std::vector<Case> cases = {
      {"20-digit dimension", dict("<u2", "(99999999999999999999,)"), 0, DType::kBF16, "99999999999999999999"},
      {"byte count overflows", dict("<f4", "(4611686018427387904, 4)"), 16, DType::kFP32, "4611686018427387904"},
      {"element count overflows", dict("|u1", "(4294967296, 4294967296)"), 16, DType::kUInt8, "4294967296"},
      {"more dimensions than supported", dict("<u2", "(1, 1, 1, 1, 1, 1, 1)"), 2, DType::kBF16, "dimensions"},
      {"no dimensions", dict("<u2", "()"), 2, DType::kBF16, "dimensions"},
      {"negative dimension", dict("<u2", "(-4,)"), 8, DType::kBF16, "-4"},
      {"not a number", dict("<u2", "(4, x)"), 8, DType::kBF16, "shape"},
      {"header longer than the file", dict("<u2", "(4,)"), 0, DType::kBF16, "header", 4000},
      {"data shorter than the shape", dict("<u2", "(3, 4)"), 20, DType::kBF16, "24"},
      {"data longer than the shape", dict("<u2", "(3, 4)"), 30, DType::kBF16, "24"},
      {"a shape the file cannot hold", dict("|u1", "(1099511627776,)"), 8, DType::kUInt8, "1099511627776"},
      {"missing shape", "{'descr': '<u2', 'fortran_order': False, }\n", 8, DType::kBF16, "shape"},
      {"Fortran order", "{'descr': '<u2', 'fortran_order': True, 'shape': (4,), }\n", 8, DType::kBF16, "Fortran"},
      {"other dtype", dict("<f8", "(4,)"), 32, DType::kBF16, "<f8"},
      {"not a dictionary", "hello\n", 8, DType::kBF16, "header"},
  };
  for (const Case& c : cases) {
    const std::string& path = file.write(c.header, c.data_bytes, c.declared);
    const std::string message = read_error(path, c.as);
    EXPECT_FALSE(message.empty()) << c.what << ": accepted";
    EXPECT_FALSE(contains(message, "not a moe_ep error")) << c.what << ": " << message;
    EXPECT_TRUE(contains(message, path)) << c.what << ": " << message;
    EXPECT_TRUE(contains(message, c.expected)) << c.what << ": " << message;
  }
  // Version 2 headers (4-byte lengths) are not written by write_npy.
  EXPECT_FALSE(read_error(file.write(dict("<u2", "(4,)"), 8, -1, 2), DType::kBF16).empty());
}

TEST(NpyRead, WellFormedVariantsAreRead) {
  NpyFile file("variants");
  // Keys in any order, spaces around separators, no padding and no final newline.
  const std::string header = "{ 'shape' : ( 2 , 3 ) , 'fortran_order' : False , 'descr' : '<i4' }";
  std::string data;
  for (char i = 1; i <= 6; ++i) data += std::string{i, 0, 0, 0};
  Tensor t = core::read_npy(file.write_data(header, data), DType::kInt32);
  ASSERT_EQ(t.ndim(), 2);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(1), 3);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(t.data_as<std::int32_t>()[i], i + 1);
  Tensor v = core::read_npy(file.write(dict("<u2", "(3,)"), 6), DType::kBF16);
  ASSERT_EQ(v.ndim(), 1);
  EXPECT_EQ(v.size(0), 3);
  EXPECT_EQ(v.data_as<std::uint16_t>()[2], 0x0101);
  // Zero elements.
  Tensor z = core::read_npy(file.write(dict("<u2", "(0, 5)"), 0), DType::kBF16);
  EXPECT_EQ(z.numel(), 0);
  EXPECT_EQ(z.size(1), 5);
}

TEST(NpyRead, BytesInMemoryReadAsTheFile) {
  NpyFile file("memory");
  Tensor t = Tensor::empty({2, 5}, DType::kFP32);
  for (int i = 0; i < 10; ++i) t.data_as<float>()[i] = static_cast<float>(i) * 0.5f - 1.0f;
  const std::string path = file.write("", 0);
  core::write_npy(path, t);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto span = std::as_bytes(std::span(bytes.data(), bytes.size()));
  Tensor back = core::read_npy(span, DType::kFP32, "in memory");
  ASSERT_EQ(back.ndim(), 2);
  EXPECT_EQ(back.size(0), 2);
  EXPECT_EQ(back.size(1), 5);
  EXPECT_EQ(std::memcmp(back.data(), t.data(), t.nbytes()), 0);
  // Cut short by one byte: the name given stands for the file.
  try {
    core::read_npy(span.first(span.size() - 1), DType::kFP32, "in memory");
    ADD_FAILURE() << "a truncated buffer was accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "read_npy: in memory: it holds 39 bytes of data after its header")) << e.what();
  }
  EXPECT_THROW(core::read_npy(span.first(9), DType::kFP32, "in memory"), Error);
}

}  // namespace
}  // namespace moe_ep
