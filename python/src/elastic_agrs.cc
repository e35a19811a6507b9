// ElasticBuffer's all-gather sessions (docs/agrs.md), added to the ElasticBuffer class that
// register_elastic made, and their handle. Collective calls (agrs_set_config, all_gather) convert
// their arguments without raising: a conversion that fails still takes part in the call as a
// rejection (peers raise PeerError naming this rank), then the original error is raised here.
#include <fmt/format.h>

#include "common.hh"
#include "elastic_runtime.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep::python {
namespace {

using ElasticBox = Box<ElasticRuntime>;

// The built-in buffer behind a Python ElasticBuffer (the CUDA provider has no sessions).
ElasticBuffer& host_buffer(const ElasticBox& box, const char* operation) {
  ElasticBuffer* buffer = box.get().host_buffer();
  if (buffer == nullptr)
    throw StateError(fmt::format("[rank {}] {}: all-gather sessions move host tensors (the built-in provider); this "
                                 "buffer uses the CUDA provider",
                                 box.get().rank(), operation));
  return *buffer;
}

// Integer arguments of a collective call: the first failure is kept, not raised.
class Integers {
 public:
  std::int64_t get(py::handle obj, const char* name, std::int64_t low, std::int64_t high) {
    if (error_) return 0;
    try {
      return to_integer(obj, name, low, high);
    } catch (const std::exception& e) {
      error_ = std::current_exception();
      message_ = e.what();
      return 0;
    }
  }
  const std::string& rejection() const { return message_; }
  // Runs the call (GIL released); raises the kept conversion error instead of the call's refusal.
  template <class Fn>
  void call(Fn fn) {
    try {
      py::gil_scoped_release release;
      fn();
    } catch (...) {
      if (error_) std::rethrow_exception(error_);
      throw;
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::exception_ptr error_;
  std::string message_;
};

// all_gather(t) or all_gather(sequence of t): every rank's inputs, gathered.
py::tuple all_gather(ElasticBox& box, py::handle t, bool batched) {
  ElasticBuffer& buffer = host_buffer(box, "all_gather");
  ArgumentImports in(box.get().placement());
  std::vector<Tensor> tensors;
  std::exception_ptr shape_error;
  if (!batched) {
    tensors.push_back(in.tensor(t, "t"));
  } else if (!py::isinstance<py::list>(t) && !py::isinstance<py::tuple>(t)) {
    shape_error = std::make_exception_ptr(py::type_error(fmt::format(
        "t must be a tensor or a sequence (list or tuple) of tensors, not {}",
        py::str(py::type::of(t).attr("__name__")).cast<std::string>())));
  } else {
    py::sequence items = py::reinterpret_borrow<py::sequence>(t);
    for (std::size_t i = 0; i < items.size(); ++i) {
      const std::string name = fmt::format("t[{}]", i);
      tensors.push_back(in.tensor(items[i], name.c_str()));
    }
  }
  std::string rejection = in.rejection();
  if (rejection.empty() && shape_error) rejection = "t must be a tensor or a sequence (list or tuple) of tensors";
  const std::vector<TensorView> views(tensors.begin(), tensors.end());
  AllGatherResult result;
  try {
    result = in.call([&] { return buffer.all_gather(views, rejection); });
  } catch (...) {
    if (shape_error && !in.failed()) std::rethrow_exception(shape_error);
    throw;
  }
  py::list gathered;
  for (const Tensor& g : result.gathered) gathered.append(export_tensor(g));
  return py::make_tuple(gathered, result.handle);
}

}  // namespace

void register_elastic_agrs(py::module_& m) {
  py::class_<AgrsHandle>(m, "AgrsHandle", "all_gather's handle: call it (no arguments) inside the same session.")
      .def("__call__", [](const AgrsHandle& h) { h(); })
      .def_property_readonly("session", &AgrsHandle::session);

  auto cls = py::reinterpret_borrow<py::class_<ElasticBox, std::shared_ptr<ElasticBox>>>(m.attr("ElasticBuffer"));
  cls.def_static(
         "get_agrs_num_max_session_bytes",
         [](const std::shared_ptr<Group>& group, const std::vector<AgrsShape>& shapes, const std::string& dtype) {
           return ElasticBuffer::get_agrs_num_max_session_bytes(
               *group, shapes, parse_dtype(dtype, fmt::format("[rank {}] get_agrs_num_max_session_bytes", group->rank())));
         },
         py::arg("group"), py::arg("shapes"), py::arg("dtype"))
      .def_static(
          "get_agrs_buffer_size_hint",
          [](const std::shared_ptr<Group>& group, std::int64_t bytes) {
            return ElasticBuffer::get_agrs_buffer_size_hint(*group, bytes);
          },
          py::arg("group"), py::arg("num_max_session_bytes"))
      .def(
          "agrs_set_config",
          [](ElasticBox& box, py::handle bytes, py::handle count) {
            ElasticBuffer& buffer = host_buffer(box, "agrs_set_config");
            Integers in;
            const std::int64_t s = in.get(bytes, "num_max_session_bytes", INT64_MIN, INT64_MAX);
            const auto q = static_cast<int>(in.get(count, "num_max_all_gathers_per_session", INT32_MIN, INT32_MAX));
            in.call([&] { buffer.agrs_set_config(s, q, in.rejection()); });
          },
          py::arg("num_max_session_bytes"), py::arg("num_max_all_gathers_per_session"))
      .def("create_agrs_session",
           [](ElasticBox& box) {
             ElasticBuffer& buffer = host_buffer(box, "create_agrs_session");
             py::gil_scoped_release release;  // the buffer's call lock may be held by a thread that needs the GIL
             buffer.create_agrs_session();
           })
      .def("destroy_agrs_session",
           [](ElasticBox& box) {
             ElasticBuffer& buffer = host_buffer(box, "destroy_agrs_session");
             py::gil_scoped_release release;
             buffer.destroy_agrs_session();
           })
      .def(
          "agrs_get_inplace_tensor",
          [](ElasticBox& box, const std::vector<AgrsShape>& shapes, const std::string& dtype) {
            ElasticBuffer& buffer = host_buffer(box, "agrs_get_inplace_tensor");
            const std::string ctx = fmt::format("[rank {}] agrs_get_inplace_tensor", buffer.rank());
            const DType type = parse_dtype(dtype, ctx);
            std::vector<Tensor> tensors;
            {
              py::gil_scoped_release release;
              tensors = buffer.agrs_get_inplace_tensor(shapes, type);
            }
            py::list out;
            for (const Tensor& t : tensors) out.append(export_tensor(t));
            return out;
          },
          py::arg("shapes"), py::arg("dtype"))
      .def("all_gather", &all_gather, py::arg("t"), py::arg("batched"));
}

}  // namespace moe_ep::python
