// Groups from Python: threads of this process (LocalWorld) and processes of one host bootstrapped
// through a callable all-gather (a torch.distributed group); MPI communicators (mpi4py) are
// moe_ep._C_mpi's (python/src/mpi).
#include <fmt/format.h>

#include <exception>

#include "common.hh"
#include "moe_ep/dtype.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/host.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::python {

PyObject* peer_error_class();

namespace {

// Runs fn(group) on `ranks` threads; returns their results. A rank's Python exception ends its
// part (its peers raise PeerError naming it); the root cause is re-raised: the lowest rank's
// exception that is not a moe_ep.PeerError, else the lowest rank's.
py::list run_local_world(int ranks, int num_scaleout, int num_scaleup, py::function fn) {
  LocalWorld world(ranks, Topology{num_scaleout, num_scaleup});
  std::vector<py::object> results(static_cast<size_t>(ranks));
  std::vector<std::unique_ptr<py::error_already_set>> errors(static_cast<size_t>(ranks));
  std::exception_ptr other;
  struct RankFailed : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  {
    py::gil_scoped_release release;
    try {
      world.run([&](Group& g) {
        // A channel of its own, so that Python may keep the group past this call (later
        // collectives on it then fail cleanly: the peers are gone).
        std::shared_ptr<Group> group = g.duplicate(0, "LocalWorld: channel setup");
        py::gil_scoped_acquire acquire;
        try {
          results[static_cast<size_t>(g.rank())] = fn(group);
        } catch (py::error_already_set& e) {
          std::string what = e.what();
          errors[static_cast<size_t>(g.rank())] = std::make_unique<py::error_already_set>(std::move(e));
          throw RankFailed(what);
        }
      });
    } catch (const RankFailed&) {
    } catch (...) {
      other = std::current_exception();
    }
  }
  py::error_already_set* first = nullptr;
  py::error_already_set* root = nullptr;
  for (auto& e : errors) {
    if (!e) continue;
    if (!first) first = e.get();
    if (!root && !e->matches(peer_error_class())) root = e.get();
  }
  if (root || first) {
    (root ? root : first)->restore();
    throw py::error_already_set();
  }
  if (other) std::rethrow_exception(other);
  py::list out;
  for (auto& r : results) out.append(r ? r : py::none());
  return out;
}

}  // namespace

// Long: the declarative table of this module's Python classes and functions (one statement per binding).
void register_groups(py::module_& m) {
  py::class_<Group, std::shared_ptr<Group>>(m, "Group", "One rank's handle on a group of ranks.")
      .def("rank", &Group::rank)
      .def("size", &Group::size)
      .def_property_readonly("num_scaleout", &Group::num_scaleout)
      .def_property_readonly("num_scaleup", &Group::num_scaleup)
      .def("barrier", &Group::barrier, py::arg("timeout_secs") = 0.0, py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather_bytes",
          [](Group& g, const py::bytes& mine, double timeout_secs) {
            const std::string data = mine;
            std::vector<std::vector<std::byte>> blocks;
            {
              py::gil_scoped_release release;
              blocks = g.all_gather(std::as_bytes(std::span(data.data(), data.size())), timeout_secs,
                                    "Group.all_gather_bytes");
            }
            py::list out;
            for (const std::vector<std::byte>& b : blocks)
              out.append(py::bytes(reinterpret_cast<const char*>(b.data()), b.size()));
            return out;
          },
          py::arg("data"), py::arg("timeout_secs") = 0.0, "Collective: every rank's bytes, by rank.")
      .def("shared_bytes_copied", &Group::shared_bytes_copied)
      .def("scaleout_bytes_sent", &Group::scaleout_bytes_sent)
      .def("ranks_on_host", &Group::ranks_on_host)
      .def("__repr__", [](const Group& g) {
        return fmt::format("<moe_ep.Group rank {} of {} ({} x {})>", g.rank(), g.size(), g.num_scaleout(), g.num_scaleup());
      });

  m.def("run_local_world", &run_local_world, py::arg("ranks"), py::arg("num_scaleout"), py::arg("num_scaleup"),
        py::arg("fn"));

  m.def(
      "host_group",
      [](int rank, int size, py::function all_gather, std::optional<int> ranks_per_node, double timeout_secs) {
        host::GroupOptions options;
        options.ranks_per_node = ranks_per_node;
        options.timeout_secs = timeout_secs;
        host::AllGather gather = [&](const std::string& mine) {
          py::gil_scoped_acquire acquire;
          py::list blocks = all_gather(py::bytes(mine));
          std::vector<std::string> out;
          for (py::handle b : blocks) out.push_back(b.cast<std::string>());
          return out;
        };
        py::gil_scoped_release release;
        return std::shared_ptr<Group>(host::make_group(rank, size, gather, options));
      },
      py::arg("rank"), py::arg("size"), py::arg("all_gather"), py::arg("ranks_per_node") = py::none(),
      py::arg("timeout_secs") = 0.0);

  m.def("timeout_from_env", [] { return env::get_float("MOE_EP_TIMEOUT_SECS"); });
  m.def(
      "empty",
      [](std::vector<std::int64_t> shape, const std::string& dtype) {
        return export_tensor(Tensor::empty(shape, parse_dtype(dtype, "empty")));
      },
      py::arg("shape"), py::arg("dtype"));
  m.def("dtype_names", [] {
    std::vector<std::string> names;
    for (const DType dtype : all_dtypes()) names.emplace_back(dtype_name(dtype));
    return names;
  }, "The names of the dtypes moe-ep moves (torch's names), in the order its messages list them.");
  m.def("allocator_stats", [] {
    const HostAllocatorStats s = host_allocator_stats();
    py::dict d;
    d["mapped_bytes"] = s.mapped_bytes;
    d["cached_bytes"] = s.cached_bytes;
    d["num_maps"] = s.num_maps;
    return d;
  }, "This process's moe-ep tensor allocator: bytes mapped (live and cached), cached, and mmap calls so far.");
}

}  // namespace moe_ep::python
