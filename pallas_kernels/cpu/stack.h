// Stacked weight operands: a scanned layer group (ikjax/model/groups.py) passes each weight as
// one stack [L, ...] and the layer it runs as an s32 operand (the scan's index, known only at run
// time), so the kernels read that layer in place instead of XLA copying a slice of every weight
// on every step.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ikj {

// Layer `layer` of a stack whose dimensions are `dims` = [1, ..., 1, L, <kept dims>]: leading
// ones (jax.vmap's expand_dims), then the layer count L, then `kept` more dimensions. On success
// the byte offset of that layer (elements of `elem_bytes`); else an error naming `op`.
inline xla::ffi::Error layer_offset(const char* op, xla::ffi::Span<const int64_t> dims, size_t kept,
                                    xla::ffi::Buffer<xla::ffi::S32>& layer, size_t elem_bytes, int64_t* offset) {
  if (dims.size() < kept + 1 || layer.element_count() != 1)
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": weights must be a stack [L, ...] with one layer index");
  for (size_t i = 0; i + kept + 1 < dims.size(); ++i)
    if (dims[i] != 1)
      return xla::ffi::Error::InvalidArgument(std::string(op) + ": batched (vmapped) weights are not supported");
  const int64_t L = dims[dims.size() - kept - 1];
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L)
    return xla::ffi::Error::InvalidArgument(std::string(op) + ": layer " + std::to_string(li) + " outside the stack of " +
                                            std::to_string(L));
  int64_t per = 1;
  for (size_t i = dims.size() - kept; i < dims.size(); ++i) per *= dims[i];
  *offset = li * per * static_cast<int64_t>(elem_bytes);
  return xla::ffi::Error::Success();
}

}  // namespace ikj
