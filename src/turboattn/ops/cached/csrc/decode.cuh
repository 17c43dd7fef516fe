// Split-K decode over a compressed cache on tensor cores (mma.sync m16n8k16): K and V codes of 2 to 8 bits (the
// pairs of TURBOATTN_BIT_PAIRS, decode.h), head_dim 64 / 128 / 256 / 512.  Included by one translation unit per head dim
// and variant (decode_d*.cu), so that nvcc builds them in parallel.
//
// One CTA per (split, sequence x KV head), 4 warps; each warp walks 16-key tiles of the split and keeps its own
// online softmax, and the warps are combined at the end.  (k4v4, k3v3 and k2v2 at D = 128 launch CTAs of two such
// teams, one part each, that share the code table: Shape::TEAMS; D = 128's plain kernels on 3 CTAs per SM, but
// k4v3's, run a tile's PV product in the next tile's step: Shape::SKEWED.)  Keys sit on the MMA's M side ("swap
// AB": a decode step has at most 8 query rows per KV head, the N = 8 side), and every code byte is decoded exactly
// once per CTA, straight into an MMA fragment (lane = 4 g + c):
//   * scores S^T = K Q^T: the A operand (16 keys x 16 dims) of lane (g, c) holds keys g and g + 8 at the k-indices
//     2c, 2c+1, 2c+8, 2c+9.  The dot product does not care which dim sits at which k-index as long as Q^T uses the
//     same order, so a lane takes a contiguous quarter of each of its keys' code bytes and every byte goes
//     straight into A registers; KeyCodes<BITS>::dim says which dim each k-index then holds, and the q fragments
//     follow it.
//   * output O^T = V^T P^T: P^T leaves the score accumulators in the A/C layout and one movmatrix.trans per 8 keys
//     puts it in the B layout; the A operand (16 dims x 16 keys) of lane (g, c) holds keys 2c, 2c+1, 2c+8, 2c+9 at
//     rows g and g + 8 of a 16-dim tile; a lane takes an eighth of those keys' code bytes (bytes g ...), and a
//     register pairs two keys' centroids of one dim: 4-bit codes, and 2 and 3-bit codes at D <= 256, merge the two
//     keys' fields into one byte first, whose lookup is the register; the others byte-permute two lookups.
//     ValueCodes<BITS>::dim says which dims tile t holds; output dims are un-permuted on store.
//   Key m above is the MMAs' row m (k-index m of the PV product), which holds key tile_key(m) of the tile: a
//   permutation where it makes each value load read whole 128-byte lines (Shape::PERMUTED_KEYS).
// Centroids come from byte -> fp16 tables in shared memory (CodeTable), a copy per lane or per lane pair (no bank
// conflicts); a lookup is one byte-permute (rows 256 bytes apart) or one shift and one lop3, and one shared load.
// 8-bit codes' uniform levels are computed from the byte instead (CodeTable<8>: a byte-permute and an fma per
// register, no table).  The packed format is the codec's (planar bit planes); codes of two planes (3, 5, 6 bits)
// are merged into table bytes on the fly (merge_planes: one select per word and half, plus its shifts).
// The scores carry q_scale (with log2 e unless softcap) and the K scale; P is multiplied by the V scale before
// the PV product.  The running row maximum is only recomputed across lanes when some score exceeds it (a warp
// vote), and tiles that no mask can touch skip the position arithmetic.  Each CTA writes its split's normalized
// output and log2-sum-exp; with counters given, the last CTA of each (sequence, KV head) merges all parts
// (merge_parts) in the same launch, and otherwise a second launch merges them (merge_rows): one CTA per output row,
// or at D = 512, where each CTA writes its part rotated back into the model's domain, per slice of a row's dims.
// D = 512 splits each row's dims over the warps instead of its keys (Shape::SLICED) and reads two norm blocks
// (KeyCodes::BLOCKED).  Keys in two channel groups (KeyGroups, decode_groups.cu) take q already in the groups'
// domain and score each group in its own chain.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

#include "codebooks.h"
#include "decode.h"
#include "key_groups.cuh"

namespace turboattn {

constexpr int WARPS = 4;
constexpr int TILE_KEYS = 16;
constexpr int MAX_ROWS = 8;
static_assert(MAX_ROWS % WARPS == 0, "each warp rotates MAX_ROWS / WARPS query rows");

// A warp-uniform value through a shuffle from lane 0: ptxas takes the result as uniform across the warp and cannot
// recompute it from its source, so what derives from it can stay in uniform registers.
__device__ __forceinline__ uint32_t from_lane0(uint32_t x) { return __shfl_sync(0xffffffffu, x, 0); }

// A decode CTA holds TEAMS teams of WARPS warps (Shape::TEAMS): each team is one part of the grid (what the rest of
// this file calls a CTA: its own split, barriers and shared arrays), and the teams share the code tables.
// The team's index from lane 0 (from_lane0): what derives from it (the part, its bounds and pointers, the team's
// arrays) then stays in uniform registers, as a one-team CTA's does (from the thread index itself, ptxas kept them
// in the 128 registers of 4 CTAs per SM and spilled 24-172 bytes).
template <int TEAMS>
__device__ __forceinline__ int team_index() {
  return TEAMS == 1 ? 0 : static_cast<int>(from_lane0(static_cast<int>(threadIdx.x) / (WARPS * 32)));
}
template <int TEAMS>
__device__ __forceinline__ int team_thread() { return TEAMS == 1 ? threadIdx.x : threadIdx.x % (WARPS * 32); }
// A barrier of team `team`'s WARPS warps: named barrier 1 + team.
__device__ __forceinline__ void team_barrier(int team) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "n"(WARPS * 32) : "memory");
}
// A barrier of the team's threads; the whole CTA's when one team.
template <int TEAMS>
__device__ __forceinline__ void team_sync() {
  if constexpr (TEAMS == 1) __syncthreads();
  else team_barrier(team_index<TEAMS>());
}

// Phase stamps of a profiling build (nvcc -DTURBOATTN_STAMPS, never in the shipped build; `turboattn bench
// phases` builds and reads it): thread 0 of each CTA writes STAMP_SLOTS 64-bit words after every CTA's part
// in o_part (the probe allocates the room): slots 10 / 11 / 12 the global timer at the start / part written / end,
// 13 the SM, the others the SM clock at: 1 start, 2 loads issued, 9 tables built, 3 q fragments
// ready, 4 main loop done (warp 0), 0 every warp done, 5 part written, 6 merge started (fused), 14 merge weights
// ready, 15 parts summed, 7 end (slot 8 is free; a merge in its own launch, merge_rows, stamps nothing).  The exact
// rows' CTAs (the grid's last) stamp 1 start, 2 set-up done, 9 the first chunk's scores, 3 every chunk attended,
// 5 part written, 7 end, and the global timer.
constexpr int STAMP_SLOTS = 16;
#ifdef TURBOATTN_STAMPS
template <int D>
__device__ __forceinline__ void stamp(const DecodeParams& p, int slot) {
  // A team is a CTA here: team t of launched CTA b stamps for part b + t gridDim.x (decode).
  if (threadIdx.x % (WARPS * 32) != 0) return;
  const size_t parts_floats = (size_t)p.num_parts * p.batch_kv_heads * p.tq * p.group * D;  // parts x rows x D
  const size_t cta = blockIdx.x + threadIdx.x / (WARPS * 32) * (size_t)gridDim.x;
  if (cta >= (size_t)p.num_parts * p.batch_kv_heads) return;  // a second key stream (Shape::STREAMS): not a part
  unsigned long long* at = reinterpret_cast<unsigned long long*>(p.o_part + parts_floats) + cta * STAMP_SLOTS;
  unsigned long long v;
  if (slot >= 10 && slot <= 12) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
  } else if (slot == 13) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    v = sm;
  } else {
    v = clock64();
  }
  at[slot] = v;
}
#define TURBOATTN_STAMP(slot) stamp<D>(p, slot)
#else
#define TURBOATTN_STAMP(slot)
#endif

__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// Bit planes of a BITS-bit code (format/codec.py): the low plane is 2, 4 or 8 bits wide; 3-bit codes add a
// 1-bit plane to a 2-bit one, 5 and 6-bit codes a 1 or 2-bit plane to a 4-bit one.
template <int BITS>
struct Planes {
  static_assert(BITS >= 2 && BITS <= 8 && BITS != 7, "the format has 2, 3, 4, 5, 6 and 8-bit codes");
  static constexpr int LOW = BITS == 3 ? 2 : (BITS == 5 || BITS == 6 ? 4 : BITS);
  static constexpr int HIGH = BITS - LOW;  // 0: one plane
};

// Byte -> fp16 centroid table of a BITS-bit side, COLUMNS copies side by side so that a warp's lookups do not
// conflict: entry (byte, column) is ENTRY_WORDS words at word (byte * COLUMNS + column) * ENTRY_WORDS, for bytes
// below ROWS, and lane l reads column l % COLUMNS.  One column per lane (32), except COMPACT 2-bit tables: an 8-byte
// lookup takes two shared-memory wavefronts anyway, so 16 columns (lanes l and l + 16 sharing one) halve the table
// to 32 KB.  They serve the kernels that hold a second table (k4v2, k2v4: one CTA more per SM, 4-15% faster at
// D <= 128, H100) and k2v2 at D = 64 (4 CTAs instead of 3: 7% faster; at D = 128 its plain build now holds two teams
// sharing the full table, Shape::TEAMS).  k2v2's one table keeps 32 columns at D = 256: compact, it
// measured 4% slower on 2 CTAs and up to 16% slower on 3 (q's fragments in shared memory or registers).  k2v8 and
// k8v2 keep the compact table, measured (with the above) beside their 8-bit side's former table; that side has none
// now (CodeTable<8>), and 32 columns were not measured for them since.  An entry
// holds the centroids of every code in the byte, in the order of the planar packing (the low bits' code first):
//   4 bits: half2 (c[byte & 15], c[byte >> 4]);
//   2 bits: half2 (c[byte & 3], c[(byte >> 2) & 3]), half2 (c[(byte >> 4) & 3], c[byte >> 6]);
//   3 bits: half2 (c[a], c[b]) of a byte that merge_planes built: a's low bits at 0-1 and high bit at 4, b's at 2-3
//           and 6 (bits 5 and 7 other dims');
//   5, 6 bits: half2 (c[byte], c[byte]) of a byte that merge_planes built: one code (the bits above it other dims').
// merge_planes takes whole nibbles of the high plane (a select), other dims' bits included.  A narrow table masks
// them off at each lookup (ROW_MASK): three instructions per lookup where masking each code's bits took four.
// Rows are 128 or 256 bytes apart (SHIFT 7 or 8).  At 256 the code byte is an offset's byte 1 and the lane's
// column its byte 0, so one byte-permute makes a lookup's offset where a shift and a lop3 made it (BYTE_ROWS):
// tables of 8-byte entries in 32 columns fill such rows, and WIDE tables of 4-byte entries take them too, where the
// kernel's CTAs per SM still fit (Shape::WIDE).  A WIDE 3, 5 or 6-bit table has a row for every byte, the other
// dims' bits choosing copies of one entry (EVERY_BYTE), so that its lookups need no mask either.  Such rows fill
// half of their 256 bytes (HALF_ROWS), and a second half-row table takes the other half (Shape::INTERLEAVED): two
// sides in 64 KB.  Every-byte tables took 0.88-0.95 of the masked tables' time at D = 128 (k5v3 0.879, k6v6 0.899,
// k5v4 0.919, k4v3 0.921 at B = 8 x 32K), k5v4 0.947 at D = 64 and 0.949 at D = 256, D = 512's k5v3 preset 0.965
// (H200, BENCHMARKS.md).  8-bit codes have no table (CodeTable<8>, below).
template <int BITS, bool COMPACT = false, bool WIDE = false>
struct CodeTable {
  static constexpr int ENTRY_WORDS = BITS == 2 ? 2 : 1;
  // Two-plane codes' bytes (merge_planes) hold other dims' high bits beside the code (3 bits: bits 5 and 7; 5 and 6
  // bits: those above the code).  A narrow table masks them off (ROW_MASK); a WIDE one has a row for every byte,
  // those bits choosing copies of one entry, so that one byte-permute makes the offset (BYTE_ROWS).
  static constexpr bool TWO_PLANES = BITS == 3 || BITS == 5 || BITS == 6;
  static constexpr bool EVERY_BYTE = WIDE && TWO_PLANES;
  static constexpr int ROWS = EVERY_BYTE ? 256 : BITS == 3 ? 0x60 : (TWO_PLANES ? 1 << BITS : 256);
  static constexpr uint32_t ROW_MASK =
      EVERY_BYTE ? 0xFF : BITS == 3 ? 0x5F : (TWO_PLANES ? (1 << BITS) - 1 : 0xFF);
  static constexpr int COLUMNS = COMPACT ? 32 / ENTRY_WORDS : 32;
  static constexpr int ENTRY_ROW_WORDS = COLUMNS * ENTRY_WORDS;  // the words an entry row fills
  static constexpr bool BYTE_ROWS = ROW_MASK == 0xFF && ((WIDE && BITS != 2) || ENTRY_ROW_WORDS == 64);
  // Byte rows of 128-byte entries fill half of their 256 bytes: a second such table takes the other half
  // (Shape::INTERLEAVED).
  static constexpr bool HALF_ROWS = BYTE_ROWS && ENTRY_ROW_WORDS == 32;
  static constexpr int ROW_WORDS = BYTE_ROWS ? 64 : ENTRY_ROW_WORDS;
  static constexpr int WORDS = ROWS * ROW_WORDS;
  static constexpr int SHIFT = ROW_WORDS == 64 ? 8 : 7;  // log2 of an entry row's bytes
  static_assert(ROW_WORDS * 4 == 1 << SHIFT, "an entry row is 128 or 256 bytes");
  // The byte offset of this lane's column in an entry row.  A compact column's index passes through a shuffle, once
  // per kernel: ptxas then cannot see its mask (lane & 15) and keeps the offset in a register, so a lookup's offset
  // is one lop3; when it sees the mask it re-applies it at every lookup (two lop3s: nvcc 13.0, sm_90).  The
  // multiply stays outside, so that the offset is known to be a multiple of 8 and 8-byte lookups stay one load.
  __device__ __forceinline__ static uint32_t lane_offset(int lane) {
    if constexpr (COLUMNS < 32)
      return static_cast<uint32_t>(__shfl_sync(0xffffffffu, lane % COLUMNS, lane)) * 4 * ENTRY_WORDS;
    else return (lane % COLUMNS) * 4 * ENTRY_WORDS;
  }

  // Fills the table from the codebook's constants (codebooks.h); the whole CTA, no barrier at the end.  Store
  // k of thread t writes 16 bytes of entry row byte = t / SPB + k 128 / SPB (SPB stores per row: its columns
  // hold the same entry, four or two of them per store), so a row's stores are consecutive (no bank
  // conflicts) and each field of `byte` is either thread-constant (u = t / SPB) or store-constant (k): the
  // centroids come from small select trees over immediates, and the build waits on no load.
  static constexpr int SPB = COLUMNS * ENTRY_WORDS / 4;
  static constexpr int STORES = ROWS * SPB / (WARPS * 32);
  static_assert(ROWS * SPB % (WARPS * 32) == 0, "the table's stores spread evenly over the threads");

  // Codebook<BITS>::HALF[LO + idx], idx in [0, N) (N a power of two): N - 1 selects between immediates.
  template <int LO, int N>
  __device__ __forceinline__ static uint32_t pick(int idx) {
    if constexpr (N == 1) return Codebook<BITS>::HALF[LO];
    else return idx & (N / 2) ? pick<LO + N / 2, N / 2>(idx) : pick<LO, N / 2>(idx);
  }
  template <int LO>
  __device__ __forceinline__ static uint32_t fixed() { return Codebook<BITS>::HALF[LO]; }

  template <int K>
  __device__ __forceinline__ static void store(uint32_t* table, int t) {
    const int u = t / SPB;
    // byte = u + K * 128 / SPB; u < 128 / SPB.
    uint4 entries;
    if constexpr (BITS == 5 || BITS == 6) {   // one code: c[byte & ROW_MASK] (16 k + u, k's high bits dropped)
      const uint32_t c = pick<16 * (K % (1 << (BITS - 4))), 16>(u);
      const uint32_t e = c | (c << 16);
      entries = make_uint4(e, e, e, e);
    } else if constexpr (BITS == 4) {   // (c[byte & 15], c[byte >> 4]) = (c[u], c[k])
      const uint32_t e = pick<0, 16>(u) | (fixed<K>() << 16);
      entries = make_uint4(e, e, e, e);
    } else if constexpr (BITS == 3) {   // a = (byte & 3) | bit 4 of byte << 2, b = (byte >> 2 & 3) | bit 6 << 2
      const uint32_t e = pick<(K & 1) * 4, 4>(u & 3) | (pick<((K >> 2) & 1) * 4, 4>((u >> 2) & 3) << 16);
      entries = make_uint4(e, e, e, e);
    } else if constexpr (SPB == 8) {   // 2 bits, compact: byte = u + 16 k, fields 0 and 1 are u's, 2 and 3 k's
      const uint32_t e0 = pick<0, 4>(u & 3) | (pick<0, 4>(u >> 2) << 16);
      const uint32_t e1 = fixed<K & 3>() | (fixed<(K >> 2)>() << 16);
      entries = make_uint4(e0, e1, e0, e1);
    } else {   // 2 bits, byte = u + 8 k: fields byte & 3 = u & 3, bits 2-3 = (u >> 2) | (k & 1) << 1, then k's
      const uint32_t e0 = pick<0, 4>(u & 3) | (pick<(K & 1) * 2, 2>(u >> 2) << 16);
      const uint32_t e1 = fixed<(K >> 1) & 3>() | (fixed<(K >> 3)>() << 16);
      entries = make_uint4(e0, e1, e0, e1);
    }
    const int store = t + K * WARPS * 32;
    reinterpret_cast<uint4*>(table)[store / SPB * (ROW_WORDS / 4) + store % SPB] = entries;
  }
  template <int FIRST, int... K>
  __device__ __forceinline__ static void store_all(uint32_t* table, int t, std::integer_sequence<int, K...>) {
    (store<FIRST + K>(table, t), ...);
  }
  __device__ static void build(uint32_t* table) {
    store_all<0>(table, threadIdx.x, std::make_integer_sequence<int, STORES>{});
  }
  // The two teams of a CTA build it together, each half of the stores (t: the thread in its team).
  template <int TEAMS>
  __device__ static void build_shared(uint32_t* table, int team, int t) {
    static_assert(TEAMS == 2 && STORES % 2 == 0, "two teams, half of the stores each");
    if (team == 0) store_all<0>(table, t, std::make_integer_sequence<int, STORES / 2>{});
    else store_all<STORES / 2>(table, t, std::make_integer_sequence<int, STORES / 2>{});
  }
  // Built by a CTA's GROUPS groups of WARPS warps (its key streams: Shape::STREAMS) together; t: the thread in its
  // group.
  template <int GROUPS>
  __device__ static void build_by(uint32_t* table, int group, int t) {
    if constexpr (GROUPS == 1) build(table);
    else build_shared<GROUPS>(table, group, t);
  }

  // Byte i of `word`'s entry for this lane (lane_offset = lane * 4 * ENTRY_WORDS): the byte offset
  // (byte & ROW_MASK) << SHIFT | lane_offset in one byte-permute (BYTE_ROWS: the byte and the lane's offset are the
  // offset's bytes 1 and 0), else in one shift and one lop3 (the fields do not overlap); the table's own address is
  // the shared load's uniform operand.
  __device__ __forceinline__ static uint32_t offset(uint32_t lane_offset, uint32_t word, int i) {
    if constexpr (BYTE_ROWS) return __byte_perm(word, lane_offset, 0x5504 | i << 4);
    const uint32_t shifted = i * 8 <= SHIFT ? word << (SHIFT - 8 * i) : word >> (8 * i - SHIFT);
    return (shifted & (ROW_MASK << SHIFT)) | lane_offset;
  }
  __device__ __forceinline__ static uint32_t lookup(const uint32_t* table, uint32_t lane_offset, uint32_t word,
                                                    int i) {
    return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(table) + offset(lane_offset, word, i));
  }
  __device__ __forceinline__ static uint2 lookup2(const uint32_t* table, uint32_t lane_offset, uint32_t word,
                                                  int i) {
    return *reinterpret_cast<const uint2*>(reinterpret_cast<const char*>(table) + offset(lane_offset, word, i));
  }
};

// 8-bit codes take uniform levels (format/codebook.py: UNIFORM_BITS): code i means (i - 128) / 32, computed instead
// of looked up.  A byte-permute puts two code bytes under the exponent byte 0x64, which makes the float16 pair
// 1024 + i, and one fused multiply-add makes (1024 + i) / 32 - 36 of it: exact, since every level is a float16
// number and the fma rounds once.  Two instructions per register where two lookups and a byte-permute took seven,
// and no table in shared memory.
template <bool COMPACT, bool WIDE>
struct CodeTable<8, COMPACT, WIDE> {
  static constexpr int WORDS = 0;
  static constexpr bool HALF_ROWS = false;
  __device__ __forceinline__ static uint32_t lane_offset(int) { return 0; }
  __device__ __forceinline__ static void build(uint32_t*) {}
  template <int GROUPS>
  __device__ __forceinline__ static void build_by(uint32_t*, int, int) {}
  // half2 (level of byte i of x, level of byte j of x).
  __device__ __forceinline__ static uint32_t levels(uint32_t x, int i, int j) {
    const uint32_t biased = __byte_perm(x, 0x64u, i | 4 << 4 | j << 8 | 4 << 12);  // (1024 + x_i, 1024 + x_j)
    uint32_t y;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(biased), "r"(0x28002800u), "r"(0xD080D080u));  // 1/32, -36
    return y;
  }
};

// Whether a K and a V table share rows (Shape::INTERLEAVED): each fills half of every 256-byte row.
template <class KTable, class VTable>
constexpr bool interleaves() { return KTable::HALF_ROWS && VTable::HALF_ROWS; }

// The low halves of two table words as one half2 register.
__device__ __forceinline__ uint32_t low_halves(uint32_t x, uint32_t y) { return __byte_perm(x, y, 0x5410); }
__device__ __forceinline__ uint32_t high_halves(uint32_t x, uint32_t y) { return __byte_perm(x, y, 0x7632); }

// The bits of a under MASK, the others from b: one lop3 (as inline PTX, so that the compiler does not split it per
// table byte: it folded the masks into each lookup's byte, three instructions per lookup).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t select_bits(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "n"(MASK));  // (a & MASK) | (b & ~MASK)
  return r;
}
// The low nibble of each byte from a, the high nibble from b.
__device__ __forceinline__ uint32_t select_low_nibbles(uint32_t a, uint32_t b) {
  return select_bits<0x0F0F0F0Fu>(a, b);
}

