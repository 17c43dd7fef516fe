// Parameters of the split-K decode kernel (decode.cuh); plain data, shared with the binding.
#pragma once
#include <stdint.h>

namespace turboattn {

// Cache parts per (sequence, KV head) at most: the merge's scratch (ops/cached/config.py: CUDA_MAX_PARTS).
constexpr int MAX_PARTS = 1024;
// Arrival counters per (sequence, KV head): the fused merge's (ops/cached/config.py: CUDA_COUNTERS_PER_HEAD).
constexpr int COUNTERS_PER_HEAD = 1;
// The merge launch's slices of an output row (decode.cuh: merge_rows): at least MERGE_SLICE_DIMS dims each
// (ops/cached/config.py: CUDA_MERGE_SLICE_DIMS), and several only where the decode kernel writes its parts in the
// model's domain, at D = 512 (decode.cuh: rotates_parts_back).
constexpr int MERGE_SLICE_DIMS = 64;
constexpr int most_merge_slices(int head_dim) { return head_dim >= 512 ? head_dim / MERGE_SLICE_DIMS : 1; }

// A divisor fixed at launch (1 <= d < 2^31), for the quotient of a non-negative int below 2^31 in one high
// multiply and a shift: mul = ceil(2^(31 + L) / d) with L = ceil(log2 d), so mul < 2^32 and the error
// mul d - 2^(31 + L) < d <= 2^L keeps n mul / 2^(31 + L) below the next integer for every n < 2^31; d = 1 takes the
// numerator itself.  The set-up's quotients (the CTA's split and head, the chunk, query rows by the GQA group, the
// ring's wrap) and the merge's were integer divisions of about 20 dependent instructions each, the set-up's ahead of
// the first tile's loads.
struct Divisor {
  int d;
  uint32_t mul, shift;
};
inline Divisor make_divisor(int d) {
  Divisor v{d, 0u, 0u};
  if (d <= 1) return v;
  int bits = 0;
  while ((1ll << bits) < d) ++bits;
  v.mul = static_cast<uint32_t>(((1ull << (31 + bits)) + static_cast<unsigned long long>(d) - 1) / d);
  v.shift = static_cast<uint32_t>(bits - 1);
  return v;
}
#ifdef __CUDACC__
__device__ __forceinline__ int quotient(const Divisor& v, int n) {
  return v.d == 1 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), v.mul) >> v.shift);
}
#endif

struct DecodeParams {
  const void* q;
  long long q_stride_b, q_stride_h, q_stride_t;
  int q_dtype;  // 0 float16, 1 bfloat16, 2 float32
  const uint8_t* k_codes;
  const void* k_scales;   // float32, or bfloat16 with scale_bf16
  const uint8_t* v_codes;
  const void* v_scales;
  int scale_bf16;
  const int* seen;
  const int* starts;
  const float* gain_inv;  // [B, Hkv, D] or nullptr
  // Keys in channel groups (launch_decode_groups): the kernel takes q / gain into the stored channel order
  // (key_order [B, Hkv, D] int16, stored channel j being the model's key_order[b, h, j]; nullptr: the model's order)
  // and through each group's rotation (the signs' first entries and the Hartley factors hartley_a / hartley_b,
  // [m * m] float32; key_groups.cuh).  The exact rows and the fresh tokens are scored in the model's domain.
  const int16_t* key_order;
  const float* hartley_a;
  const float* hartley_b;
  const float* signs;     // [D]
  float* o_part;          // [B * Hkv * num_parts * rows, D]
  float* lse_part;        // [B * Hkv * num_parts * rows]
  // Fused merge (counters non-null): the last CTA of each (sequence, KV head) merges the num_parts cache parts
  // with the fresh tokens (if any), adds the sinks, rotates back and writes out.  Without counters the decode
  // launch only writes the parts (at D = 512 rotated back into the model's domain), and merge_rows (a launch of its
  // own, merge_slices CTAs per output row, each a slice of the dims) does the rest.
  int* counters;          // [B * Hkv * COUNTERS_PER_HEAD] zeros; each merge leaves its counter at zero again
  void* out;              // [B, Hq, Tq, D] contiguous, q's dtype
  const float* sinks;     // [Hq] or nullptr
  // Fresh tokens (has_fresh): k, v [B, Hkv, Tq, D] in q's dtype, sharing strides, attended in full precision by the
  // merging CTA in the model's domain (no rotation: scores are q . (k - key_shift), as the cached part's are).
  const void* k_new;
  const void* v_new;
  long long kv_stride_b, kv_stride_h, kv_stride_t;
  const float* key_shift;  // [B, Hkv, D] or nullptr
  // Exact rows (exact_recent R > 0 and / or exact_first S > 0; format/layout.py): full-precision K and V in the
  // model's domain, exact_dtype (0 float16, 1 bfloat16, 2 float32).  Recent: [B, Hkv, R + 1, D], position p in
  // row p mod R for p in [seen - R, seen); first: [B, Hkv, S, D], position starts + j in row j.  The code splits
  // skip those positions, and num_parts - num_splits more CTAs per (sequence, KV head) attend the rows as the
  // parts after the splits (ops/cached/config.cuda_exact_parts).
  const void* recent_k;
  const void* recent_v;
  long long recent_stride_b, recent_stride_h, recent_stride_t;
  const void* first_k;
  const void* first_v;
  long long first_stride_b, first_stride_h, first_stride_t;
  int exact_recent, exact_first, exact_dtype;
  float q_scale, softcap;  // softcap 0: none
  // chunk_align: split boundaries, in keys, a power of two (the kernel rounds chunks up with a mask).
  int tq, capacity, window, num_kv_heads, group, num_splits, num_parts, ring, has_fresh, chunk_align;
  int batch_kv_heads;  // B x Hkv: the grid is num_parts x batch_kv_heads CTAs
  // num_splits, num_kv_heads, group, the query rows (tq x group) and capacity as divisors (the binding makes them).
  Divisor splits_div, kv_heads_div, group_div, rows_div, capacity_div;
  int merge_slices;  // without counters: CTAs per output row of merge_rows (1; at D = 512 1, 2, 4 or 8)
  int sms;           // the device's SMs (the launcher sizes small grids by them; the kernel does not read it)
};

}  // namespace turboattn

