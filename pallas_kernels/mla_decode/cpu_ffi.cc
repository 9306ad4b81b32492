// XLA FFI binding of the CPU absorbed-MLA attention: ikjax_cpu_mla_attention.
//   operands:   q f32 [B, T, H, D];
//               cache: a stack of L layers' caches, f32 / f16 / bf16 [L, B, S, W], or q8_0 data
//               int8 [L, B, S, nb, 32];
//               scales: q8_0 only, f16 or f32 [L, B, S, nb] (any array, ignored, for a float cache);
//               q_pos s32 [B, T] (the query at position p sees keys 0..p);
//               layer s32 [] (which of the L caches: a layer group's scan index, read at run time,
//               so a scanned step reads its layer in place, no copy of it in the graph)
//   attributes: scale (f32), v_dim, n_threads (<= 0: all cores)
//   result:     out f32 [B, T, H, v_dim]
// The cache is taken as it is stored (no bitcast or repack in the graph, which would copy it).
//
// ikjax_cpu_attention: the same kernel as standard attention with keys and values of their own
//   operands:   q f32 or bf16 [B, T, H, D]; k f32 / f16 / bf16 [B, S, Hk, Wk] (Wk >= D; Hk = 1 or H);
//               v, k's type, [B, S, Hk, Dv]; q_pos s32 [B, T]
//   attributes: scale (f32), n_threads
//   result:     out f32 [B, T, H, Dv]
//   With q, k and v all bf16, p is rounded to bf16 before p·v and the products run in bf16.
//
// ikjax_cpu_attention_kv: the -mla 2/3 prompt's attention straight from the kv_b product, with no
// concatenated K or sliced V in the graph
//   operands:   q f32 or bf16 [B, T, H, nope + R]; kv f32 / f16 / bf16 [B, S, H, nope + Dv] (each
//               head's k_nope | v); k_rope f32 / f16 / bf16 [B, S, R'] (R' >= R, shared by the heads);
//               q_pos s32 [B, T]
//   attributes: scale (f32), nope, n_threads
//   result:     out f32 [B, T, H, Dv]
//   K row (b, s, h) = kv[b, s, h, :nope] ++ k_rope[b, s, :R], V row = kv[b, s, h, nope:]; bf16 q
//   takes K, V and p at bf16 (the XLA form's converts), products in bf16.
#include <optional>
#include <string>

