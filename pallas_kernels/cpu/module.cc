// pallas_kernels._cpu: hands the XLA FFI handlers of every CPU op to Python as PyCapsules, which
// pallas_kernels.cpu registers with jax.ffi.register_ffi_target(..., platform="cpu").
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu/isa.h"
#include "cpu/runtime.h"
#include "quant_matmul/cpu_kernel.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.doc() = "ikjax CPU kernels (XLA FFI handlers)";
  m.def("registrations", [] {
    nb::dict d;
    for (const auto& e : ikj::ffi_registry()) d[e.name.c_str()] = nb::capsule(e.handler);
    return d;
  });
  m.def("isa", [] { return std::string(ikj::isa_name(ikj::current_isa())); },
        "instruction-set level the kernels run at on this CPU (IKJAX_CPU_ISA caps it)");
  m.def("isa_report", [] { return ikj::isa_report(); },
        "the level that runs, why (IKJAX_CPU_ISA's cap or the CPU features a higher level lacks), its int8 paths");
  m.def("available_cores", &ikj::available_cores);
  m.def("quant_type_supported", [](int type) { return IKJ_DISPATCH(quant_matmul_supported)(type); },
        "whether the quant core (qgemm_tile) has a path for this ggml type id at the current level");
}
