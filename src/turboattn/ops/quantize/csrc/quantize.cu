// Fused quantize-append on CUDA GPUs, head_dim 64 / 128 / 256 / 512 and every bit width of the format: the twin
// of quantize/triton.py and of naive.py (the reference codec, format/codec.py), which define what is stored.
//
// A vector's D coordinates are spread over L = D / PL consecutive lanes, PL each (lane s of the group holds
// coordinates PL s .. PL s + PL - 1): PL = 16 or 32 for long chunks, so a warp codes 32 / L vectors at once; a
// decode step spreads a vector over a whole warp (QuantShape).  Every reduction over a vector is a few shuffles inside its
// group.  Per vector: load (wide loads; the next block's are in flight while this one is coded), key transform,
// non-finite check, the exact power-of-two prescale of codec.quantize, signs, the Hadamard transform (butterflies
// inside a lane, log2 L stages across lanes by shuffles; unnormalized: 1 / sqrt(D) is folded into the scale), the
// norm block's RMS, the Lloyd–Max cell of every coordinate (one read of a uniform grid of boundary counts plus one
// boundary compare, exact because no grid cell holds two boundaries: quantize/triton.py's method, with grids of 64
// to 1024 one-byte cells by the bit width, so that lanes seldom meet in a shared-memory bank; a grid of 16-byte cells
// holding the boundary and both centroids, one read instead of three, ran 10% slower at D = 128), the scale rule, and
// the planar packing: each lane puts its cell indices in shared memory as bytes, and the group then builds the
// packed row's 32-bit words (a row is D * bits / 8 bytes): a word of a w-bit plane of P bytes ORs, for k < 8 / w,
// the w-bit slices of four consecutive indices at coordinate j + k P (byte j of a plane holds coordinate j + k P at
// bit k w).  Tokens are read once and codes written once, so the kernel streams; CTAs loop over token blocks so
// that the tables they stage in shared memory serve many tokens.
//
// Long appends (at least 8192 tokens x KV heads x sequences) of float16 / bfloat16 vectors at D <= 256 take code_tiles
// instead (the rotation's first stage on tensor cores; its section below), in a kernel of its own.
//
// One launch does the whole append: the cache's exact rows (recent window, first tokens) take the raw vectors of
// the tokens they keep, and the last CTA of each sequence to arrive on its arrival counter (each arrives once it has
// read the lengths) advances them as it ends, so a decode step's append is one kernel, also inside a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "decode.h"  // TURBOATTN_KEY_GROUPS: the key groupings built
#include "key_groups.cuh"
#include "quantize.h"

namespace turboattn {
namespace {

constexpr int MAX_WARPS = 4;
constexpr int SHORT_CHUNK = 16;   // tokens per sequence up to which a launch takes the decode-step shape

// PL coordinates per lane.  Long chunks: 32 at D <= 128 (128 registers, 4 CTAs per SM, but wide loads and few
// shuffle stages: faster there than 16 at 72 registers) and 16 above (BENCHMARKS.md has the runs).  A decode step
// takes the fewest that fit a vector in a warp (max(D / 32, 4)), so each lane's dependency chain is short.
template <int D, int PL>
struct QuantShape {
  static_assert(D == 64 || D == 128 || D == 256 || D == 512, "head_dim 64, 128, 256 or 512");
  static_assert(PL >= 4 && PL <= 32 && D / PL <= 32, "4 to 32 coordinates per lane, at most 32 lanes");
  static constexpr int L = D / PL;                // lanes per vector
  static constexpr int VECTORS = 32 / L;          // vectors per warp
  static constexpr int NB = D > 256 ? 2 : 1;      // norm blocks (format/codec.py)
  static constexpr int BLOCK = D / NB;
  static constexpr int BLOCK_LANES = BLOCK / PL;
};

template <int D>
__host__ __device__ constexpr int long_chunk_per_lane() { return D <= 128 ? 32 : 16; }

template <int D>
__host__ __device__ constexpr int short_chunk_per_lane() { return D / 32 > 4 ? D / 32 : 4; }

template <int BITS>
struct PlaneWidths {  // format/codec.py plane_widths: the low bits in the widest plane
  static constexpr int LOW = BITS == 3 ? 2 : (BITS == 5 || BITS == 6 ? 4 : BITS);
  static constexpr int HIGH = BITS - LOW;
};

__device__ __forceinline__ float pow2(int n) { return __int_as_float((n + 127) << 23); }

// x * 2^n in two normal factors, in codec.times_pow2's order (exact unless the result over- or underflows).
__device__ __forceinline__ float times_pow2(float x, int n) {
  n = min(max(n, -252), 252);
  const int half = n >> 1;  // floor(n / 2)
  return x * pow2(half) * pow2(n - half);
}

// A lane's PL consecutive values of a row, as loaded (8 or 16-byte loads).
template <int DTYPE, int PL>  // DTYPE: 0 float16, 1 bfloat16, 2 float32
struct RawRow {
  static constexpr int BYTES = PL * (DTYPE == 2 ? 4 : 2);
  uint32_t w[BYTES / 4];
};

template <int DTYPE, int PL>
__device__ __forceinline__ void fetch_row(const void* base, long long offset, RawRow<DTYPE, PL>& raw) {
  constexpr int BYTES = RawRow<DTYPE, PL>::BYTES;
  const char* src = static_cast<const char*>(base) + offset * (DTYPE == 2 ? 4 : 2);
  // Read once: stream past the caches.
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      const uint4 q = __ldcs(reinterpret_cast<const uint4*>(src) + i);
      raw.w[4 * i] = q.x, raw.w[4 * i + 1] = q.y, raw.w[4 * i + 2] = q.z, raw.w[4 * i + 3] = q.w;
    }
  } else {
    static_assert(BYTES == 8, "8 or a multiple of 16 bytes per lane");
    const uint2 q = __ldcs(reinterpret_cast<const uint2*>(src));
    raw.w[0] = q.x, raw.w[1] = q.y;
  }
}

template <int DTYPE, int PL>
__device__ __forceinline__ void convert_row(const RawRow<DTYPE, PL>& raw, float (&x)[PL]) {
#pragma unroll
  for (int j = 0; j < RawRow<DTYPE, PL>::BYTES / 4; ++j) {
    if constexpr (DTYPE == 2) {
      x[j] = __uint_as_float(raw.w[j]);
    } else if constexpr (DTYPE == 1) {  // bfloat16: the top half of a float32
      x[2 * j] = __uint_as_float(raw.w[j] << 16);
      x[2 * j + 1] = __uint_as_float(raw.w[j] & 0xffff0000u);
    } else {
      x[2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(raw.w[j] & 0xffffu)));
      x[2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(raw.w[j] >> 16)));
    }
  }
}

// (x - shift) * gain for four coordinates: the key transform, in the Triton kernel's order.
__device__ __forceinline__ void shift_and_scale(float* x, float4 s, float4 g) {
  x[0] = (x[0] - s.x) * g.x;
  x[1] = (x[1] - s.y) * g.y;
  x[2] = (x[2] - s.z) * g.z;
  x[3] = (x[3] - s.w) * g.w;
}

// The lane's largest magnitude, and a probe that is NaN exactly when one of its values is a NaN or an infinity
// (x * 0 is NaN only for them).
template <int PL>
__device__ __forceinline__ void magnitude_and_probe(const float (&x)[PL], float& amax, float& probe) {
  amax = 0.f, probe = 0.f;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    amax = fmaxf(amax, fabsf(x[i]));
    probe = fmaf(x[i], 0.f, probe);
  }
}

// Sum (or max, or OR) over the `lanes` consecutive lanes of a group (a power of two, aligned).
template <int LANES>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int m = 1; m < LANES; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// One word of a W-bit plane of P = D W / 8 bytes, at plane byte j (a multiple of 4), from a vector's cell indices
// (one byte each, in coordinate order): byte j + i holds bits [shift, shift + W) of index j + i + k P at bit k W.
template <int D, int W>
__device__ __forceinline__ uint32_t plane_word(const uint8_t* cells, int j, int shift) {
  constexpr int P = D * W / 8;
  constexpr uint32_t MASK = ((1u << W) - 1) * 0x01010101u;
  uint32_t word = 0;
#pragma unroll
  for (int k = 0; k < 8 / W; ++k) {
    const uint32_t four = *reinterpret_cast<const uint32_t*>(cells + j + k * P);
    word |= ((four >> shift) & MASK) << (k * W);
  }
  return word;
}

// Word `at` (a byte offset, a multiple of 4) of a vector's packed row of WIDTH coordinates at BITS: its planes one
// after the other (format/codec.py pack_codes), from the cell indices as bytes in coordinate order.
template <int WIDTH, int BITS>
__device__ __forceinline__ uint32_t row_word(const uint8_t* cells, int at) {
  using PW = PlaneWidths<BITS>;
  constexpr int P0 = WIDTH * PW::LOW / 8;
  if constexpr (PW::HIGH == 0) return plane_word<WIDTH, PW::LOW>(cells, at, 0);
  else return at < P0 ? plane_word<WIDTH, PW::LOW>(cells, at, 0) : plane_word<WIDTH, PW::HIGH>(cells, at - P0, PW::LOW);
}

// Store N words at dst with the widest accesses its alignment allows (dst is a multiple of 4 * N bytes).
template <int N>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) reinterpret_cast<uint4*>(dst)[i / 4] = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) reinterpret_cast<uint2*>(dst)[i / 2] = make_uint2(w[i], w[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) reinterpret_cast<uint32_t*>(dst)[i] = w[i];
  }
}

__device__ __forceinline__ void store_scale(void* scales, size_t at, float s, bool as_bf16) {
  if (!as_bf16) {
    static_cast<float*>(scales)[at] = s;
    return;
  }
  // Round to nearest even in integer arithmetic, as the Triton kernel and torch's .to(torch.bfloat16) do; a NaN
  // stays the quiet NaN torch stores.
  const uint32_t bits = __float_as_uint(s);
  const uint32_t rounded = s == s ? (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16 : 0x7fc0u;
  static_cast<uint16_t*>(scales)[at] = static_cast<uint16_t>(rounded);
}

// Global -> shared copies of BYTES (4, 8 or 16) that no thread waits on until copy_async_wait_all (sm_80+).
template <int BYTES>
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  if constexpr (BYTES == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(global));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(at), "l"(global), "n"(BYTES));
}
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

