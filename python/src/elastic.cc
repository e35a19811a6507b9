// ElasticBuffer (V2) and EPHandle.
#include <fmt/format.h>

#include "common.hh"
#include "elastic_runtime.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/elastic_provider.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep::python {
namespace {

using ElasticBox = Box<ElasticRuntime>;

// The stream arguments dispatch and combine share; `stream`: the caller's cudaStream_t (0 = the
// legacy default stream; ignored by the built-in provider).
template <class Args>
void stream_arguments(ArgumentImports& in, Args& a, py::handle previous_event, py::handle before_epilogue,
                      py::handle async_with_compute_stream, py::handle allocate_on_comm_stream,
                      std::uintptr_t stream) {
  a.stream = stream;
  a.previous_event = in.event(previous_event, "previous_event");
  a.previous_event_before_epilogue = in.event(before_epilogue, "previous_event_before_epilogue");
  a.async_with_compute_stream = in.boolean(async_with_compute_stream, "async_with_compute_stream");
  a.allocate_on_comm_stream = in.boolean(allocate_on_comm_stream, "allocate_on_comm_stream");
}

void keep_inputs(PyEvent& ev, std::initializer_list<const Tensor*> tensors) {
  if (ev.event.query()) return;
  for (const Tensor* t : tensors)
    if (t->defined()) ev.keep.push_back(*t);
}

}  // namespace