// Table bytes of a two-plane code from a word of its low plane and the word of its high plane that holds the same
// dims' high bits from bit high_shift on: .x from the low nibble of each low byte (fields 0 and 1 of a 2-bit plane,
// field 0 of a 4-bit one), .y from the high nibble.  Field f of a low byte has its high bits at bit 2f (2-bit low
// plane: 1-bit fields interleaved two to one) or 4f (4-bit low plane) of the shifted high byte, so a whole nibble
// of it placed above the low bits carries them (and other dims' bits, which CodeTable::offset masks off;
// high_shift < 4 in every layout).
template <int BITS>
__device__ __forceinline__ uint2 merge_planes(uint32_t low, uint32_t high, int high_shift) {
  return make_uint2(select_low_nibbles(low, high << (4 - high_shift)),
                    select_low_nibbles(low >> 4, high >> high_shift));
}

// Where a lane's high-plane bytes are: a lane reads BYTES contiguous bytes of the low plane from byte `first`
// (dims first + i + k P0 of field k, P0 the low plane's bytes); the same dims' high bits sit in as many contiguous
// bytes of the high plane (P1 bytes, P0 / P1 = 2 or 4 dividing the fields' spacing), from high_offset (in the row),
// at bit high_shift (+ the field's spacing, which merge_planes knows).
template <int BITS, int D>
struct HighPlane {
  using P = Planes<BITS>;
  static constexpr int P0 = D * P::LOW / 8, P1 = P::HIGH ? D * P::HIGH / 8 : 1;
  __device__ __forceinline__ static int offset(int first) { return P0 + first % P1; }
  __device__ __forceinline__ static int shift(int first) { return P::HIGH * (first / P1); }
};

// A row of D codes of BITS bits packed planar (format/codec.py): byte j of a plane of width w holds, at bit offset
// k w, the w bits of dim j + k P, P = D w / 8 (the plane's bytes).  A lane reads slices of the low plane (and the
// same dims' slices of the high plane); the dims a fragment holds follow the low plane's width.
//
// SLICES > 1 (D = 512): the warps split each row's dims instead of its keys; warp s reads slice s, the low plane's
// bytes [s P0 / SLICES, (s + 1) P0 / SLICES), and a lane's slot in the row is s 4 + c (keys) or s 8 + g (values).
// Its arithmetic is then the D / SLICES kernel's, with D's plane strides.
//
// Norm blocks (format/codec.py): D = 512 stores one scale per 256 dims (block b: dims [256 b, 256 b + 256)), and a
// byte of a 2 or 4-bit plane holds dims of both blocks (j and j + 256 for 4 bits).  There ("BLOCKED") each k-step
// and each output tile takes the dims of one block only, so that the block's scale can still multiply the score
// after the MMA and P before the PV MMA: k-step kk and tile t hold block kk % 2 and t % 2, built from the same
// bytes as their neighbour of the other block by taking the other halves (two byte-permutes per register pair for
// 4 bits, none for 2 bits).  8-bit rows need nothing: a warp's slice lies in block warp / 2.
//
// Keys: lane (g, c) reads LANE_BYTES = D LOW / 32 / SLICES contiguous bytes of the low plane (from byte c' LANE_BYTES,
// c' = s 4 + c) of each of its two keys, and as many bytes of the high plane.  fragment(w, kk) gives the key's two A
// registers of k-step kk: (k-indices 2c, 2c+1) and (2c+8, 2c+9); dim(c', kk, reg, h) is the dim that half h of
// register reg holds.
template <int BITS, int D, int SLICES, class TABLE>  // TABLE: the side's CodeTable, chosen by Shape
struct KeyCodes {
  using P = Planes<BITS>;
  static constexpr int ROW_BYTES = D * BITS / 8;
  static constexpr int LANE_BYTES = D * P::LOW / 32 / SLICES;
  static constexpr int LOW_WORDS = LANE_BYTES / 4;
  static constexpr int WORDS = LOW_WORDS * (P::HIGH ? 2 : 1);  // low-plane words, then high-plane words
  static constexpr bool BLOCKED = D > 256 && P::LOW != 8;
  using Table = TABLE;
  using High = HighPlane<BITS, D>;

  // 2-bit keys are looked up for both of the lane's keys at once (paired_fragment).
  static constexpr bool PAIRED = BITS == 2;

  __device__ __forceinline__ static uint2 fragment(const uint32_t* table, uint32_t lane_offset,
                                                   const uint32_t (&w)[WORDS], int kk, int high_shift) {
    static_assert(!PAIRED, "2-bit keys take paired_fragment");
    if constexpr (BLOCKED) {
      return blocked_fragment(table, lane_offset, w, kk, high_shift);
    } else if constexpr (BITS == 4) {  // byte 2kk + reg: dims j, j + D/2
      const uint32_t word = w[kk / 2];
      return make_uint2(Table::lookup(table, lane_offset, word, 2 * (kk % 2)),
                        Table::lookup(table, lane_offset, word, 2 * (kk % 2) + 1));
    } else if constexpr (BITS == 8) {  // bytes 4kk + 2reg + h: one dim each
      return make_uint2(Table::levels(w[kk], 0, 1), Table::levels(w[kk], 2, 3));
    } else if constexpr (P::LOW == 2) {  // 3 bits: as 2 bits, the merged words holding k = 0, 1 and k = 2, 3
      const uint2 m = merge_planes<BITS>(w[kk / 4], w[LOW_WORDS + kk / 4], high_shift);
      return make_uint2(Table::lookup(table, lane_offset, m.x, kk % 4), Table::lookup(table, lane_offset, m.y, kk % 4));
    } else {  // 5, 6 bits: as 4 bits, one lookup per dim
      const uint2 m = merge_planes<BITS>(w[kk / 2], w[LOW_WORDS + kk / 2], high_shift);
      const int i = 2 * (kk % 2);
      return make_uint2(low_halves(Table::lookup(table, lane_offset, m.x, i), Table::lookup(table, lane_offset, m.y, i)),
                        low_halves(Table::lookup(table, lane_offset, m.x, i + 1),
                                   Table::lookup(table, lane_offset, m.y, i + 1)));
    }
  }
  // BLOCKED: k-steps 2m (block 0) and 2m + 1 (block 1) share bytes; 4 bits: word m, register reg holding bytes
  // 2 reg, 2 reg + 1 (low or high nibbles); 2 bits: bytes 2m + reg, fields 0, 1 (block 0) or 2, 3 (block 1).
  __device__ __forceinline__ static uint2 blocked_fragment(const uint32_t* table, uint32_t lane_offset,
                                                           const uint32_t (&w)[WORDS], int kk, int high_shift) {
    const int b = kk % 2, m = kk / 2;
    if constexpr (P::LOW == 4) {
      uint32_t x[4];
      if constexpr (BITS == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = Table::lookup(table, lane_offset, w[m], i);   // (dim j_i, j_i + 256)
        return b ? make_uint2(high_halves(x[0], x[1]), high_halves(x[2], x[3]))
                 : make_uint2(low_halves(x[0], x[1]), low_halves(x[2], x[3]));
      } else {  // 5, 6 bits: the merged word of block b holds one code per byte
        const uint2 mw = merge_planes<BITS>(w[m], w[LOW_WORDS + m], high_shift);
        const uint32_t word = b ? mw.y : mw.x;
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = Table::lookup(table, lane_offset, word, i);
        return make_uint2(low_halves(x[0], x[1]), low_halves(x[2], x[3]));
      }
    } else {  // 3 bits: bytes 2m, 2m + 1 of the merged word of fields 0, 1 (block 0) or 2, 3 (block 1)
      const int i = (2 * m) % 4;
      const uint2 mw = merge_planes<BITS>(w[m / 2], w[LOW_WORDS + m / 2], high_shift);
      const uint32_t word = b ? mw.y : mw.x;
      return make_uint2(Table::lookup(table, lane_offset, word, i), Table::lookup(table, lane_offset, word, i + 1));
    }
  }
  // 2 bits: the A operand of k-step kk for keys g (words w) and g + 8 (w8), in the MMA's register order.  An entry
  // is two registers of the byte's key, which the operand wants apart (key g's at 0 and 2, key g + 8's at 1 and 3):
  // looked up per key it took 3-4 register moves per k-step (D = 256, nvcc 13.0).  So the two keys' low nibbles
  // (fields 0 and 1) are merged into one byte, and so are their high nibbles (fields 2 and 3), one select per word
  // each: the entry of a merged byte is registers (key g, key g + 8) of one half of the fields, an aligned pair of
  // the operand.  Byte kk % 4 of word kk / 4 gives register 0 from the low, register 1 from the high nibbles; when
  // BLOCKED, k-step kk = 2m + b takes bytes 2m % 4 and 2m % 4 + 1 of word kk / 4, low nibbles (block 0) or high
  // (block 1).  The dims are KeyCodes::dim's, as for one key.
  __device__ __forceinline__ static uint4 paired_fragment(const uint32_t* table, uint32_t lane_offset,
                                                          const uint32_t (&w)[WORDS], const uint32_t (&w8)[WORDS],
                                                          int kk) {
    static_assert(PAIRED, "2-bit keys");
    const uint32_t low = select_low_nibbles(w[kk / 4], w8[kk / 4] << 4);
    const uint32_t high = select_low_nibbles(w[kk / 4] >> 4, w8[kk / 4]);
    uint2 r0, r1;
    if constexpr (BLOCKED) {
      const int i = (kk / 2 * 2) % 4;
      r0 = Table::lookup2(table, lane_offset, kk % 2 ? high : low, i);
      r1 = Table::lookup2(table, lane_offset, kk % 2 ? high : low, i + 1);
    } else {
      r0 = Table::lookup2(table, lane_offset, low, kk % 4);
      r1 = Table::lookup2(table, lane_offset, high, kk % 4);
    }
    return make_uint4(r0.x, r0.y, r1.x, r1.y);
  }
  __device__ __forceinline__ static int dim(int c, int kk, int reg, int h) {
    if constexpr (BLOCKED && P::LOW == 4) return c * LANE_BYTES + 4 * (kk / 2) + 2 * reg + h + (kk % 2) * (D / 2);
    else if constexpr (BLOCKED) return c * LANE_BYTES + 2 * (kk / 2) + reg + (2 * (kk % 2) + h) * (D / 4);
    else if constexpr (P::LOW == 4) return c * LANE_BYTES + 2 * kk + reg + h * (D / 2);
    else if constexpr (P::LOW == 8) return c * LANE_BYTES + 4 * kk + 2 * reg + h;
    else return c * LANE_BYTES + kk + (2 * reg + h) * (D / 4);
  }
};

// Values: lane (g, c) reads LANE_BYTES = D LOW / 64 / SLICES contiguous bytes of the low plane (from byte
// g' LANE_BYTES, g' = s 8 + g) of each of its four keys 2c, 2c+1, 2c+8, 2c+9 (j = 0..3), and as many of the high
// plane.  fragment(w, t) gives the A registers of dim tile t (rows g and g + 8, keys 2c, 2c+1 then 2c+8, 2c+9);
// dim(g', t, h) is the dim of row g + 8h of tile t.
template <int BITS, int D, int SLICES, class TABLE>  // TABLE: the side's CodeTable, chosen by Shape
struct ValueCodes {
  using P = Planes<BITS>;
  static constexpr int ROW_BYTES = D * BITS / 8;
  static constexpr int LANE_BYTES = D * P::LOW / 64 / SLICES;
  static constexpr int LOW_WORDS = LANE_BYTES >= 4 ? LANE_BYTES / 4 : 1;  // 2 or 3-bit codes at D = 64: 2 bytes
  static constexpr int WORDS = LOW_WORDS * (P::HIGH ? 2 : 1);
  // Norm blocks (see KeyCodes): 2 and 3-bit tiles hold one block already (tile t: block t % 2); 4, 5 and 6-bit
  // tiles 2m (block 0) and 2m + 1 (block 1) take rows g, g + 8 from bytes 2m, 2m + 1, low or high nibbles.
  static constexpr bool BLOCKED = D > 256 && P::LOW == 4;
  static constexpr bool TILE_BLOCKS = D > 256 && P::LOW != 8;  // tile t holds block t % 2; else the warp's block
  using Table = TABLE;
  using High = HighPlane<BITS, D>;

  __device__ __forceinline__ static uint4 fragment(const uint32_t* table, uint32_t lane_offset,
                                                   const uint32_t (&w)[4][WORDS], int t, int high_shift) {
    if constexpr (BITS == 8) {
      // Bytes 2t and 2t + 1 (rows g and g + 8) of keys j and j + 1, interleaved by one byte-permute: (j's row g,
      // j + 1's row g, j's row g + 8, j + 1's row g + 8), whose byte pairs are the registers' codes.
      const int word = t / 2, lo = 2 * (t % 2);
      auto keys = [&](int j) {
        return __byte_perm(w[j][word], w[j + 1][word], lo | (lo + 4) << 4 | (lo + 1) << 8 | (lo + 5) << 12);
      };
      const uint32_t k01 = keys(0), k23 = keys(2);
      return make_uint4(Table::levels(k01, 0, 1), Table::levels(k01, 2, 3), Table::levels(k23, 0, 1),
                        Table::levels(k23, 2, 3));
    } else if constexpr (BITS == 4) {
      // The low nibbles of keys j and j + 1 (j = 0, 2: keys 2c, 2c + 1 or 2c + 8, 2c + 9) merged into one byte (one
      // lop3, shared by the word's four tiles) look up a register directly, and so do their high nibbles: no
      // byte-permutes of the looked-up halves (2% faster at D = 128 and 256, 3% at D = 512, H100).
      const int word = t / 4;
      auto merged = [&](int j, bool high) {
        return high ? select_low_nibbles(w[j][word] >> 4, w[j + 1][word])
                    : select_low_nibbles(w[j][word], w[j + 1][word] << 4);
      };
      if constexpr (!BLOCKED) {
        // Byte t % 4 of a key's word holds dims d, d + D/2 (low, high nibble): rows g and g + 8.
        const int i = t % 4;
        return make_uint4(Table::lookup(table, lane_offset, merged(0, false), i),
                          Table::lookup(table, lane_offset, merged(0, true), i),
                          Table::lookup(table, lane_offset, merged(2, false), i),
                          Table::lookup(table, lane_offset, merged(2, true), i));
      } else {
        // Tile t holds block t % 2: row g the low (block 0) or high (block 1) nibbles of byte 2 (t / 2), row g + 8
        // those of the next byte.
        const int i = (2 * (t / 2)) % 4;
        const uint32_t k01 = merged(0, t % 2), k23 = merged(2, t % 2);
        return make_uint4(Table::lookup(table, lane_offset, k01, i), Table::lookup(table, lane_offset, k01, i + 1),
                          Table::lookup(table, lane_offset, k23, i), Table::lookup(table, lane_offset, k23, i + 1));
      }
    } else if constexpr (P::LOW == 2 && !TILE_BLOCKS) {
      // 2 and 3 bits (D <= 256): keys j and j + 1 (j = 0, 2) merged field by field into one byte, whose lookup is a
      // register of the operand (or a pair of them), where looking each key up took a byte-permute per register.
      const int word = t / 8, i = (t / 2) % 4;
      if constexpr (BITS == 2) {
        // Fields k and k + 2 (k = t % 2) of both keys, (j, j + 1, j, j + 1): the 8-byte entry holds the registers
        // of rows g (field k) and g + 8 (field k + 2), one select per word and k (ValueCodes::dim).
        auto merged = [&](int j) {
          return t % 2 ? select_bits<0x33333333u>(w[j][word] >> 2, w[j + 1][word])
                       : select_bits<0x33333333u>(w[j][word], w[j + 1][word] << 2);
        };
        const uint2 keys01 = Table::lookup2(table, lane_offset, merged(0), i);
        const uint2 keys23 = Table::lookup2(table, lane_offset, merged(2), i);
        return make_uint4(keys01.x, keys01.y, keys23.x, keys23.y);
      } else {
        // 3 bits: merge_planes gives each key's bytes fields a (bits 0, 1, 4: row g) and b (2, 3, 6: row g + 8);
        // a byte of key j's a field and key j + 1's (or both b fields) looks up the register of that row.
        uint32_t m[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint2 mw = merge_planes<BITS>(w[j][word], w[j][LOW_WORDS + word], high_shift);
          m[j] = t % 2 ? mw.y : mw.x;
        }
        auto row = [&](int j, int h) {
          return h ? select_bits<0x13131313u>(m[j] >> 2, m[j + 1]) : select_bits<0x13131313u>(m[j], m[j + 1] << 2);
        };
        auto look = [&](int j, int h) { return Table::lookup(table, lane_offset, row(j, h), i); };
        return make_uint4(look(0, 0), look(0, 1), look(2, 0), look(2, 1));
      }
    } else {
      uint32_t x[4];  // key j's half2 (row g, row g + 8)
      if constexpr (BLOCKED) {  // 5, 6 bits: the merged word of block t % 2
        const int i = (2 * (t / 2)) % 4, word = t / 4;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint2 m = merge_planes<BITS>(w[j][word], w[j][LOW_WORDS + word], high_shift);
          const uint32_t mw = t % 2 ? m.y : m.x;
          x[j] = low_halves(Table::lookup(table, lane_offset, mw, i), Table::lookup(table, lane_offset, mw, i + 1));
        }
      } else if constexpr (BITS == 2) {  // D = 512: byte t / 2, dims j + k D/4; tile t takes k = 2 (t % 2), +1
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint2 e = Table::lookup2(table, lane_offset, w[j][t / 8], (t / 2) % 4);
          x[j] = t % 2 ? e.y : e.x;
        }
      } else if constexpr (P::LOW == 2) {  // 3 bits, D = 512: as 2 bits, from the merged word of k = 2 (t % 2), +1
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint2 m = merge_planes<BITS>(w[j][t / 8], w[j][LOW_WORDS + t / 8], high_shift);
          x[j] = Table::lookup(table, lane_offset, t % 2 ? m.y : m.x, (t / 2) % 4);
        }
      } else {  // 5, 6 bits: as 4 bits, one lookup per dim
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint2 m = merge_planes<BITS>(w[j][t / 4], w[j][LOW_WORDS + t / 4], high_shift);
          x[j] = low_halves(Table::lookup(table, lane_offset, m.x, t % 4),
                            Table::lookup(table, lane_offset, m.y, t % 4));
        }
      }
      return make_uint4(low_halves(x[0], x[1]), high_halves(x[0], x[1]), low_halves(x[2], x[3]),
                        high_halves(x[2], x[3]));
    }
  }
  __device__ __forceinline__ static int dim(int g, int t, int h) {
    if constexpr (BLOCKED) return g * LANE_BYTES + 2 * (t / 2) + h + (t % 2) * (D / 2);
    else if constexpr (P::LOW == 4) return g * LANE_BYTES + t + h * (D / 2);
    else if constexpr (P::LOW == 8) return g * LANE_BYTES + 2 * t + h;
    else if constexpr (BITS == 2 && !TILE_BLOCKS) return g * LANE_BYTES + t / 2 + (t % 2 + 2 * h) * (D / 4);
    else return g * LANE_BYTES + t / 2 + (2 * (t % 2) + h) * (D / 4);
  }
};

// Keys coded in two channel groups (format/codec.py: key_groups): group a, the first GA stored channels at KB bits,
// then group b, the other D - GA at KB2 bits, each a planar row of its own width (rotated by its own rotation, which
// the set-up applies to q: DecodeParams::key_order) with its own scale, group a's bytes first.  A group's width is a
// multiple of 16 but need not give each lane whole words, and group b's bytes start on any 4-byte boundary (e.g.
// 156-byte keys of 112 x 6 + 144 x 4 bits), so a lane's slice is strided: word i of its low plane is bytes
// [16 i + 4 c, 16 i + 4 c + 4), holding k-steps 2i and 2i + 1 of a 4-bit low plane (bytes 2 (kk % 2) + reg, dims j
// and j + W / 2 as in KeyCodes) or k-step i of an 8-bit one, and an odd last k-step of a 4-bit low plane takes the
// 2 bytes at 16 i + 2 c.  The high plane's bits of low byte j sit in its byte j % P1 at bit HIGH (j / P1)
// (HighPlane's rule), per word: a word never straddles P1 (5 bits need W % 32 == 0 for that).
template <int W, int BITS>
struct GroupCodes {
  using P = Planes<BITS>;
  static_assert(P::LOW == 4 || P::LOW == 8, "key groups on the CUDA kernel have 4, 5, 6 or 8 bits");
  static_assert(W % 16 == 0 && (P::HIGH != 1 || W % 32 == 0), "a group's width is a multiple of 16 (32 at 5 bits)");
  using Table = CodeTable<BITS, true>;  // 4 to 8 bits: one column per lane, compact or not
  static constexpr int ROW_BYTES = W * BITS / 8;
  static constexpr int K_STEPS = W / 16;
  static constexpr int P0 = W * P::LOW / 8, P1 = P::HIGH ? W * P::HIGH / 8 : 1;
  static constexpr bool TAIL = P::LOW == 4 && K_STEPS % 2 == 1;   // the last low word is 2 bytes
  static constexpr int LOW_WORDS = P::LOW == 8 ? K_STEPS : (K_STEPS + 1) / 2;
  static constexpr int WORDS = LOW_WORDS * (P::HIGH ? 2 : 1);

  __device__ __forceinline__ static int low_byte(int c, int i) {
    return TAIL && i == LOW_WORDS - 1 ? 16 * i + 2 * c : 16 * i + 4 * c;
  }
  // The lane's words of one key's group row (4-byte aligned, as every low_byte and high byte of a word is).
  __device__ __forceinline__ static void load(const uint8_t* row, int c, uint32_t* w) {
#pragma unroll
    for (int i = 0; i < LOW_WORDS; ++i) {
      const int j = low_byte(c, i);
      if (TAIL && i == LOW_WORDS - 1) {
        w[i] = __ldcs(reinterpret_cast<const unsigned short*>(row + j));
        if constexpr (P::HIGH > 0)
          w[LOW_WORDS + i] = __ldcs(reinterpret_cast<const unsigned short*>(row + P0 + j % P1));
      } else {
        w[i] = __ldcs(reinterpret_cast<const unsigned int*>(row + j));
        if constexpr (P::HIGH > 0)
          w[LOW_WORDS + i] = __ldcs(reinterpret_cast<const unsigned int*>(row + P0 + j % P1));
      }
    }
  }
  __device__ __forceinline__ static uint2 fragment(const uint32_t* table, uint32_t lane_offset, const uint32_t* w,
                                                   int kk, int c) {
    if constexpr (P::LOW == 8) {  // bytes 2 reg + h of word kk: one dim each
      return make_uint2(Table::levels(w[kk], 0, 1), Table::levels(w[kk], 2, 3));
    } else {
      const int i = kk / 2, b = 2 * (kk % 2);
      if constexpr (BITS == 4) {
        return make_uint2(Table::lookup(table, lane_offset, w[i], b), Table::lookup(table, lane_offset, w[i], b + 1));
      } else {
        const uint2 m = merge_planes<BITS>(w[i], w[LOW_WORDS + i], P::HIGH * (low_byte(c, i) / P1));
        return make_uint2(
            low_halves(Table::lookup(table, lane_offset, m.x, b), Table::lookup(table, lane_offset, m.y, b)),
            low_halves(Table::lookup(table, lane_offset, m.x, b + 1), Table::lookup(table, lane_offset, m.y, b + 1)));
      }
    }
  }
  __device__ __forceinline__ static int dim(int c, int kk, int reg, int h) {
    if constexpr (P::LOW == 8) return 16 * kk + 4 * c + 2 * reg + h;
    else return low_byte(c, kk / 2) + 2 * (kk % 2) + reg + h * (W / 2);
  }
};

