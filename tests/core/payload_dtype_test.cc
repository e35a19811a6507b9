// The payload dtypes float16, int8 and int16: sizes and names, their DLPack codes in both
// directions, and .npy files written and read back with NumPy's descriptors for them. The one
// table of dtype names: every dtype's name parses back to it, other names are refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/npy.hh"
#include "support/temp_dir.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {
namespace {

struct Expected {
  DType dtype;
  std::size_t size;
  const char* name;
  DLDataType dl;
  const char* npy_descr;
};
constexpr Expected kPayloads[] = {
    {DType::kFP16, 2, "float16", {kDLFloat, 16, 1}, "'<f2'"},
    {DType::kInt8, 1, "int8", {kDLInt, 8, 1}, "'|i1'"},
    {DType::kInt16, 2, "int16", {kDLInt, 16, 1}, "'<i2'"},
};

TEST(PayloadDtype, SizesNamesAndDlpackCodes) {
  for (const auto& e : kPayloads) {
    EXPECT_EQ(element_size(e.dtype), e.size) << e.name;
    EXPECT_EQ(dtype_name(e.dtype), e.name);
    Tensor t = Tensor::empty({2, 8}, e.dtype);
    for (std::size_t i = 0; i < t.nbytes(); ++i) static_cast<unsigned char*>(t.data())[i] = static_cast<unsigned char>(i * 37);
    DLManagedTensor* managed = t.to_dlpack();
    EXPECT_EQ(managed->dl_tensor.dtype.code, e.dl.code) << e.name;
    EXPECT_EQ(managed->dl_tensor.dtype.bits, e.dl.bits) << e.name;
    Tensor back = Tensor::from_dlpack(managed);
    EXPECT_EQ(back.dtype(), e.dtype);
    EXPECT_EQ(back.nbytes(), t.nbytes());
    EXPECT_EQ(std::memcmp(back.data(), t.data(), t.nbytes()), 0) << e.name;
    std::int64_t shape[] = {3};
    std::uint32_t storage[2] = {};
    const DLTensor plain{storage, {kDLCPU, 0}, 1, e.dl, shape, nullptr, 0};
    EXPECT_EQ(view_from_dlpack(plain).dtype(), e.dtype) << e.name;
  }
}

TEST(DtypeNames, EveryNameParsesBackAndOthersAreRefused) {
  EXPECT_EQ(all_dtypes().size(), 10u);
  for (const DType dtype : all_dtypes()) EXPECT_EQ(parse_dtype(dtype_name(dtype), "test"), dtype) << dtype_name(dtype);
  EXPECT_EQ(dtype_names(), "bfloat16, float16, float32, float8_e4m3fn, int8, int16, int32, int64, uint8 or bool");
  try {
    parse_dtype("float64", "empty");
    FAIL() << "float64 parsed";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "empty: dtype 'float64' is not one of " + dtype_names());
  }
}

TEST(PayloadDtype, NpyRoundTrip) {
  const testing::TempDir dir("moe_ep_payload_npy");
  for (const auto& e : kPayloads) {
    Tensor t = Tensor::empty({3, 16}, e.dtype);
    for (std::size_t i = 0; i < t.nbytes(); ++i) static_cast<unsigned char*>(t.data())[i] = static_cast<unsigned char>(255 - i);
    const std::string path = dir.file(std::string(e.name) + ".npy");
    core::write_npy(path, t);
    std::ifstream in(path, std::ios::binary);
    const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(file.find(std::string("'descr': ") + e.npy_descr), std::string::npos) << file.substr(0, 80);
    Tensor back = core::read_npy(path, e.dtype);
    EXPECT_EQ(back.dtype(), e.dtype);
    ASSERT_EQ(back.nbytes(), t.nbytes());
    EXPECT_EQ(std::memcmp(back.data(), t.data(), t.nbytes()), 0) << e.name;
    // A file of another dtype is refused by name.
    EXPECT_THROW(core::read_npy(path, e.dtype == DType::kInt8 ? DType::kUInt8 : DType::kBF16), Error) << e.name;
  }
}

}  // namespace
}  // namespace moe_ep