struct Tables {  // in shared memory
  const uint8_t* grid;   // [grid_size]: boundaries below each grid cell's left edge
  const float* bounds;   // [2^bits], the last +inf
  const float* centroids;
  const float* signs;    // [D]
  float grid_lo, grid_scale;
  int grid_size;
};

// The cells of a lane's PL rotated coordinates x (u = x * inv), as bytes packed four to a word, and with CENTROIDS
// the sums the corrected and least-squares scales need (sum of c^2, sum of x c).  Branch-free: every lane reads the
// same tables whatever its values.
template <int PL, bool CENTROIDS>
__device__ __forceinline__ void find_cells(const float (&x)[PL], float inv, int keep, const Tables& tab,
                                           uint32_t (&packed)[PL / 4], float& csq, float& yc) {
  const float offset = -tab.grid_lo * tab.grid_scale;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const float u = x[i] * inv;
    const int g = min(max(static_cast<int>(fmaf(u, tab.grid_scale, offset)), 0), tab.grid_size - 1);
    const int below = tab.grid[g];
    const int idx = (below + (tab.bounds[below] < u)) & keep;
    if constexpr (CENTROIDS) {
      const float c = tab.centroids[idx];
      csq = fmaf(c, c, csq);
      yc = fmaf(x[i], c, yc);
    }
    if (i % 4 == 0) packed[i / 4] = 0;
    packed[i / 4] |= static_cast<uint32_t>(idx) << (8 * (i % 4));
  }
}

// Where a lane's rows of the input lie, and its first row, fetched as the kernel starts (before the tables are
// staged and the lengths read: any token below T is a valid address), so that a decode step waits for one round
// trip to memory rather than three.
template <int DTYPE, int PL>
struct Rows {
  const void* src;        // of DTYPE (p.in_dtype)
  long long row0, stride_t;
  int t_first;
  RawRow<DTYPE, PL> first;
  // A decode step's keys with a transform (PL <= 8): the lane's shift and gain, fetched with the first row, so that
  // code_vectors does not wait a round trip for them after the barrier.
  static constexpr bool TRANSFORM_AHEAD = PL <= 8;
  bool transform_ahead = false;
  float4 shift[TRANSFORM_AHEAD ? PL / 4 : 1], gain[TRANSFORM_AHEAD ? PL / 4 : 1];

  __device__ __forceinline__ void fetch(int t, RawRow<DTYPE, PL>& raw) const {
    fetch_row<DTYPE, PL>(src, row0 + t * stride_t, raw);
  }
};

template <int D, int PL, int DTYPE>
__device__ __forceinline__ Rows<DTYPE, PL> first_rows(const QuantizeParams& p, bool is_key, int b, int h) {
  using S = QuantShape<D, PL>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Rows<DTYPE, PL> rows;
  rows.src = is_key ? p.k : p.v;
  rows.stride_t = is_key ? p.k_stride_t : p.v_stride_t;
  rows.row0 = b * (is_key ? p.k_stride_b : p.v_stride_b) + h * (is_key ? p.k_stride_h : p.v_stride_h) +
              (lane % S::L) * PL;
  rows.t_first = blockIdx.x * (blockDim.x / 32) * S::VECTORS + warp * S::VECTORS + lane / S::L;
  if (rows.t_first < p.tokens) rows.fetch(rows.t_first, rows.first);
  if constexpr (Rows<DTYPE, PL>::TRANSFORM_AHEAD) {
    rows.transform_ahead = is_key && p.key_shift != nullptr;
    if (rows.transform_ahead) {
      const size_t at = (static_cast<size_t>(b) * p.num_kv_heads + h) * D + (lane % S::L) * PL;
#pragma unroll
      for (int i = 0; i < PL / 4; ++i) {
        rows.shift[i] = reinterpret_cast<const float4*>(p.key_shift + at)[i];
        rows.gain[i] = reinterpret_cast<const float4*>(p.key_gain + at)[i];
      }
    }
  }
  return rows;
}

// Code one block of vectors (this lane's: token t, its 32 / L-th of a warp's vectors), whose raw values were fetched:
// valid says whether it is stored, at `slot`.
// shift_ahead, gain_ahead: the lane's key transform when the caller fetched it (Rows), else nullptr.
template <int D, int PL, int DTYPE, int BITS>
__device__ __forceinline__ void code_vectors(const QuantizeParams& p, bool is_key, int b, int bh, bool valid, int slot,
                                             const RawRow<DTYPE, PL>& raw, const Tables& tab, uint8_t* warp_cells,
                                             const float4* shift_ahead = nullptr, const float4* gain_ahead = nullptr) {
  using S = QuantShape<D, PL>;
  using PW = PlaneWidths<BITS>;
  constexpr int ROW = D * BITS / 8;
  constexpr int P0 = D * PW::LOW / 8;
  constexpr int ROW_WORDS = ROW / 4;
  constexpr int LANE_WORDS = (ROW_WORDS + S::L - 1) / S::L;  // packed words per lane (BITS * PL / 32)
  const int lane = threadIdx.x % 32;
  const int vec = lane / S::L, sub = lane % S::L, c0 = sub * PL;
  uint8_t* codes = is_key ? p.k_codes : p.v_codes;
  void* scales = is_key ? p.k_scales : p.v_scales;
  const bool transform = is_key && p.key_shift != nullptr;
  const float norm = 1.f / sqrtf(static_cast<float>(D));  // the transform below is unnormalized
  float x[PL];
  if (valid) {
    convert_row<DTYPE, PL>(raw, x);
  } else {
#pragma unroll
    for (int i = 0; i < PL; ++i) x[i] = 0.f;
  }
  if (transform) {  // (k - shift) * gain, in the Triton kernel's order
    const float4* shift = reinterpret_cast<const float4*>(p.key_shift + static_cast<size_t>(bh) * D + c0);
    const float4* gain = reinterpret_cast<const float4*>(p.key_gain + static_cast<size_t>(bh) * D + c0);
#pragma unroll
    for (int i = 0; i < PL / 4; ++i) {
      const float4 s = shift_ahead != nullptr ? shift_ahead[i] : shift[i];
      const float4 g = gain_ahead != nullptr ? gain_ahead[i] : gain[i];
      x[4 * i] = (x[4 * i] - s.x) * g.x;
      x[4 * i + 1] = (x[4 * i + 1] - s.y) * g.y;
      x[4 * i + 2] = (x[4 * i + 2] - s.z) * g.z;
      x[4 * i + 3] = (x[4 * i + 3] - s.w) * g.w;
    }
  }
  // A NaN or infinity anywhere makes `probe` NaN (x * 0 is NaN only for them): such a vector is stored as codes 0
  // and NaN scales, so what the arithmetic below makes of it does not matter.  (Written out here, not through
  // code_grouped_key's helpers, shift_and_scale and magnitude_and_probe: with them nvcc 13.0 schedules the
  // decode-step kernels at D = 64 / 128 differently, and this code is what BENCHMARKS.md timed.)
  float amax = 0.f, probe = 0.f;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    amax = fmaxf(amax, fabsf(x[i]));
    probe = fmaf(x[i], 0.f, probe);
  }
#pragma unroll
  for (int m = 1; m < S::L; m <<= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    probe += __shfl_xor_sync(0xffffffffu, probe, m);
  }
  const bool bad = probe != probe;
  int e;
  frexpf(amax, &e);  // amax in [2^(e-1), 2^e); 0 for 0 (codec.magnitude_exponent)
  const int half = (-e) >> 1;
  const float down_a = pow2(half), down_b = pow2(-e - half);  // |e| <= 149: no clamp needed
#pragma unroll
  for (int i = 0; i < PL; ++i) x[i] = x[i] * down_a * down_b * tab.signs[c0 + i];
  // Hadamard transform over the group's D coordinates: coordinate 32 s + i is lane s's x[i].
#pragma unroll
  for (int hstep = 1; hstep < PL; hstep <<= 1) {
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      if (i & hstep) continue;
      const float u = x[i], v = x[i + hstep];
      x[i] = u + v;
      x[i + hstep] = u - v;
    }
  }
#pragma unroll
  for (int m = 1; m < S::L; m <<= 1) {
    const float sign = (sub & m) ? -1.f : 1.f;  // this lane holds the butterfly's second half
#pragma unroll
    for (int i = 0; i < PL; ++i) x[i] = fmaf(sign, x[i], __shfl_xor_sync(0xffffffffu, x[i], m));
  }
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < PL; ++i) sumsq = fmaf(x[i], x[i], sumsq);
  sumsq = group_sum<S::BLOCK_LANES>(sumsq);
  const float rms = sqrtf(sumsq / S::BLOCK);
  const float inv = 1.f / (rms > 0.f ? rms : 1.f);
  // Cells: count the boundaries strictly below u (ties to the lower cell, saturating at the ends).  Two copies
  // of the loop, so that neither branches per coordinate: the scale rules other than rms need the centroids.
  uint32_t packed[PL / 4];
  float csq = 0.f, yc = 0.f;
  const int keep = bad ? 0 : 0xff;  // a non-finite vector stores codes 0
  if (p.rule != 0) {
    find_cells<PL, true>(x, inv, keep, tab, packed, csq, yc);
  } else {
    find_cells<PL, false>(x, inv, keep, tab, packed, csq, yc);
  }
  __syncwarp();  // the previous block's packing has read its cells
  uint8_t* cells_out = warp_cells + lane * PL;
  if constexpr (PL % 16 == 0) {
#pragma unroll
    for (int i = 0; i < PL / 16; ++i)
      reinterpret_cast<uint4*>(cells_out)[i] = make_uint4(packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < PL / 4; ++i) reinterpret_cast<uint32_t*>(cells_out)[i] = packed[i];
  }
  __syncwarp();
  const uint8_t* cells = warp_cells + vec * D;
  uint32_t words[LANE_WORDS];
