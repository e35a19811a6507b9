// The extension module moe_ep._C_mpi: groups over MPI communicators (mpi4py), apart from moe_ep._C
// so that only a process that uses MPI loads the MPI library. The Group it returns is the class
// moe_ep._C registers (one pybind11 registry for both modules); its errors are translated by the
// translator moe_ep._C registers. moe_ep._groups imports it on the first mpi4py communicator.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "moe_ep/group.hpp"
#include "moe_ep/mpi.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_C_mpi, m) {
  m.doc() = "moe-ep: groups over MPI communicators (the MPI transport)";
  m.def(
      "mpi_group",
      [](std::uintptr_t handle, std::optional<int> ranks_per_node, double timeout_secs) {
        moe_ep::mpi::GroupOptions options;
        options.ranks_per_node = ranks_per_node;
        options.timeout_secs = timeout_secs;
        py::gil_scoped_release release;
        return std::shared_ptr<moe_ep::Group>(moe_ep::mpi::make_group(reinterpret_cast<MPI_Comm>(handle), options));
      },
      py::arg("comm_handle"), py::arg("ranks_per_node") = py::none(), py::arg("timeout_secs") = 0.0);
}