// Both groups as the kernel's K side: k-steps [0, A_STEPS) are group a's, the rest group b's; the scores of each
// group are summed in their own accumulator and scaled by their own scale.  The tables: group a's, then group b's
// (unless both have one width of codes).
template <int D, int GA, int KB, int KB2>
struct KeyGroups {
  using A = GroupCodes<GA, KB>;
  using B = GroupCodes<D - GA, KB2>;
  static constexpr int ROW_BYTES = A::ROW_BYTES + B::ROW_BYTES;
  static constexpr int WORDS = A::WORDS + B::WORDS;
  static constexpr int A_STEPS = A::K_STEPS;
  static constexpr int B_TABLE = KB == KB2 ? 0 : A::Table::WORDS;   // group b's table, in words after group a's
  static constexpr int TABLE_WORDS = B_TABLE + B::Table::WORDS;
  static_assert(A::ROW_BYTES % 4 == 0, "group b's bytes start on a 4-byte boundary");
  // q is rotated in the set-up unnormalized, and scaled by one 1 / sqrt(P) (key_groups.cuh).
  static_assert(GroupShape<GA>::P == GroupShape<D - GA>::P, "both groups' rotations of one power-of-two size");
  static constexpr bool PAIRED = false;  // 4 to 8 bits: one key's lookups give its registers

  __device__ __forceinline__ static void build(uint32_t* table) {
    A::Table::build(table);
    if constexpr (KB != KB2) B::Table::build(table + B_TABLE);
  }
  __device__ __forceinline__ static void load(const uint8_t* row, int c, uint32_t (&w)[WORDS]) {
    A::load(row, c, w);
    B::load(row + A::ROW_BYTES, c, w + A::WORDS);
  }
  __device__ __forceinline__ static uint2 fragment(const uint32_t* table, uint32_t lane_offset,
                                                   const uint32_t (&w)[WORDS], int kk, int c) {
    if (kk < A_STEPS) return A::fragment(table, lane_offset, w, kk, c);
    return B::fragment(table + B_TABLE, lane_offset, w + A::WORDS, kk - A_STEPS, c);
  }
  __device__ __forceinline__ static int dim(int c, int kk, int reg, int h) {
    return kk < A_STEPS ? A::dim(c, kk, reg, h) : GA + B::dim(c, kk - A_STEPS, reg, h);
  }
};

// The A operand of score k-step kk (keys g and g + 8 of the lane, their words w and w8), in the MMA's register
// order: paired lookups for 2-bit keys, else each key's two registers.
template <class K>
__device__ __forceinline__ uint4 key_fragments(const uint32_t* table, uint32_t lane_offset,
                                               const uint32_t (&w)[K::WORDS], const uint32_t (&w8)[K::WORDS], int kk,
                                               int high_shift) {
  if constexpr (K::PAIRED) {
    return K::paired_fragment(table, lane_offset, w, w8, kk);
  } else {
    const uint2 a0 = K::fragment(table, lane_offset, w, kk, high_shift);
    const uint2 a1 = K::fragment(table, lane_offset, w8, kk, high_shift);
    return make_uint4(a0.x, a1.x, a0.y, a1.y);
  }
}

// D = 512 splits each row's dims over the warps (SLICES = WARPS): a warp's output accumulators are then D / 4 dims'
// (32 registers, as at D = 128) instead of D's (128 registers at D = 512), at the price of a shared-memory sum of
// the warps' partial scores per tile.
template <int D>
constexpr int slices() { return D >= 512 ? WARPS : 1; }

// The K side's table words: KeyGroups' (both groups) or the one CodeTable's (only the chosen type is instantiated).
template <bool GROUPED, class K, class KTable>
struct KTableWords { static constexpr int value = KTable::WORDS; };
template <class K, class KTable>
struct KTableWords<true, K, KTable> { static constexpr int value = K::TABLE_WORDS; };

constexpr int Q_REGISTER_BITS = 6;  // Shape::Q_IN_SMEM (ops/cached/config.py: CUDA_Q_REGISTER_BITS)

// CTAs per SM that the kernel's registers allow (64 K per SM): 4 CTAs allow 128 per thread, 3 allow 168, 2 allow
// 255 (nvcc 13.0's ptxas and H100 timings in BENCHMARKS.md).  k4v4 at D <= 128 takes 4: it fits 128 without
// spilling.  So do the other equal widths of at most 4 bits at D = 64 and k2v2 at D = 128 (their compact 2-bit
// table: 2-30% faster than 3 CTAs with the full one at D = 128, H100), and k3v3's plain build at D = 128: since the
// lane pointers are pinned it spills 8 bytes there (56 before, when 3 CTAs ran 3-6% faster) and takes 0.85-1.01 of
// its time at 3.  Its exact-row build would spill 68 bytes and k4v3 16 (up to 7% slower at 4): they take 3.  At
// D = 64 the kernels for caches with exact rows take 4 for every pair (no main loop spills at 128): the room lets
// the exact CTAs share the splits' wave (default preset, B=8: 12-14% faster); the plain kernels take 3: those of
// codes up to 4 bits (or 8) walk two-tile steps (Shape::STEP_TILES), whose 168 registers hold both tiles, and the
// other pairs ran up to 7% slower at 4.  Sliced D = 512 takes 2, whose registers hold a second tile in flight
// (Shape::PREFETCH; two tiles spill on 3, and on 4 k4v4 spilled 124 bytes with one).  Other pairs take 3, D = 256 2.
template <int D, int KB, int VB, bool EXACT>
constexpr int ctas_by_registers() {
  constexpr bool four = D == 64 ? EXACT
                                : (KB == 4 && VB == 4) || (KB == 2 && VB == 2) ||
                                      (D == 128 && KB == 3 && VB == 3 && !EXACT);
  return D == 256 || D == 512 ? 2 : four ? 4 : 3;
}

constexpr int SM_SHARED_BYTES = 228 * 1024;  // per SM, of which the SM reserves 1 KB per CTA

// GA > 0: keys in two channel groups (KeyGroups: GA channels at KB bits, D - GA at KB2).  EXACT: the build for
// caches with exact rows (only the main loop's step differs, at D = 64).
// SMALL_GRID: a twin build for grids of at most SMALL_GRID_CTAS parts per SM (launch: one sequence x 8 KV heads x 32
// splits on 132 SMs), which leave most of an SM's registers unused by the plain build's 128 per thread.  Bound to
// that many CTAs, the twin walks two-tile steps with two tiles in flight (202 registers for k4v4 at D = 128, no
// spill), one team and a wide table: twice the independent work per warp where two warps share a scheduler.
// (One CTA of 8 warps per SM instead, two key streams whose warps combine into one part per split, at 16 splits
// for one sequence x 8 KV heads: 0.995-1.015 of this build's time, H200, BENCHMARKS.md.)
constexpr int SMALL_GRID_CTAS = 2;
template <int D, int KB, int VB, int GA = 0, int KB2 = 0, bool EXACT = false, bool SMALL_GRID = false>
struct Shape {
  static constexpr int SLICES = slices<D>();
  static constexpr bool SLICED = SLICES > 1;
  // Key streams per CTA: D = 512's plain kernels run two teams of WARPS sliced warps on one split, each team walking
  // every other tile, on 1 CTA of 8 warps per SM where 2 CTAs of 4 ran.  The streams share the set-up (a query row
  // per warp, the tables built once per SM), and their outputs are combined into one part, so that a call has half
  // the parts to write and merge.  Against 2 CTAs of one stream (H200, BENCHMARKS.md): one sequence x 2 KV heads x
  // 32K 0.933 (k4v4), 0.965 (k3v3), 0.972 (k2v2); 8 x 64 x 8 heads x 8K 0.934.  (The exact-row builds keep one
  // stream: their exact CTAs take one part each.)
  static constexpr int STREAMS = SLICED && !EXACT ? 2 : 1;
  static constexpr bool GROUPED = GA > 0;
  static_assert(!GROUPED || !SLICED, "key groups are read by the unsliced kernel");
  static constexpr int NB = D > 256 ? D / 256 : 1;  // norm blocks: scales per token and side
  static constexpr int KNB = GROUPED ? 2 : NB;       // K scales per token: one per group when grouped
  static_assert(NB == 1 || SLICED, "two norm blocks are read by the sliced kernel");
  static constexpr int K_STEPS = D / SLICES / 16;   // MMA k-steps of a warp's (partial) score product
  static constexpr int DIM_TILES = D / SLICES / 16; // 16-dim tiles of a warp's output
  // Tiles a warp takes per step of its main loop: two (32 keys) where it measured faster, one elsewhere.  A
  // two-tile step computes both tiles' scores (two independent MMA chains), then one softmax step (one vote on the
  // row maximum; one exchange barrier when sliced), then both PV products: fewer instructions per tile (k2v2 at
  // D = 256 752 -> 702, k4v4 at D = 512 839 -> 797) and more of them independent, which the latency-bound loops
  // (1-2 warps per scheduler) lack.  It holds two tiles' loads in flight.  Against one-tile steps (H200,
  // BENCHMARKS.md): every pair at D = 512 0.96-0.98; k2v2 at D = 256 0.91-0.99 and k4v2 0.94-1.00.  Slower or
  // spilling: k2v4 (72 bytes) and k4v4 (84) at D = 256 1.03-1.06; k3v3, k5v3 and pairs with an 8-bit side spill
  // over 100 bytes there.  At D = 64 the plain kernels of codes up to 4 bits take it too, on 3 CTAs per SM (162-168
  // registers, no spill) where k2v2, k3v3 and k4v4 ran 4 with one-tile steps: 0.91-0.96 of the one-tile kernels at
  // 8 sequences x 3 KV heads x 16K, 0.92-0.93 at B = 1 x 32K and B = 32 x 4K (k4v4), H200.  So do the pairs of 8-bit
  // sides with 2, 4 or 8-bit ones, whose levels need no table (153-167 registers, no spill): 0.87-0.92 at 8 x 3 x 16K,
  // k8v8 0.92-0.94 at the other two (k8v8 spilled 16 bytes and ran 1.02 when it looked its codes up); 5 and 6-bit
  // sides keep one-tile steps.  The exact-row build keeps one tile and 4 CTAs, which let the exact CTAs share the
  // splits' wave (ctas_per_sm).
  static constexpr bool D64_STEP_PAIRS = (KB <= 4 || KB == 8) && (VB <= 4 || VB == 8);
  static constexpr int STEP_TILES = SMALL_GRID || D == 512 || (D == 64 && !EXACT && !GROUPED && D64_STEP_PAIRS) ||
                                            (D == 256 && !GROUPED && (KB == 2 || KB == 4) && VB == 2)
                                        ? 2
                                        : 1;
  // Tiles a warp keeps loading ahead of the one it computes: two for a two-tile step, and for k4v4 at D = 256
  // (0.94-1.01 of one, H100); one elsewhere: at D = 256 k3v3 (1.01-1.05) and k2v4, k2v8, k8v2 (1.01-1.04) ran
  // slower with two, and k5v5, k6v6 and k8v8 would spill 192-224 bytes.
  static constexpr int PREFETCH = STEP_TILES == 2 || (D == 256 && !GROUPED && KB == 4 && VB == 4) ? 2 : 1;
  // q fragments (2 registers per k-step) go to shared memory where registers would crowd out the accumulators:
  // at D = 256, unless the codes are narrow (KB + VB <= Q_REGISTER_BITS), whose tiles leave the room (k2v2 194 ->
  // 224 registers, k3v3 242 -> 254, no spill: 2-7% faster than reading them from shared memory in every tile).
  // k4v4 at D = 128 read them from shared memory in 1.04-1.05x the time, and 1.10-1.13x with a second tile in
  // flight in the freed registers (H200, BENCHMARKS.md).
  static constexpr bool Q_IN_SMEM = K_STEPS >= 16 && (GROUPED || KB + VB > Q_REGISTER_BITS);
  // One shared copy of the q fragments serves every warp only when the warps share their dims (not sliced).
  static_assert(!(Q_IN_SMEM && SLICED), "sliced warps hold different q fragments");
  // Dynamic shared memory: the K table(s), then the V table unless both sides share one codebook.  After the main
  // loop the same space holds the warps' outputs (not when sliced: a warp owns its dims), the merge's weights
  // (MAX_ROWS x MAX_PARTS) or the exact part's scratch (less than either), so it is at least SCRATCH_WORDS.
  static constexpr bool SHARED_TABLE = KB == VB && !GROUPED;
  static constexpr int WARP_OUT_WORDS = SLICED ? 0 : WARPS * MAX_ROWS * D;
  static constexpr int SCRATCH_WORDS = WARP_OUT_WORDS > MAX_ROWS * MAX_PARTS ? WARP_OUT_WORDS : MAX_ROWS * MAX_PARTS;
  // Static shared memory (q_rot, q fragments at D = 256, the merge's small weights, statistics; an upper bound);
  // sliced (D = 512): the partial scores' buffers and the signs past the 2 KB allowance.
  static constexpr int STATIC_BYTES = 4 * MAX_ROWS * D + (Q_IN_SMEM ? K_STEPS * 32 * 8 : 0) + 2048 +
                                      (SLICED ? 2 * STEP_TILES * WARPS * 32 * 16 * STREAMS + 4 * D : 0);
  static constexpr int BY_REGISTERS = SMALL_GRID ? SMALL_GRID_CTAS : ctas_by_registers<D, KB, VB, EXACT>() / STREAMS;
  // Skewed one-tile steps: step t computes tile t's scores and softmax beside tile t - 1's PV product, two
  // independent chains where a one-tile step runs them in a row; the K side (codes and scales) of tile t + 1 and the
  // V codes of tile t are in flight.  The same registers as a one-tile step's loads, and the same operations on the
  // accumulators in the same order (outputs bit-identical).  Where a warp has up to 168 registers (3 CTAs per SM at
  // D = 128), against one-tile steps at B = 8 x 32K (H200, BENCHMARKS.md): k8v4 0.957, k4v2 0.964, k4v8 and k2v8
  // 0.970, k5v4 0.972, k8v2 0.980, k5v5, k6v6 and k8v8 0.985, k2v4 0.988, k5v3 0.989; k4v3 1.036 keeps one-tile
  // steps.  At 128 registers (4 CTAs) it ran slower: k4v4 1.04-1.07, k3v3 1.021, k2v2 0.998; so did D = 64's
  // one-tile pairs (1.02-1.03, its exact-row k5v3 1.11) and D = 256's k3v3 (1.021); D = 128's exact-row k5v3 ran
  // 0.998-1.009.
  static constexpr bool SKEWED =
      D == 128 && !EXACT && !GROUPED && !SMALL_GRID && BY_REGISTERS == 3 && !(KB == 4 && VB == 3);
  static_assert(!SKEWED || (STEP_TILES == 1 && PREFETCH == 1 && !SLICED), "skewed steps are one-tile steps");
  // CTAs per SM that shared memory allows, of `dynamic_words` each and `teams` teams (each a CTA of the grid, with
  // its own static arrays).
  static constexpr int ctas_by_shared(int dynamic_words, int teams) {
    return teams * (SM_SHARED_BYTES / (dynamic_words * 4 + teams * STATIC_BYTES + 1024));
  }
  // A 2-bit table is compact beside a second table and at D <= 128 (CodeTable), but where teams share it (TEAMS,
  // below: k3v3 and k2v2's plain kernels at D = 128).  Tables of 3 to 6 bits are WIDE (a lookup's offset in one
  // byte-permute; two of them interleaved in 64 KB) where the CTAs per SM that the registers allow still fit: 4-bit
  // ones took k4v4 at D = 64, 256 and 512 0.93-0.97 of the narrow table's time, k5v4 0.96, k2v4 and k4v3 at
  // D = 256 0.96-0.98; 3, 5 and 6-bit ones 0.88-0.95 (CodeTable; H200, BENCHMARKS.md).  Not beside an 8-bit side
  // (k4v8, k8v4 1.02-1.04 at D = 128) nor k4v2 (1.025 at D = 256).
  static constexpr bool TEAM_PAIR =
      !GROUPED && !SLICED && !SMALL_GRID && !EXACT && D == 128 && KB == VB && (KB == 3 || KB == 2);
  static constexpr bool K_COMPACT = (KB != VB || D <= 128) && !TEAM_PAIR,
                        V_COMPACT = (KB != VB || D <= 128 || GROUPED) && !TEAM_PAIR;
  static constexpr int WIDE_TABLE_WORDS =
      CodeTable<KB, K_COMPACT, true>::WORDS +
      (SHARED_TABLE || interleaves<CodeTable<KB, K_COMPACT, true>, CodeTable<VB, V_COMPACT, true>>()
           ? 0
           : CodeTable<VB, V_COMPACT, true>::WORDS);
  static constexpr bool WIDE_GAINS = !GROUPED && KB != 8 && VB != 8 && !(KB == 4 && VB == 2);
  static constexpr bool WIDE_FITS =
      WIDE_GAINS &&
      ctas_by_shared(WIDE_TABLE_WORDS > SCRATCH_WORDS ? WIDE_TABLE_WORDS : SCRATCH_WORDS, 1) >= BY_REGISTERS;
  // Where the CTAs would not fit, k4v4's CTAs hold two teams of warps that share one wide table, each with its own
  // scratch after it (TEAMS; the shared memory of two CTAs, less one table): the plain kernel at D = 128 (0.93-0.95
  // at B = 4 to 32, 1.02 at B = 1) and the exact-row build at D = 64 (0.97); the exact-row build at D = 128 spilled
  // 40 bytes and ran 1.09, and keeps one team and the narrow table.  k3v3's and k2v2's plain kernels at D = 128
  // hold two teams too (TEAM_PAIR: 4 CTAs of 128 registers, whose narrow or compact tables the teams' one full
  // table replaces): k3v3 0.913-0.931 at B = 4 to 32 and 1.026 at B = 1, k2v2 0.925-0.942 and 1.004 (H200).
  // (Splitting each warp's work over a key warp and a value warp that take P from it through shared memory, 3 CTAs
  // of 8 warps per SM, ran 1.23-1.34x the plain kernel's time at D = 128: BENCHMARKS.md.)
  static constexpr int TEAMS =
      TEAM_PAIR || (!WIDE_FITS && !GROUPED && !SLICED && !SMALL_GRID && KB == 4 && VB == 4 && !(D == 128 && EXACT))
          ? 2 : 1;
  static constexpr bool WIDE = WIDE_FITS || TEAMS > 1;
  static constexpr int THREADS = WARPS * 32 * TEAMS * STREAMS;
  using KTable = CodeTable<KB, K_COMPACT, WIDE>;
  using VTable = CodeTable<VB, V_COMPACT, WIDE>;
  using K = std::conditional_t<GROUPED, KeyGroups<D, GA, KB, KB2>, KeyCodes<KB, D, SLICES, KTable>>;
  using V = ValueCodes<VB, D, SLICES, VTable>;
  // The tile's keys in the MMAs' order (tile_key) where a key's values are less than a 128-byte line: at D = 128
  // k4v4 0.98 of the natural order's time at B = 8 and 32, k2v2 0.99, k5v4 0.975 (H200).  Not for 3-bit values
  // (two planes of 32 and 16 bytes at D = 128): k3v3 0.999, k4v3 1.013.
  static constexpr bool PERMUTED_KEYS = V::ROW_BYTES < 128 && VB != 3;
  // The scales' byte permutations (LanePointers::sel) pinned, so that ptxas keeps them in a register where it
  // recomputed them from the lane's address in every tile: 8-15 fewer loop instructions in D = 128's plain kernels,
  // k2v2 0.984, k3v3 0.978, k5v4 0.990 of the time (H200).  k4v4 ran 1.002-1.016 and keeps them unpinned, as do
  // the exact-row builds, whose loops did not change.  (The high planes' offsets pinned the same way in one-team
  // plain kernels, loops 5-26 instructions shorter: k6v6 1.014-1.018, k5v4 0.992-0.996, k5v3 and D = 64 / 256's
  // k3v3 0.972-1.013, H200: not kept.)
  static constexpr bool PINNED_SELECTORS = D == 128 && !EXACT && !GROUPED && !(KB == 4 && VB == 4);
  // The fused merge of few parts a warp per row (merge_rows_by_warps), in the builds where it measured faster: the
  // plain kernels of k4v4 at D = 64, 128 and 256, k2v2 at D = 64 and 128, k3v3 at D = 64 (0.944-0.993 of the
  // general merge's time, H200, BENCHMARKS.md).  The others keep only the general merge: with both, ptxas allocates
  // a kernel's main loop differently, and k3v3's two teams at D = 128 then reloaded a spilled register in every
  // tile, 1.11-1.12 of the time; the rest were not measured.
  static constexpr bool ROW_WARP_MERGE =
      !EXACT && !GROUPED && !SMALL_GRID && KB == VB &&
      ((D == 64 && KB >= 2 && KB <= 4) || (D == 128 && (KB == 4 || KB == 2)) || (D == 256 && KB == 4));
  static constexpr int K_TABLE_WORDS = KTableWords<GROUPED, K, KTable>::value;
  // Two half-row tables share their rows: the V table's entries sit in the K table's unused halves.
  static constexpr bool INTERLEAVED = !SHARED_TABLE && !GROUPED && interleaves<KTable, VTable>();
  static constexpr int TABLE_WORDS = K_TABLE_WORDS + (SHARED_TABLE || INTERLEAVED ? 0 : VTable::WORDS);
  // Where the V table starts, in words: interleaved, 128 bytes into each 256-byte row (HALF_ROWS' entry rows).
  static constexpr int V_TABLE_AT = SHARED_TABLE ? 0 : INTERLEAVED ? 32 : K_TABLE_WORDS;
  // Team i's scratch: SCRATCH_SPAN words from SCRATCH_AT + i SCRATCH_SPAN; one team's is the tables' space.  A
  // team's holds the warps' outputs, the exact part's scratch and the merge's weights of up to TEAM_MERGE_WORDS
  // (rows x parts: far more than a merge on the kernel's tail takes, ops/cached/config.CUDA_MERGE_APART).
  static constexpr int TEAM_MERGE_WORDS = MAX_ROWS * MAX_PARTS / 2;
  static constexpr int SCRATCH_SPAN_OF_TEAM = WARP_OUT_WORDS > TEAM_MERGE_WORDS ? WARP_OUT_WORDS : TEAM_MERGE_WORDS;
  static constexpr int SCRATCH_AT = TEAMS > 1 ? TABLE_WORDS : 0;
  static constexpr int DYNAMIC_WORDS = TEAMS > 1                    ? TABLE_WORDS + TEAMS * SCRATCH_SPAN_OF_TEAM
                                       : TABLE_WORDS > SCRATCH_WORDS ? TABLE_WORDS
                                                                     : SCRATCH_WORDS;
  static constexpr int SCRATCH_SPAN = TEAMS > 1 ? SCRATCH_SPAN_OF_TEAM : DYNAMIC_WORDS;
};

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

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) { return half2_bits(__floats2half2_rn(lo, hi)); }