// Long: the declarative table of this module's Python classes and functions (one statement per binding).
void register_elastic(py::module_& m) {
  py::class_<EPHandle, std::shared_ptr<EPHandle>>(m, "EPHandle")
      .def_readonly("do_expand", &EPHandle::do_expand)
      .def_readonly("num_experts", &EPHandle::num_experts)
      .def_readonly("expert_alignment", &EPHandle::expert_alignment)
      .def_readonly("num_max_tokens_per_rank", &EPHandle::num_max_tokens_per_rank)
      .def_readonly("num_sms", &EPHandle::num_sms)
      .def_readonly("num_tokens", &EPHandle::num_tokens)
      .def_readonly("num_topk", &EPHandle::num_topk)
      .def_readonly("hidden", &EPHandle::hidden)
      .def_property_readonly("topk_idx", [](const EPHandle& h) { return export_tensor(h.topk_idx); })
      .def_readonly("num_recv_tokens", &EPHandle::num_recv_tokens)
      .def_readonly("num_expanded_tokens", &EPHandle::num_expanded_tokens)
      .def_readonly("num_recv_tokens_per_expert_list", &EPHandle::num_recv_tokens_per_expert_list)
      .def_property_readonly("psum_num_recv_tokens_per_scaleup_rank",
                             [](const EPHandle& h) { return export_tensor(h.psum_num_recv_tokens_per_scaleup_rank); })
      .def_property_readonly("psum_num_recv_tokens_per_expert",
                             [](const EPHandle& h) { return export_tensor(h.psum_num_recv_tokens_per_expert); })
      .def_property_readonly("num_unaligned_recv_tokens_per_expert",
                             [](const EPHandle& h) { return export_tensor(h.num_unaligned_recv_tokens_per_expert); })
      .def_property_readonly("recv_src_metadata", [](const EPHandle& h) { return export_tensor(h.recv_src_metadata); })
      .def_property_readonly("dst_buffer_slot_idx", [](const EPHandle& h) { return export_tensor(h.dst_buffer_slot_idx); });

  py::class_<ElasticBox, std::shared_ptr<ElasticBox>>(m, "ElasticBuffer")
      .def(py::init([](std::shared_ptr<Group> group, std::int64_t num_bytes, int num_max_tokens_per_rank, int hidden,
                       int num_topk, bool use_fp8_dispatch, bool deterministic, bool allow_hybrid_mode,
                       bool allow_multiple_reduction, bool prefer_overlap_with_compute, int num_allocated_qps,
                       double num_cpu_timeout_secs, bool explicitly_destroy, bool cuda, int device,
                       std::string why_host, std::string refusal, std::string provider_path,
                       std::int64_t num_cpu_bytes) {
             ElasticBufferConfig c;
             c.num_bytes = num_bytes;
             c.num_cpu_bytes = num_cpu_bytes;
             c.num_max_tokens_per_rank = num_max_tokens_per_rank;
             c.hidden = hidden;
             c.num_topk = num_topk;
             c.use_fp8_dispatch = use_fp8_dispatch;
             c.deterministic = deterministic;
             c.allow_hybrid_mode = allow_hybrid_mode;
             c.allow_multiple_reduction = allow_multiple_reduction;
             c.prefer_overlap_with_compute = prefer_overlap_with_compute;
             c.num_allocated_qps = num_allocated_qps;
             c.num_cpu_timeout_secs = num_cpu_timeout_secs;
             c.explicitly_destroy = explicitly_destroy;
             const dispatcher::ElasticProviderRequest request{.cuda = cuda,
                                                              .why_host = std::move(why_host),
                                                              .refusal = std::move(refusal),
                                                              .path_list = std::move(provider_path)};
             py::gil_scoped_release release;
             return std::make_shared<ElasticBox>(std::make_unique<ElasticRuntime>(group, c, request, device));
           }),
           py::arg("group"), py::arg("num_bytes"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"),
           py::arg("num_topk"), py::arg("use_fp8_dispatch"), py::arg("deterministic"), py::arg("allow_hybrid_mode"),
           py::arg("allow_multiple_reduction"), py::arg("prefer_overlap_with_compute"), py::arg("num_allocated_qps"),
           py::arg("num_cpu_timeout_secs"), py::arg("explicitly_destroy"), py::arg("cuda") = false,
           py::arg("device") = -1, py::arg("why_host") = "", py::arg("refusal") = "", py::arg("provider_path") = "",
           py::arg("num_cpu_bytes") = 0)
      .def_static(
          "get_buffer_size_hint",
          [](std::shared_ptr<Group> group, int t, int h, int k, bool fp8, bool hybrid, bool multi) {
            return ElasticBuffer::get_buffer_size_hint(*group, t, h, k, fp8, hybrid, multi);
          },
          py::arg("group"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("num_topk"),
          py::arg("use_fp8_dispatch"), py::arg("allow_hybrid_mode"), py::arg("allow_multiple_reduction"))
      .def(
          "dispatch",
          [](ElasticBox& box, py::handle x, py::handle topk_idx, py::handle topk_weights, py::handle stats,
             py::handle num_experts, py::handle num_max_tokens_per_rank, py::handle expert_alignment,
             py::handle num_sms, py::handle num_qps, py::handle previous_event,
             py::handle previous_event_before_epilogue, py::handle async_with_compute_stream,
             py::handle allocate_on_comm_stream, py::handle handle, py::handle do_handle_copy,
             py::handle do_cpu_sync, py::handle do_expand, py::handle do_zero_padding, py::handle use_tma,
             std::uintptr_t stream) {
            ElasticRuntime& buffer = box.get();
            ArgumentImports in(buffer.placement());
            auto [data, scales] = in.x_or_pair(x, "scales");
            const Tensor idx = in.tensor(topk_idx, "topk_idx");
            const Tensor weights = in.tensor(topk_weights, "topk_weights");
            const Tensor recv_stats = in.tensor(stats, "cumulative_local_expert_recv_stats");
            DispatchArgs a;
            a.x = data;
            a.x_scales = scales;
            a.topk_idx = idx;
            a.topk_weights = weights;
            a.cumulative_local_expert_recv_stats = recv_stats;
            a.num_experts = in.integer(num_experts, "num_experts");
            a.num_max_tokens_per_rank = in.integer(num_max_tokens_per_rank, "num_max_tokens_per_rank");
            a.expert_alignment = in.integer(expert_alignment, "expert_alignment");
            a.num_sms = in.integer(num_sms, "num_sms");
            a.num_qps = in.integer(num_qps, "num_qps");
            stream_arguments(in, a, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                             allocate_on_comm_stream, stream);
            a.handle = in.object<EPHandle>(handle, "handle", "an EPHandle returned by dispatch");
            a.do_handle_copy = in.boolean(do_handle_copy, "do_handle_copy");
            a.do_cpu_sync = in.optional_boolean(do_cpu_sync, "do_cpu_sync");
            a.do_expand = in.boolean(do_expand, "do_expand");
            a.do_zero_padding = in.boolean(do_zero_padding, "do_zero_padding");
            a.use_tma_aligned_col_major_sf = in.boolean(use_tma, "use_tma_aligned_col_major_sf");
            a.rejection = in.rejection();
            const DispatchResult r = in.call([&] { return buffer.dispatch(a); });
            auto ev = std::make_shared<PyEvent>();
            ev->event = r.event;
            keep_inputs(*ev, {&data, &scales, &idx, &weights, &recv_stats});
            return py::make_tuple(export_tensor(r.recv_x), export_tensor(r.recv_x_scales), export_tensor(r.recv_topk_idx),
                                  export_tensor(r.recv_topk_weights), r.handle, ev);
          },
          py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("cumulative_local_expert_recv_stats"),
          py::arg("num_experts"), py::arg("num_max_tokens_per_rank"), py::arg("expert_alignment"), py::arg("num_sms"),
          py::arg("num_qps"), py::arg("previous_event"), py::arg("previous_event_before_epilogue"),
          py::arg("async_with_compute_stream"), py::arg("allocate_on_comm_stream"), py::arg("handle"),
          py::arg("do_handle_copy"), py::arg("do_cpu_sync"), py::arg("do_expand"), py::arg("do_zero_padding"),
          py::arg("use_tma_aligned_col_major_sf"), py::arg("stream") = 0)
      .def(
          "combine",
          [](ElasticBox& box, py::handle x, py::handle handle, py::handle topk_weights, py::handle bias,
             py::handle num_sms, py::handle num_qps, py::handle previous_event,
             py::handle previous_event_before_epilogue, py::handle async_with_compute_stream,
             py::handle allocate_on_comm_stream, std::uintptr_t stream) {
            ElasticRuntime& buffer = box.get();
            ArgumentImports in(buffer.placement());
            const Tensor data = in.tensor(x, "x");
            const Tensor weights = in.tensor(topk_weights, "topk_weights");
            const std::vector<Tensor> biases = in.tensor_list(bias, "bias");
            CombineArgs a;
            a.x = data;
            a.handle = in.object<EPHandle>(handle, "handle", "an EPHandle returned by dispatch", true);
            a.topk_weights = weights;
            for (const Tensor& b : biases) a.bias.push_back(b);
            a.num_sms = in.integer(num_sms, "num_sms");
            a.num_qps = in.integer(num_qps, "num_qps");
            stream_arguments(in, a, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                             allocate_on_comm_stream, stream);
            a.rejection = in.rejection();
            const CombineResult r = in.call([&] { return buffer.combine(a); });
            auto ev = std::make_shared<PyEvent>();
            ev->event = r.event;
            keep_inputs(*ev, {&data, &weights});
            if (!ev->event.query()) ev->keep.insert(ev->keep.end(), biases.begin(), biases.end());
            return py::make_tuple(export_tensor(r.combined_x), export_tensor(r.combined_topk_weights), ev);
          },
          py::arg("x"), py::arg("handle"), py::arg("topk_weights"), py::arg("bias"), py::arg("num_sms"),
          py::arg("num_qps"), py::arg("previous_event"), py::arg("previous_event_before_epilogue"),
          py::arg("async_with_compute_stream"), py::arg("allocate_on_comm_stream"), py::arg("stream") = 0)
      // HybridEPBuffer's combines (python/moe_ep/deep_ep/hybrid_ep_buffer.py, docs/hybrid-ep.md):
      // the V2 combine with engine options DeepEP's API has no argument for (CombineExtras),
      // on the built-in buffer. `rejection`: the caller's own argument check failed on this rank
      // (every rank raises; peers PeerError naming it).
      .def(
          "_combine_hybrid_ep",
          [](ElasticBox& box, py::handle x, py::handle handle, py::handle topk_weights, bool sum_weights_over_ranks,
             bool own_node_rank_terms, const std::string& rejection) {
            ElasticRuntime& buffer = box.get();
            ElasticBuffer* host = buffer.host_buffer();
            if (host == nullptr)
              throw StateError(fmt::format("[rank {}] HybridEPBuffer: combine runs on host tensors only", buffer.rank()));
            ArgumentImports in(buffer.placement());
            const Tensor data = in.tensor(x, "hidden");
            const Tensor weights = in.tensor(topk_weights, "probs");
            CombineArgs a;
            a.x = data;
            a.handle = in.object<EPHandle>(handle, "handle", "an EPHandle returned by dispatch");
            a.topk_weights = weights;
            a.rejection = in.failed() ? in.rejection() : rejection;
            const CombineExtras extras{.sum_weights_over_ranks = sum_weights_over_ranks,
                                       .own_node_rank_terms = own_node_rank_terms};
            const CombineResult r = in.call([&] { return host->combine(a, extras); });
            return py::make_tuple(export_tensor(r.combined_x), export_tensor(r.combined_topk_weights));
          },
          py::arg("x"), py::arg("handle"), py::arg("topk_weights"), py::arg("sum_weights_over_ranks"),
          py::arg("own_node_rank_terms"), py::arg("rejection") = "")
      .def(
          "get_theoretical_num_sms",
          [](const ElasticBox& b, int e, int k, int so_k, double rdma, double nvl, double rd, double wr) {
            return b.get().get_theoretical_num_sms(e, k, so_k, rdma, nvl, rd, wr);
          },
          py::arg("num_experts"), py::arg("num_topk"), py::arg("num_scaleout_topk") = 0, py::arg("rdma_gbs") = 0.0,
          py::arg("nvlink_gbs") = 0.0, py::arg("sm_read_gbs") = 0.0, py::arg("sm_write_gbs") = 0.0)
      .def("get_theoretical_num_qps", [](const ElasticBox& b, int sms) { return b.get().get_theoretical_num_qps(sms); })
      .def("destroy", [](ElasticBox& b) {
        py::gil_scoped_release release;
        b.get().destroy();
      })
      .def("get_physical_domain_size", [](const ElasticBox& b) { return b.get().get_physical_domain_size(); })
      .def("get_logical_domain_size", [](const ElasticBox& b) { return b.get().get_logical_domain_size(); })
      .def_property_readonly("rank", [](const ElasticBox& b) { return b.get().rank(); })
      .def_property_readonly("num_ranks", [](const ElasticBox& b) { return b.get().num_ranks(); })
      .def_property_readonly("num_bytes", [](const ElasticBox& b) { return b.get().num_bytes(); })
      .def_property_readonly("num_max_tokens_per_rank", [](const ElasticBox& b) { return b.get().num_max_tokens_per_rank(); })
      .def_property_readonly("num_allocated_qps", [](const ElasticBox& b) { return b.get().num_allocated_qps(); })
      .def_property_readonly("num_scaleout_ranks", [](const ElasticBox& b) { return b.get().num_scaleout_ranks(); })
      .def_property_readonly("num_scaleup_ranks", [](const ElasticBox& b) { return b.get().num_scaleup_ranks(); })
      .def_property_readonly("scaleout_rank_idx", [](const ElasticBox& b) { return b.get().scaleout_rank_idx(); })
      .def_property_readonly("scaleup_rank_idx", [](const ElasticBox& b) { return b.get().scaleup_rank_idx(); })
      .def_property_readonly("is_hybrid", [](const ElasticBox& b) { return b.get().is_hybrid(); })
      .def_property_readonly("provider", [](const ElasticBox& b) { return std::string(b.get().provider()); })
      .def_property_readonly("device", [](const ElasticBox& b) { return b.get().device(); })
      .def_property_readonly("why_host", [](const ElasticBox& b) { return b.get().placement().why_host; });

  // Whether the CUDA provider can serve a Python ElasticBuffer, and from where (or why not).
  m.def(
      "cuda_provider",
      [](const std::string& path_list) {
        const dispatcher::DeviceProvider found = dispatcher::find_cuda_provider(path_list);
        py::dict d;
        d["available"] = found.table != nullptr;
        d["origin"] = found.origin;
        d["reason"] = found.reason;
        return d;
      },
      py::arg("path_list"));
}

}  // namespace moe_ep::python