#pragma unroll
  for (int w = 0; w < LANE_WORDS; ++w) {
    const int at = min(sub * LANE_WORDS + w, ROW_WORDS - 1) * 4;  // byte of the packed row (lanes past it idle)
    // (row_word's expression, written out: through it nvcc 13.0 schedules the long-chunk kernels differently, and
    // this code is what BENCHMARKS.md timed.)
    if constexpr (PW::HIGH == 0) {
      words[w] = plane_word<D, PW::LOW>(cells, at, 0);
    } else {
      words[w] = at < P0 ? plane_word<D, PW::LOW>(cells, at, 0) : plane_word<D, PW::HIGH>(cells, at - P0, PW::LOW);
    }
  }
  float scale = rms;
  if (p.rule != 0) {
    csq = group_sum<S::BLOCK_LANES>(csq);
    if (p.rule == 1) {
      scale = sqrtf(sumsq) / sqrtf(csq);
    } else {
      yc = group_sum<S::BLOCK_LANES>(yc);
      scale = yc / csq;
    }
    scale = rms > 0.f ? scale : 0.f;
  }
  if (valid) {
    const size_t row = static_cast<size_t>(bh) * p.capacity + slot;
    uint8_t* dst = codes + row * ROW + sub * LANE_WORDS * 4;
    if constexpr (ROW_WORDS % S::L == 0) {  // every lane writes LANE_WORDS words, as wide as they align
      store_words<LANE_WORDS>(dst, words);
    } else {
#pragma unroll
      for (int w = 0; w < LANE_WORDS; ++w)
        if (sub * LANE_WORDS + w < ROW_WORDS) reinterpret_cast<uint32_t*>(dst)[w] = words[w];
    }
    if (sub % S::BLOCK_LANES == 0) {
      const float s = bad ? __int_as_float(0x7fc00000) : times_pow2(scale * norm, e);
      store_scale(scales, row * S::NB + sub / S::BLOCK_LANES, s, p.scale_bf16);
    }
    if (bad && sub == 0 && p.nonfinite != nullptr) atomicAdd(p.nonfinite + b, 1);
  }
}

// Whether token t of a chunk is stored (the chunk's first `first` tokens are not when a ring keeps its last N; a
// static cache stores none past its capacity), and where.
struct Placement {
  int n_new, first, slot0, capacity;
  bool ring;
  __device__ __forceinline__ bool stored(int t) const {
    return t < n_new && t >= first && (ring || slot0 + t < capacity);
  }
  __device__ __forceinline__ int slot(int t) const { return ring ? (slot0 + t) % capacity : slot0 + t; }
};

// Which of a chunk's tokens the exact rows keep (format/layout.py), and where: the last R of the chunk go to the recent
// window's rows (slot0 + t) % R, and the tokens at positions start .. start + S - 1 to the first rows 0 .. S - 1.  The
// one rule for write_exact_rows and copy_exact_rows.
struct ExactRows {
  int n_new, slot0, start;
  // Tokens t in [lo, hi) go to row (t + offset) % modulo (modulo 0: no wrap).
  struct Span {
    int lo, hi, offset, modulo;
    __device__ __forceinline__ bool holds(int t) const { return t >= lo && t < hi; }
    __device__ __forceinline__ int row(int t) const { return modulo > 0 ? (t + offset) % modulo : t + offset; }
  };
  __device__ __forceinline__ Span recent(const QuantizeParams& p) const {
    return {max(n_new - p.exact_recent, 0), n_new, slot0, p.exact_recent};
  }
  __device__ __forceinline__ Span first(const QuantizeParams& p) const {
    const int lo = start - slot0;  // the chunk's token at position start
    return {max(lo, 0), max(min(lo + p.exact_first, n_new), 0), -lo, 0};
  }
};

// A decode step's exact rows, written from the registers that hold the token for its coding (the short path), rather
// than read again by copy_exact_rows: the lane's PL raw values.  For rows of the input's dtype, 16-byte aligned
// (exact_rows_inline checks).
template <int D, int PL, int DTYPE>
__device__ __forceinline__ void write_exact_rows(const QuantizeParams& p, int side, int b, int h, int t,
                                                 const RawRow<DTYPE, PL>& raw, const ExactRows& ex) {
  constexpr int SIZE = DTYPE == 2 ? 4 : 2;
  constexpr int BYTES = RawRow<DTYPE, PL>::BYTES;
  const int sub = (threadIdx.x % 32) % QuantShape<D, PL>::L;
  auto put = [&](void* rows, const long long (&st)[3], int row) {
    char* dst = static_cast<char*>(rows) + (b * st[0] + h * st[1] + row * st[2] + sub * PL) * SIZE;
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
      for (int i = 0; i < BYTES / 16; ++i)
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(raw.w[4 * i], raw.w[4 * i + 1], raw.w[4 * i + 2], raw.w[4 * i + 3]);
    } else {
      *reinterpret_cast<uint2*>(dst) = make_uint2(raw.w[0], raw.w[1]);
    }
  };
  if (p.exact_recent > 0) {
    const ExactRows::Span recent = ex.recent(p);
    if (recent.holds(t)) put(p.recent[side], p.recent_stride[side], recent.row(t));
  }
  if (p.exact_first > 0) {
    const ExactRows::Span first = ex.first(p);
    if (first.holds(t)) put(p.first[side], p.first_stride[side], first.row(t));
  }
}

// Whether this side's exact rows take write_exact_rows: the input's dtype, every row 16-byte aligned.
template <int DTYPE>
__device__ __forceinline__ bool exact_rows_inline(const QuantizeParams& p, int side, int b, int h) {
  if (p.exact_recent == 0 && p.exact_first == 0) return false;
  if (p.exact_dtype != DTYPE) return false;
  constexpr int SIZE = DTYPE == 2 ? 4 : 2;
  auto aligned = [&](const void* rows, const long long (&st)[3]) {
    return ((reinterpret_cast<uintptr_t>(rows) | static_cast<unsigned long long>(b * st[0] + h * st[1] | st[2]) * SIZE) &
            15) == 0;
  };
  return (p.exact_recent == 0 || aligned(p.recent[side], p.recent_stride[side])) &&
         (p.exact_first == 0 || aligned(p.first[side], p.first_stride[side]));
}

// Loop over this CTA's tokens of one (sequence, KV head) and side: code(stored, slot, raw) codes a token whose raw
// values (the lane's PL) were fetched, then its exact rows are written when `exact` says they take the registers.
template <int D, int PL, int DTYPE, typename Code>
__device__ __forceinline__ void for_each_token(const QuantizeParams& p, bool is_key, int b, int bh, const Placement& at,
                                               const Rows<DTYPE, PL>& rows, const ExactRows* exact, Code code) {
  using S = QuantShape<D, PL>;
  const int tokens_per_cta = (blockDim.x / 32) * S::VECTORS;
  const int step = gridDim.x * tokens_per_cta;
  // The next block's rows are fetched while this one is coded (one block of loads in flight per warp).
  RawRow<DTYPE, PL> next = rows.first;
  int t_next = rows.t_first;
  for (int t0 = blockIdx.x * tokens_per_cta; t0 < at.n_new; t0 += step) {
    const int t = t_next;
    const RawRow<DTYPE, PL> raw = next;
    t_next = t + step;
    if (at.stored(t_next)) rows.fetch(t_next, next);
    code(at.stored(t), at.slot(t), raw);
    if (exact != nullptr && t < at.n_new)
      write_exact_rows<D, PL, DTYPE>(p, is_key ? 0 : 1, b, bh % p.num_kv_heads, t, raw, *exact);
  }
}

// Code this CTA's tokens of one (sequence, KV head) and side, PL coordinates per lane.
template <int D, int PL, int DTYPE, int BITS>
__device__ __forceinline__ void code_tokens(const QuantizeParams& p, bool is_key, int b, int bh, const Placement& at,
                                            const Tables& tab, uint8_t* warp_cells, const Rows<DTYPE, PL>& rows,
                                            const ExactRows* exact) {
  // for_each_token's loop, written out: through it (a lambda) nvcc 13.0 schedules these kernels differently, and
  // this code is what BENCHMARKS.md timed.
  using S = QuantShape<D, PL>;
  const int tokens_per_cta = (blockDim.x / 32) * S::VECTORS;
  const int step = gridDim.x * tokens_per_cta;
  RawRow<DTYPE, PL> next = rows.first;
  int t_next = rows.t_first;
  for (int t0 = blockIdx.x * tokens_per_cta; t0 < at.n_new; t0 += step) {
    const int t = t_next;
    const RawRow<DTYPE, PL> raw = next;
    t_next = t + step;
    if (at.stored(t_next)) rows.fetch(t_next, next);
    code_vectors<D, PL, DTYPE, BITS>(p, is_key, b, bh, at.stored(t), at.slot(t), raw, tab, warp_cells,
                                     rows.transform_ahead ? rows.shift : nullptr,
                                     rows.transform_ahead ? rows.gain : nullptr);
    if (exact != nullptr && t < at.n_new)
      write_exact_rows<D, PL, DTYPE>(p, is_key ? 0 : 1, b, bh % p.num_kv_heads, t, raw, *exact);
  }
}

// ---- Keys in two channel groups (format/codec.py key_groups), D = 256 ----
//
// A warp codes one key per step, 8 coordinates per lane, for appends of any length.  The lane's raw values (the
// model's channels 8 lane .. 8 lane + 7) take the key transform, then go through shared memory into the stored order
// (key_order), where group a is the first GA channels: lanes below GA / 8 hold it, the others group b.  Each group is
// coded as codec.quantize codes a key of its width: its own power-of-two prescale, the table's first signs, the
// rotation H_P ⊗ Q_m (format/rotation.py; m the width's odd factor) in shared memory, rows of m coordinates through
// the Hartley factor and then columns of P through butterflies, a lane per row or column, unnormalized (1 / sqrt(P)
// goes into the scale); then its RMS, its cells in its own tables, its planes and its scale.  A NaN or infinity
// anywhere in the key stores codes 0 and NaN scales in both groups, counted once.
// x summed (or maxed) over the lanes of the calling lane's group (in_a: group a's lanes, else group b's).
__device__ __forceinline__ float own_group_sum(float x, bool in_a) {
  float a = in_a ? x : 0.f, b = in_a ? 0.f : x;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, m);
    b += __shfl_xor_sync(0xffffffffu, b, m);
  }
  return in_a ? a : b;
}