// N consecutive elements of a tensor in q's dtype as floats (no alignment assumed).  One branch on the dtype
// around N independent loads: the set-up and the merge run once per CTA, from a cold instruction cache, so their
// code is kept short and straight (a dtype branch per element measured as 10 µs of set-up at D = 512).
template <int N>
__device__ __forceinline__ void load_row(const void* base, int dtype, long long offset, float (&x)[N]) {
  if (dtype == 1) {
    const unsigned short* src = reinterpret_cast<const unsigned short*>(base) + offset;
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
  } else if (dtype == 0) {
    const __half* src = reinterpret_cast<const __half*>(base) + offset;
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = __half2float(src[i]);
  } else {
    const float* src = reinterpret_cast<const float*>(base) + offset;
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = src[i];
  }
}

// load_row in two halves, so that nothing waits on the loads where they are issued: N consecutive elements as
// raw words (16-bit elements zero-extended; one branch on the dtype around the loads), and later as floats.
template <int N>
__device__ __forceinline__ void load_row_raw(const void* base, int dtype, long long offset, uint32_t (&raw)[N]) {
  if (dtype == 2) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(base) + offset;
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = src[i];
  } else {
    const unsigned short* src = reinterpret_cast<const unsigned short*>(base) + offset;
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = src[i];
  }
}
template <int N>
__device__ __forceinline__ void raw_to_floats(int dtype, const uint32_t (&raw)[N], float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    x[i] = dtype == 2 ? __uint_as_float(raw[i])
           : dtype == 1 ? __uint_as_float(raw[i] << 16)
                        : __half2float(__ushort_as_half(static_cast<unsigned short>(raw[i])));
}

// W 32-bit words to an aligned address, in 16-, 8- or 4-byte stores.
template <int W>
__device__ __forceinline__ void store_words(void* dst, const uint32_t (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i)
      reinterpret_cast<uint4*>(dst)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
  } else if constexpr (W % 2 == 0) {
#pragma unroll
    for (int i = 0; i < W / 2; ++i) reinterpret_cast<uint2*>(dst)[i] = make_uint2(w[2 * i], w[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) reinterpret_cast<uint32_t*>(dst)[i] = w[i];
  }
}

// N consecutive elements of the output (q's dtype), from floats (round to nearest).  The output is contiguous (the
// binding allocates it, or checks it), so a lane's N elements at offset (a multiple of N) are aligned to their size:
// one to four wide stores instead of N narrow ones (short code: see load_row).
template <int N>
__device__ __forceinline__ void store_row(void* base, int dtype, size_t offset, const float (&x)[N]) {
  static_assert(N % 2 == 0, "a lane stores an even number of elements");
  if (dtype == 2) {
    uint32_t w[N];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __float_as_uint(x[i]);
    store_words<N>(reinterpret_cast<float*>(base) + offset, w);
  } else {
    uint32_t w[N / 2];
    if (dtype == 1) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) w[i] = pack_half2(x[2 * i], x[2 * i + 1]);
    }
    store_words<N / 2>(reinterpret_cast<unsigned short*>(base) + offset, w);
  }
}

// BYTES consecutive code bytes as 32-bit words w[0 .. max(BYTES / 4, 1)), streamed (read once: evict first).
template <int BYTES>
__device__ __forceinline__ void load_words(const uint8_t* ptr, uint32_t* w) {
  if constexpr (BYTES == 2) {
    w[0] = __ldcs(reinterpret_cast<const unsigned short*>(ptr));
  } else if constexpr (BYTES == 4) {
    w[0] = __ldcs(reinterpret_cast<const unsigned int*>(ptr));
  } else if constexpr (BYTES == 8) {
    const uint2 x = __ldcs(reinterpret_cast<const uint2*>(ptr));
    w[0] = x.x, w[1] = x.y;
  } else {
    static_assert(BYTES % 16 == 0, "a lane's slice is 2, 4, 8 or a multiple of 16 bytes");
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      const uint4 x = __ldcs(reinterpret_cast<const uint4*>(ptr) + i);
      w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
    }
  }
}

// One key's slice for this lane (C: KeyCodes or ValueCodes): the low plane's LANE_BYTES at `low`, then for two-plane
// codes the high plane's at low + high_delta (raw: the lane's shift is applied where the words are used, so that
// nothing waits on the load here).
template <class C>
__device__ __forceinline__ void load_slice(const uint8_t* low, int high_delta, uint32_t (&w)[C::WORDS]) {
  load_words<C::LANE_BYTES>(low, w);
  if constexpr (C::P::HIGH > 0) load_words<C::LANE_BYTES>(low + high_delta, w + C::LOW_WORDS);
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exp2(-inf) = 0, no range fix-ups
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One warp's 16-key tile as this lane needs it: K code words of keys g and g + 8, V code words of keys 2c, 2c+1,
// 2c+8, 2c+9, and the scales of keys g and g + 8 (the lane's score keys), keys m being the tile's keys tile_key(m).
// The k-steps of key group a (the scores' first chain); every k-step when the keys are not grouped.
template <class S>
__host__ __device__ constexpr int key_group_steps() {
  if constexpr (S::GROUPED) return S::K::A_STEPS;
  else return S::K_STEPS;
}

template <class S>
struct TileData {
  uint32_t kw[2][S::K::WORDS];
  uint32_t vw[4][S::V::WORDS];
  // [key g, g + 8][norm block, or key group]: the words that hold the scales, made floats (scale_value) only where
  // the tile is processed, so that no instruction waits on the loads in flight.
  uint32_t k_scale[2][S::KNB], v_scale[2][S::NB];
};

// This lane's addresses at slot 0 of its (sequence, KV head): every load of a tile is one of these plus the
// tile's offset plus an immediate.  A scale is read as the aligned 32-bit word that holds it and byte-permuted into
// a float (float32: the word itself; bfloat16: its half moved up), so that both dtypes take the same instructions
// (a branch on the dtype per load was if-converted into both loads and both addresses).
struct LanePointers {
  const uint8_t* k;   // K codes of tile key kg = tile_key(g), from byte c KeyCodes::LANE_BYTES of the low plane
  const uint8_t* v;   // V codes of tile key value_key(c, 0), from byte g ValueCodes::LANE_BYTES of the low plane
  const uint8_t* ks;  // the word that holds the K scale of tile key kg, block 0
  const uint8_t* vs;  // the word that holds the V scale of tile key kg, block 0
  int k_high, v_high;  // two-plane codes: the high plane's slice, in bytes after the low plane's
  int scale_row;       // bytes per key of the scales (norm blocks x 2 or 4)
  int block_step;      // bytes from block 0's word to block 1's (two norm blocks, or the K side's two key groups)
  uint32_t sel[2];     // per block: the byte permutation of its word that gives the float (K and V alike: both
                       // scale tensors are 4-byte aligned, cuda.py)
  int k_scale_row;     // key groups: bytes per key of the K scales (two per key; scale_row is then V's)
  uint32_t v_sel;      // key groups: V's permutation (its rows are half as long as K's)
};

// A lane's word through an identity shuffle, which ptxas cannot see through: it then keeps the value in a register
// where it would recompute it in every tile (Shape::PINNED_SELECTORS).
__device__ __forceinline__ uint32_t pinned_word(uint32_t x, int lane) { return __shfl_sync(0xffffffffu, x, lane); }

// A lane's pointer, pinned: ptxas recomputed it from the thread index and the CTA's head in every tile (nvcc 13.0,
// sm_90: 11-78 fewer instructions in the main loop; H100: k3v3 2-6% faster, k4v4 up to 3%).
__device__ __forceinline__ const uint8_t* pinned(const uint8_t* ptr, int lane) {
  const uint64_t x = reinterpret_cast<uint64_t>(ptr);
  const uint32_t lo = pinned_word(static_cast<uint32_t>(x), lane);
  const uint32_t hi = pinned_word(static_cast<uint32_t>(x >> 32), lane);
  return reinterpret_cast<const uint8_t*>((static_cast<uint64_t>(hi) << 32) | lo);
}

// The byte permutations that make a scale's word its float: float32, the word itself; bfloat16, the word's low or
// high half moved up.
constexpr uint32_t SCALE_F32 = 0x3210u, SCALE_BF16_LOW = 0x1044u, SCALE_BF16_HIGH = 0x3244u;

// A scale at byte `addr`: the aligned word that holds it, and the byte permutation that makes it a float.
__device__ __forceinline__ const uint8_t* scale_word(const uint8_t* addr) {
  return reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(addr) & ~static_cast<uintptr_t>(3));
}
__device__ __forceinline__ uint32_t scale_selector(const uint8_t* addr, bool bf16) {
  return !bf16 ? SCALE_F32 : ((reinterpret_cast<uintptr_t>(addr) & 2) ? SCALE_BF16_HIGH : SCALE_BF16_LOW);
}
__device__ __forceinline__ uint32_t load_scale_word(const uint8_t* word) {
  return __ldcs(reinterpret_cast<const unsigned int*>(word));
}
// prmt itself: the selector is one of the constants above, whose nibbles' sign bits are clear, where __byte_perm
// masks them off first, a lop3 per side and tile where ptxas cannot see the constant (the pinned selectors: 2-10
// fewer loop instructions in D = 128's plain kernels, k2v2 0.983-0.986 of the time, H200).
__device__ __forceinline__ float scale_value(uint32_t word, uint32_t sel) {
  uint32_t x;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(x) : "r"(word), "r"(sel));
  return __uint_as_float(x);
}

// The words that hold the scales of keys g and g + 8: slots[n] after the lane's key.  An even slot keeps the lane's
// words and permutations (a scale row is 2 bytes at least); CLAMPED slots (the last tile of a full cache) can be odd:
// their scales are read from their own words at once (a rare path) and stored as words that the lane's permutation
// turns into them.
template <class S, bool CLAMPED>
__device__ __forceinline__ void load_scales(const LanePointers& lp, const int (&slots)[2], TileData<S>& t) {
  // Key groups: K rows of two scales beside V rows of one, each side with its own row length and permutations.
  const int k_row = S::GROUPED ? lp.k_scale_row : lp.scale_row;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    // Unclamped slots are not negative: one wide multiply-add per address.
    const size_t offset = CLAMPED ? (size_t)((ptrdiff_t)slots[n] * lp.scale_row)
                                  : (size_t)(uint32_t)slots[n] * (uint32_t)lp.scale_row;
    const size_t k_offset = !S::GROUPED ? offset
                            : CLAMPED   ? (size_t)((ptrdiff_t)slots[n] * k_row)
                                        : (size_t)(uint32_t)slots[n] * (uint32_t)k_row;
    const uint8_t* ks = lp.ks + k_offset;
    const uint8_t* vs = lp.vs + offset;
    if constexpr (CLAMPED) {
      const int bytes = lp.scale_row / S::NB;
      const bool bf16 = bytes == 2;
      if constexpr (S::GROUPED) {
        // K rows (two scales) keep the lane's word alignment at any slot; V's scale is read from its own address
        // and stored as the word that the lane's permutation turns into it.
#pragma unroll
        for (int b = 0; b < S::KNB; ++b) t.k_scale[n][b] = load_scale_word(ks + b * lp.block_step);
        const uint8_t* v_at = vs + (lp.v_sel == SCALE_BF16_HIGH ? 2 : 0);
        const uint32_t vf = __float_as_uint(scale_value(load_scale_word(scale_word(v_at)), scale_selector(v_at, bf16)));
        t.v_scale[n][0] = lp.v_sel == SCALE_BF16_LOW ? vf >> 16 : vf;
        continue;
      }
      const int odd = lp.sel[0] == SCALE_BF16_HIGH ? 2 : 0;  // the lane's words are 2 bytes below its scales when odd
#pragma unroll
      for (int b = 0; b < S::NB; ++b) {  // the scales' own addresses
        const uint8_t* k_at = ks + odd + b * bytes;
        const uint8_t* v_at = vs + odd + b * bytes;
        const uint32_t kf = __float_as_uint(scale_value(load_scale_word(scale_word(k_at)), scale_selector(k_at, bf16)));
        const uint32_t vf = __float_as_uint(scale_value(load_scale_word(scale_word(v_at)), scale_selector(v_at, bf16)));
        // The permutation moves the low half up: put the value there.
        const bool low_half = lp.sel[b] == SCALE_BF16_LOW;
        t.k_scale[n][b] = low_half ? kf >> 16 : kf;
        t.v_scale[n][b] = low_half ? vf >> 16 : vf;
      }
    } else {
#pragma unroll
      for (int b = 0; b < S::KNB; ++b) t.k_scale[n][b] = load_scale_word(ks + b * lp.block_step);
#pragma unroll
      for (int b = 0; b < S::NB; ++b) t.v_scale[n][b] = load_scale_word(vs + b * lp.block_step);
    }
  }
}

// The tile's keys in the MMAs' order: score row (and PV k-index) m holds key tile_key(m) of the tile.  PERMUTED
// (Shape::PERMUTED_KEYS, where a key's values are less than a 128-byte line): m = 8 n + r -> 8 n + r / 2 + 4 (r % 2),
// the same for both products (the transpose of P keeps m).  Lane c's values (k-indices 2c, 2c + 1, 2c + 8, 2c + 9)
// are then keys c, c + 4, c + 8 and c + 12, so each of its four value loads reads four consecutive keys across the
// warp (at D = 128, 4 bits: two whole lines) where keys 2c + j touched four lines, half of each.
template <bool PERMUTED>
__host__ __device__ constexpr int tile_key(int m) { return PERMUTED ? (m & 8) | (m & 7) >> 1 | (m & 1) << 2 : m; }
static_assert(tile_key<true>(2) == 1 && tile_key<true>(3) == 5 && tile_key<true>(9) == 12 && tile_key<false>(3) == 3,
              "tile_key");
// The tile key of value word j of lane c (k-index 2c + (j & 1) + 8 (j >> 1)); value_key(c, j) - value_key(c, 0) =
// value_key(0, j).
template <bool PERMUTED>
__host__ __device__ constexpr int value_key(int c, int j) { return tile_key<PERMUTED>(2 * c + (j & 1) + 8 * (j >> 1)); }

// What a load of a tile reads: the K codes with both sides' scales (what the tile's scores and softmax take), the V
// codes (its PV product), or both.
constexpr int KEY_SIDE = 1, VALUE_SIDE = 2, BOTH_SIDES = 3;

template <class S, int SIDES = BOTH_SIDES>
__device__ __forceinline__ void load_tile(const LanePointers& lp, int tile, TileData<S>& t) {
  constexpr int KR = S::K::ROW_BYTES, VR = S::V::ROW_BYTES;
  const uint8_t* k = lp.k + (size_t)tile * KR;
  const uint8_t* v = lp.v + (size_t)tile * VR;
  if constexpr ((SIDES & KEY_SIDE) != 0) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      if constexpr (S::GROUPED) S::K::load(k + 8 * n * KR, threadIdx.x & 3, t.kw[n]);
      else load_slice<typename S::K>(k + 8 * n * KR, lp.k_high, t.kw[n]);
    }
    load_scales<S, false>(lp, {tile, tile + 8}, t);
  }
  if constexpr ((SIDES & VALUE_SIDE) != 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      load_slice<typename S::V>(v + value_key<S::PERMUTED_KEYS>(0, j) * VR, lp.v_high, t.vw[j]);
  }
}

// The last tile of a full cache: slots past the capacity read the last slot (the softmax masks them).
template <class S, int SIDES = BOTH_SIDES>
__device__ __forceinline__ void load_tile_clamped(const LanePointers& lp, int tile, int capacity, int kg, int c,
                                                  TileData<S>& t) {
  if constexpr ((SIDES & KEY_SIDE) != 0) {
    int slots[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      slots[n] = min(tile + 8 * n + kg, capacity - 1) - kg;  // lp.k already points at key kg
      if constexpr (S::GROUPED) S::K::load(lp.k + (size_t)slots[n] * S::K::ROW_BYTES, c, t.kw[n]);
      else load_slice<typename S::K>(lp.k + (size_t)slots[n] * S::K::ROW_BYTES, lp.k_high, t.kw[n]);
    }
    load_scales<S, true>(lp, slots, t);
  }
  if constexpr ((SIDES & VALUE_SIDE) != 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int slot = min(tile + value_key<S::PERMUTED_KEYS>(c, j), capacity - 1) - value_key<S::PERMUTED_KEYS>(c, 0);
      load_slice<typename S::V>(lp.v + (size_t)slot * S::V::ROW_BYTES, lp.v_high, t.vw[j]);
    }
  }
}

// Fast Walsh-Hadamard transform (unnormalized, Sylvester order) of a D-vector held by one warp: lane l holds
// dims l N ... l N + N - 1 (N = D / 32) in x.  The low log2 N stages stay in registers, the other five are
// butterflies across lanes (one shuffle per value): no shared memory, no barrier.  A lane stage is one fma per
// value, x * sign + other, sign -1 where the lane holds the butterfly's second half (other - x, rounded as the
// difference is; a select and an add took two).  ROLLED keeps the five lane stages in a loop: shorter code where it
// runs once from a cold instruction cache (the merge's rotation back); the set-up unrolls them, which lets two rows'
// shuffles overlap.
template <int D, bool ROLLED = false>
__device__ __forceinline__ void hadamard_warp(float (&x)[D / 32], int lane) {
  constexpr int N = D / 32, LANE_STAGES_UNROLLED = ROLLED ? 1 : 5;
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i & h) continue;
      const float u = x[i], v = x[i + h];
      x[i] = u + v;
      x[i + h] = u - v;
    }
  }
#pragma unroll LANE_STAGES_UNROLLED
  for (int m = 1; m < 32; m <<= 1) {
    const float sign = lane & m ? -1.f : 1.f;
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = fmaf(x[i], sign, __shfl_xor_sync(0xffffffffu, x[i], m));
  }
}

// This CTA's part and (sequence x KV head) in the one-dimensional grid: the splits' CTAs first (split fastest), then
// num_parts - num_splits exact parts per (sequence, KV head) in the kernels built for exact rows (every exact CTA
// gets part num_splits here; exact_cta_index tells them apart).  Launched last, the short exact CTAs take what the
// splits' wave leaves free, or run as a short tail, instead of taking slots from the splits.
struct CtaIndex {
  int part, bh;
};
__device__ __forceinline__ CtaIndex cta_index(const DecodeParams& p, int block) {
  const int split_blocks = p.num_splits * p.batch_kv_heads;
  if (block < split_blocks) {
    const int bh = quotient(p.splits_div, block);
    return {block - bh * p.num_splits, bh};
  }
  return {p.num_splits, block - split_blocks};   // an exact CTA: exact_cta_index has its part and head
}

// An exact CTA's part (num_splits and after) and (sequence, KV head): a head's exact CTAs are adjacent.  Apart
// from cta_index, so that the splits' code stays as it was (computed there, it reordered the whole kernel and
// cost the Gemma-3 preset 14%).
__device__ __forceinline__ CtaIndex exact_cta_index(const DecodeParams& p, int block) {
  const int exact_parts = p.num_parts - p.num_splits, x = cta_index(p, block).bh;
  return {p.num_splits + x % exact_parts, x / exact_parts};
}

// The fresh tokens' scores for query token t (row q_row of q): lane 0 writes token j's log2-domain score to s[j],
// j < MAX_ROWS (-inf where token j is not seen: j > t or outside the window; NaN where its k or v is not finite);
// returns their maximum (NaN passes by).  Scored in the model's domain: q . (k - shift), the rotation being
// orthogonal.  A lane takes D / 32 consecutive dims; rolled over the tokens (short code: see load_row).
template <int D>
__device__ __forceinline__ float fresh_scores(const DecodeParams& p, long long q_row, long long kv0, const float* shift,
                                           int t, int lane, float* s) {
  constexpr int N = D / 32;
  float qv[N];
  load_row<N>(p.q, p.q_dtype, q_row + lane * N, qv);
  float mx = -INFINITY;
#pragma unroll 1
  for (int j = 0; j < MAX_ROWS; ++j) {
    float x = -INFINITY;
    if (j <= t && (p.window <= 0 || t - j < p.window)) {  // the same for the whole warp
      float k[N], v[N];
      load_row<N>(p.k_new, p.q_dtype, kv0 + j * p.kv_stride_t + lane * N, k);
      load_row<N>(p.v_new, p.q_dtype, kv0 + j * p.kv_stride_t + lane * N, v);
      float dot = 0.f;
      bool finite = true;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        finite = finite && isfinite(k[i]) && isfinite(v[i]);
        dot += qv[i] * (shift != nullptr ? k[i] - shift[lane * N + i] : k[i]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      x = dot * p.q_scale;
      if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap) * 1.4426950408889634f;
      if (!__all_sync(0xffffffffu, finite)) x = NAN;
      mx = fmaxf(mx, x);
    }
    if (lane == 0) s[j] = x;
  }
  return mx;
}

// The weighted sums over parts of ITEMS outputs of this thread, the float4s tid + (FIRST + k) THREADS of a part
// (k < ITEMS; those from `outputs` on are skipped), added to acc: part q of output i is o[q step + i - tid] and its
// weight weight[(i / (D / 4)) num_parts + q] (weights [rows][num_parts]).  Parts outer and outputs inner, QB x ITEMS
// = about 16 loads in flight, so that num_parts / QB L2 round trips cover them (a loop over the outputs, each
// waiting on its own loads, takes a round trip per output and batch); each output adds its parts in order.
template <int D, int ITEMS, int FIRST, int TEAMS, typename Step>
__device__ __forceinline__ void sum_parts_in_flight(const float4* o, Step step, const float* weight, int num_parts,
                                                    int outputs, float4 (&acc)[ITEMS]) {
  constexpr int D4 = D / 4, THREADS = WARPS * 32, QB = ITEMS >= 16 ? 1 : 16 / ITEMS;
  const int tid = team_thread<TEAMS>();
#pragma unroll 1
  for (int q0 = 0; q0 < num_parts; q0 += QB) {
    float4 x[QB][ITEMS];
#pragma unroll
    for (int j = 0; j < QB; ++j) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const bool valid = q0 + j < num_parts && tid + (FIRST + k) * THREADS < outputs;
        x[j][k] = valid ? __ldcg(o + (q0 + j) * step + (FIRST + k) * THREADS) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int j = 0; j < QB; ++j) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const bool valid = q0 + j < num_parts && tid + (FIRST + k) * THREADS < outputs;
        const float w = valid ? weight[((tid + (FIRST + k) * THREADS) / D4) * num_parts + q0 + j] : 0.f;
        acc[k].x += w * x[j][k].x, acc[k].y += w * x[j][k].y, acc[k].z += w * x[j][k].z, acc[k].w += w * x[j][k].w;
      }
    }
  }
}

// The fresh tokens' weighted values (weights fresh_w[j] for the tokens j <= t that query token t sees, in the
// model's domain) over the merge's denominator, added to N elements v of an output row: v[i] takes token j's value
// element v_new[first + j kv_stride_t + i].
template <int N>
__device__ __forceinline__ void add_fresh_values(const DecodeParams& p, const float* fresh_w, float denom,
                                                 long long first, int t, float (&v)[N]) {
  if (!p.has_fresh || denom == 0.f) return;
  float fresh[N] = {};
#pragma unroll 1
  for (int j = 0; j <= t; ++j) {
    const float w = fresh_w[j];
    if (isnan(w)) continue;  // never 0 x inf: the denominator is NaN already
    float x[N];
    load_row<N>(p.v_new, p.q_dtype, first + j * p.kv_stride_t, x);
#pragma unroll
    for (int i = 0; i < N; ++i) fresh[i] += w * x[i];
  }
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] += fresh[i] / denom;
}

