// Buffer (V1): normal mode, low-latency mode, Config, handles and receive hooks.
#include <fmt/format.h>

#include "common.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"

namespace moe_ep::python {
namespace {

// V1 runs on the built-in provider only (the CUDA provider offers V2): host tensors.
Placement v1_placement() {
  return {.cuda = false,
          .why_host = "Buffer (V1) runs on moe-ep's built-in CPU provider, which moves host tensors (the CUDA provider "
                      "offers V2 only: ElasticBuffer)"};
}

using LegacyBox = Box<Buffer>;

std::shared_ptr<PyEvent> event_of(const Event& e, std::vector<Tensor> keep) {
  auto ev = std::make_shared<PyEvent>();
  ev->event = e;
  if (!e.query()) ev->keep = std::move(keep);
  return ev;
}

// A receive hook that releases the GIL while it waits, and keeps the inputs alive until called.
struct PyHook {
  ReceiveHook hook;
  std::vector<Tensor> keep;
  void call() {
    {
      py::gil_scoped_release release;
      hook();
    }
    keep.clear();
  }
};

py::object hook_of(const ReceiveHook& hook, std::vector<Tensor> keep) {
  if (!hook) return py::none();
  auto h = std::make_shared<PyHook>();
  h->hook = hook;
  h->keep = std::move(keep);
  return py::cast(h);
}

}  // namespace

// Long: the declarative table of this module's Python classes and functions (one statement per binding).
void register_legacy(py::module_& m) {
  py::class_<Config, std::shared_ptr<Config>>(
      m, "Config",
      "DeepEP V1's configuration of a normal-mode dispatch or combine (deep_ep.Config).\n\n"
      "On CPU, num_sms / 2 worker threads copy per rank (capped by the cores of each rank); the chunk sizes of "
      "DeepEP's rings only feed the size hints.")
      .def(py::init([](py::handle sms, py::handle nvl_send, py::handle nvl_recv, py::handle rdma_send,
                       py::handle rdma_recv) {
             return Config::make(to_int(sms, "num_sms"), to_int(nvl_send, "num_max_nvl_chunked_send_tokens"),
                                 to_int(nvl_recv, "num_max_nvl_chunked_recv_tokens"),
                                 to_int(rdma_send, "num_max_rdma_chunked_send_tokens"),
                                 to_int(rdma_recv, "num_max_rdma_chunked_recv_tokens"));
           }),
           py::arg("num_sms") = 20, py::arg("num_max_nvl_chunked_send_tokens") = 6,
           py::arg("num_max_nvl_chunked_recv_tokens") = 256, py::arg("num_max_rdma_chunked_send_tokens") = 6,
           py::arg("num_max_rdma_chunked_recv_tokens") = 256,
           "A configuration, checked (moe_ep.InvalidArgument naming the values).\n\n"
           "Arguments:\n"
           "    num_sms: int, default 20: DeepEP's SM count, even, in [2, 1024].\n"
           "    num_max_nvl_chunked_send_tokens: int, default 6: the NVLink chunk, less than the ring.\n"
           "    num_max_nvl_chunked_recv_tokens: int, default 256: the NVLink ring, in tokens.\n"
           "    num_max_rdma_chunked_send_tokens: int, default 6: the RDMA chunk, at most half the ring.\n"
           "    num_max_rdma_chunked_recv_tokens: int, default 256: the RDMA ring, rounded up to a multiple of "
           "the chunk.")
      .def_readonly("num_sms", &Config::num_sms, "int: DeepEP's SM count (num_sms / 2 worker threads on CPU).")
      .def_readonly("num_max_nvl_chunked_send_tokens", &Config::num_max_nvl_chunked_send_tokens,
                    "int: the NVLink chunk, in tokens.")
      .def_readonly("num_max_nvl_chunked_recv_tokens", &Config::num_max_nvl_chunked_recv_tokens,
                    "int: the NVLink ring, in tokens.")
      .def_readonly("num_max_rdma_chunked_send_tokens", &Config::num_max_rdma_chunked_send_tokens,
                    "int: the RDMA chunk, in tokens.")
      .def_readonly("num_max_rdma_chunked_recv_tokens", &Config::num_max_rdma_chunked_recv_tokens,
                    "int: the RDMA ring, in tokens (a multiple of the chunk).")
      .def(
          "get_nvl_buffer_size_hint",
          [](const Config& c, py::handle hidden_bytes, py::handle num_ranks) {
            return c.get_nvl_buffer_size_hint(to_int64(hidden_bytes, "hidden_bytes"), to_int(num_ranks, "num_ranks"));
          },
          py::arg("hidden_bytes"), py::arg("num_ranks"),
          "DeepEP's num_nvl_bytes for this configuration (its formula, exactly).\n\n"
          "Arguments:\n"
          "    hidden_bytes: int, the bytes of a row (DeepEP sizes with hidden * max(element size, 2)).\n"
          "    num_ranks: int, the ranks of the group.\n\n"
          "Returns:\n"
          "    num_bytes: int, a multiple of 128.")
      .def(
          "get_rdma_buffer_size_hint",
          [](const Config& c, py::handle hidden_bytes, py::handle num_ranks) {
            return c.get_rdma_buffer_size_hint(to_int64(hidden_bytes, "hidden_bytes"), to_int(num_ranks, "num_ranks"));
          },
          py::arg("hidden_bytes"), py::arg("num_ranks"),
          "DeepEP's num_rdma_bytes for this configuration (its formula, exactly: 0 on up to 8 ranks).\n\n"
          "Arguments:\n"
          "    hidden_bytes: int, the bytes of a row.\n"
          "    num_ranks: int, the ranks of the group.\n\n"
          "Returns:\n"
          "    num_bytes: int, a multiple of 128.")
      .def("__repr__", [](const Config& c) {
        return fmt::format("Config(num_sms={}, nvl_send={}, nvl_recv={}, rdma_send={}, rdma_recv={})", c.num_sms,
                           c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
                           c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens);
      });

  py::class_<PyHook, std::shared_ptr<PyHook>>(m, "ReceiveHook").def("__call__", &PyHook::call);

  py::class_<LegacyHandle, std::shared_ptr<LegacyHandle>>(m, "LegacyHandle")
      .def_readonly("num_channels", &LegacyHandle::num_channels)
      .def("fields", [](const LegacyHandle& h) {
        return py::make_tuple(export_tensor(h.rank_prefix_matrix), export_tensor(h.channel_prefix_matrix),
                              export_tensor(h.recv_channel_prefix_matrix), export_tensor(h.recv_src_idx),
                              export_tensor(h.is_token_in_rank), export_tensor(h.send_head),
                              export_tensor(h.recv_rdma_rank_prefix_sum), export_tensor(h.recv_gbl_rank_prefix_sum));
      });

  py::class_<LowLatencyHandle, std::shared_ptr<LowLatencyHandle>>(m, "LowLatencyHandle")
      .def("fields", [](const LowLatencyHandle& h) {
        return py::make_tuple(export_tensor(h.packed_recv_src_info), export_tensor(h.packed_recv_layout_range),
                              h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts);
      });

  py::class_<LegacyBox, std::shared_ptr<LegacyBox>>(m, "Buffer")
      .def(py::init([](std::shared_ptr<Group> group, std::int64_t nvl, std::int64_t rdma, bool low_latency_mode,
                       int num_qps_per_rank, bool allow_nvlink, bool allow_mnnvl, bool explicitly_destroy,
                       bool enable_shrink, double timeout) {
             BufferConfig c;
             c.num_nvl_bytes = nvl;
             c.num_rdma_bytes = rdma;
             c.low_latency_mode = low_latency_mode;
             c.num_qps_per_rank = num_qps_per_rank;
             c.allow_nvlink_for_low_latency_mode = allow_nvlink;
             c.allow_mnnvl = allow_mnnvl;
             c.explicitly_destroy = explicitly_destroy;
             c.enable_shrink = enable_shrink;
             c.num_cpu_timeout_secs = timeout;
             py::gil_scoped_release release;
             return std::make_shared<LegacyBox>(std::make_unique<Buffer>(*group, c));
           }),
           py::arg("group"), py::arg("num_nvl_bytes"), py::arg("num_rdma_bytes"), py::arg("low_latency_mode"),
           py::arg("num_qps_per_rank"), py::arg("allow_nvlink_for_low_latency_mode"), py::arg("allow_mnnvl"),
           py::arg("explicitly_destroy"), py::arg("enable_shrink"), py::arg("num_cpu_timeout_secs"))
      .def_static("set_num_sms", &Buffer::set_num_sms)
      .def_static("num_sms", &Buffer::num_sms)
      .def_static("get_dispatch_config", &Buffer::get_dispatch_config)
      .def_static("get_combine_config", &Buffer::get_combine_config)
      .def_static("get_low_latency_rdma_size_hint", &Buffer::get_low_latency_rdma_size_hint)
      .def("get_dispatch_layout",
           [](LegacyBox& box, py::handle topk_idx, int num_experts, py::handle previous_event, bool async_finish,
              bool allocate_on_comm_stream) {
             const Tensor idx = import_tensor(topk_idx, "topk_idx", std::nullopt, v1_placement());
             const std::optional<Event> prev = to_event(previous_event, "previous_event");
             DispatchLayout r;
             {
               py::gil_scoped_release release;
               r = box.get().get_dispatch_layout(idx, num_experts, prev, async_finish, allocate_on_comm_stream);
             }
             return py::make_tuple(export_tensor(r.num_tokens_per_rank), export_tensor(r.num_tokens_per_rdma_rank),
                                   export_tensor(r.num_tokens_per_expert), export_tensor(r.is_token_in_rank),
                                   event_of(r.event, {idx}));
           })
      .def("dispatch",
           [](LegacyBox& box, py::handle x, py::handle handle, py::handle per_rank, py::handle per_rdma_rank,
              py::handle in_rank, py::handle per_expert, py::handle topk_idx, py::handle topk_weights,
              py::handle expert_alignment, py::handle num_worst_tokens, py::handle config, py::handle previous_event,
              py::handle async_finish, py::handle allocate_on_comm_stream) {
             Buffer& buffer = box.get();
             ArgumentImports in(v1_placement());
             // x: a tensor, (x_fp8, x_scales), or the NVFP4 triple (packed, sf, sf_scale).
             const bool nvfp4 = py::isinstance<py::tuple>(x) && py::len(x) == 3;
             Tensor data, scales;
             std::vector<Tensor> triple;
             if (nvfp4) {
               py::tuple parts = py::reinterpret_borrow<py::tuple>(x);
               triple = {in.tensor(parts[0], "x[0] (packed)"), in.tensor(parts[1], "x[1] (sf)"),
                         in.tensor(parts[2], "x[2] (sf_scale)")};
             } else {
               std::tie(data, scales) = in.x_or_pair(x, "x_scales");
             }
             std::vector<Tensor> keep = {data,
                                         scales,
                                         in.tensor(per_rank, "num_tokens_per_rank"),
                                         in.tensor(per_rdma_rank, "num_tokens_per_rdma_rank"),
                                         in.tensor(in_rank, "is_token_in_rank", DType::kBool),
                                         in.tensor(per_expert, "num_tokens_per_expert"),
                                         in.tensor(topk_idx, "topk_idx"),
                                         in.tensor(topk_weights, "topk_weights")};
             LegacyDispatchArgs a;
             a.x = keep[0];
             a.x_scales = keep[1];
             if (nvfp4) {
               a.x_nvfp4 = Nvfp4Tokens{triple[0], triple[1], triple[2]};
               keep.insert(keep.end(), triple.begin(), triple.end());
             }
             a.handle = in.object<LegacyHandle>(handle, "handle", "a handle returned by dispatch");
             a.num_tokens_per_rank = keep[2];
             a.num_tokens_per_rdma_rank = keep[3];
             a.is_token_in_rank = keep[4];
             a.num_tokens_per_expert = keep[5];
             a.topk_idx = keep[6];
             a.topk_weights = keep[7];
             a.expert_alignment = in.integer(expert_alignment, "expert_alignment");
             a.num_worst_tokens = in.integer(num_worst_tokens, "num_worst_tokens");
             if (auto c = in.object<Config>(config, "config", "a Config")) a.config = *c;
             a.previous_event = in.event(previous_event, "previous_event");
             a.async_finish = in.boolean(async_finish, "async_finish");
             a.allocate_on_comm_stream = in.boolean(allocate_on_comm_stream, "allocate_on_comm_stream");
             a.rejection = in.rejection();
             const LegacyDispatchResult r = in.call([&] { return buffer.dispatch(a); });
             py::object list =
                 a.handle ? py::object(py::none()) : py::object(py::cast(r.num_recv_tokens_per_expert_list));
             // NVFP4: recv_x is the received triple.
             py::object recv_x = r.recv_x_nvfp4 ? py::object(py::make_tuple(export_tensor(r.recv_x_nvfp4->packed),
                                                                             export_tensor(r.recv_x_nvfp4->sf),
                                                                             export_tensor(r.recv_x_nvfp4->sf_scale)))
                                               : export_tensor(r.recv_x);
             return py::make_tuple(recv_x, export_tensor(r.recv_x_scales), export_tensor(r.recv_topk_idx),
                                   export_tensor(r.recv_topk_weights), list, r.handle, event_of(r.event, std::move(keep)));
           })
      .def("combine",
           [](LegacyBox& box, py::handle x, py::handle handle, py::handle topk_weights, py::handle bias,
              py::handle config, py::handle previous_event, py::handle async_finish,
              py::handle allocate_on_comm_stream) {
             Buffer& buffer = box.get();
             ArgumentImports in(v1_placement());
             std::vector<Tensor> keep = {in.tensor(x, "x"), in.tensor(topk_weights, "topk_weights")};
             const std::vector<Tensor> biases = in.tensor_list(bias, "bias");
             keep.insert(keep.end(), biases.begin(), biases.end());
             LegacyCombineArgs a;
             a.x = keep[0];
             a.handle = in.object<LegacyHandle>(handle, "handle", "a handle returned by dispatch", true);
             a.topk_weights = keep[1];
             for (const Tensor& b : biases) a.bias.push_back(b);
             if (auto c = in.object<Config>(config, "config", "a Config")) a.config = *c;
             a.previous_event = in.event(previous_event, "previous_event");
             a.async_finish = in.boolean(async_finish, "async_finish");
             a.allocate_on_comm_stream = in.boolean(allocate_on_comm_stream, "allocate_on_comm_stream");
             a.rejection = in.rejection();
             const CombineResult r = in.call([&] { return buffer.combine(a); });
             return py::make_tuple(export_tensor(r.combined_x), export_tensor(r.combined_topk_weights),
                                   event_of(r.event, std::move(keep)));
           })
      .def("low_latency_dispatch",
           [](LegacyBox& box, py::handle x, py::handle topk_idx, py::handle cap, py::handle num_experts,
              py::handle topk_weights, py::handle cumulative, py::handle wait_stats, py::handle x_global_scale,
              py::handle use_fp8, py::handle round_scale, py::handle use_ue8m0, py::handle use_nvfp4,
              py::handle use_ue8m0_for_sf, py::handle async_finish, py::handle return_recv_hook) {
             Buffer& buffer = box.get();
             ArgumentImports in(v1_placement());
             std::vector<Tensor> keep = {in.tensor(x, "x"), in.tensor(topk_idx, "topk_idx"),
                                         in.tensor(cumulative, "cumulative_local_expert_recv_stats"),
                                         in.tensor(wait_stats, "dispatch_wait_recv_cost_stats"),
                                         in.tensor(topk_weights, "topk_weights"),
                                         in.tensor(x_global_scale, "x_global_scale")};
             LowLatencyDispatchArgs a;
             a.x = keep[0];
             a.topk_idx = keep[1];
             a.num_max_dispatch_tokens_per_rank = in.integer(cap, "num_max_dispatch_tokens_per_rank");
             a.num_experts = in.integer(num_experts, "num_experts");
             a.cumulative_local_expert_recv_stats = keep[2];
             a.dispatch_wait_recv_cost_stats = keep[3];
             a.topk_weights = keep[4];
             a.x_global_scale = keep[5];
             a.use_fp8 = in.boolean(use_fp8, "use_fp8");
             a.round_scale = in.boolean(round_scale, "round_scale");
             a.use_ue8m0 = in.boolean(use_ue8m0, "use_ue8m0");
             a.use_nvfp4 = in.boolean(use_nvfp4, "use_nvfp4");
             a.use_ue8m0_for_sf = in.boolean(use_ue8m0_for_sf, "use_ue8m0_for_sf");
             a.async_finish = in.boolean(async_finish, "async_finish");
             a.return_recv_hook = in.boolean(return_recv_hook, "return_recv_hook");
             a.rejection = in.rejection();
             const LowLatencyDispatchResult r = in.call([&] { return buffer.low_latency_dispatch(a); });
             py::object hook = hook_of(r.hook, keep);
             return py::make_tuple(export_tensor(r.recv_x), export_tensor(r.recv_x_scales),
                                   export_tensor(r.packed_recv_count), r.handle, event_of(r.event, std::move(keep)), hook,
                                   export_tensor(r.recv_topk_weights), export_tensor(r.recv_rank_info));
           })
      .def("low_latency_combine",
           [](LegacyBox& box, py::handle x, py::handle topk_idx, py::handle topk_weights, py::handle handle,
              py::handle use_logfmt, py::handle zero_copy, py::handle async_finish, py::handle return_recv_hook,
              py::handle out, py::handle wait_stats, py::handle overlap, py::handle src_signals,
              py::handle src_signal_expect_value) {
             Buffer& buffer = box.get();
             ArgumentImports in(v1_placement());
             std::vector<Tensor> keep = {in.tensor(x, "x"), in.tensor(topk_idx, "topk_idx"),
                                         in.tensor(topk_weights, "topk_weights"), in.tensor(out, "out"),
                                         in.tensor(wait_stats, "combine_wait_recv_cost_stats"),
                                         in.tensor(src_signals, "src_signals")};
             LowLatencyCombineArgs a;
             a.x = keep[0];
             a.topk_idx = keep[1];
             a.topk_weights = keep[2];
             a.handle = in.object<LowLatencyHandle>(handle, "handle", "a handle returned by low_latency_dispatch", true);
             a.use_logfmt = in.boolean(use_logfmt, "use_logfmt");
             a.zero_copy = in.boolean(zero_copy, "zero_copy");
             a.async_finish = in.boolean(async_finish, "async_finish");
             a.return_recv_hook = in.boolean(return_recv_hook, "return_recv_hook");
             a.out = keep[3];
             a.combine_wait_recv_cost_stats = keep[4];
             a.overlap = in.boolean(overlap, "overlap");
             a.src_signals = keep[5];
             a.src_signal_expect_value = in.integer64(src_signal_expect_value, "src_signal_expect_value");
             a.rejection = in.rejection();
             const LowLatencyCombineResult r = in.call([&] { return buffer.low_latency_combine(a); });
             py::object hook = hook_of(r.hook, keep);
             return py::make_tuple(export_tensor(r.combined_x), event_of(r.event, std::move(keep)), hook);
           })
      .def("low_latency_update_mask_buffer",
           [](LegacyBox& box, int rank_to_mask, bool mask) {
             Buffer& buffer = box.get();
             py::gil_scoped_release release;  // the buffer's call lock may be held by a thread that needs the GIL
             buffer.low_latency_update_mask_buffer(rank_to_mask, mask);
           })
      .def("low_latency_query_mask_buffer",
           [](LegacyBox& box, py::handle mask_status) {
             ArgumentImports in(v1_placement());
             const Tensor status = in.tensor(mask_status, "mask_status");
             in.call([&] { box.get().low_latency_query_mask_buffer(status); });
           })
      .def("low_latency_clean_mask_buffer",
           [](LegacyBox& box) {
             Buffer& buffer = box.get();
             py::gil_scoped_release release;
             buffer.low_latency_clean_mask_buffer();
           })
      .def("get_local_buffer_tensor",
           [](LegacyBox& box, std::int64_t offset, bool use_rdma_buffer) {
             Buffer& buffer = box.get();
             Tensor view;
             {
               py::gil_scoped_release release;
               view = buffer.get_local_buffer_tensor(DType::kUInt8, offset, use_rdma_buffer);
             }
             return export_tensor(view);
           })
      .def("get_next_low_latency_combine_buffer",
           [](std::shared_ptr<LegacyBox> box, std::shared_ptr<LowLatencyHandle> handle) {
             if (!handle) throw py::type_error("handle is None");
             Buffer& buffer = box->get();
             Tensor view;
             {
               py::gil_scoped_release release;
               view = buffer.get_next_low_latency_combine_buffer(*handle);
             }
             return export_tensor(view);
           })
      .def("clean_low_latency_buffer",
           [](LegacyBox& box, int cap, int hidden, int experts, const std::string& rejection) {
             py::gil_scoped_release release;
             box.get().clean_low_latency_buffer(cap, hidden, experts, rejection);
           })
      .def("barrier", [](LegacyBox& b) {
        py::gil_scoped_release release;
        b.get().barrier();
      })
      .def("destroy", [](LegacyBox& b) {
        py::gil_scoped_release release;
        b.get().destroy();
      })
      .def_property_readonly("rank", [](const LegacyBox& b) { return b.get().rank(); })
      .def_property_readonly("num_ranks", [](const LegacyBox& b) { return b.get().num_ranks(); })
      .def("get_physical_domain_size", [](const LegacyBox& b) { return b.get().get_physical_domain_size(); });
}

}  // namespace moe_ep::python