__device__ __forceinline__ float own_group_max(float x, bool in_a) {
  float a = in_a ? x : 0.f, b = in_a ? 0.f : x;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, m));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, m));
  }
  return in_a ? a : b;
}

// Code one key of a warp in groups (the section's comment), whose raw values were fetched: valid says whether it is
// stored, at `slot`.  work: the warp's D floats of shared memory; shift, gain: the lane's key transform or nullptr.
template <int D, int GA, int KB, int KB2, int DTYPE>
__device__ __forceinline__ void code_grouped_key(const QuantizeParams& p, int b, int bh, bool valid, int slot,
                                                 const RawRow<DTYPE, GROUP_LANE_VALUES>& raw, const Tables& tab_a,
                                                 const Tables& tab_b, const float* q_a, const float* q_b,
                                                 const int (&order)[GROUP_LANE_VALUES], float* work,
                                                 uint8_t* warp_cells, const float4* shift, const float4* gain) {
  constexpr int PL = GROUP_LANE_VALUES;
  static_assert(D == 32 * PL && GA % PL == 0 && GA > 0 && GA < D, "groups of whole lanes over one warp");
  constexpr int RA = GA * KB / 8, ROW = RA + (D - GA) * KB2 / 8;  // group a's code bytes, the row's
  static_assert(RA % 4 == 0 && ROW % 4 == 0, "each group's planes in whole words");
  constexpr int ROW_WORDS = ROW / 4;
  constexpr int LANE_WORDS = (ROW_WORDS + 31) / 32;
  const int lane = threadIdx.x % 32;
  const bool in_a = lane < GA / PL;
  const int j0 = in_a ? PL * lane : PL * lane - GA;  // the lane's first channel within its group
  float x[PL];
  if (valid) {
    convert_row<DTYPE, PL>(raw, x);
  } else {
#pragma unroll
    for (int i = 0; i < PL; ++i) x[i] = 0.f;
  }
  if (shift != nullptr) {  // (k - shift) * gain, in the model's order
#pragma unroll
    for (int i = 0; i < PL / 4; ++i) shift_and_scale(x + 4 * i, shift[i], gain[i]);
  }
  __syncwarp();  // the previous key's reads of work are done
  if (p.key_order != nullptr) to_stored_order(x, work, order);
  // A NaN or infinity anywhere makes `probe` NaN; each group's largest magnitude sets its prescale.
  float amax, probe;
  magnitude_and_probe(x, amax, probe);
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) probe += __shfl_xor_sync(0xffffffffu, probe, m);
  amax = own_group_max(amax, in_a);
  const bool bad = probe != probe;
  int e;
  frexpf(amax, &e);  // amax in [2^(e-1), 2^e); 0 for 0 (codec.magnitude_exponent)
  const int half = (-e) >> 1;
  const float down_a = pow2(half), down_b = pow2(-e - half);
#pragma unroll
  for (int i = 0; i < PL; ++i) work[PL * lane + i] = x[i] * down_a * down_b * tab_a.signs[j0 + i];
  rotate_key_groups<D, GA>(work, q_a, q_b);
#pragma unroll
  for (int i = 0; i < PL; ++i) x[i] = work[PL * lane + i];
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < PL; ++i) sumsq = fmaf(x[i], x[i], sumsq);
  sumsq = own_group_sum(sumsq, in_a);
  const float rms = sqrtf(sumsq / (in_a ? GA : D - GA));
  const float inv = 1.f / (rms > 0.f ? rms : 1.f);
  uint32_t packed[PL / 4];
  float csq = 0.f, yc = 0.f;
  const int keep = bad ? 0 : 0xff;  // a non-finite key stores codes 0
  const Tables& tab = in_a ? tab_a : tab_b;
  if (p.rule != 0) {
    find_cells<PL, true>(x, inv, keep, tab, packed, csq, yc);
  } else {
    find_cells<PL, false>(x, inv, keep, tab, packed, csq, yc);
  }
  __syncwarp();  // the previous key's packing has read its cells
  reinterpret_cast<uint2*>(warp_cells + PL * lane)[0] = make_uint2(packed[0], packed[1]);
  __syncwarp();
  uint32_t words[LANE_WORDS];
#pragma unroll
  for (int w = 0; w < LANE_WORDS; ++w) {
    const int at = min(lane * LANE_WORDS + w, ROW_WORDS - 1) * 4;  // byte of the packed row (lanes past it idle)
    words[w] = at < RA ? row_word<GA, KB>(warp_cells, at) : row_word<D - GA, KB2>(warp_cells + GA, at - RA);
  }
  float scale = rms;
  if (p.rule != 0) {
    csq = own_group_sum(csq, in_a);
    if (p.rule == 1) {
      scale = sqrtf(sumsq) / sqrtf(csq);
    } else {
      yc = own_group_sum(yc, in_a);
      scale = yc / csq;
    }
    scale = rms > 0.f ? scale : 0.f;
  }
  if (valid) {
    const size_t row = static_cast<size_t>(bh) * p.capacity + slot;
    uint8_t* dst = p.k_codes + row * ROW;  // 4-byte aligned rows (ROW % 4 == 0): word stores
#pragma unroll
    for (int w = 0; w < LANE_WORDS; ++w)
      if (lane * LANE_WORDS + w < ROW_WORDS) reinterpret_cast<uint32_t*>(dst)[lane * LANE_WORDS + w] = words[w];
    if (lane == 0 || lane == GA / PL) {  // each group's first lane: its scale (1 / sqrt(P) normalizes the rotation)
      const float norm = in_a ? 1.f / sqrtf(static_cast<float>(GroupShape<GA>::P))
                              : 1.f / sqrtf(static_cast<float>(GroupShape<D - GA>::P));
      const float s = bad ? __int_as_float(0x7fc00000) : times_pow2(scale * norm, e);
      store_scale(p.k_scales, row * 2 + (in_a ? 0 : 1), s, p.scale_bf16);
    }
    if (bad && lane == 0 && p.nonfinite != nullptr) atomicAdd(p.nonfinite + b, 1);
  }
}

// ---- Long appends of float16 / bfloat16 vectors at D <= 256: the rotation on tensor cores ----
//
// A warp codes 8 tokens per step.  The signed inputs go to m16n8k16 MMAs against the 16 x 16 Sylvester matrix
// (products of 16-bit values and +-1 are exact; float32 accumulation), and the remaining D / 16-point transform is
// butterflies inside each lane.  Coordinate i = i0 + 2 i1 + 4 i2 + 8 (i3 + 2 i4) + 32 m is MMA index k = i0 + 2 t +
// 8 i1 with t = i3 + 2 i4 (the lane's quad position), block (i2, m): each lane's 16-byte loads (8 consecutive
// coordinates, 8 t + 32 m + 0..7) are its A fragments as loaded, and since H[i][j] = (-1)^popcount(i & j) pairs bit
// for bit, the outputs come back in the same order: lane (g, t) holds token g's rotated coordinates
// j = (q & 7) + 8 t + 32 (q >> 3) for q < D / 4.  Those hold whole bytes of every plane of width W whose planes are
// 32 bytes or more (byte b holds coordinates b + k P): the packing stays in the lane, and narrower planes OR their
// slices over two or four lanes of the quad.  A row per lane (the MMA's rows g + 8 are zero): two rows per lane halve
// the MMAs but hold twice the rotated values, 168 registers and 3 CTAs per SM, 97.9 against 92.8 us for one row at
// 128 registers (BENCHMARKS.md).
//
// No power-of-two prescale: it does not change u = y / rms or the stored scale (powers of two factor out exactly),
// as long as nothing over- or underflows.  A row whose sum of squares lies outside [2^-100, 2^100] (and is not an
// exact zero vector), or is not finite, is coded again by code_vectors, the reference's order of operations.
constexpr long long TILE_MIN_TOKENS = 8192;  // tokens x KV heads x sequences of an append that takes the tile loop
constexpr int TILE_ROWS = 8;  // tokens a warp codes per step: a row per lane of the MMA's rows g

template <int DTYPE>  // 0 float16, 1 bfloat16
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (DTYPE == 1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%10,%10,%10};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%10,%10,%10};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
  }
}

// Two 16-bit values of a word as float32 (exact).
template <int DTYPE>
__device__ __forceinline__ void to_floats(uint32_t w, float& lo, float& hi) {
  if constexpr (DTYPE == 1) {
    lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xffff0000u);
  } else {
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
}

// c += A B, bfloat16 (the key transform's three-part split, below).
__device__ __forceinline__ void mma_16816_bf16_acc(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Two float32 values as bfloat16 parts a = hi + mid + lo, each pair packed as an A-fragment word: the residues are
// exact in float32 and each part keeps 8 more bits, so the parts hold every bit of a float32 (whose own rounding
// already happened in (k - shift) * gain), and their products with +-1 are exact in the MMA.
__device__ __forceinline__ void split_bf16x3(float a, float b, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
  auto pack = [](float x, float y) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
  };
  hi = pack(a, b);
  a -= __uint_as_float(hi << 16), b -= __uint_as_float(hi & 0xffff0000u);
  mid = pack(a, b);
  a -= __uint_as_float(mid << 16), b -= __uint_as_float(mid & 0xffff0000u);
  lo = pack(a, b);
}

// Entries (k, n) and (k + 1, n) of the 16 x 16 Sylvester matrix as two 16-bit values (+-1 in DTYPE).
template <int DTYPE>
__device__ __forceinline__ uint32_t sylvester_pair(int k, int n) {
  constexpr uint32_t ONE = DTYPE == 1 ? 0x3f80u : 0x3c00u;
  const uint32_t lo = ONE | ((__popc(k & n) & 1u) << 15);
  const uint32_t hi = ONE | ((__popc((k + 1) & n) & 1u) << 15);
  return lo | (hi << 16);
}