// A merged row's last steps, by one warp: the rotation back x = signs * H y / sqrt(D), the fresh tokens' weighted
// values (in the model's domain, weights fresh_w[j] for the tokens j <= t that query token t sees) over the same
// denominator as the cached parts, and the store in q's dtype at out_row.  y: the row in the rotated domain.
// sign(i): the sign of the lane's dim lane * D / 32 + i.  finish_row_values takes the lane's D / 32 dims of y (from
// lane * D / 32 on) in registers, finish_row reads them from y in shared memory.
template <int D, typename Sign>
__device__ __forceinline__ void finish_row_values(const DecodeParams& p, float (&v)[D / 32], Sign sign,
                                                  const float* fresh_w, float denom, long long kv0, int t,
                                                  size_t out_row, int lane) {
  constexpr int N = D / 32;
  hadamard_warp<D, true>(v, lane);
  const float norm = rsqrtf((float)D);
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] *= sign(i) * norm;
  add_fresh_values<N>(p, fresh_w, denom, kv0 + lane * N, t, v);
  store_row<N>(p.out, p.q_dtype, out_row + lane * N, v);
}
template <int D, typename Sign>
__device__ __forceinline__ void finish_row(const DecodeParams& p, const float* y, Sign sign,
                                           const float* fresh_w, float denom, long long kv0, int t, size_t out_row,
                                           int lane) {
  float v[D / 32];
#pragma unroll
  for (int i = 0; i < D / 32; ++i) v[i] = y[lane * (D / 32) + i];
  finish_row_values<D>(p, v, sign, fresh_w, denom, kv0, t, out_row, lane);
}

// Whether a CTA writes its part rotated back into the model's domain: at D = 512 for the merge in a launch of its
// own (no counters), which then sums any slice of a row's dims on its own (merge_rows: p.merge_slices CTAs per
// row), where the rotation back needs the whole row.  With the sliced merge this measured 0.83 of the merge's
// rotation on one warp per row at D = 512 (H100, k4v4, one sequence) and 1.01-1.06 at D <= 256, whose warps share
// the keys rather than the dims, so that rotating adds a barrier and a shared-memory pass after they are combined
// (BENCHMARKS.md): there the parts stay in the codes' domain and the merge launch takes one CTA per row.
template <int D>
__host__ __device__ constexpr bool rotates_parts_back() { return D >= 512; }  // decode.h: most_merge_slices
template <int D>
__device__ __forceinline__ bool model_domain_parts(const DecodeParams& p) {
  return rotates_parts_back<D>() && p.counters == nullptr;
}

// Parts in the model's domain (model_domain_parts): the rows' normalized outputs y (shared [rows][D], in the codes'
// domain) rotated back, x = signs * H y / sqrt(D), and stored as part rows part0 + r, a warp per row.  (A warp's two
// rows rotated together, their shuffles overlapping, ran 1.03-1.04x the time at D = 512, B = 1: H200, BENCHMARKS.md.)
template <int D>
__device__ __forceinline__ void store_parts_in_model_domain(const DecodeParams& p, const float* y, const float* signs,
                                                            size_t part0, int rows, int warp, int lane) {
  constexpr int N = D / 32;
  const float norm = rsqrtf((float)D);
  for (int r = warp; r < rows; r += WARPS) {
    float v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = y[r * D + lane * N + i];
    hadamard_warp<D, true>(v, lane);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] *= signs[lane * N + i] * norm;
    store_row<N>(p.o_part, 2, (part0 + r) * D + lane * N, v);
  }
}

// The parts a warp per row merges in registers (merge_rows_by_warps): each lane holds its D / 32 dims of every
// part, at most 32 floats: D = 64 16 parts, D = 128 8, D = 256 4.
template <int D>
constexpr int row_warp_parts() { return D <= 256 ? 32 / (D / 32) : 0; }
// Whether the fused merge of this call takes merge_rows_by_warps: a warp per row (rows <= WARPS) and every part in
// its lanes' registers.
template <int D>
__device__ __forceinline__ bool merges_by_row_warps(const DecodeParams& p, int num_parts) {
  return p.tq * p.group <= WARPS && num_parts <= row_warp_parts<D>();
}

// The fused merge of a call with few parts (merges_by_row_warps), on the kernel's tail: warp r merges row r on its
// own, with no barrier.  Lane q loads part q's log2-sum-exp and every lane its D / 32 dims of every part, all in one
// L2 round trip issued before the fresh tokens' loads; the weights meet in shuffles, each lane sums its dims over
// the parts in part order, and the warp rotates the row back (finish_row_values).  The same sums as merge_parts,
// whose threads each own float4s of the rows and meet in shared memory behind two to four barriers: its serial path
// was about 840 instructions per warp at D = 64 (ncu).  Against it (H200, BENCHMARKS.md): D = 64 0.944-0.966 of the
// time (8 sequences x 3 KV heads x 16 parts), k4v4 at D = 128 and 256 0.991-0.993, k2v2 at D = 128 0.980-0.988.
template <int D, int TEAMS>
__device__ __forceinline__ void merge_rows_by_warps(const DecodeParams& p, int bh, float* fresh_p, const float* signs,
                                                    int num_parts) {
  constexpr int N = D / 32, PARTS = row_warp_parts<D>();
  const int tid = team_thread<TEAMS>(), lane = tid & 31, r = tid >> 5, rows = p.tq * p.group;
  if (r >= rows) return;
  const size_t first = (size_t)bh * p.num_parts * rows;  // part q of row r: first + q rows + r
  const float lse = lane < num_parts ? __ldcg(p.lse_part + first + (size_t)lane * rows + r) : -INFINITY;
  float part[PARTS][N];
#pragma unroll
  for (int q = 0; q < PARTS; ++q) {
    const float* at = p.o_part + (first + (size_t)q * rows + r) * D + lane * N;
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 x = q < num_parts ? __ldcg(reinterpret_cast<const float2*>(at + i)) : make_float2(0.f, 0.f);
      part[q][i] = x.x, part[q][i + 1] = x.y;
    }
  }
  const int b = quotient(p.kv_heads_div, bh), kvh = bh - b * p.num_kv_heads;
  const long long kv0 = b * p.kv_stride_b + kvh * p.kv_stride_h;
  const int t = quotient(p.group_div, r), head = kvh * p.group + r - t * p.group;
  const float sink = p.sinks ? p.sinks[head] * 1.4426950408889634f : -INFINITY;
  // The row's maximum and the fresh tokens' weights, as merge_parts takes them (the same lines: as shared helpers they
  // changed the SASS of all 90 kernels, the general merge's included).
  float mx = fmaxf(sink, lse);
  if (p.has_fresh) {
    mx = fmaxf(mx, fresh_scores<D>(p, b * p.q_stride_b + head * p.q_stride_h + t * p.q_stride_t, kv0,
                                   p.key_shift ? p.key_shift + (size_t)bh * D : nullptr, t, lane,
                                   fresh_p + r * MAX_ROWS));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float m_use = mx == -INFINITY ? 0.f : mx;
  const float w = lane < num_parts ? exp2f(lse - m_use) : 0.f;
  float sum = w, fresh_w = 0.f;
  if (p.has_fresh) {  // fresh token j's weight: lane j's (NaN for a non-finite token)
    __syncwarp();
    fresh_w = lane < MAX_ROWS ? exp2f(fresh_p[r * MAX_ROWS + lane] - m_use) : 0.f;
    if (lane < MAX_ROWS) fresh_p[r * MAX_ROWS + lane] = fresh_w;
    __syncwarp();
  }
  sum += fresh_w;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float denom = sum + exp2f(sink - m_use);
  TURBOATTN_STAMP(14);
  float y[N] = {};
#pragma unroll
  for (int q = 0; q < PARTS; ++q) {
    const float wq = __shfl_sync(0xffffffffu, w, q);
    if (q < num_parts) {
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] += wq * part[q][i];
    }
  }
  const float inv = denom != 0.f ? 1.f / denom : 0.f;  // NaN stays NaN
#pragma unroll
  for (int i = 0; i < N; ++i) y[i] *= inv;
  TURBOATTN_STAMP(15);
  const int hq = p.num_kv_heads * p.group;
  finish_row_values<D>(p, y, [&](int i) { return signs[lane * N + i]; }, fresh_p + r * MAX_ROWS, denom, kv0, t,
                       (((size_t)b * hq + head) * p.tq + t) * D, lane);
}

// The fused merge, run by the last CTA of a (sequence, KV head): the cache parts and the fresh tokens by
// log2-sum-exp (plus the sink logit in the denominator), then the rotation back x = signs * H y / sqrt(D), cast to
// q's dtype.  The cache parts hold outputs in the rotated domain; the fresh tokens are attended here in the model's
// domain (rotation is orthogonal, so q . (k - shift) is the score the rotated, transformed pair would give) and
// their weighted values join after the rotation back (it is linear).  scratch: shared, scratch_words floats (the
// code tables' space); small: shared, SMALL_WORDS floats; y: shared [MAX_ROWS][D];
// fresh_p: shared [MAX_ROWS][MAX_ROWS]; signs: shared [D].  Parts were written by other CTAs: read through L2.
//
// The merge sits on the kernel's tail, so it is written for latency, as one L2 round trip where it fits: each
// thread owns float4s of the output; the log2-sum-exps go out first (the weights wait on them), then a first batch
// of BATCH parts into registers and the next parts into the scratch with cp.async (as many as the scratch holds
// beside the weights: 16 more per thread at D = 128 with 32 KB tables, so B=1's 32 parts take one round trip
// instead of two).  With fewer outputs than threads, `groups` threads share an output's parts (group k takes
// parts k, k + groups, ...) and their partial sums are added in a fixed order.  The weights ([rows][num_parts])
// live in `small` when they fit, else at the end of the scratch.
constexpr int SMALL_WORDS = 256;
template <int D, int TEAMS>
__device__ __forceinline__ void merge_parts(const DecodeParams& p, int bh, float* scratch, int scratch_words,
                                            float* small, float* y, float* denominator, float* fresh_p,
                                            const float* signs, int num_parts) {
  // b and kvh are recomputed here (the main loop need not keep them alive); bh comes from the caller.
  const int tid = team_thread<TEAMS>(), lane = tid & 31, warp = tid >> 5;
  const int b = quotient(p.kv_heads_div, bh), kvh = bh - b * p.num_kv_heads, rows = p.tq * p.group;
  const size_t first = (size_t)bh * p.num_parts * rows;  // part q of row r: first + q rows + r
  const long long kv0 = b * p.kv_stride_b + kvh * p.kv_stride_h;
  constexpr int D4 = D / 4, BATCH = 16, THREADS = WARPS * 32;
  const int outputs = rows * D4;
  // i / outputs, as the row count's quotient of i / D4 (D4 a power of two).
  auto set_of = [&](int i) { return quotient(p.rows_div, i / D4); };
  const int groups = outputs < THREADS ? set_of(THREADS) : 1;
  const size_t step = (size_t)rows * D4;  // float4s between consecutive parts of a row
  float4 part[BATCH];
  const bool small_weights = rows * num_parts <= SMALL_WORDS;
  const int scratch_free = small_weights ? scratch_words : (scratch_words - rows * num_parts) & ~3;  // 16-byte aligned
  float* weight = small_weights ? small : scratch + scratch_free;
  const int stage_slots = scratch_free / 4 / THREADS;
  float4* stage = reinterpret_cast<float4*>(scratch);
  int staged = 0;
  // Work item i: output float4 i % outputs, parts i / outputs + k groups; part q of its output at parts_of(i) + q step.
  auto parts_of = [&](int i) {
    const int o4 = i - set_of(i) * outputs;
    return reinterpret_cast<const float4*>(p.o_part + (first + o4 / D4) * D) + o4 % D4;
  };
  auto load_batch = [&](int i, int q0) {
    const float4* o = parts_of(i);
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int q = q0 + j * groups;
      part[j] = q < num_parts ? __ldcg(o + q * step) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  // The first 32 parts' log2-sum-exps of this warp's rows go out before the parts: the weights wait on them.
  constexpr int RPW = MAX_ROWS / WARPS;
  float lse_first[RPW];
#pragma unroll
  for (int k = 0; k < RPW; ++k) {
    const int r = warp + k * WARPS;
    lse_first[k] = r < rows && lane < num_parts ? __ldcg(p.lse_part + first + (size_t)lane * rows + r) : 0.f;
  }
  if (tid < outputs * groups) {
    load_batch(tid, set_of(tid));
    const float4* o = parts_of(tid);
    for (int j = 0; j < stage_slots; ++j) {
      const int q = set_of(tid) + (BATCH + j) * groups;
      if (q >= num_parts) break;
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(stage + j * THREADS + tid));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(o + q * step));
      staged = j + 1;
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
#pragma unroll
  for (int k = 0; k < RPW; ++k) {
    const int r = warp + k * WARPS;
    if (r >= rows) break;
    const int t = quotient(p.group_div, r), head = kvh * p.group + r - t * p.group;
    const float sink = p.sinks ? p.sinks[head] * 1.4426950408889634f : -INFINITY;
    float* w_row = weight + r * num_parts;
    // The parts' log2-sum-exps, staged in w_row (one L2 round trip, issued before the fresh tokens' loads).
    float mx = sink;
    for (int q = lane; q < num_parts; q += 32) {
      const float x = q == lane ? lse_first[k] : __ldcg(p.lse_part + first + (size_t)q * rows + r);
      w_row[q] = x;
      mx = fmaxf(mx, x);
    }
    // The fresh tokens' scores (raw, staged in this row's fresh_p by lane 0), behind one branch.
    if (p.has_fresh) {
      mx = fmaxf(mx, fresh_scores<D>(p, b * p.q_stride_b + head * p.q_stride_h + t * p.q_stride_t, kv0,
                                     p.key_shift ? p.key_shift + (size_t)bh * D : nullptr, t, lane,
                                     fresh_p + r * MAX_ROWS));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
    for (int q = lane; q < num_parts; q += 32) {  // each lane reads back what it staged: no barrier
      const float w = exp2f(w_row[q] - m_use);
      w_row[q] = w;
      sum += w;
    }
    // Fresh token j's weight: lane j turns its score into the weight (NaN for a non-finite token).
    float fresh_w = 0.f;
    if (p.has_fresh) {
      __syncwarp();
      fresh_w = lane < MAX_ROWS ? exp2f(fresh_p[r * MAX_ROWS + lane] - m_use) : 0.f;
      if (lane < MAX_ROWS) fresh_p[r * MAX_ROWS + lane] = fresh_w;
    }
    sum += fresh_w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) denominator[r] = sum + exp2f(sink - m_use);
  }
  team_sync<TEAMS>();
  TURBOATTN_STAMP(14);
  float4* y4 = reinterpret_cast<float4*>(y);
  // At D >= 256 a thread owns up to ITEMS > 2 outputs: those after its first are summed together below.
  constexpr int ITEMS = (MAX_ROWS * D4 + THREADS - 1) / THREADS;
  constexpr bool OTHERS_TOGETHER = ITEMS > 2;
  for (int i = tid; i < outputs * groups; i += THREADS) {
    if (OTHERS_TOGETHER && i != tid) break;
    const int o4 = i - set_of(i) * outputs, r = o4 / D4;
    const float* w = weight + r * num_parts;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int q_next = set_of(i);
    if (i == tid) {  // the thread's first item: a batch in `part`, the next `staged` parts in shared memory
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int q = q_next + j * groups;
        const float wj = q < num_parts ? w[q] : 0.f;
        acc.x += wj * part[j].x, acc.y += wj * part[j].y, acc.z += wj * part[j].z, acc.w += wj * part[j].w;
      }
      q_next += BATCH * groups;
      asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's own copies: no barrier needed
      for (int j = 0; j < staged; ++j) {
        const float wj = w[q_next + j * groups];
        const float4 x = stage[j * THREADS + tid];
        acc.x += wj * x.x, acc.y += wj * x.y, acc.z += wj * x.z, acc.w += wj * x.w;
      }
      q_next += staged * groups;
    }
    for (int q0 = q_next; q0 < num_parts; q0 += BATCH * groups) {
      load_batch(i, q0);
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int q = q0 + j * groups;
        const float wj = q < num_parts ? w[q] : 0.f;
        acc.x += wj * part[j].x, acc.y += wj * part[j].y, acc.z += wj * part[j].z, acc.w += wj * part[j].w;
      }
    }
    const float inv = denominator[r] != 0.f ? 1.f / denominator[r] : 0.f;  // NaN stays NaN
    y4[i] = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);  // groups x outputs <= MAX_ROWS x D4
  }
  if constexpr (OTHERS_TOGETHER) {
    // The thread's other outputs, float4s tid + k THREADS (k = 1 .. ITEMS - 1; groups = 1 here), summed together
    // (one output after another, each waiting on its own batches, took 8 L2 round trips at D = 512 and 8.2 µs on an
    // H100).  Same summation order as the first output's.
    if (outputs > THREADS) {
      constexpr int OTHERS = ITEMS - 1;
      float4 acc[OTHERS];
#pragma unroll
      for (int k = 0; k < OTHERS; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      sum_parts_in_flight<D, OTHERS, 1, TEAMS>(reinterpret_cast<const float4*>(p.o_part + first * D) + tid,
                                                (size_t)outputs, weight, num_parts, outputs, acc);
#pragma unroll
      for (int k = 0; k < OTHERS; ++k) {
        const int i = tid + (k + 1) * THREADS;
        if (i >= outputs) break;
        const float d = denominator[i / D4], inv = d != 0.f ? 1.f / d : 0.f;  // NaN stays NaN
        y4[i] = make_float4(acc[k].x * inv, acc[k].y * inv, acc[k].z * inv, acc[k].w * inv);
      }
    }
  }
  if (groups > 1) {
    team_sync<TEAMS>();
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    if (tid < outputs) {
      for (int k = 0; k < groups; ++k) {
        const float4 x = y4[k * outputs + tid];
        sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
      }
    }
    team_sync<TEAMS>();
    if (tid < outputs) y4[tid] = sum;
  }
  team_sync<TEAMS>();
  TURBOATTN_STAMP(15);
  // Rotation back, one row per warp, and the store.
  const int hq = p.num_kv_heads * p.group;
  for (int r = warp; r < rows; r += WARPS) {
    const int t = quotient(p.group_div, r), head = kvh * p.group + r - t * p.group;
    finish_row<D>(p, y + r * D, [&](int i) { return signs[lane * (D / 32) + i]; }, fresh_p + r * MAX_ROWS,
                  denominator[r], kv0, t, (((size_t)b * hq + head) * p.tq + t) * D, lane);
  }
}

// CTAs per SM that the kernel's registers and shared memory allow (the launch bound; ops/cached/config.py plans
// splits with the same numbers, and a GPU test compares them).  Measured: 4 at D <= 128 and 2 at D = 256 for
// 4-bit codes (BENCHMARKS.md); wider codes need more prefetch registers, two tables more shared memory.
template <int D, int KB, int VB, bool EXACT, int GA = 0, int KB2 = 0, bool SMALL_GRID = false>
constexpr int ctas_per_sm() {
  using S = Shape<D, KB, VB, GA, KB2, EXACT, SMALL_GRID>;
  constexpr int by_smem = S::ctas_by_shared(S::DYNAMIC_WORDS, S::TEAMS);
  return by_smem < S::BY_REGISTERS ? by_smem : S::BY_REGISTERS;
}

// Dynamic shared memory of decode<D, KB, VB, EXACT, GA, KB2>: the code tables (later reused to combine the warps and
// merge), and with teams each team's scratch after them.
template <int D, int KB, int VB, bool EXACT, int GA = 0, int KB2 = 0, bool SMALL_GRID = false>
constexpr int dynamic_bytes() { return Shape<D, KB, VB, GA, KB2, EXACT, SMALL_GRID>::DYNAMIC_WORDS * 4; }

// The tables live in dynamic shared memory (two of them pass the 48 KB of static shared memory).  The symbol's
// address is a constant, which ptxas may still rebuild in every tile: the kernel takes it from uniform_code_tables.
extern __shared__ __align__(16) uint32_t code_tables[];

// The tables' address from lane 0 (from_lane0): ptxas keeps it in a uniform register over the main loop, the
// lookups' uniform operand.  From the symbol itself it rebuilt the address in every tile where registers ran short:
// in k3v3's teams at D = 128 in a regular register, with an add per K lookup (loop 747 -> 708 instructions,
// 0.935-0.939 of the time, H200).
__device__ __forceinline__ uint32_t* uniform_code_tables() {
  const uint32_t at = from_lane0(static_cast<uint32_t>(__cvta_generic_to_shared(code_tables)));
  return static_cast<uint32_t*>(__cvta_shared_to_generic(at));
}

// Arrive on `counter` (after making this CTA's writes visible): whether this CTA is the last of `expected`; the last
// one resets the counter for the next call (and the next replay of a captured graph).  is_last: a shared flag.
// One thread arrives, after the barrier that orders the CTA's writes before it, with one acquire-release atomic
// (release is cumulative: it publishes what the barrier ordered; acquire makes the other CTAs' parts visible to the
// last one, whose barrier then passes them on): a fence in every thread measured as the largest stall of the
// epilogue (ncu, B=1 D=128), and fence + atomic + fence in one thread 0.3-0.6 µs more than this (H100).
template <int TEAMS>
__device__ __forceinline__ bool arrive_last(int* counter, int expected, int& is_last) {
  team_sync<TEAMS>();
  if (team_thread<TEAMS>() == 0) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    is_last = old == expected - 1;
    if (is_last) *counter = 0;
  }
  team_sync<TEAMS>();
  return is_last;
}

// Count this CTA's part in; the last CTA of the (sequence, KV head) to arrive merges every part, a warp per row
// where the build has that merge (ROW_WARPS: Shape::ROW_WARP_MERGE) and the call fits it.  The merge takes the CTA's
// index from here: recomputing it costs integer divisions, cold code on the kernel's tail.
template <int D, int TEAMS, bool ROW_WARPS = false>
__device__ __forceinline__ void join_and_merge(const DecodeParams& p, const CtaIndex& cta, uint32_t* scratch,
                                               int scratch_words, float* small, float* q_rot, float* warp_ml,
                                               float* fresh_p, const float* signs, int& is_last) {
  if (!arrive_last<TEAMS>(p.counters + (size_t)cta.bh * COUNTERS_PER_HEAD, p.num_parts, is_last)) return;
  TURBOATTN_STAMP(6);
  if constexpr (ROW_WARPS) {
    if (merges_by_row_warps<D>(p, p.num_parts)) {
      merge_rows_by_warps<D, TEAMS>(p, cta.bh, fresh_p, signs, p.num_parts);
      return;
    }
  }
  merge_parts<D, TEAMS>(p, cta.bh, reinterpret_cast<float*>(scratch), scratch_words, small, q_rot, warp_ml, fresh_p,
                        signs, p.num_parts);
}

