// XLA FFI binding of the CPU fused routed experts: ikjax_cpu_moe_experts.
//   operands: x f32 [N, d], weights f32 [N, k], ids s32 [N, k],
//             gate u8 [L, E, F, gate_row_bytes], up u8 [L, E, F, up_row_bytes], down u8 [L, E, d,
//             down_row_bytes] (stacks of layers' experts), layer s32 (which of them: cpu/stack.h)
//   attributes: gate_type, up_type, down_type (ggml type ids), n_threads (0 = all cores),
//               compute (0 f32, 1 bf16: QmCompute)
//   result:   out f32 [N, d]
#include <string>
#include <utility>

#include "moe_matmul/cpu_kernel.h"
#include "quant_matmul/cpu_kernel.h"

#include "cpu/runtime.h"
#include "cpu/stack.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error MoeExpertsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> ids,
                                 ffi::Buffer<ffi::U8> gate, ffi::Buffer<ffi::U8> up, ffi::Buffer<ffi::U8> down,
                                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t gate_type, int64_t up_type,
                                 int64_t down_type, int64_t n_threads, int64_t compute) {
  auto xd = x.dimensions(), wd = weights.dimensions(), idd = ids.dimensions();
  auto gd_all = gate.dimensions(), ud_all = up.dimensions(), dd_all = down.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || idd.size() != 2 || gd_all.size() != 4 || ud_all.size() != 4 ||
      dd_all.size() != 4)
    return ffi::Error::InvalidArgument("moe_experts: expected x [N, d], weights/ids [N, k], experts [L, E, rows, bytes]");
  int64_t g_off = 0, u_off = 0, d_off = 0;
  for (auto [dims, off] : {std::pair{gd_all, &g_off}, std::pair{ud_all, &u_off}, std::pair{dd_all, &d_off}})
    if (auto err = ikj::layer_offset("moe_experts", dims, 3, layer, 1, off); err.failure()) return err;
  auto gd = gd_all.last(3), ud = ud_all.last(3), dd = dd_all.last(3);
  const int64_t N = xd[0], d = xd[1], k = idd[1], E = gd[0], F = gd[1];
  if (wd[0] != N || wd[1] != k || idd[0] != N)
    return ffi::Error::InvalidArgument("moe_experts: weights and ids must both be [N, k] with N = x rows");
  if (ud[0] != E || ud[1] != F || dd[0] != E || dd[1] != d)
    return ffi::Error::InvalidArgument("moe_experts: gate/up must be [E, F, .] and down [E, d, .]");
  for (int64_t t : {gate_type, up_type, down_type})
    if (!IKJ_DISPATCH(quant_matmul_supported)(static_cast<int>(t)))
      return ffi::Error::InvalidArgument("moe_experts: unsupported type id " + std::to_string(t));
  if (compute != QM_F32 && compute != QM_BF16)
    return ffi::Error::InvalidArgument("moe_experts: compute must be 0 (f32) or 1 (bf16), not " + std::to_string(compute));
  const int32_t* id = ids.typed_data();
  for (int64_t i = 0; i < N * k; ++i)
    if (id[i] < 0 || id[i] >= E)
      return ffi::Error::InvalidArgument("moe_experts: expert id " + std::to_string(id[i]) + " outside [0, " +
                                         std::to_string(E) + ")");
  MoeExpertsArgs a{x.typed_data(), weights.typed_data(), id, N, k, d, F, E,
                   gate.typed_data() + g_off, gd[2], static_cast<int>(gate_type),
                   up.typed_data() + u_off, ud[2], static_cast<int>(up_type),
                   down.typed_data() + d_off, dd[2], static_cast<int>(down_type),
                   out->typed_data(), static_cast<int>(n_threads), static_cast<int>(compute)};
  IKJ_DISPATCH(moe_experts)(a);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeExpertsFfi, MoeExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("gate_type")
                                  .Attr<int64_t>("up_type")
                                  .Attr<int64_t>("down_type")
                                  .Attr<int64_t>("n_threads")
                                  .Attr<int64_t>("compute"));

static ikj::FfiRegistration reg("ikjax_cpu_moe_experts", reinterpret_cast<void*>(MoeExpertsFfi));