// One row's W-bit slices [S, S + W) of a lane's cell indices (codes << SHIFT), written into a plane of P = D W / 8
// bytes (byte b holds coordinate b + k P at bit k W).  TOP: the plane holds the codes' highest bits (nothing above S + W
// to mask).  All four lanes of the quad call it (narrow planes shuffle).
template <int D, int W, int S, int SHIFT, bool TOP>
__device__ __forceinline__ uint32_t plane_bits(uint32_t idx, int pos) {
  constexpr uint32_t MASK = (1u << W) - 1;
  if constexpr (TOP && S == SHIFT) return pos >= S ? idx << (pos - S) : idx >> (S - pos);  // the bits below S are 0
  else if constexpr (TOP) return (idx >> S) << pos;
  else return ((idx >> S) & MASK) << pos;
}

template <int D, int W, int S, int SHIFT, bool TOP>
__device__ __forceinline__ void store_plane(const uint32_t (&idx)[D / 4], uint8_t* plane, int t, bool store) {
  constexpr int P = D * W / 8;
  // Slices are disjoint bit fields: added rather than ORed, so that a shift and its add are one instruction.
  if constexpr (P >= 32) {
    // The lane holds plane bytes 8 t + 32 mm + 0..7 (mm < P / 32), coordinate j = b + k P being q = (b & 7) +
    // 8 (mm + k P / 32): two words each.
#pragma unroll
    for (int mm = 0; mm < P / 32; ++mm) {
      uint32_t w[2] = {0u, 0u};
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int k = 0; k < 8 / W; ++k)
            w[c] += plane_bits<D, W, S, SHIFT, TOP>(idx[4 * c + r + 8 * (mm + k * (P / 32))], 8 * r + k * W);
      if (store) *reinterpret_cast<uint2*>(plane + 8 * t + 32 * mm) = make_uint2(w[0], w[1]);
    }
  } else {
    static_assert(P == 8 || P == 16, "planes of 8, 16 or a multiple of 32 bytes");
    // j = (q & 7) + 8 t + 32 (q >> 3) lies in byte j % P at slice j / P: P = 16, byte (q & 7) + 8 (t & 1) and slice
    // (t >> 1) + 2 (q >> 3); P = 8, byte q & 7 and slice t + 4 (q >> 3).  The lanes that differ in t's slice bits
    // fill the same two words.
    constexpr int T_BYTE_BITS = P == 16 ? 1 : 0;
    const int t_slice = t >> T_BYTE_BITS;
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int m = 0; m < D / 32; ++m)
          w[c] += plane_bits<D, W, S, SHIFT, TOP>(idx[4 * c + r + 8 * m], 8 * r + m * (32 / P) * W);
      w[c] <<= t_slice * W;
#pragma unroll
      for (int lanes = 1 << T_BYTE_BITS; lanes < 4; lanes <<= 1) w[c] |= __shfl_xor_sync(0xffffffffu, w[c], lanes);
    }
    if (store && t_slice == 0) *reinterpret_cast<uint2*>(plane + 8 * (t & T_BYTE_BITS)) = make_uint2(w[0], w[1]);
  }
}

// The tile path's cell search.  Its grid covers every u a finite vector can have (|u| <= sqrt(D): no coordinate
// exceeds the norm), so no index is clamped, with cells of the same width as the scalar path's grid but centred on
// multiples of 1 / scale: cell c holds u * scale in [c - half - 1/2, c - half + 1/2), and an FMA that adds 1.5 * 2^23
// rounds u * scale + half to that c, held in the low bits of the float.  Entries count the boundaries strictly below
// the cell's left edge, as byte offsets into the boundary and centroid tables (four times the count) up to 6 bits.
constexpr float ROUND_MAGIC = 12582912.f;  // 1.5 * 2^23
// Cells at 8 bits: 2 * ceil((sqrt(D) + 1) * 64) + 1, 1579 at D = 128 and 2177 at 256.  A cell index is the float's low
// bits, as many as the table has, so that any float reads inside the table: a finite row's cell lies in the grid, and
// a row coded again (inv_scaled 0) reads the middle cell or, for a NaN (0x7fffffff), the last entry, set to 0.
template <int D>
__host__ __device__ constexpr int tile_grid_cells() { return D <= 128 ? 2048 : 4096; }

template <int BITS>
struct TileGrid {
  static constexpr int SHIFT = BITS <= 6 ? 2 : 0;  // entries and indices are codes << SHIFT
  const uint8_t* cell;
  int half;
};

// Built by the whole CTA into shared memory (a binary search per cell over the staged boundaries), then a barrier.
template <int D, int BITS>
__device__ __forceinline__ TileGrid<BITS> build_tile_grid(const Tables& tab, uint8_t* cells) {
  const int half = static_cast<int>(ceilf((sqrtf(static_cast<float>(D)) + 1.f) * tab.grid_scale));
  const float width = 1.f / tab.grid_scale;  // a power of two: the edges below are exact
  if (threadIdx.x == 0) cells[tile_grid_cells<D>() - 1] = 0;
  for (int c = threadIdx.x; c <= 2 * half; c += blockDim.x) {
    const float left = (static_cast<float>(c - half) - 0.5f) * width;
    int lo = 0, hi = (1 << BITS) - 1;  // the finite boundaries strictly below `left`
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (tab.bounds[mid] < left) lo = mid + 1;
      else hi = mid;
    }
    cells[c] = static_cast<uint8_t>(lo << TileGrid<BITS>::SHIFT);
  }
  __syncthreads();
  return TileGrid<BITS>{cells, half};
}

// One row's cells (as codes << SHIFT) and the corrected / least-squares sums, for a lane's Q rotated coordinates.
template <int Q, int BITS, int RULE>  // the scale rule: 0 rms, 1 corrected (sum c^2), 2 lsq (and sum y c)
__device__ __forceinline__ void tile_cells(const float (&y)[Q], float inv, float inv_scaled, float cell_offset,
                                           const Tables& tab, const TileGrid<BITS>& tg, uint32_t (&idx)[Q],
                                           float& csq, float& yc) {
  constexpr int SHIFT = TileGrid<BITS>::SHIFT;
  const char* bounds = reinterpret_cast<const char*>(tab.bounds);
  const char* centroids = reinterpret_cast<const char*>(tab.centroids);
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    const float u = y[q] * inv;
    const uint32_t cell = __float_as_uint(fmaf(y[q], inv_scaled, cell_offset)) & (tile_grid_cells<4 * Q>() - 1);
    const uint32_t below = tg.cell[cell];
    const float bound = *reinterpret_cast<const float*>(bounds + (below << (2 - SHIFT)));
    idx[q] = below + (bound < u ? 1u << SHIFT : 0u);
    if constexpr (RULE != 0) {
      const float c = *reinterpret_cast<const float*>(centroids + (idx[q] << (2 - SHIFT)));
      csq = fmaf(c, c, csq);
      if constexpr (RULE == 2) yc = fmaf(y[q], c, yc);
    }
  }
}

// A tile row out of the safe range, coded by code_vectors with the whole warp (a vector per step; the lanes of its
// second vector at D = 64 idle).  Not inlined: the tile loop keeps its registers, and the call is rare.
template <int D, int DTYPE, int BITS>
__device__ __noinline__ void recode_row(const QuantizeParams& p, bool is_key, int b, int bh, int tok, int slot,
                                        const Tables& tab, uint8_t* warp_cells) {
  constexpr int PL = short_chunk_per_lane<D>();
  using F = QuantShape<D, PL>;
  const int lane = threadIdx.x % 32;
  const bool first_vector = lane / F::L == 0;
  const long long row = b * (is_key ? p.k_stride_b : p.v_stride_b) +
                        (bh % p.num_kv_heads) * (is_key ? p.k_stride_h : p.v_stride_h) +
                        tok * (is_key ? p.k_stride_t : p.v_stride_t) + (lane % F::L) * PL;
  RawRow<DTYPE, PL> raw;
  if (first_vector) fetch_row<DTYPE, PL>(is_key ? p.k : p.v, row, raw);
  code_vectors<D, PL, DTYPE, BITS>(p, is_key, b, bh, first_vector, slot, raw, tab, warp_cells);
}

