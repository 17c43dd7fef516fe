// Parameters of the split-K decode kernel (decode.cuh); plain data, shared with the binding.
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
  const float* k_centroids;  // [2^k_bits] float32, the K codebook
  const float* v_centroids;  // [2^v_bits]
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

// Launch decode<D, k_bits, v_bits> (D = 64, 128, 256 by the function's name; bits 2, 4 or 8 each) on `stream`
// (a cudaStream_t): the CUDA error code (0: none), or -1 for a bit width the kernel does not have.  One per head
// dim, each in its own translation unit (decode_d*.cu) so that nvcc builds them in parallel.
int launch_decode_d64(const turboattn::DecodeParams& params, int k_bits, int v_bits, int num_splits,
                      int batch_kv_heads, void* stream);
int launch_decode_d128(const turboattn::DecodeParams& params, int k_bits, int v_bits, int num_splits,
                       int batch_kv_heads, void* stream);
int launch_decode_d256(const turboattn::DecodeParams& params, int k_bits, int v_bits, int num_splits,
                       int batch_kv_heads, void* stream);
// CTAs per SM the kernel of that shape is built for (its launch bound), or -1.
int ctas_per_sm_d64(int k_bits, int v_bits);
int ctas_per_sm_d128(int k_bits, int v_bits);
int ctas_per_sm_d256(int k_bits, int v_bits);
