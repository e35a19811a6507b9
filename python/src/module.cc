// moe_ep._C: the extension module. Python-facing defaults, tuples and DeepEP's names live in the
// pure-Python package around it (python/moe_ep); this module binds the C++ classes one to one.
#include <fmt/format.h>

#include "moe_ep/version.hpp"
#include "common.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::python {
namespace {

struct Classes {
  PyObject *error, *invalid, *capacity, *state, *resource, *peer, *timeout;
};
Classes g_classes{};

PyObject* make_class(py::module_& m, const char* name, std::initializer_list<PyObject*> bases, const char* doc) {
  py::tuple tuple(bases.size());
  size_t i = 0;
  for (PyObject* b : bases) tuple[i++] = py::reinterpret_borrow<py::object>(b);
  const std::string qualified = fmt::format("moe_ep.{}", name);
  py::dict dict;
  dict["__doc__"] = doc;
  PyObject* cls = PyErr_NewException(qualified.c_str(), tuple.ptr(), dict.ptr());
  if (!cls) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(cls));
  return cls;
}

void raise(PyObject* cls, const char* what, const std::vector<int>* ranks = nullptr, const CapacityError* cap = nullptr) {
  py::object instance = py::reinterpret_borrow<py::object>(cls)(what);
  if (ranks) instance.attr("ranks") = py::cast(*ranks);
  if (cap) {
    instance.attr("required_bytes") = cap->required_bytes();
    instance.attr("available_bytes") = cap->available_bytes();
  }
  PyErr_SetObject(cls, instance.ptr());
}

}  // namespace

void register_errors(py::module_& m) {
  g_classes.error = make_class(m, "Error", {PyExc_RuntimeError}, "Base class of everything moe-ep raises.");
  g_classes.invalid = make_class(m, "InvalidArgument", {g_classes.error, PyExc_ValueError},
                                 "An argument has a wrong value, shape, dtype or stride; nothing was sent or written.");
  g_classes.capacity = make_class(m, "CapacityError", {g_classes.invalid},
                                  "The call needs more memory than the buffer holds (required_bytes, available_bytes).");
  g_classes.state = make_class(m, "StateError", {g_classes.error},
                               "The object is in a state that does not allow the call.");
  g_classes.resource = make_class(m, "ResourceError", {g_classes.error},
                                  "The system refused a resource the call needed (memory, threads).");
  g_classes.peer = make_class(m, "PeerError", {g_classes.error},
                              "Other ranks failed, disagreed or left; .ranks lists them (the root cause where known).");
  g_classes.timeout = make_class(m, "TimeoutError", {g_classes.peer, PyExc_TimeoutError},
                                 "A wait expired; .ranks did not arrive in time.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CapacityError& e) {
      raise(g_classes.capacity, e.what(), nullptr, &e);
    } catch (const InvalidArgument& e) {
      raise(g_classes.invalid, e.what());
    } catch (const TimeoutError& e) {
      raise(g_classes.timeout, e.what(), &e.ranks());
    } catch (const PeerError& e) {
      raise(g_classes.peer, e.what(), &e.ranks());
    } catch (const StateError& e) {
      raise(g_classes.state, e.what());
    } catch (const ResourceError& e) {
      raise(g_classes.resource, e.what());
    } catch (const Error& e) {
      raise(g_classes.error, e.what());
    }
  });
}

PyObject* peer_error_class() { return g_classes.peer; }

}  // namespace moe_ep::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe-ep: expert-parallel dispatch and combine (C++ core)";
  m.attr("__version__") = moe_ep::version();  // the loaded library's
  namespace mp = moe_ep::python;
  mp::register_errors(m);
  py::class_<mp::PyEvent, std::shared_ptr<mp::PyEvent>>(m, "Event")
      .def(py::init([] { return std::make_shared<mp::PyEvent>(); }), "An already complete event.")
      .def("wait", &mp::PyEvent::wait, "Blocks until the work is done; raises its error.")
      .def("query", &mp::PyEvent::query);
  m.def("integer", &mp::to_integer, py::arg("value"), py::arg("name"), py::arg("low"), py::arg("high"),
        "value as an int in [low, high]: TypeError naming the argument unless it is an int (bool excluded), "
        "InvalidArgument naming it, the value and the limit outside the range.");
  m.def("last_native_seconds", [] { return mp::last_native_seconds(); },
        "Seconds this thread's last buffer call spent in C++ (the rest of its time is the Python layer's).");
  mp::register_groups(m);
  mp::register_elastic(m);
  mp::register_elastic_agrs(m);
  mp::register_elastic_extras(m);
  mp::register_legacy(m);
  mp::register_dispatcher(m);
}
