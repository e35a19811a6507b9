// Buffer (V1): normal mode, low-latency mode, Config, handles and receive hooks.
#include <fmt/format.h>

#include "common.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"

namespace moe_ep::python {
namespace {

using LegacyBox = Box<Buffer>;

std::pair<Tensor, Tensor> import_x(py::handle x) {
  if (py::isinstance<py::tuple>(x) || py::isinstance<py::list>(x)) {
    py::sequence pair = py::reinterpret_borrow<py::sequence>(x);
    if (pair.size() != 2)
      throw py::value_error(fmt::format("x must be a tensor or a pair (x_fp8, x_scales), got a sequence of {} items",
                                        pair.size()));
    return {import_tensor(pair[0], "x[0] (FP8 data)", DType::kFP8E4M3), import_tensor(pair[1], "x[1] (x_scales)")};
  }
  return {import_tensor(x, "x"), Tensor{}};
}

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

void register_legacy(py::module_& m) {
  py::class_<Config>(m, "Config")
      .def(py::init(&Config::make), py::arg("num_sms") = 20, py::arg("num_max_nvl_chunked_send_tokens") = 6,
           py::arg("num_max_nvl_chunked_recv_tokens") = 256, py::arg("num_max_rdma_chunked_send_tokens") = 6,
           py::arg("num_max_rdma_chunked_recv_tokens") = 256)
      .def_readonly("num_sms", &Config::num_sms)
      .def_readonly("num_max_nvl_chunked_send_tokens", &Config::num_max_nvl_chunked_send_tokens)
      .def_readonly("num_max_nvl_chunked_recv_tokens", &Config::num_max_nvl_chunked_recv_tokens)
      .def_readonly("num_max_rdma_chunked_send_tokens", &Config::num_max_rdma_chunked_send_tokens)
      .def_readonly("num_max_rdma_chunked_recv_tokens", &Config::num_max_rdma_chunked_recv_tokens)
      .def("get_nvl_buffer_size_hint", &Config::get_nvl_buffer_size_hint, py::arg("hidden_bytes"), py::arg("num_ranks"))
      .def("get_rdma_buffer_size_hint", &Config::get_rdma_buffer_size_hint, py::arg("hidden_bytes"), py::arg("num_ranks"))
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
                       double timeout) {
             BufferConfig c;
             c.num_nvl_bytes = nvl;
             c.num_rdma_bytes = rdma;
             c.low_latency_mode = low_latency_mode;
             c.num_qps_per_rank = num_qps_per_rank;
             c.allow_nvlink_for_low_latency_mode = allow_nvlink;
             c.allow_mnnvl = allow_mnnvl;
             c.explicitly_destroy = explicitly_destroy;
             c.num_cpu_timeout_secs = timeout;
             py::gil_scoped_release release;
             return std::make_shared<LegacyBox>(std::make_unique<Buffer>(*group, c));
           }),
           py::arg("group"), py::arg("num_nvl_bytes"), py::arg("num_rdma_bytes"), py::arg("low_latency_mode"),
           py::arg("num_qps_per_rank"), py::arg("allow_nvlink_for_low_latency_mode"), py::arg("allow_mnnvl"),
           py::arg("explicitly_destroy"), py::arg("num_cpu_timeout_secs"))
      .def_static("set_num_sms", &Buffer::set_num_sms)
      .def_static("num_sms", &Buffer::num_sms)
      .def_static("get_dispatch_config", &Buffer::get_dispatch_config)
      .def_static("get_combine_config", &Buffer::get_combine_config)
      .def_static("get_low_latency_rdma_size_hint", &Buffer::get_low_latency_rdma_size_hint)
      .def("get_dispatch_layout",
           [](LegacyBox& box, py::handle topk_idx, int num_experts, py::handle previous_event, bool async_finish,
              bool allocate_on_comm_stream) {
             const Tensor idx = import_tensor(topk_idx, "topk_idx");
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
           [](LegacyBox& box, py::handle x, std::shared_ptr<LegacyHandle> handle, py::handle per_rank,
              py::handle per_rdma_rank, py::handle in_rank, py::handle per_expert, py::handle topk_idx,
              py::handle topk_weights, int expert_alignment, int num_worst_tokens, std::optional<Config> config,
              py::handle previous_event, bool async_finish, bool allocate_on_comm_stream) {
             auto [data, scales] = import_x(x);
             std::vector<Tensor> in = {data, scales,
                                       import_optional(per_rank, "num_tokens_per_rank"),
                                       import_optional(per_rdma_rank, "num_tokens_per_rdma_rank"),
                                       import_optional(in_rank, "is_token_in_rank"),
                                       import_optional(per_expert, "num_tokens_per_expert"),
                                       import_optional(topk_idx, "topk_idx"),
                                       import_optional(topk_weights, "topk_weights")};
             LegacyDispatchArgs a;
             a.x = in[0];
             a.x_scales = in[1];
             a.handle = handle;
             a.num_tokens_per_rank = in[2];
             a.num_tokens_per_rdma_rank = in[3];
             a.is_token_in_rank = in[4];
             a.num_tokens_per_expert = in[5];
             a.topk_idx = in[6];
             a.topk_weights = in[7];
             a.expert_alignment = expert_alignment;
             a.num_worst_tokens = num_worst_tokens;
             a.config = config;
             a.previous_event = to_event(previous_event, "previous_event");
             a.async_finish = async_finish;
             a.allocate_on_comm_stream = allocate_on_comm_stream;
             LegacyDispatchResult r;
             {
               py::gil_scoped_release release;
               r = box.get().dispatch(a);
             }
             py::object list = handle ? py::object(py::none()) : py::object(py::cast(r.num_recv_tokens_per_expert_list));
             return py::make_tuple(export_tensor(r.recv_x), export_tensor(r.recv_x_scales), export_tensor(r.recv_topk_idx),
                                   export_tensor(r.recv_topk_weights), list, r.handle, event_of(r.event, std::move(in)));
           })
      .def("combine",
           [](LegacyBox& box, py::handle x, std::shared_ptr<LegacyHandle> handle, py::handle topk_weights,
              std::vector<py::handle> bias, std::optional<Config> config, py::handle previous_event, bool async_finish,
              bool allocate_on_comm_stream) {
             if (!handle) throw py::type_error("handle is None; combine needs the handle of a dispatch");
             std::vector<Tensor> in = {import_tensor(x, "x"), import_optional(topk_weights, "topk_weights")};
             for (size_t i = 0; i < bias.size(); ++i) in.push_back(import_tensor(bias[i], i == 0 ? "bias[0]" : "bias[1]"));
             LegacyCombineArgs a;
             a.x = in[0];
             a.handle = handle;
             a.topk_weights = in[1];
             for (size_t i = 2; i < in.size(); ++i) a.bias.push_back(in[i]);
             a.config = config;
             a.previous_event = to_event(previous_event, "previous_event");
             a.async_finish = async_finish;
             a.allocate_on_comm_stream = allocate_on_comm_stream;
             CombineResult r;
             {
               py::gil_scoped_release release;
               r = box.get().combine(a);
             }
             return py::make_tuple(export_tensor(r.combined_x), export_tensor(r.combined_topk_weights),
                                   event_of(r.event, std::move(in)));
           })
      .def("low_latency_dispatch",
           [](LegacyBox& box, py::handle x, py::handle topk_idx, int cap, int num_experts, py::handle cumulative,
              py::handle wait_stats, bool use_fp8, bool round_scale, bool use_ue8m0, bool async_finish,
              bool return_recv_hook) {
             std::vector<Tensor> in = {import_tensor(x, "x"), import_tensor(topk_idx, "topk_idx"),
                                       import_optional(cumulative, "cumulative_local_expert_recv_stats"),
                                       import_optional(wait_stats, "dispatch_wait_recv_cost_stats")};
             LowLatencyDispatchArgs a;
             a.x = in[0];
             a.topk_idx = in[1];
             a.num_max_dispatch_tokens_per_rank = cap;
             a.num_experts = num_experts;
             a.cumulative_local_expert_recv_stats = in[2];
             a.dispatch_wait_recv_cost_stats = in[3];
             a.use_fp8 = use_fp8;
             a.round_scale = round_scale;
             a.use_ue8m0 = use_ue8m0;
             a.async_finish = async_finish;
             a.return_recv_hook = return_recv_hook;
             LowLatencyDispatchResult r;
             {
               py::gil_scoped_release release;
               r = box.get().low_latency_dispatch(a);
             }
             py::object hook = hook_of(r.hook, in);
             return py::make_tuple(export_tensor(r.recv_x), export_tensor(r.recv_x_scales),
                                   export_tensor(r.packed_recv_count), r.handle, event_of(r.event, std::move(in)), hook);
           })
      .def("low_latency_combine",
           [](LegacyBox& box, py::handle x, py::handle topk_idx, py::handle topk_weights,
              std::shared_ptr<LowLatencyHandle> handle, bool use_logfmt, bool zero_copy, bool async_finish,
              bool return_recv_hook, py::handle out, py::handle wait_stats) {
             if (!handle) throw py::type_error("handle is None; low_latency_combine needs the handle of a dispatch");
             std::vector<Tensor> in = {import_tensor(x, "x"), import_tensor(topk_idx, "topk_idx"),
                                       import_tensor(topk_weights, "topk_weights"), import_optional(out, "out"),
                                       import_optional(wait_stats, "combine_wait_recv_cost_stats")};
             LowLatencyCombineArgs a;
             a.x = in[0];
             a.topk_idx = in[1];
             a.topk_weights = in[2];
             a.handle = handle;
             a.use_logfmt = use_logfmt;
             a.zero_copy = zero_copy;
             a.async_finish = async_finish;
             a.return_recv_hook = return_recv_hook;
             a.out = in[3];
             a.combine_wait_recv_cost_stats = in[4];
             LowLatencyCombineResult r;
             {
               py::gil_scoped_release release;
               r = box.get().low_latency_combine(a);
             }
             py::object hook = hook_of(r.hook, in);
             return py::make_tuple(export_tensor(r.combined_x), event_of(r.event, std::move(in)), hook);
           })
      .def("get_next_low_latency_combine_buffer",
           [](std::shared_ptr<LegacyBox> box, std::shared_ptr<LowLatencyHandle> handle) {
             if (!handle) throw py::type_error("handle is None");
             const TensorView v = box->get().get_next_low_latency_combine_buffer(*handle);
             return export_view(v, box);
           })
      .def("clean_low_latency_buffer",
           [](LegacyBox& box, int cap, int hidden, int experts) {
             py::gil_scoped_release release;
             box.get().clean_low_latency_buffer(cap, hidden, experts);
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
