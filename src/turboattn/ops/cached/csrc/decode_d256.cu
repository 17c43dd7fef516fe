// decode<256, k_bits, v_bits, false> for each pair of TURBOATTN_BIT_PAIRS (caches without exact rows): one
// translation unit per head dim and variant, built in parallel.
#include "decode.cuh"

int launch_decode_d256(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                      void* stream) {
  return turboattn::launch_decode_for<256, false>(params, k_bits, v_bits, batch_kv_heads,
                                                 static_cast<cudaStream_t>(stream));
}

int ctas_per_sm_d256(int k_bits, int v_bits, bool exact) {
  return turboattn::ctas_per_sm_for<256>(k_bits, v_bits, exact);
}

int launch_merge_d256(const turboattn::DecodeParams& params, int batch_kv_heads, void* stream) {
  return turboattn::launch_merge<256>(params, batch_kv_heads, static_cast<cudaStream_t>(stream));
}