// The (K bits, V bits) pairs the kernel is built for: every preset of the format (2, 3, 4, 5, 6 or 8 bits; see
// format/codec.py); ops/cached/config.py lists the same pairs as CUDA_BIT_PAIRS (a GPU test compares them).  Other
// pairs go to the Triton kernel.
#define TURBOATTN_BIT_PAIRS(X) \
  X(2, 2) X(2, 4) X(2, 8) X(3, 3) X(4, 2) X(4, 3) X(4, 4) X(4, 8) X(5, 3) X(5, 4) X(5, 5) X(6, 6) X(8, 2) X(8, 4) X(8, 8)

// Launch decode<D, k_bits, v_bits, exact> (D = 64, 128, 256, 512 by the function's name; the _exact functions for caches
// with exact rows) on `stream` (a cudaStream_t), params.num_parts x batch_kv_heads CTAs: the CUDA error code
// (0: none), or -1 for a bit pair the kernel is not built for.  Each in its own translation unit (decode_d*.cu) so
// that nvcc builds them in parallel.
int launch_decode_d64(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                      void* stream);
int launch_decode_d128(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                       void* stream);
int launch_decode_d256(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                       void* stream);
int launch_decode_d512(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                       void* stream);
int launch_decode_d64_exact(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                            void* stream);
int launch_decode_d128_exact(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                             void* stream);
int launch_decode_d256_exact(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                             void* stream);
int launch_decode_d512_exact(const turboattn::DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads,
                             void* stream);
// Keys in two channel groups (format/codec.py key_groups: group a's `group_a` channels at k_bits, the rest at
// k_bits_b; TURBOATTN_KEY_GROUPS lists the builds, as ops/cached/config.py's CUDA_KEY_GROUPS does): launch
// decode<head_dim, k_bits, v_bits, exact, group_a, k_bits_b>, or -1 where it is not built.
#define TURBOATTN_KEY_GROUPS(X) X(256, 112, 6, 4, 3) X(256, 96, 6, 4, 3)
int launch_decode_groups(const turboattn::DecodeParams& params, int head_dim, int group_a, int k_bits, int k_bits_b,
                         int v_bits, bool exact, int batch_kv_heads, void* stream);
int ctas_per_sm_groups(int head_dim, int group_a, int k_bits, int k_bits_b, int v_bits, bool exact);
// The merge in a launch of its own (decode.cuh: merge_rows), after a decode launch without counters:
// params.merge_slices CTAs per output row.  The CUDA error code (0: none).
int launch_merge_d64(const turboattn::DecodeParams& params, int batch_kv_heads, void* stream);
int launch_merge_d128(const turboattn::DecodeParams& params, int batch_kv_heads, void* stream);
int launch_merge_d256(const turboattn::DecodeParams& params, int batch_kv_heads, void* stream);
int launch_merge_d512(const turboattn::DecodeParams& params, int batch_kv_heads, void* stream);
// CTAs per SM the kernel of that shape (exact: the build for caches with exact rows) is built for (its launch
// bound), or -1.
int ctas_per_sm_d64(int k_bits, int v_bits, bool exact);
int ctas_per_sm_d128(int k_bits, int v_bits, bool exact);
int ctas_per_sm_d256(int k_bits, int v_bits, bool exact);
int ctas_per_sm_d512(int k_bits, int v_bits, bool exact);
