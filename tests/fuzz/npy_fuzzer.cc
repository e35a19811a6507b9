// Fuzzes the .npy reader: the first byte picks the dtype to read as (and, with its high bit,
// whether to also read the bytes through a file, an in-memory one); the rest is the file. Refusals are moe_ep
// errors naming the input; an accepted tensor is exactly the bytes after the header, its shape
// has 1 to 4 sizes, and the file and in-memory readers agree.
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>

#include "core/npy.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace {

using moe_ep::DType;
using moe_ep::Tensor;

[[noreturn]] void violated(const std::string& what) {
  fmt::print(stderr, "npy fuzzer: {}\n", what);
  std::abort();
}

constexpr DType kTypes[] = {DType::kBool, DType::kUInt8, DType::kInt32, DType::kInt64,
                            DType::kBF16, DType::kFP32,  DType::kFP8E4M3, DType::kFP16,
                            DType::kInt8, DType::kInt16};

// An in-memory file (memfd) for the path reader, so that inputs read through a file cost no
// disk I/O: its path, /proc/self/fd/N, opens it anew at offset 0.
struct MemoryFile {
  MemoryFile() : fd(memfd_create("moe-ep-npy-fuzz", MFD_CLOEXEC)), path(fmt::format("/proc/self/fd/{}", fd)) {
    if (fd < 0) violated("memfd_create failed");
  }
  ~MemoryFile() { close(fd); }
  void write(std::span<const std::byte> bytes) const {
    if (ftruncate(fd, 0) != 0 || pwrite(fd, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size()))
      violated("cannot write the in-memory file");
  }
  int fd;
  std::string path;
};

struct Outcome {
  std::optional<Tensor> tensor;
  std::string error;  // without the "read_npy: <name>: " prefix
};

template <class F>
Outcome attempt(const std::string& name, F&& read) {
  Outcome o;
  try {
    o.tensor = read();
  } catch (const moe_ep::Error& e) {
    const std::string prefix = "read_npy: " + name + ": ";
    const std::string m = e.what();
    if (m.compare(0, prefix.size(), prefix) != 0) violated("an error does not name the input: " + m);
    o.error = m.substr(prefix.size());
  }
  return o;
}

void check_accepted(const Tensor& t, std::span<const std::byte> file, DType as) {
  if (t.dtype() != as || t.ndim() < 1 || t.ndim() > moe_ep::TensorView::kMaxDims || !t.is_contiguous()) violated("accepted tensor is malformed");
  const std::size_t bytes = t.nbytes();
  if (bytes > file.size() || file.size() - bytes < 10) violated("accepted tensor is larger than its file");
  if (bytes > 0 && std::memcmp(t.data(), file.data() + (file.size() - bytes), bytes) != 0)
    violated("accepted tensor is not the data at the end of the file");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const DType as = kTypes[(data[0] & 0x7f) % std::size(kTypes)];
  const auto file = std::as_bytes(std::span(data + 1, size - 1));
  const Outcome memory = attempt("input", [&] { return moe_ep::core::read_npy(file, as, "input"); });
  if (memory.tensor) check_accepted(*memory.tensor, file, as);
  if (data[0] & 0x80) {
    static const MemoryFile temp;
    temp.write(file);
    const Outcome disk = attempt(temp.path, [&] { return moe_ep::core::read_npy(temp.path, as); });
    if (disk.tensor.has_value() != memory.tensor.has_value() || disk.error != memory.error)
      violated(fmt::format("file and memory readers disagree: '{}' / '{}'", disk.error, memory.error));
    if (disk.tensor && (disk.tensor->nbytes() != memory.tensor->nbytes() ||
                        std::memcmp(disk.tensor->data(), memory.tensor->data(), disk.tensor->nbytes()) != 0))
      violated("file and memory readers read different data");
  }
  return 0;
}
