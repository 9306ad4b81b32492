// K-quant and ik-type row dequantizers (Q2_K..Q6_K, IQ4_XS, IQ4_K, ...): see cpu_dequant.h.
// Placeholder until the K-quants implementation lands: handles no type.
#include "quant_matmul/cpu_dequant.h"

namespace IKJ_NS {

bool dequant_row_kquants(int /*type*/, const uint8_t* /*row*/, int64_t /*K*/, float* /*out*/) {
  return false;
}

}  // namespace IKJ_NS