// An exact part (the CTAs of parts num_splits .. num_parts - 1, in the kernels built for caches with exact rows):
// its share of the exact first tokens and the exact recent window (cta: exact_cta_index), attended in full
// precision in the model's domain (scores q . (k - key_shift), as the fresh tokens'), up to EXACT_CHUNK rows at a
// time.  Written for latency (this CTA runs beside the splits and must not outlast them, and each of its round
// trips to memory is long while they stream):
// T threads per exact row compute that row's scores against every query row (q from shared memory; their partial
// sums meet in log2 T shuffles), a warp per query row runs the online softmax, then each thread accumulates two
// output dims over a group of the rows, a batch of rows' loads in flight at a time.  The groups' outputs
// are added in a fixed order, normalized and rotated into the codes' domain, y = H (signs x) / sqrt(D) (the
// merge's rotation back inverts it), so the merge takes the result as one more part.  A row with a non-finite k
// or v scores NaN where it is seen, as fresh tokens do.  scratch: shared memory (the code tables' space, unused by
// this CTA); q_s: shared [MAX_ROWS][D]; signs: shared [D].
constexpr int EXACT_CHUNK = WARPS * 32;
// Steps of 8 dims whose loads a thread of the exact part issues together: a row's thread then costs D / 8 / T /
// exact_steps round trips to memory instead of D / 8 / T (the exact rows are rarely still in L2 when a decode step
// reads them: the splits stream the cache through it).  Two at D = 512, whose kernels hold 128 registers.
template <int D>
__host__ __device__ constexpr int exact_steps() { return D >= 512 ? 2 : 4; }

// Eight consecutive elements of an exact row (16 or 32 bytes, aligned), as loaded (b: float32 rows only).
struct Raw8 {
  uint4 a, b;
};
__device__ __forceinline__ Raw8 load_raw8(const char* row, int dtype, int d0) {
  Raw8 r;
  if (dtype == 2) {
    r.a = reinterpret_cast<const uint4*>(row)[d0 / 4], r.b = reinterpret_cast<const uint4*>(row)[d0 / 4 + 1];
  } else {
    r.a = reinterpret_cast<const uint4*>(row)[d0 / 8], r.b = make_uint4(0u, 0u, 0u, 0u);
  }
  return r;
}

// ... as floats.
__device__ __forceinline__ void to_floats8(const Raw8& r, int dtype, float (&x)[8]) {
  if (dtype == 2) {
    x[0] = __uint_as_float(r.a.x), x[1] = __uint_as_float(r.a.y), x[2] = __uint_as_float(r.a.z);
    x[3] = __uint_as_float(r.a.w), x[4] = __uint_as_float(r.b.x), x[5] = __uint_as_float(r.b.y);
    x[6] = __uint_as_float(r.b.z), x[7] = __uint_as_float(r.b.w);
    return;
  }
  const uint32_t words[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (dtype == 1) {
      x[2 * i] = __uint_as_float(words[i] << 16), x[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
      x[2 * i] = f.x, x[2 * i + 1] = f.y;
    }
  }
}

// Two consecutive elements (d even) as floats.
__device__ __forceinline__ float2 load2(const char* row, int dtype, int d) {
  if (dtype == 2) return reinterpret_cast<const float2*>(row)[d / 2];
  const uint32_t w = reinterpret_cast<const uint32_t*>(row)[d / 2];
  if (dtype == 1) return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

template <int D, int TEAMS>
__device__ __forceinline__ void exact_part(const DecodeParams& p, const CtaIndex cta, uint32_t* scratch, float* q_s,
                                           float* signs) {
  constexpr int THREADS = WARPS * 32, RPW = MAX_ROWS / WARPS, CH = EXACT_CHUNK;
  // P V: each thread takes PPT pairs of dims (pair + k THREADS) over one group of the rows.
  constexpr int PAIRS = D / 2, GROUPS = THREADS / PAIRS > 0 ? THREADS / PAIRS : 1;
  constexpr int PPT = PAIRS > THREADS ? PAIRS / THREADS : 1;
  static_assert(PAIRS % THREADS == 0 || THREADS % PAIRS == 0, "pairs of dims spread evenly over the threads");
  const int tid = team_thread<TEAMS>(), lane = tid & 31, warp = tid >> 5;
  const int bh = cta.bh, b = quotient(p.kv_heads_div, bh), kvh = bh - b * p.num_kv_heads, rows = p.tq * p.group;
  const int seen = p.seen[b], start = p.starts[b];
  const int qpos_base = p.has_fresh ? seen : seen - p.tq;
  const int S = p.exact_first, R = p.exact_recent;
  // This CTA's share of the exact rows (first rows, then the window's): rows j0 + [0, total) of an even split over
  // the (sequence, KV head)'s exact CTAs (ops/cached/config.cuda_exact_parts).
  const int exact_parts = p.num_parts - p.num_splits, share = (S + R + exact_parts - 1) / exact_parts;
  const int j0 = (cta.part - p.num_splits) * share, total = max(0, min(S + R - j0, share));
  const int elem = p.exact_dtype == 2 ? 4 : 2;
  const char** v_row = reinterpret_cast<const char**>(scratch);    // [CH]: the chunk's V rows (null: none)
  float* s_s = reinterpret_cast<float*>(v_row + CH);               // [MAX_ROWS][CH]: scores, then weights
  float* alpha_s = s_s + MAX_ROWS * CH;                            // [MAX_ROWS]: each query row's rescale
  float* shift_s = alpha_s + MAX_ROWS;                             // [D]: the key shift
  float* o_s = shift_s + D;                                        // [GROUPS][MAX_ROWS][D]: the groups' outputs
  {  // q: thread t takes QPT consecutive dims of row t / (D / QPT)
    constexpr int QPT = MAX_ROWS * D / THREADS;
    static_assert(D % QPT == 0, "a thread's dims of q lie in one row");
    const int r = tid / (D / QPT), d0 = tid % (D / QPT) * QPT, t = quotient(p.group_div, r);
    const int h = kvh * p.group + r - t * p.group;
    float x[QPT] = {};
    if (r < rows) load_row<QPT>(p.q, p.q_dtype, b * p.q_stride_b + h * p.q_stride_h + t * p.q_stride_t + d0, x);
#pragma unroll
    for (int i = 0; i < QPT; ++i) q_s[r * D + d0 + i] = x[i];
  }
  for (int i = tid; i < D; i += THREADS) {
    signs[i] = p.signs[i];
    shift_s[i] = p.key_shift ? p.key_shift[(size_t)bh * D + i] : 0.f;
  }
  float m_r[RPW], l_r[RPW];   // warp w owns query rows w + k WARPS
#pragma unroll
  for (int k = 0; k < RPW; ++k) m_r[k] = -INFINITY, l_r[k] = 0.f;
  const int pair = tid % PAIRS, group = tid / PAIRS;   // P V: dims 2 pair', 2 pair' + 1 over rows group, group + GROUPS..
  float acc[MAX_ROWS][2 * PPT];
#pragma unroll
  for (int r = 0; r < MAX_ROWS; ++r)
#pragma unroll
    for (int i = 0; i < 2 * PPT; ++i) acc[r][i] = 0.f;
  team_sync<TEAMS>();
  TURBOATTN_STAMP(2);   // the exact CTA's set-up done (queries, signs, shift)

  // T threads per exact row (a power of two, uniform): as many as keep every thread busy over the rows, at most a
  // warp and at most one per 8-dim step.  Thread tid takes row c0 + tid / T of a chunk of CR = THREADS / T rows, and
  // its steps sub + T u (sub = tid % T): a row's threads read adjacent 16-byte pieces, and a row costs
  // D / (8 T EXACT_STEPS) round trips to memory instead of D / (8 EXACT_STEPS) (the presets' 12 exact rows at
  // D = 256: one instead of eight).  Each round trip is long here: the splits beside this CTA load the memory.
  constexpr int EXACT_STEPS = exact_steps<D>();
  int T = 1;
  while (2 * T <= 32 && 2 * T * EXACT_STEPS * 8 <= D && 2 * T * total <= THREADS) T *= 2;
  const int CR = THREADS / T;
  for (int c0 = 0; c0 < total; c0 += CR) {
    // Scores of exact row j = j0 + c0 + jl (first rows, then the window's).
    {
      const int sub = tid & (T - 1), jl = tid / T, j = j0 + c0 + jl;
      const char *kr = nullptr, *vr = nullptr;
      int pos = 0;
      if (c0 + jl >= total) {
        // past this CTA's rows: nothing to read
      } else if (j < S) {
        pos = start + j;
        const long long off = b * p.first_stride_b + kvh * p.first_stride_h + (long long)j * p.first_stride_t;
        if (pos < seen)
          kr = static_cast<const char*>(p.first_k) + off * elem, vr = static_cast<const char*>(p.first_v) + off * elem;
      } else {
        const int r = j - S;
        pos = seen - R + ((r - seen) % R + R) % R;   // the p in [seen - R, seen) with p = r (mod R)
        const long long off = b * p.recent_stride_b + kvh * p.recent_stride_h + (long long)r * p.recent_stride_t;
        // Not padding, and not one of the first tokens (their rows win).
        if (pos >= 0 && pos >= start + S)
          kr = static_cast<const char*>(p.recent_k) + off * elem, vr = static_cast<const char*>(p.recent_v) + off * elem;
      }
      if (sub == 0) v_row[jl] = vr;
      float dot[MAX_ROWS];
#pragma unroll
      for (int r = 0; r < MAX_ROWS; ++r) dot[r] = 0.f;
      bool finite = true;
      if (kr != nullptr) {
        const int steps = D / 8 / T;   // a multiple of EXACT_STEPS
#pragma unroll 1
        for (int u0 = 0; u0 < steps; u0 += EXACT_STEPS) {
          Raw8 k_raw[EXACT_STEPS], v_raw[EXACT_STEPS];  // every load of the round in flight before the first use
#pragma unroll
          for (int u = 0; u < EXACT_STEPS; ++u) {
            k_raw[u] = load_raw8(kr, p.exact_dtype, 8 * (sub + T * (u0 + u)));
            v_raw[u] = load_raw8(vr, p.exact_dtype, 8 * (sub + T * (u0 + u)));
          }
#pragma unroll
          for (int u = 0; u < EXACT_STEPS; ++u) {
            const int d0 = 8 * (sub + T * (u0 + u));
            float kx[8], vx[8];
            to_floats8(k_raw[u], p.exact_dtype, kx);
            to_floats8(v_raw[u], p.exact_dtype, vx);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              finite = finite && isfinite(kx[e]) && isfinite(vx[e]);
              kx[e] -= shift_s[d0 + e];
            }
#pragma unroll
            for (int r = 0; r < MAX_ROWS; ++r) {
              if (r >= rows) break;  // the same for every thread
              const float4 qa = *reinterpret_cast<const float4*>(q_s + r * D + d0);
              const float4 qb = *reinterpret_cast<const float4*>(q_s + r * D + d0 + 4);
              dot[r] += qa.x * kx[0] + qa.y * kx[1] + qa.z * kx[2] + qa.w * kx[3] + qb.x * kx[4] + qb.y * kx[5] +
                        qb.z * kx[6] + qb.w * kx[7];
            }
          }
        }
      }
      // The row's T partial sums, over the aligned lanes that hold them (a row's threads share kr: uniform).
      for (int o = 1; o < T; o <<= 1) {
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) {
          if (r >= rows) break;
          dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], o);
        }
        finite = __shfl_xor_sync(0xffffffffu, (int)finite, o) && finite;
      }
      for (int r = 0; r < MAX_ROWS; ++r) {
        const int qpos = qpos_base + quotient(p.group_div, r);
        float x = -INFINITY;
        if (kr != nullptr && r < rows && pos <= qpos && (p.window <= 0 || qpos - pos < p.window)) {
          x = dot[r] * p.q_scale;
          if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap) * 1.4426950408889634f;
          if (!finite) x = NAN;
        }
        if (sub == 0) s_s[r * CH + jl] = x;
      }
    }
    team_sync<TEAMS>();
    if (c0 == 0) { TURBOATTN_STAMP(9); }   // the first chunk's scores
    // Online softmax, a warp per query row.  A hidden row's weight is -0 (its sign marks it: P V skips it).
#pragma unroll
    for (int k = 0; k < RPW; ++k) {
      float* srow = s_s + (warp + k * WARPS) * CH;
      float x[CH / 32];
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < CH / 32; ++i) {  // slots past the chunk's CR rows hold nothing
        x[i] = lane + 32 * i < CR ? srow[lane + 32 * i] : -INFINITY;
        mx = fmaxf(mx, x[i]);  // NaN passes by
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m_r[k], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_r[k] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < CH / 32; ++i) {
        const float w = x[i] == -INFINITY ? -0.f : exp2f(x[i] - m_use);
        sum += w;
        srow[lane + 32 * i] = w;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      l_r[k] = l_r[k] * alpha + sum;
      m_r[k] = m_new;
      if (lane == 0) alpha_s[warp + k * WARPS] = alpha;
    }
    team_sync<TEAMS>();
    // P V: dims 2 pair', 2 pair' + 1 (pair' = pair + k THREADS) over this group's rows.
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r)
#pragma unroll
      for (int i = 0; i < 2 * PPT; ++i) acc[r][i] *= alpha_s[r];
    const int n = min(CR, total - c0);
    if (group < GROUPS) {
      // RB rows' loads in flight before their first use: a round trip per batch, not per row or two.
      constexpr int RB = D >= 512 ? 4 : 8;
#pragma unroll 1
      for (int j0 = group; j0 < n; j0 += RB * GROUPS) {
        float2 v[RB][PPT];
#pragma unroll
        for (int u = 0; u < RB; ++u) {
          const int jj = j0 + u * GROUPS;
          const char* vr = jj < n ? v_row[jj] : nullptr;
#pragma unroll
          for (int k = 0; k < PPT; ++k)
            v[u][k] = vr ? load2(vr, p.exact_dtype, 2 * (pair + k * THREADS)) : make_float2(0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < RB; ++u) {
          const int jj = j0 + u * GROUPS;
          if (jj >= n) break;
#pragma unroll
          for (int r = 0; r < MAX_ROWS; ++r) {
            if (r >= rows) break;  // the same for every thread
            const float pr = s_s[r * CH + jj];
            if (signbit(pr) && !isnan(pr)) continue;  // hidden from this query row (never 0 x inf)
#pragma unroll
            for (int k = 0; k < PPT; ++k) acc[r][2 * k] += pr * v[u][k].x, acc[r][2 * k + 1] += pr * v[u][k].y;
          }
        }
      }
    }
    team_sync<TEAMS>();  // the next chunk rewrites v_row and s_s
  }
  TURBOATTN_STAMP(3);   // every chunk attended

  // The groups' outputs, then their sum in a fixed order (deterministic), normalized, rotated and stored.
  if (group < GROUPS) {
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r)
#pragma unroll
      for (int k = 0; k < PPT; ++k) {
        o_s[(group * MAX_ROWS + r) * D + 2 * (pair + k * THREADS)] = acc[r][2 * k];
        o_s[(group * MAX_ROWS + r) * D + 2 * (pair + k * THREADS) + 1] = acc[r][2 * k + 1];
      }
  }
  team_sync<TEAMS>();
  constexpr int N = D / 32;
  const float norm = rsqrtf((float)D);
#pragma unroll
  for (int k = 0; k < RPW; ++k) {
    const int r = warp + k * WARPS;
    if (r >= rows) continue;
    const float inv = l_r[k] != 0.f ? 1.f / l_r[k] : 0.f;  // nothing seen: 0; NaN stays NaN
    // A merge in its own launch at D = 512 (no counters) takes the part in the model's domain as it is.
    const bool rotate = !model_domain_parts<D>(p);
    float y[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float sum = 0.f;
      for (int g = 0; g < GROUPS; ++g) sum += o_s[(g * MAX_ROWS + r) * D + lane * N + i];
      y[i] = sum * inv * (rotate ? signs[lane * N + i] : 1.f);
    }
    if (rotate) hadamard_warp<D>(y, lane);
    const size_t part = ((size_t)bh * p.num_parts + cta.part) * rows + r;
#pragma unroll
    for (int i = 0; i < N; ++i) p.o_part[part * D + lane * N + i] = rotate ? y[i] * norm : y[i];
    if (lane == 0) p.lse_part[part] = l_r[k] != 0.f ? m_r[k] + log2f(l_r[k]) : -INFINITY;
  }
}

