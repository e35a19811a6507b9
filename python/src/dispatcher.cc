// The token dispatcher, its buffer cache, the provider probe and the environment registry.
#include <fmt/format.h>

#include "common.hh"
#include "moe_ep/dispatcher.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep::python {
namespace {

// CUDA tensors go on to the C++ dispatcher, which refuses them by name, saying why.
const Placement kToDispatcher{.cuda = true, .why_host = ""};

using CacheBox = Box<BufferCache>;

// A dispatcher and the cache it must not outlive.
struct PyDispatcher {
  std::shared_ptr<CacheBox> cache;
  std::unique_ptr<TokenDispatcher> dispatcher;
  std::vector<py::object> hooks;  // owned here (the C++ hooks hold borrowed pointers)
  ~PyDispatcher() {
    {
      py::gil_scoped_release release;
      dispatcher.reset();
    }
    hooks.clear();
  }
};

// What dispatch and dispatch_a take.
struct DispatchInputs {
  Tensor x, topk_idx, topk_weights;
  DispatchInputs(ArgumentImports& in, py::handle x_, py::handle idx, py::handle w)
      : x(in.tensor(x_, "hidden_states")), topk_idx(in.tensor(idx, "topk_idx")), topk_weights(in.tensor(w, "topk_weights")) {}
};

py::dict output_dict(const DispatchOutput& o) {
  py::dict d;
  d["format"] = format_name(o.format);
  d["generation"] = generation_name(o.generation);
  d["mode"] = mode_name(o.mode);
  d["provider"] = o.provider;
  d["micro_batch"] = o.micro_batch;
  d["hidden_states"] = export_tensor(o.hidden_states);
  d["hidden_states_scale"] = export_tensor(o.hidden_states_scale);
  d["topk_ids"] = export_tensor(o.topk_ids);
  d["topk_weights"] = export_tensor(o.topk_weights);
  d["num_recv_tokens_per_expert"] = o.num_recv_tokens_per_expert;
  d["masked_m"] = export_tensor(o.masked_m);
  d["expected_m"] = o.expected_m;
  return d;
}

py::dict generation_dict(const GenerationProbe& g) {
  py::dict d;
  d["available"] = g.available;
  d["provider"] = g.provider;
  d["origin"] = g.origin;
  d["reason"] = g.reason;
  return d;
}

}  // namespace

