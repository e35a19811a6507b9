// The glue of the extension module moe_ep._C: tensors across the boundary, errors, events.
//
// Tensors cross as DLPack capsules both ways, so nothing links libtorch. An input is any object
// with __dlpack__ (torch CPU tensors, numpy arrays): it is imported without a copy and the
// returned Tensor keeps the producer's tensor alive. Outputs are moe-ep tensors exported to torch
// (torch.utils.dlpack.from_dlpack): torch holds a reference on moe-ep's storage and returns it
// when the last torch view goes; no copy either way. bool and float8_e4m3fn outputs travel as
// uint8 and are viewed back as torch.bool / torch.float8_e4m3fn (any torch 2.x, whatever DLPack
// codes it knows); a torch dtype moe-ep does not move is a TypeError naming the argument and the
// dtype. Every C++ error becomes the Python class of the same name (moe_ep.Error and its
// subclasses) with the same message. Calls that wait or move data release the GIL, and so does
// every call that may wait for a buffer's call lock (docs/semantics.md, "Concurrent calls"): the
// thread holding the lock may need the GIL to finish (a Python hook, another rank's thread).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moe_ep/event.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/tensor.hpp"

namespace py = pybind11;

namespace moe_ep::python {

// Where a call's tensors may live. Host tensors are always imported; CUDA tensors only when
// `cuda` (the callee, e.g. the CUDA provider, checks the device and refuses what it cannot
// serve by name); otherwise they are refused with a TypeError naming the argument, its device
// and `why_host` (why this callee moves host tensors only).
struct Placement {
  bool cuda = false;
  std::string why_host = "moe-ep's built-in CPU provider moves host tensors";
};

// What an argument must be; `dtype`: re-tag a uint8 input as this 1-byte dtype (FP8 data given as
// its uint8 codes).
Tensor import_tensor(py::handle obj, const char* name, std::optional<DType> dtype = std::nullopt,
                     const Placement& placement = {});
// None -> an undefined Tensor.
inline Tensor import_optional(py::handle obj, const char* name, std::optional<DType> dtype = std::nullopt,
                              const Placement& placement = {}) {
  return obj.is_none() ? Tensor{} : import_tensor(obj, name, dtype, placement);
}
// A torch tensor (None for an undefined tensor).
py::object export_tensor(const Tensor& t);

// An Event and what must stay alive until it completes (the imported inputs). Dropped before
// its work completed, it waits for it first (GIL released): the worker may still read the inputs.
struct PyEvent {
  Event event;
  std::vector<Tensor> keep;
  PyEvent() = default;
  PyEvent(const PyEvent&) = delete;
  PyEvent& operator=(const PyEvent&) = delete;
  ~PyEvent();
  void wait();
  bool query() const { return event.query(); }
};

// Objects whose destruction waits on peers (collective destructors): they are destroyed with the
// GIL released, so other ranks' threads of this process can reach their own destructors.
template <class T>
struct Box {
  std::unique_ptr<T> value;
  explicit Box(std::unique_ptr<T> v) : value(std::move(v)) {}
  ~Box() {
    if (!value) return;
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      value.reset();
    } else {
      value.reset();
    }
  }
  T& get() const {
    if (!value) throw py::value_error("the object was already destroyed");
    return *value;
  }
};

std::optional<Event> to_event(py::handle obj, const char* name);

// An integer argument in [low, high]: a Python int or an object with __index__ (numpy integers,
// integer 0-d tensors); a bool, a float or anything else is a TypeError naming the argument, a
// value outside the range InvalidArgument naming the argument, the value and the limit it passes.
std::int64_t to_integer(py::handle obj, const char* name, std::int64_t low, std::int64_t high);
inline int to_int(py::handle obj, const char* name) {
  return static_cast<int>(to_integer(obj, name, INT32_MIN, INT32_MAX));
}
inline std::int64_t to_int64(py::handle obj, const char* name) { return to_integer(obj, name, INT64_MIN, INT64_MAX); }

// Seconds the calling thread's last buffer call spent in C++ (inside ArgumentImports::call): what
// the Python layer adds is the rest of the call's time (python3 -m moe_ep.bench reports it).
double& last_native_seconds();

// The arguments of one collective call, converted from Python. A conversion that fails on one
// rank must not leave its peers waiting (or pair its next call with their current one): the
// first failure is kept, the call is still made with `rejection()` set (the C++ call then
// refuses it on every rank: PeerError naming this rank on the others), and finish() re-raises the
// original Python error here.
class ArgumentImports {
 public:
  ArgumentImports() = default;
  explicit ArgumentImports(Placement placement) : placement_(std::move(placement)) {}
  Tensor tensor(py::handle obj, const char* name, std::optional<DType> dtype = std::nullopt);  // None: undefined
  // x or (x_fp8, scales): the data and the scales (undefined for a plain tensor).
  std::pair<Tensor, Tensor> x_or_pair(py::handle x, const char* scales_name);
  std::optional<Event> event(py::handle obj, const char* name);
  int integer(py::handle obj, const char* name);              // to_int
  std::int64_t integer64(py::handle obj, const char* name);  // to_int64
  bool boolean(py::handle obj, const char* name);
  std::optional<bool> optional_boolean(py::handle obj, const char* name);
  // An object of a bound class; None gives null unless `required` (then a TypeError).
  template <class T>
  std::shared_ptr<T> object(py::handle obj, const char* name, const char* what, bool required = false) {
    if (obj.is_none() && !required) return nullptr;
    if (!failed() && py::isinstance<T>(obj)) return obj.cast<std::shared_ptr<T>>();
    if (!failed()) fail_with(std::make_exception_ptr(py::type_error(type_message(obj, name, what))));
    return nullptr;
  }
  std::vector<Tensor> tensor_list(py::handle obj, const char* name);  // a sequence of tensors

  bool failed() const { return error_ != nullptr; }
  const std::string& rejection() const { return message_; }
  // Runs the C++ call (GIL released); re-raises the kept conversion error, if any, instead of
  // the call's refusal.
  template <class Fn>
  auto call(Fn fn) -> decltype(fn()) {
    try {
      py::gil_scoped_release release;
      const auto start = std::chrono::steady_clock::now();
      struct Clock {
        std::chrono::steady_clock::time_point start;
        ~Clock() { last_native_seconds() = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
      } clock{start};
      if constexpr (std::is_void_v<decltype(fn())>) {
        fn();
        if (failed()) std::rethrow_exception(error_);
        return;
      } else {
        auto result = fn();
        if (failed()) std::rethrow_exception(error_);
        return result;
      }
    } catch (...) {
      if (failed()) std::rethrow_exception(error_);
      throw;
    }
  }

 private:
  static std::string type_message(py::handle obj, const char* name, const char* what);
  void fail_with(std::exception_ptr error);
  template <class Fn>
  auto guarded(Fn fn, decltype(fn()) fallback) -> decltype(fn()) {
    if (failed()) return fallback;
    try {
      return fn();
    } catch (...) {
      fail_with(std::current_exception());
      return fallback;
    }
  }

  Placement placement_;
  std::exception_ptr error_;
  std::string message_;
};

void register_errors(py::module_& m);
void register_groups(py::module_& m);
void register_elastic(py::module_& m);
void register_elastic_agrs(py::module_& m);  // after register_elastic: adds to its ElasticBuffer
void register_elastic_extras(py::module_& m);  // after register_elastic: methods of its ElasticBuffer
void register_legacy(py::module_& m);
void register_dispatcher(py::module_& m);

}  // namespace moe_ep::python
