// pallas_kernels._cpu: hands the XLA FFI handlers of every CPU op to Python as PyCapsules, which
// pallas_kernels.cpu registers with jax.ffi.register_ffi_target(..., platform="cpu").
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <vector>

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
  m.def("amx_unavailable_reason", [] { return std::string(ikj::amx_unavailable_reason()); },
        "why the amx level does not run on this machine ('' where it can)");
  m.def("available_cores", &ikj::available_cores);
  m.def(
      "qmatmul_amx_emulated",
      [](nb::bytes x, int64_t M, int64_t K, nb::bytes w, int64_t row_bytes, int type, int64_t N, bool bf16) {
        if (static_cast<int64_t>(x.size()) != M * K * 4 || static_cast<int64_t>(w.size()) != N * row_bytes)
          throw std::invalid_argument("qmatmul_amx_emulated: x must be M * K float32, w N * row_bytes bytes");
        std::vector<float> y(static_cast<size_t>(M * N));
        const std::string err = ikj_generic::qgemm_amx_emulated(
            reinterpret_cast<const float*>(x.c_str()), M, K, reinterpret_cast<const uint8_t*>(w.c_str()), row_bytes,
            type, N, y.data(), bf16);
        if (!err.empty()) throw std::runtime_error(err);
        return nb::bytes(reinterpret_cast<const char*>(y.data()), y.size() * 4);
      },
      nb::arg("x"), nb::arg("M"), nb::arg("K"), nb::arg("w"), nb::arg("row_bytes"), nb::arg("type"), nb::arg("N"),
      nb::arg("bf16") = false,
      "test only: y = x @ W.T (float32 bytes, [M, N]) by the AMX prompt engine on emulated tiles "
      "(quant_matmul/cpu_amx.h; bf16: its bf16 form, else int8), at any level");
  m.def("forget_file", &ikj::embed_rows_forget_file, nb::arg("dev"), nb::arg("inode"),
        "let go of the row gather's open descriptor of file (st_dev, st_ino), if it has one (an engine closed)");
  m.def("quant_type_supported", [](int type) { return IKJ_DISPATCH(quant_matmul_supported)(type); },
        "whether the quant core (qgemm_tile) has a path for this ggml type id at the current level");
}
