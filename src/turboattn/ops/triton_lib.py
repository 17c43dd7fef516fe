"""@triton.jit pieces shared by the kernel families: constants, Hadamard on tensor cores, softcap,
the online-softmax step, the key transform, the split-K merge by log-sum-exp, and a dot that the
interpreter gets right for bfloat16.

Every kernel works in the log2 domain (exp2 is one instruction): scores are
pre-multiplied by LOG2E, and LSEs are converted back with LN2 where a user sees them.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ..format.rotation import hartley, odd_factor, walsh_hadamard
from .launch import next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)   # host code reads LOG2E.value
LN2 = tl.constexpr(0.6931471805599453)
# Whether @triton.jit builds interpreted functions in this process (TRITON_INTERPRET=1 when the kernel
# modules are imported; triton.jit reads the same knob).  Branches on it are resolved at compile time,
# so compiled GPU kernels never contain the interpreter's workarounds.
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@lru_cache(maxsize=None)
def hadamard_tile(n: int, device: torch.device) -> torch.Tensor:
    """The H matrix that hadamard_any(., ., n) expects: unnormalized H_min(n, 128) in float16
    (entries ±1 are exact), cached per device and read-only."""
    m = min(n, 128)
    return walsh_hadamard(torch.eye(m, dtype=torch.float32)).to(torch.float16).to(device)


@lru_cache(maxsize=None)  # asked by every launch
def padded_factor(head_dim: int) -> tuple[int, int]:
    """(m, m_pad): head_dim = P * m with m odd, and m_pad = next_power_of_2(m), the kernels' constexprs M, MP.

    A kernel holds a row of n = P * m coordinates in P * m_pad = next_power_of_2(n) columns, the padded
    layout: column c = p * m_pad + r holds coordinate p * m + r (r < m); the other columns hold zeros.
    For a power of two (m = 1) it is the plain layout.
    """
    m = odd_factor(head_dim)
    return m, next_power_of_2(m)


def kron_width(m_pad: int) -> int:
    """L = A * m_pad: the columns the dense factor H_A ⊗ Q_m of kron_rows spans (A the least power of two
    with L >= 16, tl.dot's smallest K and N)."""
    return max(16, m_pad)


@lru_cache(maxsize=None)
def kron_tile(m: int, device: torch.device) -> torch.Tensor:
    """The factor kron_rows(., ., ., N, m, m_pad) expects: H_A ⊗ Q_m (Q the orthonormal Hartley matrix)
    in the padded layout, an [L, L] float32 matrix (rows and columns r >= m zero), cached per device and
    read-only.  For m = 1 a 16 x 16 placeholder (kron_rows reads no table then)."""
    m_pad = triton.next_power_of_2(m)
    width = kron_width(m_pad)
    a = width // m_pad
    dense = torch.kron(walsh_hadamard(torch.eye(a, dtype=torch.float64)), hartley(m).to(torch.float32).double())
    cols = torch.tensor([pa * m_pad + r for pa in range(a) for r in range(m)])
    tile = torch.zeros(width, width, dtype=torch.float64)
    tile[cols[:, None], cols[None, :]] = dense
    return tile.to(torch.float32).to(device)


@triton.jit
def padded_columns(N: tl.constexpr, M: tl.constexpr, MP: tl.constexpr):
    """(coordinate, holds one) of the padded layout's columns 0..N-1 (padded_factor): c -> (c // MP) * M + c % MP."""
    # One return per function: the compiler visits the statements after a constexpr-if's return too, and
    # refuses returns of different types (the interpreter does not check).
    c = tl.arange(0, N)
    if M == 1:
        coord, real = c, c < N
    else:
        coord, real = (c // MP) * M + c % MP, c % MP < M
    return coord, real


@triton.jit
def padded_mask(rows_ok, cols_ok, M: tl.constexpr):
    """The [R, N] mask of a tile's rows and (for M > 1) its padded layout's real columns."""
    if M == 1:
        mask = rows_ok[:, None]
    else:
        mask = rows_ok[:, None] & cols_ok[None, :]
    return mask


@triton.jit
def load_padded_vector(ptr, offs, cols_ok, M: tl.constexpr):
    """A per-coordinate vector at the columns' coordinates offs [1, N] (zero in padded columns when M > 1)."""
    if M == 1:
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=cols_ok[None, :], other=0.0)
    return x


@triton.jit
def _h2_blocks(z, G: tl.constexpr, K: tl.constexpr):
    """(I_G ⊗ H_2 ⊗ I_K) applied to each row of z [R, G * 2 * K]: one butterfly level, in float32 adds."""
    R: tl.constexpr = z.shape[0]
    a, b = tl.split(tl.permute(tl.reshape(z, (R * G, 2, K)), (0, 2, 1)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (R, G * 2 * K))


@triton.jit
def kron_rows(x, had_ptr, kron_ptr, N: tl.constexpr, M: tl.constexpr, MP: tl.constexpr):
    """(H_P ⊗ Q_M) @ each row of x [R, N] float32 in the padded layout (P = N / MP), unnormalized like H_P.

    M == 1: hadamard_any(x, had_ptr, N).  Otherwise H_P ⊗ Q = H_{P/A} ⊗ (H_A ⊗ Q): the dense factor
    (kron_ptr, kron_tile(M)) on groups of L = A * MP columns as one float32 product, then H_{P/A} over the
    groups by butterflies (P/A <= 16 for every supported head dim).  Padded columns stay zero.
    """
    if M == 1:
        z = hadamard_any(x, had_ptr, N)
    else:
        R: tl.constexpr = x.shape[0]
        L: tl.constexpr = 16 if MP < 16 else MP
        PH: tl.constexpr = N // L
        tl.static_assert(PH <= 16, "kron_rows: at most 16 groups")
        offs = tl.arange(0, L)
        kmat = tl.load(kron_ptr + offs[:, None] * L + offs[None, :])
        # Row-vector form: H_A ⊗ Q is symmetric.
        z = tl.reshape(tl.dot(tl.reshape(x, (R * PH, L)), kmat, input_precision="ieee"), (R, N))
        if PH >= 2:
            z = _h2_blocks(z, 1, N // 2)
        if PH >= 4:
            z = _h2_blocks(z, 2, N // 4)
        if PH >= 8:
            z = _h2_blocks(z, 4, N // 8)
        if PH >= 16:
            z = _h2_blocks(z, 8, N // 16)
    return z


@triton.jit
def dot(a, b, acc=None, input_precision: tl.constexpr = None):
    """tl.dot(a, b, acc) that is also right for bfloat16 operands under the interpreter.

    Triton's interpreter holds bfloat16 tensors as their uint16 bit patterns, and its dot
    multiplies those integers (Triton 3.9: relative error ~1e9, no error raised).  There the
    operands are widened to float32 first: exact, and what the GPU's bf16 MMA computes (exact
    products, float32 sums).  Compiled, the branch vanishes and the dot stays bf16.
    """
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=input_precision)


@triton.jit
def hadamard_rows(x, h_ptr, N: tl.constexpr):
    """H_N @ each row of x [R, N] (float32 in, float32 out), on tensor cores.

    Rows are first scaled by a power of two (exact) so they fit float16, then
    split into hi + lo float16 parts: two float16 products with float32
    accumulation give ~22 significant bits, like float32 for our purposes.
    """
    amax = tl.max(tl.abs(x), axis=1)
    expo = tl.where(amax > 0, tl.ceil(tl.log2(tl.where(amax > 0, amax, 1.0))), 0.0)
    norm = tl.exp2(-expo)
    xn = x * norm[:, None]
    hi = xn.to(tl.float16)
    lo = (xn - hi.to(tl.float32)).to(tl.float16)
    offs = tl.arange(0, N)
    h = tl.load(h_ptr + offs[:, None] * N + offs[None, :])
    y = tl.dot(hi, h, out_dtype=tl.float32)
    y = tl.dot(lo, h, acc=y, out_dtype=tl.float32)
    return y / norm[:, None]


@triton.jit
def hadamard_any(x, had_ptr, N: tl.constexpr):
    """H_N @ each row of x [R, N]; had_ptr holds H_min(N, 128).

    For N = 256, H_N = [[H, H], [H, -H]] with H = H_128: one butterfly in
    registers keeps the H tile (shared memory) at 32 KB instead of 128 KB.
    """
    if N <= 128:
        y = hadamard_rows(x, had_ptr, N)
    else:
        R: tl.constexpr = x.shape[0]
        x0, x1 = tl.split(tl.permute(tl.reshape(x, (R, 2, N // 2)), (0, 2, 1)))
        y0 = hadamard_rows(x0 + x1, had_ptr, N // 2)
        y1 = hadamard_rows(x0 - x1, had_ptr, N // 2)
        y = tl.reshape(tl.permute(tl.join(y0, y1), (0, 2, 1)), (R, N))
    return y


@triton.jit
def key_transform_rows(x, shift_ptr, gain_ptr, offs, SHIFT: tl.constexpr):
    """(x - shift) * gain per channel (shift only when SHIFT); offs index the channels of x's columns."""
    if SHIFT:
        x = x - tl.load(shift_ptr + offs)
    return x * tl.load(gain_ptr + offs)


@triton.jit
def tanh(x):
    # 1 - 2 / (e^2x + 1): exact limits at +-inf and no libdevice dependency (works interpreted).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def online_softmax(s, m, l, MAY_BE_EMPTY: tl.constexpr):
    """One step of the streaming softmax over a tile of log2-domain scores s [R, N].

    Returns (p, new max, alpha = rescale of the old sums, new sum).  MAY_BE_EMPTY: some
    row may have seen no finite score yet; it keeps m = -inf and p = 0 instead of NaN.
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if MAY_BE_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    return p, m_new, alpha, l * alpha + tl.sum(p, axis=1)


@triton.jit
def finish_split(acc, m, l):
    """A split's partial result: (acc / l, its log2-sum-exp); a row that saw nothing gives (0, -inf).
    A NaN sum (a NaN score) gives NaN for both, so the merge passes it on."""
    empty = l == 0.0
    safe = tl.where(empty, 1.0, l)
    lse = tl.where(empty, float("-inf"), m + tl.log2(safe))
    return acc * tl.where(empty, 0.0, 1.0 / safe)[:, None], lse


@triton.jit
def merge_splits(o_part, lse_part, first, stride, num_parts, cols, row_ok, col_ok, sink,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROW_PITCH: tl.constexpr):
    """Merge split partials (finish_split's) of a tile of rows [BLOCK_R] by their log2-sum-exp, a part at a time.

    Part p of row r is lse_part[first[r] + p * stride] and the row of ROW_PITCH floats at
    o_part + (first[r] + p * stride) * ROW_PITCH, of which columns `cols` are merged.  `sink`
    [BLOCK_R] is a log2-domain logit joining the denominator only (-inf: none).  Returns
    (out [BLOCK_R, BLOCK_C], lse [BLOCK_R] in log2 units); a row with nothing gives zeros and -inf.
    For callers that need whole rows together (the cached merge rotates them back).
    """
    m = sink
    for part in range(num_parts):
        m = tl.maximum(m, tl.load(lse_part + first + part * stride, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.exp2(sink - m_use)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for part in range(num_parts):
        idx = first + part * stride
        w = tl.exp2(tl.load(lse_part + idx, mask=row_ok, other=float("-inf")) - m_use)
        denom += w
        o = tl.load(o_part + idx[:, None] * ROW_PITCH + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc += w[:, None] * o
    safe, lse = _merged_denominator(m_use, denom)
    return acc / safe[:, None], lse


@triton.jit
def merge_splits_at_once(o_part, lse_part, parts, part_ok, cols, col_ok, sink, ROW_PITCH: tl.constexpr):
    """merge_splits for one row with all its parts loaded together: `parts` [P] are the part indices.

    For callers with few rows and many splits (dense decode): one program per row and column
    chunk, no loop, so the merge costs one load latency instead of one per part.  `sink` is a scalar.
    """
    lse = tl.load(lse_part + parts, mask=part_ok, other=float("-inf"))
    m = tl.maximum(tl.max(lse, axis=0), sink)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    o = tl.load(o_part + parts[:, None] * ROW_PITCH + cols[None, :], mask=part_ok[:, None] & col_ok[None, :],
                other=0.0)
    safe, lse = _merged_denominator(m_use, tl.sum(w, axis=0) + tl.exp2(sink - m_use))
    return tl.sum(o * w[:, None], axis=0) / safe, lse


@triton.jit
def _merged_denominator(m_use, denom):
    """(denominator safe to divide by, log2-sum-exp): 1 and -inf where it is 0 (nothing to attend, acc is 0)."""
    safe = tl.where(denom > 0, denom, 1.0)
    return safe, tl.where(denom > 0, m_use + tl.log2(safe), float("-inf"))