#include "cpu/runtime.h"
#include "mla_decode/cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error MlaAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache, ffi::AnyBuffer scales,
                                   ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> layer,
                                   ffi::ResultBuffer<ffi::F32> out, float scale, int64_t v_dim, int64_t n_threads) {
  auto qd = q.dimensions();
  auto cd_all = cache.dimensions();
  auto sd_all = scales.dimensions();
  auto pd = q_pos.dimensions();
  if (cd_all.size() < 1 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("mla_attention: cache must be a stack [L, ...] and layer one s32");
  const int64_t L = cd_all[0];
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("mla_attention: layer index outside the cache stack");
  auto cd = cd_all.last(cd_all.size() - 1);
  auto sd = sd_all.size() > 0 ? sd_all.last(sd_all.size() - 1) : sd_all;
  if (qd.size() != 4) return ffi::Error::InvalidArgument("mla_attention: q must be [B, T, H, D]");
  ikj::MlaArgs a{};
  a.B = qd[0], a.T = qd[1], a.H = qd[2], a.D = qd[3];
  if (pd.size() != 2 || pd[0] != a.B || pd[1] != a.T)
    return ffi::Error::InvalidArgument("mla_attention: q_pos must be [B, T] like q");
  const auto et = cache.element_type();
  if (et == ffi::DataType::S8) {
    if (sd_all.size() != 4 || sd_all[0] != L || cd.size() != 4 || cd[3] != 32 || sd.size() != 3 || sd[0] != cd[0] || sd[1] != cd[1] || sd[2] != cd[2])
      return ffi::Error::InvalidArgument("mla_attention: q8_0 cache must be int8 [B, S, nb, 32] + scales [B, S, nb]");
    if (scales.element_type() == ffi::DataType::F16)
      a.kind = ikj::MLA_Q8_0_F16D;
    else if (scales.element_type() == ffi::DataType::F32)
      a.kind = ikj::MLA_Q8_0_F32D;
    else
      return ffi::Error::InvalidArgument("mla_attention: q8_0 scales must be f16 or f32");
    a.W = cd[2] * 32;
  } else {
    if (et == ffi::DataType::F32)
      a.kind = ikj::MLA_F32;
    else if (et == ffi::DataType::F16)
      a.kind = ikj::MLA_F16;
    else if (et == ffi::DataType::BF16)
      a.kind = ikj::MLA_BF16;
    else
      return ffi::Error::InvalidArgument("mla_attention: cache must be f32, f16, bf16 or q8_0 (int8 + scales)");
    if (cd.size() != 3) return ffi::Error::InvalidArgument("mla_attention: float cache must be [B, S, W]");
    a.W = cd[2];
  }
  if (cd[0] != a.B) return ffi::Error::InvalidArgument("mla_attention: cache batch differs from q's");
  a.S = cd[1];
  if (a.D > a.W) return ffi::Error::InvalidArgument("mla_attention: q width D exceeds the cache row width");
  if (v_dim < 1 || v_dim > a.D) return ffi::Error::InvalidArgument("mla_attention: v_dim must be in [1, D]");
  auto od = out->dimensions();
  if (od.size() != 4 || od[0] != a.B || od[1] != a.T || od[2] != a.H || od[3] != v_dim)
    return ffi::Error::InvalidArgument("mla_attention: out must be [B, T, H, v_dim]");
  a.q = q.typed_data();
  // layer li's cache: the stack's li-th [B, S, ...] block (row-major, so contiguous)
  int64_t per_layer = 1;
  for (auto d : cd) per_layer *= d;
  a.cache = static_cast<const char*>(cache.untyped_data()) + li * per_layer * ffi::ByteWidth(et);
  a.scales = scales.untyped_data();
  if (et == ffi::DataType::S8) {
    int64_t per_scales = 1;
    for (auto d : sd) per_scales *= d;
    a.scales = static_cast<const char*>(scales.untyped_data()) + li * per_scales * ffi::ByteWidth(scales.element_type());
  }
  a.q_pos = q_pos.typed_data();
  a.out = out->typed_data();
  a.v_dim = v_dim;
  a.scale = scale;
  a.n_threads = static_cast<int>(n_threads);
  IKJ_DISPATCH(mla_attention)(a);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlaAttentionFfi, MlaAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("v_dim")
                                  .Attr<int64_t>("n_threads"));

static ikj::FfiRegistration reg("ikjax_cpu_mla_attention", reinterpret_cast<void*>(MlaAttentionFfi));

static bool float_kind(ffi::DataType t, int* kind) {
  if (t == ffi::DataType::F32) return *kind = ikj::MLA_F32, true;
  if (t == ffi::DataType::F16) return *kind = ikj::MLA_F16, true;
  if (t == ffi::DataType::BF16) return *kind = ikj::MLA_BF16, true;
  return false;
}

// B, T, H, D of q [B, T, H, D] into a, q_pos checked [B, T]; an error, or nothing.
static std::optional<ffi::Error> query_shape(ffi::AnyBuffer& q, ffi::Buffer<ffi::S32>& q_pos, const std::string& op,
                                             ikj::MlaArgs& a) {
  auto qd = q.dimensions(), pd = q_pos.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument(op + ": q must be [B, T, H, D]");
  a.B = qd[0], a.T = qd[1], a.H = qd[2], a.D = qd[3];
  if (pd.size() != 2 || pd[0] != a.B || pd[1] != a.T)
    return ffi::Error::InvalidArgument(op + ": q_pos must be [B, T] like q");
  return std::nullopt;
}

// The rest of a call with K / V set in a: out's shape, q as f32 or bf16, then the kernel.
static ffi::Error run_attention(ikj::MlaArgs& a, ffi::AnyBuffer& q, ffi::Buffer<ffi::S32>& q_pos,
                                ffi::ResultBuffer<ffi::F32>& out, float scale, int64_t n_threads, const std::string& op) {
  auto od = out->dimensions();
  if (od.size() != 4 || od[0] != a.B || od[1] != a.T || od[2] != a.H || od[3] != a.v_dim)
    return ffi::Error::InvalidArgument(op + ": out must be [B, T, H, Dv]");
  if (q.element_type() == ffi::DataType::BF16)
    a.q16 = static_cast<const uint16_t*>(q.untyped_data());
  else if (q.element_type() == ffi::DataType::F32)
    a.q = static_cast<const float*>(q.untyped_data());
  else
    return ffi::Error::InvalidArgument(op + ": q must be f32 or bf16");
  a.q_pos = q_pos.typed_data();
  a.out = out->typed_data();
  a.scale = scale;
  a.n_threads = static_cast<int>(n_threads);
  IKJ_DISPATCH(mla_attention)(a);
  return ffi::Error::Success();
}

static ffi::Error AttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> q_pos, ffi::ResultBuffer<ffi::F32> out, float scale,
                                int64_t n_threads) {
  auto kd = k.dimensions(), vd = v.dimensions();
  ikj::MlaArgs a{};
  if (auto err = query_shape(q, q_pos, "attention", a); err) return *err;
  if (kd.size() != 4 || vd.size() != 4 || kd[0] != a.B || vd[0] != a.B || vd[1] != kd[1] || vd[2] != kd[2])
    return ffi::Error::InvalidArgument("attention: k and v must be [B, S, Hk, .] with q's batch");
  if (kd[2] != 1 && kd[2] != a.H) return ffi::Error::InvalidArgument("attention: k/v heads must be 1 or q's H");
  if (!float_kind(k.element_type(), &a.kind) || v.element_type() != k.element_type())
    return ffi::Error::InvalidArgument("attention: k and v must be f32, f16 or bf16, of one type");
  a.S = kd[1], a.Hk = kd[2], a.W = kd[3], a.Wv = vd[3], a.v_dim = vd[3];
  if (a.D < 1 || a.D > a.W) return ffi::Error::InvalidArgument("attention: q width D must be in [1, k's width]");
  if (a.v_dim < 1) return ffi::Error::InvalidArgument("attention: v must have values");
  a.cache = k.untyped_data();
  a.v = v.untyped_data();
  return run_attention(a, q, q_pos, out, scale, n_threads, "attention");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFfi, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("n_threads"));

