"""Checks shared by the quantize-append kernels' tests (Triton under the interpreter, CUDA on a GPU): a fused
kernel's cache against the reference codec's."""

from __future__ import annotations

import torch

import turboattn as ta
from turboattn.format import codebook, rotation


def near_boundary(codec, x, kind, rel=1e-5):
    """Coordinates whose u = y / rms lies within float rounding of a cell boundary ([..., D] bool)."""
    y = rotation.rotate(x.double())
    yb = y.reshape(*y.shape[:-1], codec.num_blocks, codec.block_size)
    u = yb / yb.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-300)
    bounds = codebook.boundaries(codec.bits(kind), torch.float64).to(u.device)
    gap = (u[..., None] - bounds).abs().amin(-1)
    return (gap <= rel * (1 + u.abs())).reshape(x.shape)


def assert_same(fused, ref, inputs):
    """Fused and reference caches agree; `inputs` lists every (k, v) appended so far."""
    assert torch.equal(fused.seen, ref.seen)
    for i, kind in enumerate(("k", "v")):
        idx = [fused.codec.unpack(ta.Packed(getattr(c, f"{kind}_codes"), getattr(c, f"{kind}_scales")), kind)
               for c in (fused, ref)]
        n_diff = int((idx[0] != idx[1]).sum())
        # Only cells decided by float rounding may differ: no more than the near-boundary coordinates.
        near = sum(int(near_boundary(ref.codec, kv[i], kind).sum()) for kv in inputs)
        assert n_diff <= near
        # Scales are float32 sums of the same squares in another order where the block's
        # codes agree; a flipped code moves the corrected/lsq scale by at most
        # |c_a^2 - c_b^2| / (2 |c|^2) < 5% for any table and block of >= 64 coordinates.
        s_got, s_want = getattr(fused, f"{kind}_scales"), getattr(ref, f"{kind}_scales")
        codec = ref.codec
        flipped = (idx[0] != idx[1]).reshape(*idx[0].shape[:-1], codec.num_blocks, codec.block_size).any(-1)
        if s_want.dtype == torch.bfloat16:
            # Stored rounded to bfloat16 (8 significant bits) from float32 scales that agree to 1e-5: a scale within
            # 1e-5 of a rounding midpoint rounds up in one and down in the other, so where the codes agree the two
            # are the same or neighbouring bfloat16 values (one unit in the last place: scales are non-negative).
            ulps = (s_got.view(torch.int16).int() - s_want.view(torch.int16).int()).abs()
            assert int(ulps.masked_fill(flipped, 0).max()) <= 1
            s_got, s_want = s_got.float(), s_want.float()
        else:
            rel = (s_got - s_want).abs() / s_want.abs().clamp_min(1e-30)
            assert float(rel.masked_fill(flipped, 0.0).max()) < 1e-5
        rel = (s_got - s_want).abs() / s_want.abs().clamp_min(1e-30)
        assert float(rel.max()) < 0.05


def assert_grouped_codes_agree(fused, ref, k, v, b):
    """Sequence b's cell indices in caches with keys in channel groups (each group's and the values') equal but for
    coordinates within float rounding of a cell boundary (near_boundary); scales to float32 rounding where a vector's
    codes agree (bfloat16 scales: to one unit in the last place).  k, v [1, Hkv, T, D]: the tokens the sequence's
    first T slots hold, in the model's domain (the reference cache's key transform and order apply)."""
    codec = ref.codec
    seq = slice(b, b + 1)
    stored = k.double()
    if ref.key_shift is not None:
        stored = (stored - ref.key_shift.double()[seq, :, None]) * ref.key_gain.double()[seq, :, None]
        if ref.key_order is not None:
            stored = stored.gather(-1, ref.key_order.long()[seq, :, None, :].expand(k.shape))
    lo, byte, sides = 0, 0, []
    for i, group in enumerate(codec.key_group_codecs):
        width, nbytes = group.head_dim, group.code_bytes("k")
        sides.append((group, "k", stored[..., lo:lo + width], slice(byte, byte + nbytes), slice(i, i + 1)))
        lo, byte = lo + width, byte + nbytes
    sides.append((codec, "v", v.double(), slice(None), slice(None)))
    t = k.shape[2]
    for group, kind, x, code_cols, scale_cols in sides:
        packed = [ta.Packed(getattr(c, f"{kind}_codes")[seq, :, :t, code_cols],
                            getattr(c, f"{kind}_scales")[seq, :, :t, scale_cols]) for c in (fused, ref)]
        idx = [group.unpack(p, kind) for p in packed]
        differ = idx[0] != idx[1]
        assert int(differ.sum()) <= int(near_boundary(group, x, kind).sum())
        same = ~differ.reshape(*differ.shape[:-1], group.num_blocks if kind == "v" else 1, -1).any(-1)
        got, want = packed[0].scales, packed[1].scales
        assert torch.equal(got.isnan(), want.isnan())
        if want.dtype == torch.bfloat16:   # neighbouring values at most (assert_same)
            ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            assert int(ulps.masked_fill(~same | want.isnan(), 0).max()) <= 1
        else:
            torch.testing.assert_close(torch.where(same, got, 0), torch.where(same, want, 0), rtol=1e-5, atol=0,
                                       equal_nan=True)
