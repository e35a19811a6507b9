#include <fmt/format.h>

#include <string>

#include "common.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::python {
namespace {

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

struct Torch {
  // The C functions behind torch.utils.dlpack (the Python wrappers around them cost more than
  // the exchange itself); tensor_type: torch.Tensor, whose instances take the direct path.
  py::object from_dlpack, to_dlpack, tensor_type, uint8, boolean, float8;
  // torch dtype -> what moe-ep moves it as (the dtypes of docs/python.md's table).
  py::dict movable;
};

const Torch& torch_api() {
  static Torch* api = [] {
    auto* t = new Torch;  // lives until exit, as the torch module does
    py::module_ torch = py::module_::import("torch");
    py::object c = torch.attr("_C");
    t->from_dlpack = py::hasattr(c, "_from_dlpack")
                         ? py::object(c.attr("_from_dlpack"))
                         : py::object(py::module_::import("torch.utils.dlpack").attr("from_dlpack"));
    t->to_dlpack = py::hasattr(c, "_to_dlpack") ? py::object(c.attr("_to_dlpack")) : py::object(py::none());
    t->tensor_type = torch.attr("Tensor");
    t->uint8 = torch.attr("uint8");
    t->boolean = torch.attr("bool");
    t->float8 = torch.attr("float8_e4m3fn");  // every supported torch has it (moe_ep/__init__.py checks)
    // Every DType, under torch's name for it (which dtype_name gives).
    for (const DType dtype : all_dtypes())
      t->movable[torch.attr(std::string(dtype_name(dtype)).c_str())] = static_cast<int>(dtype);
    return t;
  }();
  return *api;
}

std::string type_name(py::handle obj) { return py::str(py::type::of(obj).attr("__name__")).cast<std::string>(); }

void capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;  // consumed: the consumer owns it now
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed && managed->deleter) managed->deleter(managed);
}

py::object capsule_to_torch(DLManagedTensor* managed) {
  py::capsule capsule(managed, kCapsuleName, &capsule_destructor);
  return torch_api().from_dlpack(capsule);
}

// A view of the same bytes with another 1-byte dtype.
TensorView retagged(const TensorView& v, DType dtype) {
  return TensorView(v.data(), dtype, v.shape(), v.strides());
}

[[noreturn]] void not_a_tensor(py::handle obj, const char* name) {
  throw py::type_error(fmt::format("{} must be a tensor (torch.Tensor or numpy.ndarray), not {}", name, type_name(obj)));
}

[[noreturn]] void not_moved(const char* name, py::handle dtype) {
  throw py::type_error(fmt::format("{} has dtype {}, which moe-ep does not move (it moves {})", name,
                                   py::str(dtype).cast<std::string>(), dtype_names()));
}

// What moe-ep moves a torch tensor's dtype as; a dtype it does not move (float64, complex,
// float8_e5m2, ...) is a TypeError naming the argument and the dtype.
DType movable_dtype(py::handle tensor, const char* name) {
  py::object dtype = tensor.attr("dtype");
  PyObject* code = PyDict_GetItem(torch_api().movable.ptr(), dtype.ptr());  // borrowed
  if (code == nullptr) not_moved(name, dtype);
  return static_cast<DType>(PyLong_AsLong(code));
}

[[noreturn]] void not_on_host(py::handle obj, const char* name, int device_type, const std::string& why) {
  const std::string where = py::hasattr(obj, "device") ? py::str(obj.attr("device")).cast<std::string>()
                                                       : fmt::format("DLPack device type {}", device_type);
  throw py::type_error(fmt::format("{} is on {}, but {}: pass CPU tensors", name, where, why));
}

// A torch tensor torch will not export through DLPack, refused by what it is: a layout other than
// torch.strided (sparse COO, CSR, CSC, BSR, BSC, mkldnn, jagged), a nested tensor, or one on the
// meta device (shape and dtype without data). TypeError naming the argument, what it is and what
// moe-ep takes.
void expect_exportable(py::handle tensor, const char* name) {
  const std::string layout = py::str(tensor.attr("layout")).cast<std::string>();
  if (layout != "torch.strided")
    throw py::type_error(fmt::format("{} has layout {}, which moe-ep does not take: it takes dense tensors (layout "
                                     "torch.strided; Tensor.to_dense() makes one)",
                                     name, layout));
  if (py::hasattr(tensor, "is_nested") && py::cast<bool>(tensor.attr("is_nested")))
    throw py::type_error(fmt::format(
        "{} is a nested tensor, which moe-ep does not take: it takes dense tensors (layout torch.strided)", name));
  const std::string device = py::str(tensor.attr("device")).cast<std::string>();
  if (device == "meta")
    throw py::type_error(fmt::format("{} is on device meta (a shape and dtype without data), but moe-ep moves host and "
                                     "CUDA tensors only: pass CPU tensors",
                                     name));
}