template <int D, int DTYPE, int BITS, bool TRANSFORM>  // TRANSFORM: built for keys with a transform (D <= 128)
__device__ __forceinline__ void code_tiles(const QuantizeParams& p, bool is_key, int b, int bh, const Placement& at,
                                           const Tables& tab, uint8_t* tile_grid, uint8_t* warp_cells) {
  static_assert(D == 64 || D == 128 || D == 256, "the tile path holds D / 4 rotated coordinates per lane");
  static_assert(DTYPE == 0 || DTYPE == 1, "16-bit inputs");
  using PW = PlaneWidths<BITS>;
  constexpr int M = D / 32;  // 16-byte loads per row and lane
  constexpr int Q = D / 4;   // rotated coordinates per row and lane
  constexpr int ROW = D * BITS / 8;
  constexpr int P0 = D * PW::LOW / 8;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int g = lane / 4, t = lane % 4;
  uint8_t* codes = is_key ? p.k_codes : p.v_codes;
  void* scales = is_key ? p.k_scales : p.v_scales;
  const float norm = 1.f / sqrtf(static_cast<float>(D));
  // The rotation's signs as masks of the sign bits of the input pairs (coordinates 2 j, 2 j + 1), in shared memory
  // after the tile grid (registers would cost occupancy): a lane reads its words 4 t + 16 m + 0..3 per 16-byte load.
  uint32_t* sign_pairs = reinterpret_cast<uint32_t*>(tile_grid + tile_grid_cells<D>());
  for (int j = threadIdx.x; j < D / 2; j += blockDim.x)
    sign_pairs[j] = (tab.signs[2 * j] < 0.f ? 0x8000u : 0u) | (tab.signs[2 * j + 1] < 0.f ? 0x80000000u : 0u);
  // B fragments of the two 8-column halves n3 (columns g + 8 n3): rows 2 t, 2 t + 1 and 2 t + 8, 2 t + 9.
  const uint32_t b00 = sylvester_pair<DTYPE>(2 * t, g), b01 = sylvester_pair<DTYPE>(2 * t + 8, g);
  const uint32_t b10 = sylvester_pair<DTYPE>(2 * t, g + 8), b11 = sylvester_pair<DTYPE>(2 * t + 8, g + 8);
  // Keys with a transform: this head's shift and gain, staged after the sign pairs, and B fragments in bfloat16 for
  // the split inputs whatever the input dtype.
  static_assert(!TRANSFORM || D <= 128, "at D = 256 the three-part rotation spilled 1.2 KB: keys keep code_tokens");
  const bool transform = TRANSFORM && is_key && p.key_shift != nullptr;
  float* key_shift = reinterpret_cast<float*>(tile_grid + tile_grid_cells<D>() + 2 * D);
  float* key_gain = key_shift + D;
  if (transform) {
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
      key_shift[j] = p.key_shift[static_cast<size_t>(bh) * D + j];
      key_gain[j] = p.key_gain[static_cast<size_t>(bh) * D + j];
    }
  }
  const uint32_t k00 = sylvester_pair<1>(2 * t, g), k01 = sylvester_pair<1>(2 * t + 8, g);
  const uint32_t k10 = sylvester_pair<1>(2 * t, g + 8), k11 = sylvester_pair<1>(2 * t + 8, g + 8);
  const TileGrid<BITS> tg = build_tile_grid<D, BITS>(tab, tile_grid);
  const char* src = static_cast<const char*>(is_key ? p.k : p.v);
  const long long stride_t = is_key ? p.k_stride_t : p.v_stride_t;
  const long long base = b * (is_key ? p.k_stride_b : p.v_stride_b) +
                         (bh % p.num_kv_heads) * (is_key ? p.k_stride_h : p.v_stride_h);
  const long long row0 = base + 8 * t;
  const int step = gridDim.x * warps;
  // Rows past the chunk read its last token (a valid address; they are not stored), so the loads need no predicate.
  auto fetch = [&](int tile, uint32_t (&raw)[M][4]) {
    const int tok = min(tile * TILE_ROWS + g, p.tokens - 1);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint4 q = __ldcs(reinterpret_cast<const uint4*>(src + 2 * (row0 + tok * stride_t + 32 * m)));
      raw[m][0] = q.x, raw[m][1] = q.y, raw[m][2] = q.z, raw[m][3] = q.w;
    }
  };
  // The next tile's rows are fetched while this one is coded (16 registers at one row per lane).
  int tile = blockIdx.x * warps + warp;
  uint32_t next[M][4];
  if (tile * TILE_ROWS < at.n_new) fetch(tile, next);
  for (; tile * TILE_ROWS < at.n_new; tile += step) {
    uint32_t x[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int w = 0; w < 4; ++w) x[m][w] = next[m][w];
    if ((tile + step) * TILE_ROWS < at.n_new) fetch(tile + step, next);
    // An exact zero vector (signed zeros included) is coded as such; any other row must pass the range check.
    uint32_t any = 0u;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int w = 0; w < 4; ++w) any |= x[m][w];
    any &= 0x7fff7fffu;
    any |= __shfl_xor_sync(0xffffffffu, any, 1);
    any |= __shfl_xor_sync(0xffffffffu, any, 2);
    const bool zero = any == 0u && !transform;  // a transformed key is zero only if it equals the shift: coded again
    // Rotate: y[q], q = e + 2 n3 + 4 i2 + 8 m (column 2 t + e of half n3, block (i2, m)).
    float y[Q];
    if (TRANSFORM && transform) {
      // Keys as the cache codes them, (k - shift) * gain in float32 (the reference's two roundings), rotated as three
      // bfloat16 parts whose MMAs accumulate.  One row per lane.
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i2 = 0; i2 < 2; ++i2) {
          const int c0 = 8 * t + 32 * m + 4 * i2;
          const float4 sh = *reinterpret_cast<const float4*>(key_shift + c0);
          const float4 gn = *reinterpret_cast<const float4*>(key_gain + c0);
          float e[4];
          to_floats<DTYPE>(x[m][2 * i2], e[0], e[1]);
          to_floats<DTYPE>(x[m][2 * i2 + 1], e[2], e[3]);
          e[0] = (e[0] - sh.x) * gn.x, e[1] = (e[1] - sh.y) * gn.y;
          e[2] = (e[2] - sh.z) * gn.z, e[3] = (e[3] - sh.w) * gn.w;
          uint32_t part01[3], part23[3];
          split_bf16x3(e[0], e[1], part01[0], part01[1], part01[2]);
          split_bf16x3(e[2], e[3], part23[0], part23[1], part23[2]);
          const uint2 sign = reinterpret_cast<const uint2*>(sign_pairs)[2 * t + 8 * m + i2];
          float c0v[4] = {0.f, 0.f, 0.f, 0.f}, c1v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int part = 0; part < 3; ++part) {
            mma_16816_bf16_acc(c0v, part01[part] ^ sign.x, part23[part] ^ sign.y, k00, k01);
            mma_16816_bf16_acc(c1v, part01[part] ^ sign.x, part23[part] ^ sign.y, k10, k11);
          }
          const int q = 4 * i2 + 8 * m;
          y[q] = c0v[0], y[q + 1] = c0v[1], y[q + 2] = c1v[0], y[q + 3] = c1v[1];
        }
    } else {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        // A fragment: rows g (rows g + 8 are zero), k = 2 t + e and 2 t + 8 + e.
        const uint2 sign = reinterpret_cast<const uint2*>(sign_pairs)[2 * t + 8 * m + i2];
        const uint32_t a0 = x[m][2 * i2] ^ sign.x;
        const uint32_t a2 = x[m][2 * i2 + 1] ^ sign.y;
        float c[4];
        const int q = 4 * i2 + 8 * m;
        mma_16816<DTYPE>(c, a0, 0u, a2, 0u, b00, b01);
        y[q] = c[0], y[q + 1] = c[1];
        mma_16816<DTYPE>(c, a0, 0u, a2, 0u, b10, b11);
        y[q + 2] = c[0], y[q + 3] = c[1];
      }
    }
#pragma unroll
    for (int s = 4; s < Q; s <<= 1)
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        if (q & s) continue;
        const float u = y[q], v = y[q + s];
        y[q] = u + v;
        y[q + s] = u - v;
      }
    const int tok = tile * TILE_ROWS + g;
    float sumsq = 0.f;
#pragma unroll
    for (int q = 0; q < Q; ++q) sumsq = fmaf(y[q], y[q], sumsq);
    sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 1);
    sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 2);
    const bool ok = zero || (sumsq >= 0x1p-100f && sumsq <= 0x1p100f);
    const bool stored = at.stored(tok);
    // Lane 4 g's bit: row g is coded again by code_vectors below.
    const unsigned redo = __ballot_sync(0xffffffffu, t == 0 && stored && !ok);
    const float rms = sqrtf(sumsq / D);
    const float inv = 1.f / (rms > 0.f ? rms : 1.f);
    // The cells, as code_vectors finds them (u = y * inv against the boundary of its grid cell), from the tile grid:
    // cell RN(u * scale) + half, the rounding done by the FMA into a float whose mantissa then holds the cell.
    uint32_t idx[Q];
    float csq = 0.f, yc = 0.f;
    // A row out of range takes inv_scaled = 0: its cells stay inside the grid (NaN and infinities pick cell 0), and it
    // is coded again below.
    const float inv_scaled = ok ? inv * tab.grid_scale : 0.f;
    const float cell_offset = static_cast<float>(tg.half) + ROUND_MAGIC;
    if (p.rule == 1) tile_cells<Q, BITS, 1>(y, inv, inv_scaled, cell_offset, tab, tg, idx, csq, yc);
    else if (p.rule == 2) tile_cells<Q, BITS, 2>(y, inv, inv_scaled, cell_offset, tab, tg, idx, csq, yc);
    else tile_cells<Q, BITS, 0>(y, inv, inv_scaled, cell_offset, tab, tg, idx, csq, yc);
    const bool write = stored && ok;
    const size_t row = static_cast<size_t>(bh) * p.capacity + (stored ? at.slot(tok) : 0);
    uint8_t* dst = codes + row * ROW;
    constexpr int SHIFT = TileGrid<BITS>::SHIFT;
    store_plane<D, PW::LOW, SHIFT, SHIFT, PW::HIGH == 0>(idx, dst, t, write);
    if constexpr (PW::HIGH > 0) store_plane<D, PW::HIGH, PW::LOW + SHIFT, SHIFT, true>(idx, dst + P0, t, write);
    float scale = rms;
    if (p.rule != 0) {
      csq += __shfl_xor_sync(0xffffffffu, csq, 1);
      csq += __shfl_xor_sync(0xffffffffu, csq, 2);
      if (p.rule == 1) {
        scale = sqrtf(sumsq) / sqrtf(csq);
      } else {
        yc += __shfl_xor_sync(0xffffffffu, yc, 1);
        yc += __shfl_xor_sync(0xffffffffu, yc, 2);
        scale = yc / csq;
      }
      scale = rms > 0.f ? scale : 0.f;
    }
    if (write && t == 0) store_scale(scales, row, scale * norm, p.scale_bf16);
    // Rows out of the safe range (or not finite): the whole warp codes each, a vector per step (the lanes of
    // code_vectors' second vector at D = 64 idle).
    for (unsigned rows = redo; rows != 0u; rows &= rows - 1) {
      const int again = tile * TILE_ROWS + (__ffs(rows) - 1) / 4;
      recode_row<D, DTYPE, BITS>(p, is_key, b, bh, again, at.slot(again), tab, warp_cells);
    }
  }
}

