// decode<128, k_bits, v_bits> for every bit pair: one translation unit per head dim, built in parallel.
#include "decode.cuh"

int launch_decode_d128(const turboattn::DecodeParams& params, int k_bits, int v_bits, int num_splits,
                      int batch_kv_heads, void* stream) {
  return turboattn::launch_decode_for<128>(params, k_bits, v_bits, num_splits, batch_kv_heads,
                                          static_cast<cudaStream_t>(stream));
}

int ctas_per_sm_d128(int k_bits, int v_bits) { return turboattn::ctas_per_sm_for<128>(k_bits, v_bits); }