// obj.__dlpack__(): a failure is a TypeError naming the argument and what the exporter said.
py::object exported(py::handle source, py::handle obj, const char* name) {
  PyObject* capsule = PyObject_CallMethod(source.ptr(), "__dlpack__", nullptr);
  if (capsule != nullptr) return py::reinterpret_steal<py::object>(capsule);
  const py::error_already_set error;  // fetches (and clears) the exporter's exception
  throw py::type_error(fmt::format("{} ({}) cannot be exported through DLPack: {}: {}; moe-ep takes dense host "
                                   "tensors (torch.Tensor or numpy.ndarray)",
                                   name, type_name(obj), py::str(error.type().attr("__name__")).cast<std::string>(),
                                   py::str(error.value()).cast<std::string>()));
}

// The DLPack capsule of `obj`. The common case (a CPU tensor torch or numpy can export) is one
// call (CUDA tensors included: the callee checks their device). The slow path: tensors torch does
// not export (refused by what they are), tensors that require grad (only their data is read), and
// 1-byte dtypes a torch's DLPack cannot name (bool, float8_e4m3fn), which travel as uint8 and are
// re-tagged (*retag).
py::object dlpack_capsule(py::handle obj, const char* name, std::optional<DType>* retag) {
  const Torch& torch = torch_api();
  const bool is_torch = PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(torch.tensor_type.ptr()));
  if (is_torch && !torch.to_dlpack.is_none()) {
    PyObject* capsule = PyObject_CallOneArg(torch.to_dlpack.ptr(), obj.ptr());
    if (capsule != nullptr) return py::reinterpret_steal<py::object>(capsule);  // the device is checked by the caller
    PyErr_Clear();
  }
  if (is_torch) {
    expect_exportable(obj, name);
    const DType dtype = movable_dtype(obj, name);  // refused here with the torch dtype's name
    py::object source = py::reinterpret_borrow<py::object>(obj);
    if (py::cast<bool>(source.attr("requires_grad"))) source = source.attr("detach")();
    if (dtype == DType::kBool || dtype == DType::kFP8E4M3) {
      PyObject* capsule = PyObject_CallMethod(source.ptr(), "__dlpack__", nullptr);
      if (capsule != nullptr) return py::reinterpret_steal<py::object>(capsule);
      PyErr_Clear();
      *retag = dtype;
      source = source.attr("view")(torch.uint8);
    }
    return exported(source, obj, name);
  }
  if (!py::hasattr(obj, "__dlpack__")) not_a_tensor(obj, name);
  return exported(obj, obj, name);
}

}  // namespace

Tensor import_tensor(py::handle obj, const char* name, std::optional<DType> dtype, const Placement& placement) {
  if (obj.is_none()) throw py::type_error(fmt::format("{} is None; a tensor is required", name));
  std::optional<DType> retag;
  py::object capsule = dlpack_capsule(obj, name, &retag);
  if (!PyCapsule_IsValid(capsule.ptr(), kCapsuleName))
    throw py::type_error(fmt::format("{}.__dlpack__() did not return a DLPack capsule", name));
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kCapsuleName));
  const int device = managed->dl_tensor.device.device_type;
  // The capsule still owns the tensor and releases it.
  if (device != kDLCPU && device != kDLCUDAHost) {
    if (device != kDLCUDA) not_on_host(obj, name, device, "moe-ep moves host and CUDA tensors only");
    if (!placement.cuda) not_on_host(obj, name, device, placement.why_host);
  }
  PyCapsule_SetName(capsule.ptr(), kUsedCapsuleName);
  Tensor t;
  try {
    t = Tensor::from_dlpack(managed);
  } catch (const InvalidArgument& e) {
    // A dtype DLPack names but moe-ep does not move (float64, complex, ...; numpy arrays too).
    if (py::hasattr(obj, "dtype")) not_moved(name, obj.attr("dtype"));
    throw InvalidArgument(fmt::format("{}: {}", name, e.what()));
  }
  if (retag) return t.with_view(retagged(t, *retag));
  // FP8 data given as its uint8 codes (x = (x_fp8, scales) with a uint8 x_fp8).
  if (dtype && *dtype != t.dtype() && t.dtype() == DType::kUInt8 && element_size(*dtype) == 1)
    t = t.with_view(retagged(t, *dtype));
  return t;
}

// bool and float8_e4m3fn leave as uint8 and are viewed back (a real torch.bool or
// torch.float8_e4m3fn tensor, whatever DLPack codes the installed torch knows).
py::object export_tensor(const Tensor& t) {
  if (!t.defined()) return py::none();
  const DType dtype = t.dtype();
  if (dtype != DType::kBool && dtype != DType::kFP8E4M3) return capsule_to_torch(t.to_dlpack());
  py::object bytes = capsule_to_torch(t.with_view(retagged(t, DType::kUInt8)).to_dlpack());
  return bytes.attr("view")(dtype == DType::kBool ? torch_api().boolean : torch_api().float8);
}

