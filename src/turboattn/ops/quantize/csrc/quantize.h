// Parameters of the CUDA quantize-append kernel (quantize.cu); plain data, shared with the binding.
#pragma once
#include <stdint.h>

namespace turboattn {

struct QuantizeParams {
  // Fresh vectors k, v [B, Hkv, T, D], unit stride along D, rows 16-byte aligned (ops/quantize/cuda.py makes sure).
  const void* k;
  const void* v;
  long long k_stride_b, k_stride_h, k_stride_t, v_stride_b, v_stride_h, v_stride_t;
  int in_dtype;  // 0 float16, 1 bfloat16, 2 float32 (k and v alike)
  // The cache: codes [B, Hkv, N, D * bits / 8] uint8, scales [B, Hkv, N, NB] float32 or bfloat16.
  uint8_t* k_codes;
  void* k_scales;
  uint8_t* v_codes;
  void* v_scales;
  int scale_bf16;
  // Cell search per side (quantize/cuda.py cell_grid): centroids [2^bits], boundaries [2^bits] (the last +inf), and
  // a uniform grid over u in [lo, -lo) of grid_size cells (at most MAX_GRID) of 1 / scale, each narrower than the
  // closest two boundaries: grid[g] counts the boundaries below cell g's left edge.
  const float* k_centroids;
  const float* k_bounds;
  const uint8_t* k_grid;
  const float* v_centroids;
  const float* v_bounds;
  const uint8_t* v_grid;
  float k_grid_lo, k_grid_scale, v_grid_lo, v_grid_scale;
  int k_grid_size, v_grid_size;
  const float* signs;      // [D]
  const float* key_shift;  // [B, Hkv, D] float32 or nullptr: keys are coded as (k - shift) * gain
  const float* key_gain;
  // [B]: token 0 of sequence b is position seen[b], in slot seen[b] (modulo the capacity for a ring).  Read by thread 0
  // of every CTA of sequence b as it starts, which then arrives on the counter (arrivals + b * arrival_stride:
  // sequence b's counter, zeroed and left zero); the last to arrive advances it by the real tokens as it ends
  // (nullptr: the caller advances it).
  int* seen;
  int* arrivals;
  int arrival_stride;
  const int* new_lengths;  // [B] real tokens per sequence, or nullptr (all T)
  int* nonfinite;          // [B] vectors stored with a NaN or infinity, or nullptr
  // Exact rows (format/layout.py), written in the model's domain (before the key transform) in exact_dtype
  // (0 float16, 1 bfloat16, 2 float32), unit stride along D, whether or not the codes have room: the recent window
  // [B, Hkv, R + 1, D] (position p in row p % R; each sequence's last min(n, R) real tokens) and the first rows
  // [B, Hkv, S, D] (position starts[b] + j in row j).  nullptr / 0 without them.
  void* recent[2];  // K, V
  long long recent_stride[2][3];  // per side: b, h, t
  int exact_recent;
  void* first[2];
  long long first_stride[2][3];
  int exact_first;
  const int* starts;  // [B]
  int exact_dtype;
  int k_bits, v_bits, rule;  // rule: 0 rms, 1 corrected, 2 lsq (format/codec.py SCALE_RULES)
  int tokens, capacity, num_kv_heads, ring;
  // Keys in two channel groups (format/codec.py key_groups; key_group_a 0: one width).  The stored key is the
  // transformed key's channels in key_order [B, Hkv, D] (int16; nullptr: the model's order); group a is its first
  // key_group_a channels at k_bits (the k_* tables), group b the rest at k_bits_b (the k2_* tables), each rotated
  // with its own Hartley factor (hartley_a / hartley_b, [m * m] float32, format/rotation.py) and the first signs.
  int key_group_a, k_bits_b;
  const int16_t* key_order;
  const float* k2_centroids;
  const float* k2_bounds;
  const uint8_t* k2_grid;
  float k2_grid_lo, k2_grid_scale;
  int k2_grid_size;
  const float* hartley_a;
  const float* hartley_b;
};

constexpr int MAX_GRID = 1024;  // cells of the largest grid (8-bit codes)

}  // namespace turboattn

// Launch quantize-append for head_dim D (64, 128, 256 or 512; with key groups, those of TURBOATTN_KEY_GROUPS in
// decode.h) on `stream` (a cudaStream_t) over the batch * Hkv rows of a GPU with `sms` multiprocessors: the CUDA
// error code (0: none), -1 for a head dim or key grouping the kernel is not built for.
int launch_quantize_append(const turboattn::QuantizeParams& params, int head_dim, int batch, int sms, void* stream);