// Copy one side's real tokens that the exact rows keep (ExactRows), raw (the model's domain), converted to the
// exact dtype (round to nearest even, as torch's .to()), whether or not the codes had room.  At most R + S
// tokens per sequence, over the CTAs of this (sequence, KV head, side), after their coding.  Rows of the input's
// dtype (the model's: the usual case) are copied 16 bytes per thread and step, so that a decode step's token is one
// step of one warp at D <= 256 instead of D / 32 dependent element steps: the input's rows are 16-byte aligned (the
// wrapper's _aligned) and so are a cache's own exact rows; other dtypes and rows that are not aligned (a view handed
// in) take the element loop.
template <int D, int DTYPE>  // DTYPE: the input's, 0 float16, 1 bfloat16, 2 float32
__device__ void copy_exact_rows(const QuantizeParams& p, bool is_key, int b, int h, const ExactRows& ex) {
  const int side = is_key ? 0 : 1;
  const long long in0 = b * (is_key ? p.k_stride_b : p.v_stride_b) + h * (is_key ? p.k_stride_h : p.v_stride_h);
  const long long in_t = is_key ? p.k_stride_t : p.v_stride_t;
  const void* in = is_key ? p.k : p.v;
  constexpr int SIZE = DTYPE == 2 ? 4 : 2, PER_16 = 16 / SIZE;
  auto copy = [&](void* rows, const long long (&st)[3], const ExactRows::Span& span) {
    const long long out0 = b * st[0] + h * st[1];
    const int first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    if (p.exact_dtype == DTYPE &&
        ((reinterpret_cast<uintptr_t>(rows) | static_cast<unsigned long long>(out0 | st[2]) * SIZE) & 15) == 0) {
      constexpr int CHUNKS = D / PER_16;
      const int count = (span.hi - span.lo) * CHUNKS;
      for (int i = first; i < count; i += stride) {
        const int t = span.lo + i / CHUNKS, d = (i % CHUNKS) * PER_16, row = span.row(t);
        const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const char*>(in) + (in0 + t * in_t + d) * SIZE);
        *reinterpret_cast<uint4*>(static_cast<char*>(rows) + (out0 + row * st[2] + d) * SIZE) = x;
      }
      return;
    }
    const int count = (span.hi - span.lo) * D;
    for (int i = first; i < count; i += stride) {
      const int t = span.lo + i / D, d = i % D, row = span.row(t);
      const long long at = in0 + t * in_t + d;
      float x;
      if constexpr (DTYPE == 2) x = static_cast<const float*>(in)[at];
      else if constexpr (DTYPE == 1) x = __bfloat162float(static_cast<const __nv_bfloat16*>(in)[at]);
      else x = __half2float(static_cast<const __half*>(in)[at]);
      const long long out = out0 + row * st[2] + d;
      if (p.exact_dtype == 2) static_cast<float*>(rows)[out] = x;
      else if (p.exact_dtype == 1) static_cast<__nv_bfloat16*>(rows)[out] = __float2bfloat16_rn(x);
      else static_cast<__half*>(rows)[out] = __float2half_rn(x);
    }
  };
  if (p.exact_recent > 0) copy(p.recent[side], p.recent_stride[side], ex.recent(p));
  if (p.exact_first > 0) copy(p.first[side], p.first_stride[side], ex.first(p));
}

// Grid: (token blocks, B * Hkv, 2: K or V); 32 to 128 threads.  Each CTA stages its side's tables in shared memory
// (the cell grid, boundaries, centroids and signs: at most 4 KB), loops over token blocks gridDim.x apart, and
// arrives on p.arrivals when done.  TILES: long appends of 16-bit vectors take code_tiles, at 4 CTAs of 128 registers
// per SM up to D = 128 and 3 of 168 at 256; TRANSFORM: its build for keys with a transform (D <= 128).  GA > 0: the
// build for keys in two groups (GA channels at KB bits, the rest at KB2: code_grouped_key), which also stages group
// b's tables and the Hartley factors.
template <int D, int PL, int DTYPE, bool TILES, bool TRANSFORM, int GA = 0, int KB = 0, int KB2 = 0>
__global__ void __launch_bounds__(MAX_WARPS * 32, TILES ? (D <= 128 ? 4 : 3) : 1) quantize_append_kernel(const __grid_constant__ QuantizeParams p) {
  __shared__ __align__(16) uint8_t grid[MAX_GRID];
  __shared__ __align__(16) float bounds[256];
  __shared__ __align__(16) float centroids[256];
  __shared__ __align__(16) float signs[D];
  __shared__ __align__(16) uint8_t cells[MAX_WARPS][32 * PL];  // each warp's cell indices, a byte each
  // The tile grid, the sign pairs and a transformed key side's shift and gain.
  __shared__ __align__(16) uint8_t tile_grid[TILES ? tile_grid_cells<D>() + (TRANSFORM ? 10 : 2) * D : 1];
  // Grouped keys: group b's tables, both groups' Hartley factors, each warp's key as it is rotated.
  __shared__ __align__(16) uint8_t grid_b[GA > 0 ? MAX_GRID : 1];
  __shared__ __align__(16) float bounds_b[GA > 0 ? 256 : 1];
  __shared__ __align__(16) float centroids_b[GA > 0 ? 256 : 1];
  __shared__ __align__(16) float hartley[hartley_floats<D, GA>()];
  __shared__ __align__(16) float group_work[GA > 0 ? MAX_WARPS * D : 1];
  const bool is_key = blockIdx.z == 0;
  const int bits = is_key ? p.k_bits : p.v_bits;
  const int bh = blockIdx.y, b = bh / p.num_kv_heads;
  // Keys with a transform take the tile loop in the kernel built for them (TRANSFORM, D <= 128; the launch sends them
  // nowhere else), code_tokens otherwise.
  const bool tiles = TILES && !(is_key && p.key_shift != nullptr && !TRANSFORM);
  const int grid_size = is_key ? p.k_grid_size : p.v_grid_size;
  const Tables tab{grid, bounds, centroids, signs, is_key ? p.k_grid_lo : p.v_grid_lo,
                   is_key ? p.k_grid_scale : p.v_grid_scale, grid_size};
  // The tables in shared memory, this sequence's placement, and where the exact first rows start.  Thread 0 reads the
  // lengths for the CTA and, once it holds seen, arrives on the sequence's counter (`ticket`): the last CTA to arrive
  // advances seen as it ends, when every CTA has read it.  Arriving here rather than after the coding hides the
  // atomic's round trip behind the coding (0.4-0.6 us of a decode step's append, BENCHMARKS.md).
  // The tables come by asynchronous copies (cp.async): every load is in flight at once and no thread waits on one
  // before the barrier.  Loops of load-then-store waited one round trip to memory per iteration (ptxas kept a load's
  // store next to it however the loads were written): a decode step's single warp took seven in a row at D = 128,
  // eleven at 256.
  __shared__ int lengths[3];  // n_new, seen, start of this sequence
  auto stage = [&](Placement& at, int& start, int& ticket) {
    int n_new = 0, seen = 0, first_at = 0;
    if (threadIdx.x == 0) {
      n_new = p.new_lengths != nullptr ? p.new_lengths[b] : p.tokens;
      seen = p.seen[b];
      first_at = p.exact_first > 0 ? p.starts[b] : 0;
    }
    const uint4* grid_src = reinterpret_cast<const uint4*>(is_key ? p.k_grid : p.v_grid);
    const float* bounds_src = is_key ? p.k_bounds : p.v_bounds;
    const float* centroids_src = is_key ? p.k_centroids : p.v_centroids;
    for (int i = threadIdx.x; i < grid_size / 16; i += blockDim.x)
      copy_async<16>(reinterpret_cast<uint4*>(grid) + i, grid_src + i);
    for (int i = threadIdx.x; i < (1 << bits); i += blockDim.x) {
      copy_async<4>(bounds + i, bounds_src + i);
      copy_async<4>(centroids + i, centroids_src + i);
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) copy_async<4>(signs + i, p.signs + i);
    if constexpr (GA > 0) {
      if (is_key) {
        constexpr int QA = GroupShape<GA>::HARTLEY, QB = GroupShape<D - GA>::HARTLEY;
        for (int i = threadIdx.x; i < p.k2_grid_size / 16; i += blockDim.x)
          copy_async<16>(reinterpret_cast<uint4*>(grid_b) + i, reinterpret_cast<const uint4*>(p.k2_grid) + i);
        for (int i = threadIdx.x; i < (1 << KB2); i += blockDim.x) {
          copy_async<4>(bounds_b + i, p.k2_bounds + i);
          copy_async<4>(centroids_b + i, p.k2_centroids + i);
        }
        for (int i = threadIdx.x; i < QA; i += blockDim.x) copy_async<4>(hartley + i, p.hartley_a + i);
        for (int i = threadIdx.x; i < QB; i += blockDim.x) copy_async<4>(hartley + QA + i, p.hartley_b + i);
      }
    }
    if (threadIdx.x == 0) {
      lengths[0] = n_new, lengths[1] = seen, lengths[2] = first_at;
      // The add depends on seen's value (seen >= 0), so the arrival cannot be performed before the read of it.
      if (p.arrivals != nullptr) ticket = atomicAdd(p.arrivals + b * p.arrival_stride, 1 + min(seen, 0));
    }
    copy_async_wait_all();
    __syncthreads();
    at.n_new = lengths[0];
    at.slot0 = lengths[1];
    start = lengths[2];
    at.first = p.ring ? max(at.n_new - p.capacity, 0) : 0;  // a ring keeps only the last N of a long chunk
    at.capacity = p.capacity;
    at.ring = p.ring != 0;
  };
  Placement at;
  int start, ticket = 0;
  bool inline_exact = false;  // the exact rows written by code_tokens
  uint8_t* warp_cells = cells[threadIdx.x / 32];
  // Two disjoint branches, so that nothing of one is live in the other.
  if (tiles) {
    stage(at, start, ticket);
    if constexpr (TILES) {
      switch (bits) {
        case 2: code_tiles<D, DTYPE, 2, TRANSFORM>(p, is_key, b, bh, at, tab, tile_grid, warp_cells); break;
        case 3: code_tiles<D, DTYPE, 3, TRANSFORM>(p, is_key, b, bh, at, tab, tile_grid, warp_cells); break;
        case 4: code_tiles<D, DTYPE, 4, TRANSFORM>(p, is_key, b, bh, at, tab, tile_grid, warp_cells); break;
        case 5: code_tiles<D, DTYPE, 5, TRANSFORM>(p, is_key, b, bh, at, tab, tile_grid, warp_cells); break;
        case 6: code_tiles<D, DTYPE, 6, TRANSFORM>(p, is_key, b, bh, at, tab, tile_grid, warp_cells); break;
        case 8: code_tiles<D, DTYPE, 8, TRANSFORM>(p, is_key, b, bh, at, tab, tile_grid, warp_cells); break;
      }
    }
  } else {
    // The first rows are fetched before the tables are staged and the lengths read (any token below T is a valid
    // address), so that a decode step waits for one round trip to memory rather than three.
    const Rows<DTYPE, PL> rows = first_rows<D, PL, DTYPE>(p, is_key, b, bh % p.num_kv_heads);
    int order[GROUP_LANE_VALUES];
    if constexpr (GA > 0) {
      if (is_key) key_order_ahead<D>(p.key_order, bh, order);  // read as the CTA starts
    }
    stage(at, start, ticket);
    // A decode step (the short path) writes the exact rows from the registers it codes the tokens from.
    const ExactRows exact{at.n_new, at.slot0, start};
    if constexpr (PL == short_chunk_per_lane<D>())
      inline_exact = exact_rows_inline<DTYPE>(p, is_key ? 0 : 1, b, bh % p.num_kv_heads);
    const ExactRows* ex = inline_exact ? &exact : nullptr;
    bool coded = false;
    if constexpr (GA > 0) {
      if (is_key) {
        constexpr int QA = GroupShape<GA>::HARTLEY;
        const Tables tab_b{grid_b, bounds_b, centroids_b, signs, p.k2_grid_lo, p.k2_grid_scale, p.k2_grid_size};
        float* work = group_work + (threadIdx.x / 32) * D;
        auto code = [&](bool valid, int slot, const RawRow<DTYPE, PL>& raw) {
          code_grouped_key<D, GA, KB, KB2, DTYPE>(p, b, bh, valid, slot, raw, tab, tab_b, hartley, hartley + QA, order,
                                                  work, warp_cells, rows.transform_ahead ? rows.shift : nullptr,
                                                  rows.transform_ahead ? rows.gain : nullptr);
        };
        for_each_token<D, PL, DTYPE>(p, true, b, bh, at, rows, ex, code);
        coded = true;
      }
    }
    if (!coded) switch (bits) {
      case 2: code_tokens<D, PL, DTYPE, 2>(p, is_key, b, bh, at, tab, warp_cells, rows, ex); break;
      case 3: code_tokens<D, PL, DTYPE, 3>(p, is_key, b, bh, at, tab, warp_cells, rows, ex); break;
      case 4: code_tokens<D, PL, DTYPE, 4>(p, is_key, b, bh, at, tab, warp_cells, rows, ex); break;
      case 5: code_tokens<D, PL, DTYPE, 5>(p, is_key, b, bh, at, tab, warp_cells, rows, ex); break;
      case 6: code_tokens<D, PL, DTYPE, 6>(p, is_key, b, bh, at, tab, warp_cells, rows, ex); break;
      case 8: code_tokens<D, PL, DTYPE, 8>(p, is_key, b, bh, at, tab, warp_cells, rows, ex); break;
    }
  }
  const int n_new = at.n_new;
  if ((p.exact_recent > 0 || p.exact_first > 0) && !inline_exact)
    copy_exact_rows<D, DTYPE>(p, is_key, b, bh % p.num_kv_heads, ExactRows{n_new, at.slot0, start});
  // The last CTA of this sequence to arrive (stage) advances its length.  Only thread 0 of each CTA read it, and each
  // arrived after its read had returned, so no read can still be pending: no fence is needed, and the update is a
  // fire-and-forget reduction (nothing in this launch reads it back).  One counter per sequence: a single one took
  // every CTA's atomic at one address (512 at B = 32 with 8 KV heads).
  if (p.arrivals == nullptr) return;  // the caller advances the lengths
  const int ctas = static_cast<int>(gridDim.x) * p.num_kv_heads * 2;  // every token block, KV head and side
  if (threadIdx.x == 0 && ticket == ctas - 1) {
    atomicAdd(p.seen + b, n_new);
    p.arrivals[b * p.arrival_stride] = 0;  // ready for the next launch (and the next replay of a captured graph)
  }
}

