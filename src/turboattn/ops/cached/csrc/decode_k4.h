// Parameters of the 4-bit split-K decode kernel (decode_k4.cu); plain data, shared with the binding.
#pragma once
#include <stdint.h>

namespace turboattn {

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
  // Fused merge (counters non-null): the last CTA of each (sequence, KV head) merges the num_parts cache parts
  // with the fresh tokens (if any), adds the sinks, rotates back and writes out.
  int* counters;          // [B * Hkv] zeros; each merge leaves its counter at zero again
  void* out;              // [B, Hq, Tq, D] contiguous, q's dtype
  const float* sinks;     // [Hq] or nullptr
  // Fresh tokens (has_fresh): k, v [B, Hkv, Tq, D] in q's dtype, sharing strides, attended in full precision by the
  // merging CTA in the model's domain (no rotation: scores are q . (k - key_shift), as the cached part's are).
  const void* k_new;
  const void* v_new;
  long long kv_stride_b, kv_stride_h, kv_stride_t;
  const float* key_shift;  // [B, Hkv, D] or nullptr
  float q_scale, softcap;  // softcap 0: none
  int tq, capacity, window, num_kv_heads, group, num_splits, num_parts, ring, has_fresh, chunk_align;
};

}  // namespace turboattn

// Launches decode_k4<head_dim> (64, 128 or 256) on `stream` (a cudaStream_t); returns the CUDA error code (0: none).
// min_blocks: CTAs per SM the register allocation must allow (1-5; 4 caps it at 128 registers).
int launch_decode_k4(const turboattn::DecodeParams& params, int head_dim, int num_splits, int batch_kv_heads,
                     int min_blocks, void* stream);