static ikj::FfiRegistration reg_attention("ikjax_cpu_attention", reinterpret_cast<void*>(AttentionFfi));

static int elem_size(int kind) { return kind == ikj::MLA_F32 ? 4 : 2; }

static ffi::Error AttentionKvImpl(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer k_rope,
                                  ffi::Buffer<ffi::S32> q_pos, ffi::ResultBuffer<ffi::F32> out, float scale,
                                  int64_t nope, int64_t n_threads) {
  auto kd = kv.dimensions(), rd = k_rope.dimensions();
  ikj::MlaArgs a{};
  if (auto err = query_shape(q, q_pos, "attention_kv", a); err) return *err;
  if (kd.size() != 4 || kd[0] != a.B || kd[2] != a.H || rd.size() != 3 || rd[0] != a.B || rd[1] != kd[1])
    return ffi::Error::InvalidArgument("attention_kv: kv must be [B, S, H, W] and k_rope [B, S, R] with q's B, H");
  if (!float_kind(kv.element_type(), &a.kind) || !float_kind(k_rope.element_type(), &a.kind2))
    return ffi::Error::InvalidArgument("attention_kv: kv and k_rope must be f32, f16 or bf16");
  if (a.D < 1 || nope < 0 || nope >= kd[3] || nope > a.D || a.D - nope > rd[2])
    return ffi::Error::InvalidArgument("attention_kv: need D >= 1, 0 <= nope < kv's width, q's D - nope <= k_rope's width");
  a.S = kd[1], a.Hk = a.H, a.W = kd[3], a.Wv = kd[3], a.v_dim = kd[3] - nope;
  a.D1 = nope, a.W2 = rd[2];
  a.cache = kv.untyped_data();
  a.v = static_cast<const char*>(kv.untyped_data()) + nope * elem_size(a.kind);
  a.k2 = k_rope.untyped_data();
  return run_attention(a, q, q_pos, out, scale, n_threads, "attention_kv");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionKvFfi, AttentionKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("nope")
                                  .Attr<int64_t>("n_threads"));

static ikj::FfiRegistration reg_attention_kv("ikjax_cpu_attention_kv", reinterpret_cast<void*>(AttentionKvFfi));
