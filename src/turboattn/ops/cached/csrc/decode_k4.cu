// Split-K decode over a 4-bit compressed cache (K and V), head_dim 128, on tensor cores (mma.sync m16n8k16).
//
// One CTA per (split, sequence x KV head), 4 warps; each warp walks 16-key tiles of the split and keeps its own
// online softmax, and the warps are combined at the end.  Keys sit on the MMA's M side ("swap AB": a decode step
// has at most 8 query rows per KV head, the N = 8 side), and every code byte is decoded exactly once per CTA,
// straight into an MMA fragment (lane = 4 g + c):
//   * scores S^T = K Q^T: the A operand (16 keys x 16 dims) of lane (g, c) holds keys g and g + 8 at the k-indices
//     2c, 2c+1, 2c+8, 2c+9.  The dot product does not care which dim sits at which k-index as long as Q^T uses the
//     same order, so a lane takes 16 contiguous code bytes of each of its keys (bytes 16c..16c+15): byte i gives the
//     half2 (centroid of dim 16c+i, centroid of dim 64+16c+i) (planar nibbles), exactly one A register.
//   * output O^T = V^T P^T: P^T leaves the score accumulators in the A/C layout and one movmatrix.trans per 8 keys
//     puts it in the B layout; the A operand (16 dims x 16 keys) of lane (g, c) holds keys 2c, 2c+1, 2c+8, 2c+9 at
//     dims g and g + 8 of the tile; a lane takes code bytes 8g..8g+7 of those keys, and byte-permutes pair two
//     keys' centroids per register.  Output dims are un-permuted on store.
// Centroids come from a byte -> half2 table in shared memory, one copy per lane (no bank conflicts).
// The scores carry q_scale (with log2 e unless softcap) and the K scale; P is multiplied by the V scale before
// the PV product.  Each CTA writes its split's normalized output and log2-sum-exp (the Triton merge reads them).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "decode_k4.h"

namespace turboattn {

constexpr int WARPS = 4;
constexpr int TILE_KEYS = 16;
constexpr int MAX_ROWS = 8;
constexpr int ROW_BYTES = HEAD_DIM / 2;  // 4-bit codes
constexpr int SMEM_BYTES = 256 * 32 * 4 + MAX_ROWS * HEAD_DIM * 4 + WARPS * MAX_ROWS * 2 * 4;

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float load_q(const DecodeParams& p, long long offset) {
  if (p.q_dtype == 0) return __half2float(reinterpret_cast<const __half*>(p.q)[offset]);
  if (p.q_dtype == 1) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.q)[offset]);
  return reinterpret_cast<const float*>(p.q)[offset];
}

__device__ __forceinline__ uint32_t byte_of(uint32_t word, int i) { return (word >> (8 * i)) & 0xFF; }

// One warp's 16-key tile as this lane needs it: K code words of keys g and g + 8 (16 bytes each), V code words of
// keys 2c, 2c+1, 2c+8, 2c+9 (8 bytes each), and the scales of keys g and g + 8 (the lane's score keys).
struct TileData {
  uint4 kw[2];
  uint2 vw[4];
  float k_scale[2], v_scale[2];
};

__device__ __forceinline__ void load_tile(const DecodeParams& p, size_t row0, int tile, int hi, int g, int c,
                                          TileData& t) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int slot = tile + 8 * n + g;
    const bool ok = slot < hi;
    t.kw[n] = ok ? *reinterpret_cast<const uint4*>(p.k_codes + (row0 + slot) * ROW_BYTES + 16 * c)
                 : make_uint4(0, 0, 0, 0);
    t.k_scale[n] = ok ? p.k_scales[row0 + slot] : 0.f;
    t.v_scale[n] = ok ? p.v_scales[row0 + slot] : 0.f;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int slot = tile + 2 * c + (j & 1) + 8 * (j >> 1);
    t.vw[j] = slot < hi ? *reinterpret_cast<const uint2*>(p.v_codes + (row0 + slot) * ROW_BYTES + 8 * g)
                        : make_uint2(0, 0);
  }
}