PyEvent::~PyEvent() {
  if (keep.empty() || event.query()) return;
  auto finish = [this] {
    try {
      event.wait();
    } catch (...) {  // the error was the caller's to collect; only the inputs' lifetime matters here
    }
  };
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    finish();
  } else {
    finish();
  }
}

void PyEvent::wait() {
  {
    py::gil_scoped_release release;
    event.wait();
  }
  keep.clear();
}

std::optional<Event> to_event(py::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  if (py::isinstance<PyEvent>(obj)) return obj.cast<PyEvent&>().event;
  throw py::type_error(fmt::format("{} must be an event captured by this module (EventHandle), not {}", name,
                                   type_name(obj)));
}

std::int64_t to_integer(py::handle obj, const char* name, std::int64_t low, std::int64_t high) {
  // bool is an int to Python, and a float or a float tensor has no exact integer value.
  const auto not_an_int = [&] {
    return py::type_error(fmt::format("{} must be an int, not {}", name, type_name(obj)));
  };
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr())) throw not_an_int();
  const py::object value = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!value) {
    PyErr_Clear();
    throw not_an_int();
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow == 0 && v >= low && v <= high) return v;
  const bool above = overflow > 0 || (overflow == 0 && v > high);
  throw InvalidArgument(fmt::format("{} = {} is out of range (must be at {} {})", name,
                                    py::str(value).cast<std::string>(), above ? "most" : "least", above ? high : low));
}

double& last_native_seconds() {
  thread_local double seconds = 0;
  return seconds;
}

std::string ArgumentImports::type_message(py::handle obj, const char* name, const char* what) {
  return fmt::format("{} must be {}, not {}", name, what, type_name(obj));
}

void ArgumentImports::fail_with(std::exception_ptr error) {
  error_ = error;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    message_ = e.what();
  } catch (...) {
    message_ = "an argument could not be converted";
  }
  if (message_.empty()) message_ = "an argument could not be converted";
}

Tensor ArgumentImports::tensor(py::handle obj, const char* name, std::optional<DType> dtype) {
  return guarded([&] { return import_optional(obj, name, dtype, placement_); }, Tensor{});
}

std::pair<Tensor, Tensor> ArgumentImports::x_or_pair(py::handle x, const char* scales_name) {
  if (!failed() && py::isinstance<py::tuple>(x)) {
    py::tuple pair = py::reinterpret_borrow<py::tuple>(x);
    if (pair.size() != 2) {
      fail_with(std::make_exception_ptr(py::value_error(
          fmt::format("x must be a tensor or a pair (x_fp8, {}), got a tuple of {} items", scales_name, pair.size()))));
      return {};
    }
    return {tensor(pair[0], "x[0] (FP8 data)", DType::kFP8E4M3), tensor(pair[1], scales_name)};
  }
  return {guarded([&] { return import_tensor(x, "x", std::nullopt, placement_); }, Tensor{}), Tensor{}};
}

std::optional<Event> ArgumentImports::event(py::handle obj, const char* name) {
  return guarded([&] { return to_event(obj, name); }, std::optional<Event>{});
}

int ArgumentImports::integer(py::handle obj, const char* name) {
  return guarded([&] { return to_int(obj, name); }, 0);
}

std::int64_t ArgumentImports::integer64(py::handle obj, const char* name) {
  return guarded([&] { return to_int64(obj, name); }, std::int64_t{0});
}

bool ArgumentImports::boolean(py::handle obj, const char* name) {
  return guarded(
      [&] {
        if (!PyBool_Check(obj.ptr()) && !PyLong_Check(obj.ptr())) throw py::type_error(type_message(obj, name, "a bool"));
        return PyObject_IsTrue(obj.ptr()) == 1;
      },
      false);
}

std::optional<bool> ArgumentImports::optional_boolean(py::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return boolean(obj, name);
}

std::vector<Tensor> ArgumentImports::tensor_list(py::handle obj, const char* name) {
  std::vector<Tensor> out;
  if (failed() || obj.is_none()) return out;
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj)) {
    fail_with(std::make_exception_ptr(py::type_error(type_message(obj, name, "a sequence of tensors"))));
    return out;
  }
  py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
  static const char* kNames[] = {"bias[0]", "bias[1]", "bias[2]", "bias[3]"};
  for (size_t i = 0; i < seq.size(); ++i) out.push_back(tensor(seq[i], i < 4 ? kNames[i] : name));
  return out;
}

}  // namespace moe_ep::python