// Long: the declarative table of this module's Python classes and functions (one statement per binding).
void register_dispatcher(py::module_& m) {
  py::class_<CacheBox, std::shared_ptr<CacheBox>>(m, "BufferCache")
      .def(py::init([](std::shared_ptr<Group> group) {
             py::gil_scoped_release release;
             return std::make_shared<CacheBox>(std::make_unique<BufferCache>(*group));
           }),
           py::arg("group"))
      .def("destroy", [](CacheBox& c) {
        py::gil_scoped_release release;
        c.get().destroy();
      })
      .def("stats", [](const CacheBox& c) {
        const BufferCache& cache = c.get();
        BufferCacheStats s;
        {
          py::gil_scoped_release release;  // the cache's call lock may be held by a thread that needs the GIL
          s = cache.stats();
        }
        py::dict d;
        d["builds"] = s.builds;
        d["reuses"] = s.reuses;
        d["destroys"] = s.destroys;
        d["clean_calls"] = s.clean_calls;
        d["buffer_bytes"] = s.buffer_bytes;
        d["current_provider"] = s.current_provider;
        d["current_generation"] = s.current_generation ? py::object(py::str(generation_name(*s.current_generation)))
                                                       : py::object(py::none());
        return d;
      });

  py::class_<PyDispatcher, std::shared_ptr<PyDispatcher>>(m, "TokenDispatcher")
      .def(py::init([](std::shared_ptr<CacheBox> cache, int hidden, int num_experts, int num_topk,
                       std::optional<bool> use_v2, std::optional<std::string> mode, std::optional<int> cap,
                       std::optional<int> prefill_cap, std::optional<std::string> dtype, std::optional<int> workers,
                       std::optional<bool> hybrid, std::optional<bool> multiple_reduction,
                       std::optional<std::string> normal_layout, std::optional<double> timeout,
                       std::optional<std::string> provider_path, bool round_scale, bool use_ue8m0,
                       int expert_alignment, float nvfp4_global_scale, bool nvfp4_use_ue8m0) {
             DispatcherOptions o;
             o.hidden = hidden;
             o.num_experts = num_experts;
             o.num_topk = num_topk;
             o.use_v2 = use_v2;
             if (mode) o.mode = parse_mode(*mode);
             o.num_max_dispatch_tokens_per_rank = cap;
             o.num_max_prefill_tokens_per_rank = prefill_cap;
             if (dtype) o.dispatch_dtype = parse_wire_dtype(*dtype);
             o.num_workers = workers;
             o.allow_hybrid_mode = hybrid;
             o.allow_multiple_reduction = multiple_reduction;
             if (normal_layout) o.v2_normal_layout = parse_v2_normal_layout(*normal_layout);
             o.timeout_secs = timeout;
             o.provider_path = provider_path;
             o.round_scale = round_scale;
             o.use_ue8m0 = use_ue8m0;
             o.expert_alignment = expert_alignment;
             o.nvfp4_global_scale = nvfp4_global_scale;
             o.nvfp4_use_ue8m0 = nvfp4_use_ue8m0;
             auto d = std::make_shared<PyDispatcher>();
             d->cache = cache;
             d->dispatcher = std::make_unique<TokenDispatcher>(cache->get(), o);
             return d;
           }),
           py::arg("cache"), py::arg("hidden"), py::arg("num_experts"), py::arg("num_topk"), py::arg("use_v2"),
           py::arg("mode"), py::arg("num_max_dispatch_tokens_per_rank"), py::arg("num_max_prefill_tokens_per_rank"),
           py::arg("dispatch_dtype"), py::arg("num_workers"), py::arg("allow_hybrid_mode"),
           py::arg("allow_multiple_reduction"), py::arg("v2_normal_layout"), py::arg("timeout_secs"),
           py::arg("provider_path"), py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("expert_alignment"),
           py::arg("nvfp4_global_scale"), py::arg("nvfp4_use_ue8m0"))
      .def("dispatch_a",
           [](PyDispatcher& d, py::handle x, py::handle topk_idx, py::handle topk_weights, const std::string& kind,
              int micro_batch) {
             const BatchKind k = parse_batch_kind(kind);
             ArgumentImports in(kToDispatcher);
             const DispatchInputs i(in, x, topk_idx, topk_weights);
             in.call([&] { d.dispatcher->dispatch_a(i.x, i.topk_idx, i.topk_weights, k, micro_batch); });
           })
      .def("dispatch",
           [](PyDispatcher& d, py::handle x, py::handle topk_idx, py::handle topk_weights, const std::string& kind,
              int micro_batch) {
             const BatchKind k = parse_batch_kind(kind);
             ArgumentImports in(kToDispatcher);
             const DispatchInputs i(in, x, topk_idx, topk_weights);
             return output_dict(
                 in.call([&] { return d.dispatcher->dispatch(i.x, i.topk_idx, i.topk_weights, k, micro_batch); }));
           })
      .def("dispatch_b",
           [](PyDispatcher& d, int micro_batch) {
             DispatchOutput o;
             {
               py::gil_scoped_release release;
               o = d.dispatcher->dispatch_b(micro_batch);
             }
             return output_dict(o);
           })
      .def("combine_a",
           [](PyDispatcher& d, py::handle x, int micro_batch) {
             ArgumentImports in(kToDispatcher);
             const Tensor a = in.tensor(x, "hidden_states");
             in.call([&] { d.dispatcher->combine_a(a, micro_batch); });
           })
      .def("combine",
           [](PyDispatcher& d, py::handle x, int micro_batch) {
             ArgumentImports in(kToDispatcher);
             const Tensor a = in.tensor(x, "hidden_states");
             return export_tensor(in.call([&] { return d.dispatcher->combine(a, micro_batch); }));
           })
      .def("combine_b",
           [](PyDispatcher& d, int micro_batch) {
             Tensor t;
             {
               py::gil_scoped_release release;
               t = d.dispatcher->combine_b(micro_batch);
             }
             return export_tensor(t);
           })
      .def("add_hook",
           [](PyDispatcher& d, const std::string& point, py::function fn) {
             HookPoint p;
             if (point == "after_dispatch_a")
               p = HookPoint::kAfterDispatchA;
             else if (point == "after_combine_a")
               p = HookPoint::kAfterCombineA;
             else
               throw InvalidArgument(fmt::format("point = '{}' is not one of after_dispatch_a | after_combine_a", point));
             d.hooks.push_back(fn);
             PyObject* callable = fn.ptr();
             auto hook = [callable, point](const HookInfo& info) {
               py::gil_scoped_acquire acquire;
               py::dict i;
               i["point"] = point;
               i["micro_batch"] = info.micro_batch;
               i["mode"] = mode_name(info.mode);
               py::reinterpret_borrow<py::object>(callable)(i);
             };
             py::gil_scoped_release release;  // the cache's call lock may be held by a thread that needs the GIL
             d.dispatcher->add_hook(p, std::move(hook));
           })
      .def_property_readonly("generation", [](const PyDispatcher& d) { return generation_name(d.dispatcher->generation()); })
      .def_property_readonly("mode", [](const PyDispatcher& d) { return mode_name(d.dispatcher->mode()); })
      .def("resolve", [](const PyDispatcher& d, const std::string& kind) {
        return mode_name(d.dispatcher->resolve(parse_batch_kind(kind)));
      })
      .def("options", [](const PyDispatcher& d) {
        const DispatcherOptions& o = d.dispatcher->options();
        py::dict r;
        r["hidden"] = o.hidden;
        r["num_experts"] = o.num_experts;
        r["num_topk"] = o.num_topk;
        r["use_v2"] = o.use_v2;
        r["mode"] = o.mode ? py::object(py::str(mode_name(*o.mode))) : py::object(py::none());
        r["num_max_dispatch_tokens_per_rank"] = o.num_max_dispatch_tokens_per_rank;
        r["num_max_prefill_tokens_per_rank"] = o.num_max_prefill_tokens_per_rank;
        r["dispatch_dtype"] =
            o.dispatch_dtype ? py::object(py::str(wire_dtype_name(*o.dispatch_dtype))) : py::object(py::none());
        r["nvfp4_global_scale"] = o.nvfp4_global_scale;
        r["nvfp4_use_ue8m0"] = o.nvfp4_use_ue8m0;
        r["num_workers"] = o.num_workers;
        r["allow_hybrid_mode"] = o.allow_hybrid_mode;
        r["allow_multiple_reduction"] = o.allow_multiple_reduction;
        r["v2_normal_layout"] =
            o.v2_normal_layout ? py::object(py::str(v2_normal_layout_name(*o.v2_normal_layout))) : py::object(py::none());
        r["timeout_secs"] = o.timeout_secs;
        r["provider_path"] = o.provider_path;
        r["expert_alignment"] = o.expert_alignment;
        return r;
      });

  m.def(
      "probe_providers",
      [](const std::string& path_list) {
        const ProbeReport& r = probe_providers(path_list);
        py::dict d;
        d["path_list"] = r.path_list;
        py::list providers;
        for (const ProviderProbe& p : r.providers) {
          py::dict e;
          e["entry"] = p.entry;
          e["name"] = p.name;
          e["offers_v1"] = p.offers_v1;
          e["offers_v2"] = p.offers_v2;
          e["error"] = p.error;
          providers.append(e);
        }
        d["providers"] = providers;
        d["v1"] = generation_dict(r.v1);
        d["v2"] = generation_dict(r.v2);
        return d;
      },
      py::arg("path_list") = "");

  // A bool variable of the registry, parsed as the library parses it (InvalidArgument naming the
  // variable and its value otherwise).
  m.def("env_bool", [](const std::string& name) { return env::get_bool(name); }, py::arg("name"));
  m.def("env_registry", [] {
    py::list out;
    for (const env::Variable& v : env::registry()) {
      py::dict d;
      d["name"] = std::string(v.name);
      d["type"] = std::string(env::type_name(v.type));
      d["default"] = std::string(v.default_value);
      d["accepted"] = env::accepted_values(v);
      d["doc"] = std::string(v.doc);
      try {
        const env::Current c = env::current(v.name);
        d["value"] = c.value;
        d["source"] = std::string(env::source_name(c.source));
        d["error"] = py::none();
      } catch (const Error& e) {
        d["value"] = py::none();
        d["source"] = "environment";
        d["error"] = e.what();
      }
      out.append(d);
    }
    return out;
  });
}

}  // namespace moe_ep::python
