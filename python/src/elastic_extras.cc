// ElasticBuffer's Engram storage, PP send/receive and barrier (docs/engram-pp.md), bound as methods
// of the ElasticBuffer class register_elastic made. The collective ones (engram_write,
// pp_set_config, barrier) convert their arguments through ArgumentImports, so a rank whose
// arguments cannot be converted still takes part and its peers raise PeerError naming it; the
// others (engram_fetch, pp_send, pp_recv) involve no agreement and raise where they are called.
#include <fmt/format.h>

#include "common.hh"
#include "elastic_runtime.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep::python {
namespace {

using ElasticBox = Box<ElasticRuntime>;

// The built-in buffer behind a Python ElasticBuffer (the Python layer refuses these methods on the
// cuda provider first; this is the same refusal for direct callers of _C).
ElasticBuffer& builtin(const ElasticRuntime& rt, const char* what) {
  if (ElasticBuffer* b = rt.host_buffer()) return *b;
  throw StateError(fmt::format("[rank {}] {}: the cuda provider has no Engram storage or PP send/receive", rt.rank(),
                               what));
}

void engram_write(ElasticBox& box, py::handle storage, py::handle sf) {
  ElasticRuntime& rt = box.get();
  ElasticBuffer& b = builtin(rt, "engram_write");
  ArgumentImports in(rt.placement());
  const Tensor table = in.tensor(storage, "storage");
  const Tensor scales = in.tensor(sf, "sf");
  const std::string rejection = in.rejection();
  in.call([&] { b.engram_write(table, scales, rejection); });
}

py::tuple engram_fetch(ElasticBox& box, py::handle indices, int num_qps, bool use_tma_aligned_col_major_sf) {
  ElasticRuntime& rt = box.get();
  ElasticBuffer& b = builtin(rt, "engram_fetch");
  const Tensor idx = import_tensor(indices, "indices", std::nullopt, rt.placement());
  EngramFetchResult r;
  {
    py::gil_scoped_release release;
    r = b.engram_fetch(idx, num_qps, use_tma_aligned_col_major_sf);
  }
  return py::make_tuple(export_tensor(r.data), export_tensor(r.sf));
}

void pp_set_config(ElasticBox& box, py::handle num_max_tensor_bytes, py::handle num_max_inflight_tensors) {
  ElasticRuntime& rt = box.get();
  ElasticBuffer& b = builtin(rt, "pp_set_config");
  ArgumentImports in(rt.placement());
  const std::int64_t bytes = in.integer64(num_max_tensor_bytes, "num_max_tensor_bytes");
  const std::int64_t inflight = in.integer64(num_max_inflight_tensors, "num_max_inflight_tensors");
  const std::string rejection = in.rejection();
  in.call([&] { b.pp_set_config(bytes, inflight, rejection); });
}

// pp_send (send = true) or pp_recv.
void pp_transfer(ElasticBox& box, py::handle t, int peer, int num_sms, bool send) {
  ElasticRuntime& rt = box.get();
  ElasticBuffer& b = builtin(rt, send ? "pp_send" : "pp_recv");
  const Tensor tensor = import_tensor(t, "t", std::nullopt, rt.placement());
  py::gil_scoped_release release;
  if (send) {
    b.pp_send(tensor, peer, num_sms);
  } else {
    b.pp_recv(tensor, peer, num_sms);
  }
}

void barrier(ElasticBox& box, py::handle use_comm_stream, py::handle with_cpu_sync, py::handle sequential) {
  ElasticRuntime& rt = box.get();
  ArgumentImports in(rt.placement());
  in.boolean(use_comm_stream, "use_comm_stream");
  in.boolean(with_cpu_sync, "with_cpu_sync");
  in.boolean(sequential, "sequential");
  const std::string rejection = in.rejection();
  in.call([&] {
    // The built-in buffer's barrier carries the rejection to the peers; the CUDA provider's is the
    // group's (docs/python.md, "CUDA tensors").
    if (ElasticBuffer* b = rt.host_buffer()) return b->barrier(true, false, true, rejection);
    rt.barrier();
  });
}

}  // namespace

void register_elastic_extras(py::module_& m) {
  py::class_<ElasticBox, std::shared_ptr<ElasticBox>> cls(m.attr("ElasticBuffer"));
  cls.def("engram_write", &engram_write, py::arg("storage"), py::arg("sf"))
      .def("engram_fetch", &engram_fetch, py::arg("indices"), py::arg("num_qps"),
           py::arg("use_tma_aligned_col_major_sf"))
      .def("pp_set_config", &pp_set_config, py::arg("num_max_tensor_bytes"), py::arg("num_max_inflight_tensors"))
      .def(
          "pp_send", [](ElasticBox& box, py::handle t, int dst, int num_sms) { pp_transfer(box, t, dst, num_sms, true); },
          py::arg("t"), py::arg("dst_rank_idx"), py::arg("num_sms"))
      .def(
          "pp_recv", [](ElasticBox& box, py::handle t, int src, int num_sms) { pp_transfer(box, t, src, num_sms, false); },
          py::arg("t"), py::arg("src_rank_idx"), py::arg("num_sms"))
      .def("barrier", &barrier, py::arg("use_comm_stream"), py::arg("with_cpu_sync"), py::arg("sequential"))
      .def_property_readonly("num_cpu_bytes",
                             [](const ElasticBox& b) {
                               const ElasticBuffer* e = b.get().host_buffer();
                               return e ? e->num_cpu_bytes() : std::int64_t{0};
                             })
      .def_static(
          "get_engram_storage_size_hint",
          [](std::int64_t num_entries, std::int64_t hidden, std::int64_t rows, const std::string& dtype) {
            return ElasticBuffer::get_engram_storage_size_hint(num_entries, hidden, rows,
                                                               parse_dtype(dtype, "get_engram_storage_size_hint"));
          },
          py::arg("num_entries"), py::arg("hidden"), py::arg("num_max_tokens_per_rank"), py::arg("dtype"))
      .def_static("get_pp_buffer_size_hint", &ElasticBuffer::get_pp_buffer_size_hint, py::arg("num_max_tensor_bytes"),
                  py::arg("num_max_inflight_tensors"));
}

}  // namespace moe_ep::python