// CTAs of quantize_append_kernel<D, PL, DTYPE, TILES, TRANSFORM> resident per SM (registers and shared memory), asked
// once.
template <int D, int PL, int DTYPE, bool TILES, bool TRANSFORM, int GA, int KB, int KB2>
int resident_ctas(int threads) {
  static int per_sm[MAX_WARPS + 1] = {};
  const int warps = threads / 32;
  if (per_sm[warps] == 0)
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm[warps], quantize_append_kernel<D, PL, DTYPE, TILES, TRANSFORM, GA, KB, KB2>, threads, 0);
  return per_sm[warps];
}

template <int D, int PL, int DTYPE, bool TILES, bool TRANSFORM = false, int GA = 0, int KB = 0, int KB2 = 0>
int launch(const QuantizeParams& p, int batch, int sms, cudaStream_t stream) {
  constexpr int PER_WARP = TILES ? TILE_ROWS : QuantShape<D, PL>::VECTORS;  // tokens a warp codes per step
  const int rows = 2 * batch * p.num_kv_heads;
  const int warps = min(MAX_WARPS, (p.tokens + PER_WARP - 1) / PER_WARP);
  const int blocks = (p.tokens + warps * PER_WARP - 1) / (warps * PER_WARP);
  // One wave of resident CTAs over all (sequence, KV head, side) rows: long chunks keep the GPU full and each CTA's
  // staged tables serve many tokens.
  const int per_row = max(1, (resident_ctas<D, PL, DTYPE, TILES, TRANSFORM, GA, KB, KB2>(warps * 32) * sms) / rows);
  const dim3 grid(min(blocks, per_row), batch * p.num_kv_heads, 2);
  quantize_append_kernel<D, PL, DTYPE, TILES, TRANSFORM, GA, KB, KB2><<<grid, warps * 32, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <int D, int DTYPE>
int launch_for_shape(const QuantizeParams& p, int batch, int sms, cudaStream_t stream) {
  if (p.tokens <= SHORT_CHUNK) return launch<D, short_chunk_per_lane<D>(), DTYPE, false>(p, batch, sms, stream);
  // The tile loop pays for its CTAs' set-up (the tile grid) over many tokens: at 2K tokens of one D = 256 head it took
  // 22.7 us against the scalar loop's 12.7, at 1000 tokens of 8 D = 128 heads the same time (BENCHMARKS.md).
  if (static_cast<long long>(batch) * p.num_kv_heads * p.tokens < TILE_MIN_TOKENS)
    return launch<D, long_chunk_per_lane<D>(), DTYPE, false>(p, batch, sms, stream);
  // Keys with a transform take code_tokens in the tile kernel too, at 16 coordinates per lane: at 32 its registers
  // would set the kernel's.
  // A key transform gets its own build of the tile kernel: its three-part rotation's registers (124 bytes spilled at
  // 128) made the plain appends 6% slower when both lived in one kernel.  At D = 256 it takes the scalar kernel: the
  // tile kernel's keys through code_tokens (3 CTAs of 168 registers) took 232 us where the scalar kernel takes 194.
  if (p.key_shift != nullptr) {
    if constexpr (D <= 128 && DTYPE != 2) return launch<D, 16, DTYPE, true, true>(p, batch, sms, stream);
    return launch<D, long_chunk_per_lane<D>(), DTYPE, false>(p, batch, sms, stream);
  }
  if constexpr (D <= 256 && DTYPE != 2) return launch<D, 16, DTYPE, true>(p, batch, sms, stream);
  else return launch<D, long_chunk_per_lane<D>(), DTYPE, false>(p, batch, sms, stream);
}

// Keys in groups: every append takes the decode-step shape (a key per warp: code_grouped_key).
template <int D, int GA, int KB, int KB2>
int launch_groups(const QuantizeParams& p, int batch, int sms, cudaStream_t stream) {
  constexpr int PL = short_chunk_per_lane<D>();
  static_assert(PL == GROUP_LANE_VALUES, "a grouped key over one warp");
  switch (p.in_dtype) {
    case 0: return launch<D, PL, 0, false, false, GA, KB, KB2>(p, batch, sms, stream);
    case 1: return launch<D, PL, 1, false, false, GA, KB, KB2>(p, batch, sms, stream);
    default: return launch<D, PL, 2, false, false, GA, KB, KB2>(p, batch, sms, stream);
  }
}

template <int D>
int launch_for_dtype(const QuantizeParams& p, int batch, int sms, cudaStream_t stream) {
  switch (p.in_dtype) {
    case 0: return launch_for_shape<D, 0>(p, batch, sms, stream);
    case 1: return launch_for_shape<D, 1>(p, batch, sms, stream);
    default: return launch_for_shape<D, 2>(p, batch, sms, stream);
  }
}

}  // namespace
}  // namespace turboattn

int launch_quantize_append(const turboattn::QuantizeParams& params, int head_dim, int batch, int sms,
                           void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (params.key_group_a != 0) {
#define TURBOATTN_QUANTIZE_GROUPS(D_, GA_, KB_, KB2_, VB_)                                                       \
  if (head_dim == D_ && params.key_group_a == GA_ && params.k_bits == KB_ && params.k_bits_b == KB2_)          \
    return turboattn::launch_groups<D_, GA_, KB_, KB2_>(params, batch, sms, s);
    TURBOATTN_KEY_GROUPS(TURBOATTN_QUANTIZE_GROUPS)
#undef TURBOATTN_QUANTIZE_GROUPS
    return -1;
  }
  switch (head_dim) {
    case 64: return turboattn::launch_for_dtype<64>(params, batch, sms, s);
    case 128: return turboattn::launch_for_dtype<128>(params, batch, sms, s);
    case 256: return turboattn::launch_for_dtype<256>(params, batch, sms, s);
    case 512: return turboattn::launch_for_dtype<512>(params, batch, sms, s);
    default: return -1;
  }
}
