// decode<512, k_bits, v_bits, true> for each pair of TURBOATTN_BIT_PAIRS: caches with exact rows (an
// exact recent window, exact first tokens), whose kernels add the exact part's CTA.
#include "decode.cuh"

int launch_decode_d512_exact(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                            void* stream) {
  return turboattn::launch_decode_for<512, true>(params, k_bits, v_bits, batch_kv_heads,
                                                static_cast<cudaStream_t>(stream));
}
