// Keys in two channel groups (format/codec.py key_groups), the device side shared by the decode kernel (which puts q
// into the groups' domain) and quantize-append (which codes keys in it): a vector of D = 256 coordinates over a warp,
// 8 per lane, taken into the stored channel order, and each group's rotation (format/rotation.py: H_P ⊗ Q_m for a
// group of P * m channels, m odd) in shared memory: rows of m coordinates through the Hartley factor, then columns of
// P through butterflies, a lane per row or column, unnormalized (the caller folds in 1 / sqrt(P)).
#pragma once
#include <stdint.h>

namespace turboattn {

constexpr int GROUP_LANE_VALUES = 8;  // coordinates per lane: D = 256 over a warp

template <int W>
struct GroupShape {  // a key group of W = P * M channels, M odd
  static constexpr int M = W / (W & -W);
  static constexpr int P = W / M;
  static constexpr int HARTLEY = M * M;  // floats of its Hartley factor
  static_assert(P <= 32, "a group's butterflies run in one lane's registers: P <= 32");
};

template <int D, int GA>
__host__ __device__ constexpr int hartley_floats() {
  if constexpr (GA == 0) return 1;
  else return GroupShape<GA>::HARTLEY + GroupShape<D - GA>::HARTLEY;
}

// z[c] = sum_r x[r] Q[r][c] over a row of M coordinates, in place (format/rotation.py's row-vector product).
template <int M>
__device__ __forceinline__ void hartley_row(float* x, const float* q) {
  float in[M];
#pragma unroll
  for (int r = 0; r < M; ++r) in[r] = x[r];
#pragma unroll
  for (int c = 0; c < M; ++c) {
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < M; ++r) acc = fmaf(in[r], q[r * M + c], acc);
    x[c] = acc;
  }
}

// The unnormalized Walsh-Hadamard transform of N values in registers, in place (natural order).
template <int N>
__device__ __forceinline__ void walsh_hadamard(float (&v)[N]) {
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i & h) continue;
      const float u = v[i], w = v[i + h];
      v[i] = u + w;
      v[i + h] = u - w;
    }
  }
}

// The unnormalized Walsh-Hadamard transform of a column x[p M], p < P, in place.
template <int P, int M>
__device__ __forceinline__ void hadamard_column(float* x) {
  float v[P];
#pragma unroll
  for (int i = 0; i < P; ++i) v[i] = x[i * M];
  walsh_hadamard(v);
#pragma unroll
  for (int i = 0; i < P; ++i) x[i * M] = v[i];
}

// Both groups of a warp's key in `work` (group a's GA channels, then group b's) through their rotations.
template <int D, int GA>
__device__ __forceinline__ void rotate_key_groups(float* work, const float* q_a, const float* q_b) {
  using A = GroupShape<GA>;
  using B = GroupShape<D - GA>;
  const int lane = threadIdx.x % 32;
  __syncwarp();
  for (int row = lane; row < A::P + B::P; row += 32) {
    if (row < A::P) {
      if constexpr (A::M > 1) hartley_row<A::M>(work + row * A::M, q_a);
    } else {
      if constexpr (B::M > 1) hartley_row<B::M>(work + GA + (row - A::P) * B::M, q_b);
    }
  }
  __syncwarp();
  for (int col = lane; col < A::M + B::M; col += 32) {
    if (col < A::M) hadamard_column<A::P, A::M>(work + col);
    else hadamard_column<B::P, B::M>(work + GA + (col - A::M));
  }
  __syncwarp();
}

// x (the lane's coordinates 8 lane + i) taken into the stored order through `row` (the warp's D floats of shared
// memory): stored channel 8 lane + i is channel order[i].  The caller has synced the warp since row was last read.
__device__ __forceinline__ void to_stored_order(float (&x)[GROUP_LANE_VALUES], float* row,
                                                const int (&order)[GROUP_LANE_VALUES]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < GROUP_LANE_VALUES; ++i) row[GROUP_LANE_VALUES * lane + i] = x[i];
  __syncwarp();
#pragma unroll
  for (int i = 0; i < GROUP_LANE_VALUES; ++i) x[i] = row[order[i]];
  __syncwarp();
}

// The lane's stored channels' model channels (key_order [B, Hkv, D] int16, row bh; nullptr: the identity).
template <int D>
__device__ __forceinline__ void key_order_ahead(const int16_t* key_order, int bh, int (&order)[GROUP_LANE_VALUES]) {
  const int c0 = (threadIdx.x % 32) * GROUP_LANE_VALUES;
#pragma unroll
  for (int i = 0; i < GROUP_LANE_VALUES; ++i)
    order[i] = key_order != nullptr ? key_order[static_cast<size_t>(bh) * D + c0 + i] : c0 + i;
}

}  // namespace turboattn