// EXACT: built for caches with exact rows (more CTAs attend them); a separate build keeps that code out of the
// other kernels' register allocation (inlined or as a call, it made the k4v4 kernel spill).
template <int D, int KB, int VB, bool EXACT, int GA = 0, int KB2 = 0, bool SMALL_GRID = false>
__global__ void __launch_bounds__(Shape<D, KB, VB, GA, KB2, EXACT, SMALL_GRID>::THREADS,
                                  (ctas_per_sm<D, KB, VB, EXACT, GA, KB2, SMALL_GRID>() /
                                   Shape<D, KB, VB, GA, KB2, EXACT, SMALL_GRID>::TEAMS))
    decode(const DecodeParams p) {
  using S = Shape<D, KB, VB, GA, KB2, EXACT, SMALL_GRID>;
  constexpr int TEAMS = S::TEAMS, STREAMS = S::STREAMS;
  static_assert(STREAMS == 1 || (TEAMS == 1 && S::SLICED && !EXACT), "key streams: D = 512's plain kernels");
  // The code tables (dynamic, shared by the teams), the rotated queries, the q fragments when they live in shared
  // memory, and the warps' row statistics (a team's own).
  uint32_t* const k_table = uniform_code_tables();
  uint32_t* const v_table = k_table + S::V_TABLE_AT;
  const int team = team_index<TEAMS>();
  uint32_t* const scratch = code_tables + S::SCRATCH_AT + team * S::SCRATCH_SPAN;
  // A team's arrays in one struct: one base address per team.
  struct TeamArrays {
    __align__(16) float merge_small[SMALL_WORDS];  // the merge's weights, when they fit
    float q_rot[MAX_ROWS * D];
    float signs[D];  // the rotation's signs, for the merge's rotation back
    float warp_ml[WARPS * MAX_ROWS * 2];
    float fresh_p[MAX_ROWS * MAX_ROWS];
    float row_inv[MAX_ROWS];
    int is_last;
  };
  __shared__ TeamArrays team_arrays[TEAMS];
  TeamArrays& mine = team_arrays[team];
  float* const merge_small = mine.merge_small;
  float* const q_rot = mine.q_rot;
  float* const signs = mine.signs;
  float* const warp_ml = mine.warp_ml;
  float* const fresh_p = mine.fresh_p;
  float* const row_inv = mine.row_inv;
  int& is_last = mine.is_last;
  static_assert(TEAMS == 1 || !(S::Q_IN_SMEM || S::SLICED), "teams hold their q fragments in registers, unsliced");
  __shared__ uint2 q_frag[S::Q_IN_SMEM ? S::K_STEPS * 32 : 1];
  // Sliced: the warps' partial scores of a step's tiles (two buffers per stream, alternating by step: one barrier
  // per step).
  __shared__ float4 partial_scores[S::SLICED ? 2 * S::STEP_TILES * WARPS * 32 * STREAMS : 1];

  // tid, warp: the thread and warp in its team (its stream's, with key streams: a warp's slice is its warp).
  const int tid = team_thread<TEAMS * STREAMS>(), lane = tid & 31, warp = tid >> 5;
  const int stream = STREAMS > 1 ? static_cast<int>(from_lane0(threadIdx.x / (WARPS * 32))) : 0;
  // A barrier of the stream's warps (the team's without key streams).
  auto stream_sync = [&] {
    if constexpr (STREAMS > 1) team_barrier(stream);
    else team_sync<TEAMS>();
  };
  // The set-up's warps (both streams'), each loading and rotating ROWS_PER_WARP query rows.
  constexpr int SET_UP_WARPS = WARPS * STREAMS, ROWS_PER_WARP = MAX_ROWS / SET_UP_WARPS;
  const int set_up_warp = stream * WARPS + warp;
  const int g = lane >> 2, c = lane & 3;
  // Team t of CTA b takes part b + t gridDim.x of the grid: a launch of one CTA per part (launch: small grids) then
  // leaves every CTA's second team without one.
  const int block = blockIdx.x + team * gridDim.x;
  if constexpr (TEAMS > 1) {
    // The teams build the shared tables together, before either takes its own path; a CTA's last team may have
    // no part (an odd number of parts).
    static_assert(S::SHARED_TABLE, "teams share one table");
    S::KTable::template build_shared<TEAMS>(k_table, team, tid);
    __syncthreads();
    if (block >= p.num_parts * p.batch_kv_heads) return;
  }
  const CtaIndex cta = cta_index(p, block);
  const int split = cta.part, bh = cta.bh;
  const int b = quotient(p.kv_heads_div, bh), kvh = bh - b * p.num_kv_heads;
  const int rows = p.tq * p.group;
  TURBOATTN_STAMP(10);
  TURBOATTN_STAMP(1);
  TURBOATTN_STAMP(13);

  // The CTAs of parts num_splits and after attend the exact rows, then join the merge.
  if constexpr (EXACT) {
    if (split == p.num_splits) {
      const CtaIndex exact_cta = exact_cta_index(p, block);
      exact_part<D, TEAMS>(p, exact_cta, scratch, q_rot, signs);
      TURBOATTN_STAMP(5);
      TURBOATTN_STAMP(11);
      if (p.counters != nullptr)
        join_and_merge<D, TEAMS>(p, exact_cta, scratch, S::SCRATCH_SPAN, merge_small, q_rot, warp_ml, fresh_p, signs,
                                 is_last);
      TURBOATTN_STAMP(7);
      TURBOATTN_STAMP(12);
      return;
    }
  }
  // This split's slots, narrowed to what some query can see (as the Triton kernel does).
  const int seen = p.seen[b], start = p.starts[b];
  // The set-up's other loads: the queries (row r = token r / G of query head kvh * G + r % G; warp w takes rows w
  // and w + 4, lane l dims l N ...), the signs and the gains.  Below D = 512 they go out here, before anything waits
  // on the lengths, and the queries stay raw words until the first tiles' loads are issued and the tables built:
  // converted where they were loaded (load_row), each query row held the tiles' loads back by a round trip (ncu at
  // B = 1: the conversion waited on its load first).  B = 1 at D = 128 took 0.963 of the time, D = 64 0.985, D = 256
  // 0.989 (H200).  At D = 512 the same order took 1.05 (not explained; its exact-row builds also spilled more), and
  // loading them after the first tiles' loads 1.02-1.04, so there they are loaded just before the tiles' loads,
  // converted, the gain folded into the sign (16 fewer registers).
  constexpr int N = D / 32;
  constexpr bool LOADS_AHEAD = N < 16;
  float sign[N], gain[N];   // (gain: LOADS_AHEAD only)
  uint32_t q_raw[ROWS_PER_WARP][N];   // as loaded (LOADS_AHEAD), else the floats' bits
  auto load_set_up = [&] {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      sign[i] = p.signs[lane * N + i];
      const float gi = p.gain_inv ? p.gain_inv[(size_t)bh * D + lane * N + i] : 1.f;
      if constexpr (LOADS_AHEAD) gain[i] = gi;
      else sign[i] *= gi;
    }
#pragma unroll
    for (int k = 0; k < ROWS_PER_WARP; ++k) {
      const int r = set_up_warp + k * SET_UP_WARPS, t = quotient(p.group_div, r), h = kvh * p.group + r - t * p.group;
      const long long offset = b * p.q_stride_b + h * p.q_stride_h + t * p.q_stride_t + lane * N;
      if (r >= rows) {
#pragma unroll
        for (int i = 0; i < N; ++i) q_raw[k][i] = 0u;   // zero in every dtype
      } else if constexpr (LOADS_AHEAD) {
        load_row_raw<N>(p.q, p.q_dtype, offset, q_raw[k]);
      } else {
        float x[N];
        load_row<N>(p.q, p.q_dtype, offset, x);
#pragma unroll
        for (int i = 0; i < N; ++i) q_raw[k][i] = __float_as_uint(x[i]);
      }
    }
  };
  if constexpr (LOADS_AHEAD) load_set_up();
  // Key groups: the lane's stored channels' model channels.
  int order[S::GROUPED ? GROUP_LANE_VALUES : 1];
  if constexpr (S::GROUPED) {
    static_assert(N == GROUP_LANE_VALUES, "key groups at D = 256: a lane's 8 channels lie in one group");
    key_order_ahead<D>(p.key_order, bh, order);
  }
  // The codes serve positions [code_lo, code_hi): the exact first tokens and the exact window are read in full
  // precision by the exact part instead.
  const int code_lo = start + p.exact_first, code_hi = seen - p.exact_recent;
  const int held = min(seen, p.capacity);
  int chunk = quotient(p.splits_div, held + p.num_splits - 1);
  chunk = (chunk + p.chunk_align - 1) & -p.chunk_align;
  const int lo = split * chunk;
  int hi = min(lo + chunk, held);
  const int qpos_base = p.has_fresh ? seen : seen - p.tq;
  const int qpos_last = qpos_base + p.tq - 1;
  if (!p.ring) hi = min(hi, qpos_last + 1);
  // Ring slots hold positions pos = slot + ring_base, minus capacity past the newest slot (ring_wrap).
  // (An empty cache, seen = 0, reads no tile: its wrap is never used.)
  const int newest = max(seen - 1, 0), ring_wrap = newest - quotient(p.capacity_div, newest) * p.capacity;
  const int ring_base = newest - ring_wrap;
  auto position = [&](int slot) { return p.ring ? slot + ring_base - (slot > ring_wrap ? p.capacity : 0) : slot; };
  // This lane's score rows are 2c and 2c + 1 (rows past `rows` hold zero queries and are never stored).
  const int qpos[2] = {qpos_base + quotient(p.group_div, 2 * c), qpos_base + quotient(p.group_div, 2 * c + 1)};

  const size_t row0 = (size_t)bh * p.capacity;
  const int kg = tile_key<S::PERMUTED_KEYS>(g);  // the tile keys of this lane's score rows g and g + 8: kg, kg + 8
  const int scale_bytes = p.scale_bf16 ? 2 : 4;
  // Two-plane codes: where this lane's high-plane slices start (relative to its low-plane ones) and the bit at
  // which their fields' high bits start.
  // The lane's slot in a row: its slice's (the warp's when sliced) quarter of the keys' bytes and eighth of the
  // values'.
  const int slice = S::SLICED ? warp : 0;
  const int kc = slice * 4 + c, vg = slice * 8 + g;
  // The norm block of the slice's 8-bit rows (a warp's slice lies in one block).
  const int warp_block = slice * S::NB / S::SLICES;
  // Key groups: a lane's slices are strided from the key's first byte (GroupCodes), and the fragments take c.
  int k_first = 0, k_shift = c, k_high = 0;
  if constexpr (!S::GROUPED) {
    k_first = kc * S::K::LANE_BYTES;
    k_shift = S::K::High::shift(k_first);
    k_high = S::K::High::offset(k_first) - k_first;
  }
  const int v_first = vg * S::V::LANE_BYTES, v_shift = S::V::High::shift(v_first);
  const bool bf16 = p.scale_bf16 != 0;
  auto selector = [&](const uint8_t* addr) {
    const uint32_t sel = scale_selector(addr, bf16);
    return S::PINNED_SELECTORS ? pinned_word(sel, lane) : sel;
  };
  const uint8_t* const ks0 = static_cast<const uint8_t*>(p.k_scales) + (row0 + kg) * S::KNB * scale_bytes;
  const uint8_t* const vs0 = static_cast<const uint8_t*>(p.v_scales) + (row0 + kg) * S::NB * scale_bytes;
  const LanePointers lp{pinned(p.k_codes + (row0 + kg) * S::K::ROW_BYTES + k_first, lane),
                        pinned(p.v_codes + (row0 + value_key<S::PERMUTED_KEYS>(c, 0)) * S::V::ROW_BYTES + v_first,
                               lane),
                        pinned(scale_word(ks0), lane), pinned(scale_word(vs0), lane),
                        k_high, S::V::High::offset(v_first) - v_first,
                        S::NB * scale_bytes,
                        static_cast<int>(scale_word(ks0 + scale_bytes) - scale_word(ks0)),
                        {selector(ks0), selector(ks0 + scale_bytes)},
                        S::KNB * scale_bytes, scale_selector(vs0, bf16)};
  // A tile's loads (`side`: a std::integral_constant of KEY_SIDE, VALUE_SIDE or BOTH_SIDES), clamped past the capacity.
  auto load_side = [&](auto side, int tile, TileData<S>& t) {
    constexpr int SIDES = decltype(side)::value;
    if (tile + TILE_KEYS <= p.capacity) load_tile<S, SIDES>(lp, tile, t);
    else load_tile_clamped<S, SIDES>(lp, tile, p.capacity, kg, c, t);
  };
  auto load = [&](int tile, TileData<S>& t) { load_side(std::integral_constant<int, BOTH_SIDES>{}, tile, t); };
  // (Key groups' tables, 4 to 8 bits, all have KTable's one column per lane.)
  const uint32_t k_lane = S::KTable::lane_offset(lane), v_lane = S::VTable::lane_offset(lane);
  // Tiles that no mask touches: [safe_lo, safe_hi) in slots when the cache is not a ring (the causal limit,
  // the split's end, left padding and the window); a ring's tiles always take the masked path.
  int safe_lo = code_lo, safe_hi = min(min(hi, qpos_base + 1), code_hi);
  if (p.window > 0) safe_lo = max(safe_lo, qpos_last - p.window + 1);
  if (p.ring) safe_hi = safe_lo - 1;


  if constexpr (!LOADS_AHEAD) load_set_up();
  // The first tiles' loads.  (An L2 prefetch of the split's first keys here, or kept running ahead of the warps,
  // measured no faster.)
  TileData<S> next, ahead;  // the next tile, and (PREFETCH = 2) the one after it
  // Each warp walks its own tiles, or (sliced) every warp of a stream walks every STREAMS-th tile.
  const int first_tile = lo + (S::SLICED ? stream : warp) * TILE_KEYS;
  constexpr int STRIDE = (S::SLICED ? STREAMS : WARPS) * TILE_KEYS;
  if constexpr (S::SKEWED) {
    if (first_tile < hi) load_side(std::integral_constant<int, KEY_SIDE>{}, first_tile, next);
  } else if (first_tile < hi) {
    load(first_tile, next);
  }
  if constexpr (S::PREFETCH > 1)
    if (first_tile + STRIDE < hi) load(first_tile + STRIDE, ahead);
  TURBOATTN_STAMP(2);
  // The tables come from the codebooks' constants, so they are built while the loads are in flight (ptxas
  // interleaves their stores with the queries' rotation, which waits on the loads: nvcc 13.0, sm_90).
  if constexpr (S::GROUPED) S::K::build(k_table);
  else if constexpr (TEAMS == 1) S::KTable::template build_by<STREAMS>(k_table, stream, tid);
  if constexpr (!S::SHARED_TABLE) S::VTable::template build_by<STREAMS>(v_table, stream, tid);
  TURBOATTN_STAMP(9);
  if constexpr (!LOADS_AHEAD) {   // sign holds the gains too
    for (int i = stream * WARPS * 32 + tid; i < D; i += S::THREADS) signs[i] = p.signs[i];
  } else if (warp == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) signs[lane * N + i] = sign[i];
  }
  // q / gain, signs, then H; key groups: q / gain into the stored order, each group's signs and rotation.
#pragma unroll
  for (int k = 0; k < ROWS_PER_WARP; ++k) {
    float* const row = q_rot + (set_up_warp + k * SET_UP_WARPS) * D;
    float qx[N];
    raw_to_floats<N>(LOADS_AHEAD ? p.q_dtype : 2, q_raw[k], qx);
    if constexpr (S::GROUPED) {
#pragma unroll
      for (int i = 0; i < N; ++i) qx[i] *= gain[i];
      to_stored_order(qx, row, order);
      // The signs of the lane's group's rotation: the table's first, at its channels' place in the group.
      const float* group_signs = p.signs + (lane * N < GA ? lane * N : lane * N - GA);
#pragma unroll
      for (int i = 0; i < N; ++i) row[lane * N + i] = qx[i] * group_signs[i];
      rotate_key_groups<D, GA>(row, p.hartley_a, p.hartley_b);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) qx[i] *= LOADS_AHEAD ? gain[i] * sign[i] : sign[i];
      hadamard_warp<D>(qx, lane);
#pragma unroll
      for (int i = 0; i < N; ++i) row[lane * N + i] = qx[i];
    }
  }
  team_sync<TEAMS>();  // publishes the tables (one team) and the rotated queries
  // The rotations are unnormalized: 1 / sqrt(D), or a group's 1 / sqrt(P) (both groups' P alike: KeyGroups).
  const float q_norm = p.q_scale * rsqrtf(static_cast<float>(S::GROUPED ? GroupShape<S::GROUPED ? GA : 16>::P : D));
  // B fragments of Q^T (16 dims x 8 rows) per k-step: row g, the dims that the K fragments hold at k-indices
  // 2c, 2c+1 (register 0) and 2c+8, 2c+9 (register 1).
  auto q_fragment = [&](int kk) {
    const float* qg = q_rot + g * D;
    using K = typename S::K;
    return make_uint2(pack_half2(qg[K::dim(kc, kk, 0, 0)] * q_norm, qg[K::dim(kc, kk, 0, 1)] * q_norm),
                      pack_half2(qg[K::dim(kc, kk, 1, 0)] * q_norm, qg[K::dim(kc, kk, 1, 1)] * q_norm));
  };
  uint2 qb[S::Q_IN_SMEM ? 1 : S::K_STEPS];
  if constexpr (S::Q_IN_SMEM) {
    for (int kk = warp; kk < S::K_STEPS; kk += WARPS) q_frag[kk * 32 + lane] = q_fragment(kk);
    team_sync<TEAMS>();
  } else {
#pragma unroll
    for (int kk = 0; kk < S::K_STEPS; ++kk) qb[kk] = q_fragment(kk);
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[S::DIM_TILES][4];
#pragma unroll
  for (int t = 0; t < S::DIM_TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  // A 16-key tile's scores (scaled; a sliced warp's part of them) and its keys' V scales.
  auto tile_scores = [&](const TileData<S>& cur, float (&s)[4], float (&v_scale)[2][S::NB]) {
    // A non-finite V scale (the codec's mark of a non-finite value vector) moves onto the key's score, so a key
    // that some mask hides never multiplies its value by a zero weight (0 x NaN), and one that is seen gives NaN.
    // (These tests are 8 of a tile's instructions at D = 128: without them, a probe, k4v4 ran 0.988-0.991 of the
    // time and k2v2 0.974; the same rule in 4, fma(v, 0, k) on the K scale and min(v, FLT_MAX) on the V scale,
    // 0.989-1.013, H200, BENCHMARKS.md.)
    float k_scale[2][S::KNB];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      bool bad = false;
#pragma unroll
      for (int b = 0; b < S::KNB; ++b) k_scale[n][b] = scale_value(cur.k_scale[n][b], lp.sel[b]);
#pragma unroll
      for (int b = 0; b < S::NB; ++b) {
        v_scale[n][b] = scale_value(cur.v_scale[n][b], S::GROUPED ? lp.v_sel : lp.sel[b]);
        bad = bad || isnan(v_scale[n][b]);
      }
#pragma unroll
      for (int b = 0; b < S::KNB; ++b)
        if (bad) k_scale[n][b] = NAN;
#pragma unroll
      for (int b = 0; b < S::NB; ++b)
        if (bad) v_scale[n][b] = 0.f;
    }
    // Scores S^T (16 keys x 8 rows): D/16 MMAs over the dims, in two independent chains (with two norm blocks
    // and K::BLOCKED, the chains are the blocks: k-step kk holds block kk % 2; with key groups, the groups).
    // Four chains of two at D = 128 (8 more adds) ran 1.01-1.02x the time (H200).
    s[0] = s[1] = s[2] = s[3] = 0.f;
    float s_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < S::K_STEPS; ++kk) {
      const uint4 a = key_fragments<typename S::K>(k_table, k_lane, cur.kw[0], cur.kw[1], kk, k_shift);
      const uint2 qf = S::Q_IN_SMEM ? q_frag[kk * 32 + lane] : qb[S::Q_IN_SMEM ? 0 : kk];
      float(&chain)[4] = (S::GROUPED ? kk >= key_group_steps<S>() : kk % 2) ? s_odd : s;
      mma_16816(chain, a.x, a.y, a.z, a.w, qf.x, qf.y);
    }
    // s[2n + e]: key g + 8n, row 2c + e.  Scale (each block's part by its scale), then sum the warps' parts.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = i / 2;
      if constexpr (S::GROUPED) s[i] = s[i] * k_scale[n][0] + s_odd[i] * k_scale[n][1];
      else if constexpr (S::NB == 1) s[i] = (s[i] + s_odd[i]) * k_scale[n][0];
      else if constexpr (S::K::BLOCKED) s[i] = s[i] * k_scale[n][0] + s_odd[i] * k_scale[n][S::NB - 1];
      else s[i] = (s[i] + s_odd[i]) * (warp_block ? k_scale[n][S::NB - 1] : k_scale[n][0]);
    }
  };
  // Sliced: the warps' partial scores of a step's NT tiles, summed in a fixed order (every warp gets the same),
  // through one barrier.  Consecutive steps alternate between the buffer's two halves, so a warp that runs ahead
  // writes the other half, and the next barrier cannot pass before every warp has read this one.
  int exchanges = 0;
  auto exchange = [&](auto& ss) {
    constexpr int NT = sizeof(ss) / sizeof(ss[0]);
    float4* buf = partial_scores + (2 * stream + (exchanges & 1)) * S::STEP_TILES * WARPS * 32;
    ++exchanges;
#pragma unroll
    for (int k = 0; k < NT; ++k)
      buf[(k * WARPS + warp) * 32 + lane] = make_float4(ss[k][0], ss[k][1], ss[k][2], ss[k][3]);
    stream_sync();
#pragma unroll
    for (int k = 0; k < NT; ++k) {
      float4 sum = buf[k * WARPS * 32 + lane];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) {
        const float4 x = buf[(k * WARPS + w) * 32 + lane];
        sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
      }
      ss[k][0] = sum.x, ss[k][1] = sum.y, ss[k][2] = sum.z, ss[k][3] = sum.w;
    }
  };
  // Cap, and mask where a mask can apply.
  auto cap_and_mask = [&](const int tile, float (&s)[4]) {
    if (p.softcap > 0.f) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] = p.softcap * tanhf(s[i] / p.softcap) * 1.4426950408889634f;
    }
    if (tile < safe_lo || tile + TILE_KEYS > safe_hi) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int slot = tile + 8 * n + kg;
        const int pos = position(slot);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          bool keep = slot < hi && pos >= code_lo && pos < code_hi && pos <= qpos[e];
          if (p.window > 0) keep = keep && qpos[e] - pos < p.window;
          if (!keep) s[2 * n + e] = -INFINITY;
        }
      }
    }
  };
  // Online softmax of rows 2c, 2c + 1 over a step's NT tiles' scores (e2: their exponentials).  The row maximum
  // (shared by the row's 8 lanes) only moves, and the accumulators only rescale, when some lane's score exceeds it:
  // rare after the first tiles.  (The exponentials taken before the vote, and again when the maximum moves, ran
  // 1.01-1.02x the time at D = 64 to 512; a maximum that starts at -FLT_MAX, which needs no select of its -inf case
  // per tile, 0.992-1.001: H200.)
  auto softmax_step = [&](auto& ss, auto& e2) {
    constexpr int NT = sizeof(ss) / sizeof(ss[0]);
    bool grows = false;
#pragma unroll
    for (int k = 0; k < NT; ++k)
      grows = grows || fmaxf(ss[k][0], ss[k][2]) > m[0] || fmaxf(ss[k][1], ss[k][3]) > m[1];
    if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = fmaxf(ss[0][e], ss[0][2 + e]);
#pragma unroll
        for (int k = 1; k < NT; ++k) mx = fmaxf(mx, fmaxf(ss[k][e], ss[k][2 + e]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[e], mx);
        const float alpha = fast_exp2(m[e] - (m_new == -INFINITY ? 0.f : m_new));
        l[e] *= alpha;
#pragma unroll
        for (int t = 0; t < S::DIM_TILES; ++t) {
          acc[t][e] *= alpha;
          acc[t][2 + e] *= alpha;
        }
        m[e] = m_new;
      }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float m_use = m[e] == -INFINITY ? 0.f : m[e];
#pragma unroll
      for (int k = 0; k < NT; ++k)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          e2[k][2 * n + e] = fast_exp2(ss[k][2 * n + e] - m_use);
          l[e] += e2[k][2 * n + e];
        }
    }
  };
  // A tile's PV product.  P^T (16 keys x 8 rows) times the V scales, from the accumulator layout to the B layout:
  // one 8x8 transpose per 8 keys; one P per norm block when the tiles alternate blocks.
  constexpr int P_SETS = S::V::TILE_BLOCKS ? S::NB : 1;
  auto p_fragments = [&](const float (&e2)[4], const float (&v_scale)[2][S::NB], uint32_t (&pb)[P_SETS][2]) {
#pragma unroll
    for (int b = 0; b < P_SETS; ++b) {
      float vs[2];
#pragma unroll
      for (int n = 0; n < 2; ++n)
        vs[n] = S::V::TILE_BLOCKS ? v_scale[n][b] : (warp_block ? v_scale[n][S::NB - 1] : v_scale[n][0]);
      pb[b][0] = transpose_8x8(pack_half2(e2[0] * vs[0], e2[1] * vs[0]));
      pb[b][1] = transpose_8x8(pack_half2(e2[2] * vs[1], e2[3] * vs[1]));
    }
  };
  auto pv_product = [&](const TileData<S>& cur, const uint32_t (&pb)[P_SETS][2]) {
    // O^T += V^T P^T: dim tile t holds dims ValueCodes::dim(g', t, 0) (rows g') and dim(g', t, 1) (rows g' + 8).
#pragma unroll
    for (int t = 0; t < S::DIM_TILES; ++t) {
      const uint4 a = S::V::fragment(v_table, v_lane, cur.vw, t, v_shift);
      const int b = S::V::TILE_BLOCKS ? t % 2 : 0;
      mma_16816(acc[t], a.x, a.y, a.z, a.w, pb[b][0], pb[b][1]);
    }
  };
  auto tile_pv = [&](const TileData<S>& cur, const float (&e2)[4], const float (&v_scale)[2][S::NB]) {
    uint32_t pb[P_SETS][2];
    p_fragments(e2, v_scale, pb);
    pv_product(cur, pb);
  };
  // A one-tile step: scores, online softmax, and the PV product.
  auto process = [&](const TileData<S>& cur, const int tile) {
    float s[1][4], v_scale[2][S::NB], e2[1][4];
    tile_scores(cur, s[0], v_scale);
    if constexpr (S::SLICED) exchange(s);
    cap_and_mask(tile, s[0]);
    softmax_step(s, e2);
    tile_pv(cur, e2[0], v_scale);
  };
  // A two-tile step (Shape::STEP_TILES): both tiles' scores, one softmax step, both PV products.
  auto process_pair = [&](const TileData<S>& c0, const int t0, const TileData<S>& c1, const int t1) {
    float s[2][4], vs0[2][S::NB], vs1[2][S::NB], e2[2][4];
    tile_scores(c0, s[0], vs0);
    tile_scores(c1, s[1], vs1);
    if constexpr (S::SLICED) exchange(s);
    cap_and_mask(t0, s[0]);
    cap_and_mask(t1, s[1]);
    softmax_step(s, e2);
    tile_pv(c0, e2[0], vs0);
    tile_pv(c1, e2[1], vs1);
  };
  // Each warp keeps its next PREFETCH tiles' loads in flight while it computes the current step.  (Unrolling the
  // loops by two into alternating buffers, which saves the copy, measured slower: 124 vs 109 us at B=8 L=32K, and
  // again for the loops of 2c9d94a, with 4-5% fewer instructions per tile: k4v4 1.11 at B = 8, 1.04-1.07 at B = 1
  // and D = 512, other pairs up to 1.07, H200.  Nor did staging the next tile in shared memory by cp.async, in the
  // team's scratch: k4v4 at D = 128 1.05-1.09, ptxas keeping all 128 registers; nor k2v2's teams in a loop of steady
  // steps, whose next tile needs no test, before a tested one: 1.03, with 6 fewer instructions per tile, H200,
  // BENCHMARKS.md.)
  TURBOATTN_STAMP(3);
  if constexpr (S::SKEWED) {
    // Step t: the K side of tile t + STRIDE and the V side of tile t go out; tile t's scores, and tile t - STRIDE's
    // PV product, whose P (pb) the last step left; then tile t's softmax (its rescale of the accumulators follows the
    // PV product in program order) and P.  Before the first tile, P and the V words are zero: that product adds 0
    // (zero words look up finite centroids), as does the last one of a warp without a tile.
    uint32_t pb[P_SETS][2];
#pragma unroll
    for (int b = 0; b < P_SETS; ++b) pb[b][0] = pb[b][1] = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int w = 0; w < S::V::WORDS; ++w) next.vw[j][w] = 0u;
    for (int tile = first_tile; tile < hi; tile += STRIDE) {
      const TileData<S> cur = next;
      if (tile + STRIDE < hi) load_side(std::integral_constant<int, KEY_SIDE>{}, tile + STRIDE, next);
      load_side(std::integral_constant<int, VALUE_SIDE>{}, tile, next);
      float s[1][4], v_scale[2][S::NB], e2[1][4];
      tile_scores(cur, s[0], v_scale);
      pv_product(cur, pb);
      cap_and_mask(tile, s[0]);
      softmax_step(s, e2);
      p_fragments(e2[0], v_scale, pb);
    }
    pv_product(next, pb);
  } else if constexpr (S::STEP_TILES == 2) {
    // This warp's tiles in pairs (tile, tile + STRIDE), the next pair's loads in flight; an odd last tile alone.
    int tile = first_tile;
    for (; tile + STRIDE < hi; tile += 2 * STRIDE) {
      const TileData<S> c0 = next, c1 = ahead;
      if (tile + 2 * STRIDE < hi) load(tile + 2 * STRIDE, next);
      if (tile + 3 * STRIDE < hi) load(tile + 3 * STRIDE, ahead);
      process_pair(c0, tile, c1, tile + STRIDE);
    }
    if (tile < hi) process(next, tile);
  } else {
    for (int tile = first_tile; tile < hi; tile += STRIDE) {
      const TileData<S> cur = next;
      if constexpr (S::PREFETCH > 1) {
        next = ahead;
        if (tile + 2 * STRIDE < hi) load(tile + 2 * STRIDE, ahead);
      } else if (tile + STRIDE < hi) {
        load(tile + STRIDE, next);
      }
      process(cur, tile);
    }
  }
  TURBOATTN_STAMP(4);

  // Combine the warps: row sums over the 8 lanes of a row (same c), then max / rescale across warps.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 4);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 8);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 16);
  }
  if constexpr (S::SLICED) {
    // Every warp of a stream holds the same row statistics and its own dims: it writes them out, warp 0 the LSEs.
    team_sync<TEAMS>();  // the code tables are no longer read (the merge reuses their space; sliced: one team)
    TURBOATTN_STAMP(0);
    if constexpr (STREAMS > 1) {
      // Stream 1 hands its row statistics and unnormalized outputs to stream 0 through shared memory (warp_ml, and
      // q_rot, free since the q fragments were made), whose lane of the same warp and lane index holds the same rows
      // and dims: it reads its twin's values where it then writes its own (as the warps' combine below, a NaN sum
      // stays NaN).
      if (stream == 1) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 2 * c + e;
          if (warp == 0 && g == 0) warp_ml[2 * r] = m[e], warp_ml[2 * r + 1] = l[e];
#pragma unroll
          for (int t = 0; t < S::DIM_TILES; ++t) {
            q_rot[r * D + S::V::dim(vg, t, 0)] = acc[t][e];
            q_rot[r * D + S::V::dim(vg, t, 1)] = acc[t][2 + e];
          }
        }
      }
      __syncthreads();
      if (stream == 0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 2 * c + e;
          const float m1 = warp_ml[2 * r], l1 = warp_ml[2 * r + 1];
          const float m_new = fmaxf(m[e], m1), m_use = m_new == -INFINITY ? 0.f : m_new;
          const float f0 = exp2f(m[e] - m_use), f1 = exp2f(m1 - m_use);
          l[e] = l[e] * f0 + l1 * f1;
          m[e] = m_new;
#pragma unroll
          for (int t = 0; t < S::DIM_TILES; ++t) {
            acc[t][e] = acc[t][e] * f0 + q_rot[r * D + S::V::dim(vg, t, 0)] * f1;
            acc[t][2 + e] = acc[t][2 + e] * f0 + q_rot[r * D + S::V::dim(vg, t, 1)] * f1;
          }
        }
      }
    }
    // A merge in its own launch takes the parts in the model's domain (model_domain_parts): the rows go through
    // shared memory (q_rot, unused after the set-up) to be rotated back a row per warp (stream 0's, below).
    const bool apart = model_domain_parts<D>(p);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 2 * c + e;
      if (r >= rows || stream != 0) continue;
      const size_t part = ((size_t)bh * p.num_parts + split) * rows + r;
      // l is 0 when no key was visible; a NaN (a non-finite key that was seen) stays NaN.
      const float inv = l[e] != 0.f ? 1.f / l[e] : 0.f;
      float* o = apart ? q_rot + r * D : p.o_part + part * D;
