// Parameters of the 4-bit, head_dim 128 split-K decode kernel (decode_k4.cu); plain data, shared with the binding.
#pragma once
#include <stdint.h>

namespace turboattn {

constexpr int HEAD_DIM = 128;

struct DecodeParams {
  const void* q;
  long long q_stride_b, q_stride_h, q_stride_t;
  int q_dtype;  // 0 float16, 1 bfloat16, 2 float32
  const uint8_t* k_codes;
  const float* k_scales;
  const uint8_t* v_codes;
  const float* v_scales;
  const int* seen;
  const int* starts;
  const float* gain_inv;  // [B, Hkv, D] or nullptr
  const float* signs;     // [D]
  const float* centroids; // [16]
  float* o_part;          // [B * Hkv * num_parts * rows, D]
  float* lse_part;        // [B * Hkv * num_parts * rows]
  float q_scale, softcap;  // softcap 0: none
  int tq, capacity, window, num_kv_heads, group, num_splits, num_parts, ring, has_fresh, chunk_align;
};

}  // namespace turboattn

// Launches decode_k4_d128 on `stream` (a cudaStream_t); returns the CUDA error code (0: none).
// min_blocks: 2 or 3 CTAs per SM (register budget 200 or 168).
int launch_decode_k4_d128(const turboattn::DecodeParams& params, int num_splits, int batch_kv_heads, int min_blocks,
                          void* stream);
