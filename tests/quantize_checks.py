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