#pragma unroll
      for (int t = 0; t < S::DIM_TILES; ++t) {
        o[S::V::dim(vg, t, 0)] = l[e] != 0.f ? acc[t][e] * inv : 0.f;
        o[S::V::dim(vg, t, 1)] = l[e] != 0.f ? acc[t][2 + e] * inv : 0.f;
      }
      if (warp == 0 && g == 0) p.lse_part[part] = l[e] != 0.f ? m[e] + log2f(l[e]) : -INFINITY;
    }
    if (apart) {
      // Stream 0's warps rotate the rows back, as they wrote them.  (Both streams' warps, a row each, took 27.5-28.4
      // µs against 27.7 at one sequence x 2 KV heads x 32K, H200; but compute-sanitizer's racecheck reported stream
      // 1's reads of the rows as hazards wherever stream 0 had passed one more exchange barrier than stream 1, though
      // a bar.sync 0 lay between the writes and the reads: it appears to order threads by the barriers each passed.)
      if (stream != 0) return;
      stream_sync();
      store_parts_in_model_domain<D>(p, q_rot, signs, ((size_t)bh * p.num_parts + split) * rows, rows, warp, lane);
    }
    TURBOATTN_STAMP(5);
    TURBOATTN_STAMP(11);
    // With key streams, stream 0 alone joins the merge (as team 0 of two: its own barriers).
    if (p.counters != nullptr && stream == 0)
      join_and_merge<D, TEAMS * STREAMS>(p, cta, scratch, S::SCRATCH_SPAN, merge_small, q_rot, warp_ml, fresh_p,
                                         signs, is_last);
    TURBOATTN_STAMP(7);
    TURBOATTN_STAMP(12);
    return;
  }
  team_sync<TEAMS>();  // the code tables are no longer read (one team): the scratch takes the warps' outputs
  TURBOATTN_STAMP(0);
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      warp_ml[(warp * MAX_ROWS + 2 * c + e) * 2] = m[e];
      warp_ml[(warp * MAX_ROWS + 2 * c + e) * 2 + 1] = l[e];
    }
  }
  team_sync<TEAMS>();
  {
    // o_warp[warp][slot(d)][row]: a lane's two rows (2c, 2c + 1) of one dim are one 8-byte store, and slot(d) moves
    // the dims of lanes g and g' (g != g' mod 4) to different 32-byte bank groups, so a half-warp's 16 stores hit 16
    // distinct bank pairs (the plain [row][d] layout put 8 lanes on one bank).  The row sums and the LSEs are
    // computed once per row (warp 0's lanes with g = 0).
    float* o_warp = reinterpret_cast<float*>(scratch);
    auto slot = [](int d) { return d ^ ((d / S::V::LANE_BYTES) & 3); };
    float f[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 2 * c + e;
      float mall = -INFINITY;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) mall = fmaxf(mall, warp_ml[(w * MAX_ROWS + r) * 2]);
      const float m_use = mall == -INFINITY ? 0.f : mall;
      f[e] = exp2f(m[e] - m_use);
      if (warp == 0 && g == 0) {
        float lsum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
          lsum += warp_ml[(w * MAX_ROWS + r) * 2 + 1] * exp2f(warp_ml[(w * MAX_ROWS + r) * 2] - m_use);
        // lsum is 0 when no key was visible (the outputs are then 0); a NaN (a non-finite key that was seen)
        // stays NaN.
        row_inv[r] = lsum != 0.f ? 1.f / lsum : 0.f;
        if (r < rows)
          p.lse_part[((size_t)bh * p.num_parts + split) * rows + r] = lsum != 0.f ? m_use + log2f(lsum) : -INFINITY;
      }
    }
#pragma unroll
    for (int t = 0; t < S::DIM_TILES; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2* at = reinterpret_cast<float2*>(o_warp + (warp * D + slot(S::V::dim(g, t, h))) * MAX_ROWS + 2 * c);
        *at = make_float2(acc[t][2 * h] * f[0], acc[t][2 * h + 1] * f[1]);
      }
    }
    team_sync<TEAMS>();
    // Sum the warps: a thread per dim and set of rows (consecutive threads write consecutive dims of a row).
    constexpr int THREADS = WARPS * 32, ROW_SETS = THREADS / D > 1 ? THREADS / D : 1, RPT = MAX_ROWS / ROW_SETS;
    const size_t part0 = ((size_t)bh * p.num_parts + split) * rows;
    for (int i = tid; i < D * ROW_SETS; i += THREADS) {
      const int d = i % D, r0 = (i / D) * RPT;
      float o[RPT] = {};
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float4* src = reinterpret_cast<const float4*>(o_warp + (w * D + slot(d)) * MAX_ROWS + r0);
#pragma unroll
        for (int k = 0; k < RPT / 4; ++k) {
          const float4 x = src[k];
          o[4 * k] += x.x, o[4 * k + 1] += x.y, o[4 * k + 2] += x.z, o[4 * k + 3] += x.w;
        }
      }
#pragma unroll
      for (int k = 0; k < RPT; ++k)
        if (r0 + k < rows) {
          const float inv = row_inv[r0 + k];
          p.o_part[(part0 + r0 + k) * D + d] = inv != 0.f ? o[k] * inv : 0.f;
        }
    }
  }
  TURBOATTN_STAMP(5);
  TURBOATTN_STAMP(11);
  if (p.counters != nullptr)
    join_and_merge<D, TEAMS, S::ROW_WARP_MERGE>(p, cta, scratch, S::SCRATCH_SPAN, merge_small, q_rot, warp_ml,
                                                fresh_p, signs, is_last);
  TURBOATTN_STAMP(7);
  TURBOATTN_STAMP(12);
}

// The merge in a launch of its own, for calls whose parts are more than one CTA per (sequence, KV head) reads
// quickly on the decode kernel's tail (ops/cached/config.cuda_merge_slices; the decode launch then runs without
// counters and only writes its parts): SLICES (p.merge_slices) CTAs of merge_threads<D>() threads per output row,
// each a contiguous slice of its dims, so that a head's parts stream through as many SMs as it has rows times slices
// instead of a head's rows through one.  Slices need parts in the model's domain (model_domain_parts: D = 512);
// below, one CTA per row takes the row whole.  Thread t owns float4 t % W of the slice (W float4s) and sums the
// parts t / W, t / W + SETS, ... in order, MERGE_BATCH loads in flight; the sets' sums are added in order
// (deterministic).  The part loads go out first; the log2-sum-exps, the sink and the fresh tokens' scores (warp 0;
// every slice's CTA scores them whole) give the weights meanwhile, with one barrier for the maximum and one for the
// sum: every thread combines the warps' in the same order (one thread combining them took two more barriers; one
// sequence at D = 128 and 256 took 0.947-0.996 of that time, outputs bit-identical, H200).  Then the slice's
// threads add the fresh tokens' values (over the same denominator) and store in q's dtype, as finish_row does; a
// row in the codes' domain goes through finish_row itself (warp 0: the rotation back first, its signs loaded at the
// start).
constexpr int MERGE_BATCH = 16;
// Threads per merge CTA: 128 up to D = 128, a quarter of the sets, each summed over 4x the parts (one sequence at
// D = 128 and 64: 0.938-0.970 of 512 threads' time, H200); 512 above (D = 256: 128 threads took 1.08).
template <int D>
constexpr int merge_threads() { return D <= 128 ? 128 : 512; }
template <int D, int SLICES>
__global__ void __launch_bounds__(merge_threads<D>()) merge_rows(const DecodeParams p) {
  constexpr int MERGE_THREADS = merge_threads<D>();
  // The slice: W float4s from dim0; a thread's float4 f of it, and its set of parts.
  constexpr int WARPS_M = MERGE_THREADS / 32, W = D / 4 / SLICES, SETS = MERGE_THREADS / W;
  // Parts in the codes' domain (model_domain_parts is false below D = 512): one CTA per row, which rotates back.
  constexpr bool ROTATED = !rotates_parts_back<D>();
  static_assert(!ROTATED || SLICES == 1, "a row in the codes' domain rotates back whole");
  __shared__ float weight[MAX_PARTS];
  __shared__ __align__(16) float4 set_sum[MERGE_THREADS];
  __shared__ __align__(16) float row_y[ROTATED ? D : 4];
  __shared__ float reduce[2][WARPS_M];
  __shared__ float fresh_s[MAX_ROWS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rows = p.tq * p.group, parts = p.num_parts;
  const int row = blockIdx.x / SLICES, dim0 = blockIdx.x % SLICES * W * 4;
  const int bh = quotient(p.rows_div, row), r = row - bh * rows;
  const int b = quotient(p.kv_heads_div, bh), kvh = bh - b * p.num_kv_heads;
  const int t = quotient(p.group_div, r), head = kvh * p.group + r - t * p.group;
  const size_t first = (size_t)bh * parts * rows + r;  // part q of this row: first + q rows
  const long long kv0 = b * p.kv_stride_b + kvh * p.kv_stride_h;
  const int f = tid % W, set = tid / W;
  // This thread's first batch of parts goes out before anything waits.
  const float4* o = reinterpret_cast<const float4*>(p.o_part + first * D + dim0) + f;
  const size_t step = (size_t)rows * D / 4;  // float4s between consecutive parts of the row
  float4 x[MERGE_BATCH];
  auto load_batch = [&](int q0) {  // parts q0 + set, q0 + set + SETS, ...
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j) {
      const int q = q0 + set + j * SETS;
      x[j] = q < parts ? __ldcg(o + q * step) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load_batch(0);
  // The signs of the lane's dims, for the rotation back (warp 0), out before anything waits.
  float sign[ROTATED ? D / 32 : 1];
  if constexpr (ROTATED) {
    if (warp == 0) {
#pragma unroll
      for (int i = 0; i < D / 32; ++i) sign[i] = p.signs[lane * (D / 32) + i];
    }
  }
  // The row maximum over the parts' log2-sum-exps (staged in `weight`), the sink and the fresh tokens.
  float mx = p.sinks ? p.sinks[head] * 1.4426950408889634f : -INFINITY;
  const float sink = mx;
  for (int q = tid; q < parts; q += MERGE_THREADS) {
    const float lse = __ldcg(p.lse_part + first + (size_t)q * rows);
    weight[q] = lse;
    mx = fmaxf(mx, lse);  // NaN passes by (its weight is NaN below)
  }
  if (p.has_fresh && warp == 0)
    mx = fmaxf(mx, fresh_scores<D>(p, b * p.q_stride_b + head * p.q_stride_h + t * p.q_stride_t, kv0,
                                   p.key_shift ? p.key_shift + (size_t)bh * D : nullptr, t, lane, fresh_s));
  // Each warp's maximum, then its sum, through shared memory: every thread combines them in the warps' order.
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
  if (lane == 0) reduce[0][warp] = mx;
  __syncthreads();
  float all_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS_M; ++w) all_max = fmaxf(all_max, reduce[0][w]);
  const float m_use = all_max == -INFINITY ? 0.f : all_max;
  float sum = 0.f;
  for (int q = tid; q < parts; q += MERGE_THREADS) {  // each thread reads back what it staged
    const float w = exp2f(weight[q] - m_use);
    weight[q] = w;
    sum += w;
  }
  if (p.has_fresh && warp == 0) {  // fresh token j's weight, lane j (NaN for a non-finite token)
    const float w = lane < MAX_ROWS ? exp2f(fresh_s[lane] - m_use) : 0.f;
    if (lane < MAX_ROWS) fresh_s[lane] = w;
    sum += w;
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (lane == 0) reduce[1][warp] = sum;
  __syncthreads();  // every warp's weights and sum are written
  float denom = exp2f(sink - m_use);
#pragma unroll
  for (int w = 0; w < WARPS_M; ++w) denom += reduce[1][w];
  // The weighted sum of this thread's parts, in order.
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int q0 = 0; q0 < parts; q0 += MERGE_BATCH * SETS) {
    if (q0 > 0) load_batch(q0);
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j) {
      const int q = q0 + set + j * SETS;
      const float w = q < parts ? weight[q] : 0.f;
      acc.x += w * x[j].x, acc.y += w * x[j].y, acc.z += w * x[j].z, acc.w += w * x[j].w;
    }
  }
  set_sum[set * W + f] = acc;
  __syncthreads();
  if (tid >= (W > 32 ? W : 32)) return;  // the threads that sum the sets (and warp 0, which rotates back) go on
  const int hq = p.num_kv_heads * p.group;
  const size_t out_row = (((size_t)b * hq + head) * p.tq + t) * D;
  const float inv = denom != 0.f ? 1.f / denom : 0.f;  // NaN stays NaN
  float y[4] = {};
  if (tid < W) {
    float4 total = set_sum[tid];
    for (int k = 1; k < SETS; ++k) {
      const float4 a = set_sum[k * W + tid];
      total.x += a.x, total.y += a.y, total.z += a.z, total.w += a.w;
    }
    y[0] = total.x * inv, y[1] = total.y * inv, y[2] = total.z * inv, y[3] = total.w * inv;
  }
  if constexpr (ROTATED) {  // warp 0 rotates the whole row back, adds the fresh tokens' values and stores
    if (tid < W) reinterpret_cast<float4*>(row_y)[tid] = make_float4(y[0], y[1], y[2], y[3]);
    if constexpr (W <= 32) {
      __syncwarp();  // warp 0 alone wrote the row
    } else {
      asm volatile("bar.sync 1, %0;" ::"n"(W) : "memory");  // the W threads left (a multiple of 32 here)
    }
    if (warp == 0) finish_row<D>(p, row_y, [&](int i) { return sign[i]; }, fresh_s, denom, kv0, t, out_row, lane);
    return;
  }
  if (tid >= W) return;
  const int d = dim0 + 4 * tid;
  add_fresh_values<4>(p, fresh_s, denom, kv0 + d, t, y);
  store_row<4>(p.out, p.q_dtype, out_row + d, y);
}

// (As a programmatic dependent launch, its CTAs scheduled as the decode CTAs start or end and waiting for the
// decode grid, it measured 0.97-1.00 of this: not kept.  Nor were clusters of 2-8 CTAs per row that summed shares
// of the parts and added them over distributed shared memory: 1.07-1.38 of one CTA per row.)
template <int D, int SLICES = 1>
int launch_merge(const DecodeParams& params, int batch_kv_heads, cudaStream_t stream) {
  // Up to most_merge_slices(D) (the binding checks merge_slices).
  if constexpr (2 * SLICES <= most_merge_slices(D)) {
    if (params.merge_slices > SLICES) return launch_merge<D, 2 * SLICES>(params, batch_kv_heads, stream);
  }
  merge_rows<D, SLICES><<<batch_kv_heads * params.tq * params.group * SLICES, merge_threads<D>(), 0, stream>>>(params);
  return static_cast<int>(cudaGetLastError());
}

// decode<D, KB, VB, EXACT, GA, KB2, SMALL_GRID> on `ctas` CTAs (device: the current one).  Past 48 KB of shared
// memory, static and dynamic together, a kernel needs an allowance for its dynamic part; every kernel gets it, once
// per device (function attributes belong to a device's context; the binding made q's device current).
template <int D, int KB, int VB, bool EXACT, int GA, int KB2, bool SMALL_GRID>
int launch_build(const DecodeParams& params, int device, int ctas, cudaStream_t stream) {
  using S = Shape<D, KB, VB, GA, KB2, EXACT, SMALL_GRID>;
  constexpr int smem = dynamic_bytes<D, KB, VB, EXACT, GA, KB2, SMALL_GRID>();
  static bool allowed[64] = {};
  if (!allowed[device]) {
    const cudaError_t err = cudaFuncSetAttribute(decode<D, KB, VB, EXACT, GA, KB2, SMALL_GRID>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
    allowed[device] = true;
  }
  decode<D, KB, VB, EXACT, GA, KB2, SMALL_GRID><<<ctas, S::THREADS, smem, stream>>>(params);
  return static_cast<int>(cudaGetLastError());
}

// The builds that have a SMALL_GRID twin (Shape::SMALL_GRID), for grids of at most SMALL_GRID_CTAS parts per SM:
// k4v4's plain kernel at D = 128.
template <int D, int KB, int VB, bool EXACT, int GA, int KB2>
constexpr bool has_small_grid_build() { return D == 128 && KB == 4 && VB == 4 && !EXACT && GA == 0; }

// Launches decode<D, KB, VB, EXACT, GA, KB2>, or its SMALL_GRID twin for a grid that the twin holds at once.
template <int D, int KB, int VB, bool EXACT, int GA = 0, int KB2 = 0>
int launch(const DecodeParams& params, int batch_kv_heads, cudaStream_t stream) {
  using S = Shape<D, KB, VB, GA, KB2, EXACT>;
  // A team's merge on the kernel's tail keeps its weights in the team's scratch.
  if (S::TEAMS > 1 && params.counters != nullptr &&
      params.tq * params.group * params.num_parts > S::TEAM_MERGE_WORDS)
    return static_cast<int>(cudaErrorInvalidValue);
  int device = 0;
  cudaGetDevice(&device);
  if (device >= 64) return static_cast<int>(cudaErrorInvalidDevice);
  const int parts = params.num_parts * batch_kv_heads;
  // A grid that the SMALL_GRID build holds at once takes it (k4v4, D = 128: one sequence x 8 KV heads x 32 splits
  // 0.87 of the plain build's time, 2 x 8 x 16 splits 0.87, H200).
  if constexpr (has_small_grid_build<D, KB, VB, EXACT, GA, KB2>()) {
    static_assert(ctas_per_sm<D, KB, VB, EXACT, GA, KB2, true>() == SMALL_GRID_CTAS, "the small-grid build's CTAs");
    if (parts <= SMALL_GRID_CTAS * params.sms)
      return launch_build<D, KB, VB, EXACT, GA, KB2, true>(params, device, parts, stream);
  }
  // One CTA per split, plus the exact parts' (params.num_parts counts both), in one dimension (cta_index).
  // TEAMS parts per CTA (Shape::TEAMS), except where CTAs of TEAMS parts would leave SMs without one (D = 64's
  // exact-row build: one sequence x 3 KV heads x 65 parts, 98 CTAs on 132 SMs): there each CTA takes one part (its
  // second team helps build the table and leaves), so that they spread over every SM; the registers and shared
  // memory of TEAMS of them fit an SM, so the grid (fewer than TEAMS x SMs parts) is resident at once.
  static_assert(S::TEAMS == 1 || ctas_per_sm<D, KB, VB, EXACT, GA, KB2>() >= S::TEAMS * S::TEAMS,
                "TEAMS CTAs of one part each fit an SM");
  const int teams = (parts + S::TEAMS - 1) / S::TEAMS < params.sms ? 1 : S::TEAMS;
  return launch_build<D, KB, VB, EXACT, GA, KB2, false>(params, device, (parts + teams - 1) / teams, stream);
}

// decode<D, KB, VB, EXACT> for the run-time bit pair, among TURBOATTN_BIT_PAIRS (decode.h): -1 for others.
template <int D, bool EXACT>
int launch_decode_for(const DecodeParams& params, int k_bits, int v_bits, int batch_kv_heads, cudaStream_t stream) {
#define TURBOATTN_LAUNCH(KB, VB) \
  if (k_bits == KB && v_bits == VB) return launch<D, KB, VB, EXACT>(params, batch_kv_heads, stream);
  TURBOATTN_BIT_PAIRS(TURBOATTN_LAUNCH)
#undef TURBOATTN_LAUNCH
  return -1;
}

// ctas_per_sm of decode<D, k_bits, v_bits, exact> for the run-time pair and build: -1 for pairs not built.
template <int D>
int ctas_per_sm_for(int k_bits, int v_bits, bool exact) {
#define TURBOATTN_CTAS(KB, VB) \
  if (k_bits == KB && v_bits == VB) return exact ? ctas_per_sm<D, KB, VB, true>() : ctas_per_sm<D, KB, VB, false>();
  TURBOATTN_BIT_PAIRS(TURBOATTN_CTAS)
#undef TURBOATTN_CTAS
  return -1;
}

}  // namespace turboattn