// MIN_BLOCKS: CTAs per SM the register allocation must allow.
template <int MIN_BLOCKS>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) decode_k4_d128(const DecodeParams p) {
  // Shared memory: the lookup table (256 bytes x 32 lanes of half2 = 32 KB, later reused to combine the warps),
  // the rotated queries, and the warps' row statistics.
  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* lut = reinterpret_cast<uint32_t*>(smem);
  float* q_rot = reinterpret_cast<float*>(smem + 256 * 32 * 4);     // [MAX_ROWS][HEAD_DIM]
  float* warp_ml = q_rot + MAX_ROWS * HEAD_DIM;                      // [WARPS][MAX_ROWS][2]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int split = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.num_kv_heads, kvh = bh % p.num_kv_heads;
  const int rows = p.tq * p.group;

  for (int i = tid; i < 256 * 32; i += WARPS * 32) {
    const int byte = i >> 5;
    lut[i] = pack_half2(p.centroids[byte & 15], p.centroids[byte >> 4]);
  }
  // Queries of the GQA group: row r = token r / G of query head kvh * G + r % G; q / gain, signs, then H.
  for (int i = tid; i < MAX_ROWS * HEAD_DIM; i += WARPS * 32) {
    const int r = i / HEAD_DIM, d = i % HEAD_DIM;
    float x = 0.f;
    if (r < rows) {
      const int t = r / p.group, h = kvh * p.group + r % p.group;
      x = load_q(p, b * p.q_stride_b + h * p.q_stride_h + t * p.q_stride_t + d);
      if (p.gain_inv) x *= p.gain_inv[(size_t)bh * HEAD_DIM + d];
      x *= p.signs[d];
    }
    q_rot[i] = x;
  }
  __syncthreads();
  for (int h = 1; h < HEAD_DIM; h <<= 1) {  // fast Walsh-Hadamard transform of each row, in place
    for (int i = tid; i < MAX_ROWS * HEAD_DIM / 2; i += WARPS * 32) {
      const int r = i / (HEAD_DIM / 2), j = i % (HEAD_DIM / 2);
      const int lo = (j / h) * 2 * h + (j % h), hi = lo + h;
      const float x = q_rot[r * HEAD_DIM + lo], y = q_rot[r * HEAD_DIM + hi];
      q_rot[r * HEAD_DIM + lo] = x + y;
      q_rot[r * HEAD_DIM + hi] = x - y;
    }
    __syncthreads();
  }
  const float q_norm = p.q_scale * rsqrtf((float)HEAD_DIM);
  // B fragments of Q^T (16 dims x 8 rows) for the 8 k-steps: row g, the dims of k-indices 2c, 2c+1 / 2c+8, 2c+9.
  uint32_t qb[8][2];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int d0 = 16 * c + 2 * kk;
    qb[kk][0] = pack_half2(q_rot[g * HEAD_DIM + d0] * q_norm, q_rot[g * HEAD_DIM + 64 + d0] * q_norm);
    qb[kk][1] = pack_half2(q_rot[g * HEAD_DIM + d0 + 1] * q_norm, q_rot[g * HEAD_DIM + 65 + d0] * q_norm);
  }

  // This split's slots, narrowed to what some query can see (as the Triton kernel does).
  const int seen = p.seen[b], start = p.starts[b];
  const int held = min(seen, p.capacity);
  int chunk = (held + p.num_splits - 1) / p.num_splits;
  chunk = (chunk + p.chunk_align - 1) / p.chunk_align * p.chunk_align;
  const int lo = split * chunk;
  int hi = min(lo + chunk, held);
  const int qpos_base = p.has_fresh ? seen : seen - p.tq;
  if (!p.ring) hi = min(hi, qpos_base + p.tq);
  // This lane's score rows: 2c and 2c + 1.
  int qpos[2];
  bool row_ok[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * c + e;
    row_ok[e] = r < rows;
    qpos[e] = qpos_base + r / p.group;
  }

  const size_t row0 = (size_t)bh * p.capacity;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[8][4];
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  // Each warp keeps its next tile's loads in flight while it computes the current one.
  TileData next;
  load_tile(p, row0, lo + warp * TILE_KEYS, hi, g, c, next);
  for (int tile = lo + warp * TILE_KEYS; tile < hi; tile += WARPS * TILE_KEYS) {
    const TileData cur = next;
    if (tile + WARPS * TILE_KEYS < hi) load_tile(p, row0, tile + WARPS * TILE_KEYS, hi, g, c, next);
    // Scores S^T (16 keys x 8 rows): 8 MMAs over the 128 dims.
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t k0[4] = {cur.kw[0].x, cur.kw[0].y, cur.kw[0].z, cur.kw[0].w};
    const uint32_t k1[4] = {cur.kw[1].x, cur.kw[1].y, cur.kw[1].z, cur.kw[1].w};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const int i0 = (2 * kk) % 4, i1 = (2 * kk + 1) % 4;
      mma_16816(s, lut[(byte_of(k0[kk / 2], i0) << 5) | lane], lut[(byte_of(k1[kk / 2], i0) << 5) | lane],
                lut[(byte_of(k0[kk / 2], i1) << 5) | lane], lut[(byte_of(k1[kk / 2], i1) << 5) | lane],
                qb[kk][0], qb[kk][1]);
    }
    // s[2n + e]: key g + 8n, row 2c + e.  Scale, cap, mask, then the online softmax of rows 2c, 2c + 1.
    bool key_ok[2];
    int key_pos[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int slot = tile + 8 * n + g;
      const int pos = p.ring ? slot + p.capacity * ((seen - 1 - slot) / p.capacity) : slot;
      key_ok[n] = slot < hi && pos >= start;
      key_pos[n] = pos;
    }
    float pr[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        float x = s[2 * n + e] * cur.k_scale[n];
        if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap) * 1.4426950408889634f;
        bool keep = row_ok[e] && key_ok[n] && key_pos[n] <= qpos[e];
        if (p.window > 0) keep = keep && (qpos[e] - key_pos[n] < p.window);
        x = keep ? x : -INFINITY;
        s[2 * n + e] = x;
        mx = fmaxf(mx, x);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 16));
      const float m_new = fmaxf(m[e], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[e] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float e2 = exp2f(s[2 * n + e] - m_use);
        sum += e2;
        pr[2 * n + e] = e2 * cur.v_scale[n];
      }
      l[e] = l[e] * alpha + sum;
      m[e] = m_new;
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        acc[t][e] *= alpha;
        acc[t][2 + e] *= alpha;
      }
    }
    // P^T (16 keys x 8 rows) from the accumulator layout to the B layout: one 8x8 transpose per 8 keys.
    const uint32_t pb0 = transpose_8x8(pack_half2(pr[0], pr[1]));
    const uint32_t pb1 = transpose_8x8(pack_half2(pr[2], pr[3]));
    // O^T += V^T P^T: dim tile t holds dims 8g' + t (rows g') and 64 + 8g' + t (rows g' + 8).
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      uint32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = lut[(byte_of(t < 4 ? cur.vw[j].x : cur.vw[j].y, t % 4) << 5) | lane];
      mma_16816(acc[t], __byte_perm(x[0], x[1], 0x5410), __byte_perm(x[0], x[1], 0x7632),
                __byte_perm(x[2], x[3], 0x5410), __byte_perm(x[2], x[3], 0x7632), pb0, pb1);
    }
  }

  // Combine the warps: row sums over the 8 lanes of a row (same c), then max / rescale across warps.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l[e] += __shfl_xor_sync(0xffffffff, l[e], 4);
    l[e] += __shfl_xor_sync(0xffffffff, l[e], 8);
    l[e] += __shfl_xor_sync(0xffffffff, l[e], 16);
  }
  __syncthreads();  // the lookup table is no longer read: its space takes the warps' outputs
  float* o_warp = reinterpret_cast<float*>(smem);  // [WARPS][MAX_ROWS][HEAD_DIM] = 16 KB
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      warp_ml[(warp * MAX_ROWS + 2 * c + e) * 2] = m[e];
      warp_ml[(warp * MAX_ROWS + 2 * c + e) * 2 + 1] = l[e];
    }
  }
  __syncthreads();
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * c + e;
    float mall = -INFINITY;
    for (int w = 0; w < WARPS; ++w) mall = fmaxf(mall, warp_ml[(w * MAX_ROWS + r) * 2]);
    const float f = exp2f(m[e] - (mall == -INFINITY ? 0.f : mall));
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      o_warp[(warp * MAX_ROWS + r) * HEAD_DIM + 8 * g + t] = acc[t][e] * f;
      o_warp[(warp * MAX_ROWS + r) * HEAD_DIM + 64 + 8 * g + t] = acc[t][2 + e] * f;
    }
  }
  __syncthreads();
  for (int i = tid; i < rows * HEAD_DIM; i += WARPS * 32) {
    const int r = i / HEAD_DIM, d = i % HEAD_DIM;
    float mall = -INFINITY;
    for (int w = 0; w < WARPS; ++w) mall = fmaxf(mall, warp_ml[(w * MAX_ROWS + r) * 2]);
    const float m_use = mall == -INFINITY ? 0.f : mall;
    float lsum = 0.f, o = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      lsum += warp_ml[(w * MAX_ROWS + r) * 2 + 1] * exp2f(warp_ml[(w * MAX_ROWS + r) * 2] - m_use);
      o += o_warp[(w * MAX_ROWS + r) * HEAD_DIM + d];
    }
    const size_t part = ((size_t)bh * p.num_parts + split) * rows + r;
    p.o_part[part * HEAD_DIM + d] = lsum > 0.f ? o / lsum : 0.f;
    if (d == 0) p.lse_part[part] = lsum > 0.f ? m_use + log2f(lsum) : -INFINITY;
  }
}

}  // namespace turboattn

template <int MIN_BLOCKS>
static int launch(const turboattn::DecodeParams& params, int num_splits, int batch_kv_heads, cudaStream_t stream) {
  turboattn::decode_k4_d128<MIN_BLOCKS><<<dim3(num_splits, batch_kv_heads), turboattn::WARPS * 32,
                                          turboattn::SMEM_BYTES, stream>>>(params);
  return static_cast<int>(cudaGetLastError());
}

int launch_decode_k4_d128(const turboattn::DecodeParams& params, int num_splits, int batch_kv_heads, int min_blocks,
                          void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (min_blocks >= 4) return launch<4>(params, num_splits, batch_kv_heads, s);
  return min_blocks == 3 ? launch<3>(params, num_splits, batch_kv_heads, s)
                         : launch<2>(params, num_splits, batch_kv_heads, s);
}
