"""The ops as torch ops (`torch.ops.turboattn.*`): a schema, a fake implementation for tracing, and a
body that runs the implementation the caller chose (backend.choose) on plain tensors.

Arguments are flat tensors and scalars (a cache's CacheLayout spelled out, a codec as its bits),
so that torch.compile and CUDA graphs see the ops as opaque calls with known outputs.  The public
functions (attention.py, cache/) validate, then call `run(op, ...)` (or `run_cached_attention` /
`run_quantize_append` with a cache's layout and codec): the torch op while torch.compile traces, and in eager
mode the op's body directly, because the dispatcher's Python round trip costs ~25 µs per call, as
much as a whole decode kernel at small batch.  The eager path takes the layout and the cache's codec as they
are, not spelled out and rebuilt: a decode step calls both ops in every layer, and its host time is the user's.

Every body runs under a device guard for its tensors' GPU (`_on`, guard.py: Triton launches on torch's
current device), except the CUDA implementations' (`SELF_GUARDED`): the extension guards itself
(csrc/binding.cpp) and their Triton fallbacks enter the guard, so that a decode step on the GPU enters
none twice per layer.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ..format.codec import KVCodec
from ..format.layout import CacheLayout
from . import backend, cached, flash, quantize  # noqa: F401  (the packages register their implementations)
from .cached.config import DecodePlan, plan_decode
from .guard import device_guard
from .quantize.naive import advance_lengths


@lru_cache(maxsize=None)
def _codec(head_dim: int, k_bits: int, v_bits: int, scale_rule: str = "corrected",
           scale_dtype: torch.dtype = torch.float32, key_groups: tuple = ()) -> KVCodec:
    # The scale dtype is the scale tensors' own: the ops take no separate argument for it.  The ops spell key groups
    # as a flat list (op_key_groups) and their k_bits as 0.
    groups = tuple(zip(key_groups[::2], key_groups[1::2]))
    return KVCodec(head_dim, None if groups else k_bits, v_bits, scale_rule, scale_dtype, key_groups=groups)


def op_key_groups(codec: KVCodec) -> tuple[int, list[int]]:
    """(k_bits, key_groups) as the ops take them: the codec's bits and [], or with keys in channel groups 0 and the
    groups' (channels, bits) flattened, e.g. [112, 6, 144, 4]."""
    if not codec.key_groups:
        return codec.k_bits, []
    return 0, [x for group in codec.key_groups for x in group]


_on = device_guard

# The implementations that guard their launches themselves (module docstring).
SELF_GUARDED = "cuda"


def _layout(k_codes, k_scales, v_codes, v_scales, seen, starts, sliding_window, key_shift=None, key_gain=None,
            key_gain_inv=None, key_shifted=False, nonfinite=None, merge_counters=None, recent_k=None,
            recent_v=None, exact_recent=0, first_k=None, first_v=None, exact_first=0, key_order=None) -> CacheLayout:
    return CacheLayout(k_codes, k_scales, v_codes, v_scales, seen, starts, sliding_window, key_shift, key_gain,
                       key_gain_inv, key_shifted, nonfinite, merge_counters, recent_k, recent_v, exact_recent,
                       first_k, first_v, exact_first, key_order)


def _quantize_append(k: Tensor, v: Tensor, k_codes: Tensor, k_scales: Tensor, v_codes: Tensor, v_scales: Tensor,
                    seen: Tensor, starts: Tensor, new_lengths: Tensor | None, key_shift: Tensor | None,
                    key_gain: Tensor | None, sliding_window: int | None, k_bits: int, v_bits: int,
                    scale_rule: str, nonfinite: Tensor, merge_counters: Tensor | None, recent_k: Tensor | None,
                    recent_v: Tensor | None, exact_recent: int, first_k: Tensor | None, first_v: Tensor | None,
                    exact_first: int, key_groups: list[int], key_order: Tensor | None, impl: str) -> None:
    """Store k, v [B, Hkv, T, D] (new_lengths[b] of them real, default all T) in a cache: code them into the slots
    after seen[b] (a contiguous cache stores the tokens that fit in its capacity, a ring the last ones) and copy the
    ones the exact rows keep into recent_k / recent_v and first_k / first_v (format/layout.py; None, None, 0
    without them).  seen is read, not advanced: run_quantize_append advances it after the op.  nonfinite [B]
    int32 counts the vectors stored with a NaN or infinity; merge_counters: written during the call (zero before
    and after).  key_groups (flat, op_key_groups) and key_order [B, Hkv, D] int16: keys in channel groups, with
    k_bits 0; [] and None without."""
    layout = _layout(k_codes, k_scales, v_codes, v_scales, seen, starts, sliding_window, key_shift, key_gain,
                     nonfinite=nonfinite, merge_counters=merge_counters, recent_k=recent_k, recent_v=recent_v,
                     exact_recent=exact_recent, first_k=first_k, first_v=first_v, exact_first=exact_first,
                     key_order=key_order)
    codec = _codec(k.shape[-1], k_bits, v_bits, scale_rule, k_scales.dtype, tuple(key_groups))
    _append_to(k, v, layout, new_lengths, codec, impl, advance=False)


def _append_to(k: Tensor, v: Tensor, layout: CacheLayout, new_lengths: Tensor | None, codec: KVCodec, impl: str,
               advance: bool) -> None:
    """quantize_append's body on a layout; advance: the implementation also advances seen (the CUDA kernel in the
    same launch)."""
    eager_body("quantize_append", impl)(k, v, layout, codec, new_lengths, advance)


def eager_body(op: str, impl: str):
    """The body of `op`'s implementation `impl` as the eager path runs it (_attend and _append_to call it; a cache's
    decode step keeps it while the registry stays as it is, backend.generation): under the device guard of its first
    argument's device unless it guards its launches itself (SELF_GUARDED)."""
    body = backend.load(op, impl)
    if impl == SELF_GUARDED:
        return body

    def guarded(x, *args):
        with _on(x.device):
            return body(x, *args)
    return guarded


def decode_launcher(q: Tensor, layout: CacheLayout, codec: KVCodec, scale: float | None, softcap: float | None,
                    impl: str):
    """launch(q, k, v, plan): cached_attention's body on this layout and codec with fresh k, v, this scale and softcap
    and no sinks, for calls of q, k, v of this signature (attention.py's _DecodeStep checks it).  The CUDA
    implementation's launcher derives its launch arguments once (cuda.decode_launcher); any other's binds them."""
    if impl == SELF_GUARDED:
        from .cached import cuda   # imports Triton: only where it runs
        launch = cuda.decode_launcher(q, layout, codec, scale, softcap)
        if launch is not None:
            return launch
    body = eager_body("cached_attention", impl)
    return lambda q, k, v, plan: body(q, layout, codec, k, v, scale, softcap, None, plan)


def append_launcher(layout: CacheLayout, codec: KVCodec, impl: str):
    """launch(k, v): quantize_append's body on this layout and codec (every token real, seen advanced), for k, v that
    the cache has checked (a decode step's append).  The CUDA implementation's launcher derives its launch arguments
    once (quantize/cuda.append_launcher); any other's binds them."""
    if impl == SELF_GUARDED:
        from .quantize import cuda   # imports Triton: only where it runs
        launch = cuda.append_launcher(layout, codec)
        if launch is not None:
            return launch
    body = eager_body("quantize_append", impl)
    return lambda k, v: body(k, v, layout, codec, None, True)


def run_quantize_append(k: Tensor, v: Tensor, layout: CacheLayout, new_lengths: Tensor | None, codec: KVCodec,
                        impl: str) -> None:
    """Append k, v to a cache's layout, coded with the cache's codec: codes, exact rows, and seen advanced by the
    real tokens.  Eagerly one call (one launch on the CUDA path).  Under torch.compile the op stores and a traced
    in-place add advances seen: an op that mutated seen itself was miscompiled by inductor (torch 2.11, CUDA),
    which recomputed a value read from seen before the op (transformers' past_seen_tokens, inside a later layer's
    fused RoPE) from the advanced tensor; an aten add is a mutation inductor orders correctly."""
    if torch.compiler.is_compiling():
        k_bits, key_groups = op_key_groups(codec)
        torch.ops.turboattn.quantize_append(
            k, v, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen, layout.starts,
            new_lengths, layout.key_shift, layout.key_gain, layout.sliding_window, k_bits, codec.v_bits,
            codec.scale_rule, layout.nonfinite, layout.merge_counters, layout.recent_k, layout.recent_v,
            layout.exact_recent, layout.first_k, layout.first_v, layout.exact_first, key_groups, layout.key_order,
            impl)
        advance_lengths(layout, new_lengths, k.shape[2])
    else:
        _append_to(k, v, layout, new_lengths, codec, impl, advance=True)


quantize_append = torch.library.custom_op(
    "turboattn::quantize_append", _quantize_append,
    mutates_args=("k_codes", "k_scales", "v_codes", "v_scales", "nonfinite", "merge_counters", "recent_k",
                  "recent_v", "first_k", "first_v"))


@quantize_append.register_fake
def _(k, v, k_codes, k_scales, v_codes, v_scales, seen, starts, new_lengths, key_shift, key_gain, sliding_window,
      k_bits, v_bits, scale_rule, nonfinite, merge_counters, recent_k, recent_v, exact_recent, first_k, first_v,
      exact_first, key_groups, key_order, impl) -> None:
    return None


def _cached_attention(q: Tensor, k_codes: Tensor, k_scales: Tensor, v_codes: Tensor, v_scales: Tensor,
                     seen: Tensor, starts: Tensor, k: Tensor | None, v: Tensor | None, key_shift: Tensor | None,
                     key_gain: Tensor | None, key_gain_inv: Tensor | None, key_shifted: bool,
                     sinks: Tensor | None, sliding_window: int | None, k_bits: int, v_bits: int,
                     scale: float | None, softcap: float | None, plan: list[int], merge_counters: Tensor | None,
                     recent_k: Tensor | None, recent_v: Tensor | None, exact_recent: int,
                     first_k: Tensor | None, first_v: Tensor | None, exact_first: int, key_groups: list[int],
                     key_order: Tensor | None, impl: str) -> Tensor:
    """Attention of q [B, Hq, Tq, D] over the cache (plus fresh k, v).  plan is a DecodePlan.to_list(), or [] /
    [num_splits]: planned here for the cache's capacity (a static cache's plan; planned in the op because under
    torch.compile with dynamic shapes q's sizes are symbols, from which no constant plan can be made).
    merge_counters (the CUDA kernel's, zero before and after) is written during the call: a mutated argument.
    recent_k, recent_v [B, Hkv, R + 1, D] and exact_recent = R: the exact recent window (format/layout.py), read
    only; None, None, 0 without one.  first_k, first_v [B, Hkv, S, D] and exact_first = S: the exact first tokens
    (format/layout.py), read only; None, None, 0 without them.  key_groups, key_order: keys in channel groups, as
    quantize_append takes them."""
    layout = _layout(k_codes, k_scales, v_codes, v_scales, seen, starts, sliding_window, key_shift, key_gain,
                     key_gain_inv, key_shifted, merge_counters=merge_counters, recent_k=recent_k, recent_v=recent_v,
                     exact_recent=exact_recent, first_k=first_k, first_v=first_v, exact_first=exact_first,
                     key_order=key_order)
    # The scale rule does not matter to decoding: any codec of these bits and scale dtype reads the cache.
    codec = _codec(q.shape[-1], k_bits, v_bits, "corrected", k_scales.dtype, tuple(key_groups))
    if len(plan) > 1:
        decode_plan = DecodePlan.from_list(plan)
    else:
        decode_plan = capacity_plan(q, layout, codec.key_code, v_bits, plan[0] if plan else None, impl)
    return _attend(q, layout, codec, k, v, sinks, scale, softcap, decode_plan, impl)


def capacity_plan(q: Tensor, layout: CacheLayout, k_bits: int, v_bits: int, num_splits: int | None,
                  impl: str) -> DecodePlan:
    """The plan for the cache's capacity (a static cache's, the same every step)."""
    b, hq, tq, d = q.shape
    hkv = layout.num_kv_heads
    return plan_decode(q.device, d, k_bits, v_bits, b * hkv, tq * (hq // hkv), layout.capacity, num_splits,
                       kernel=impl, exact_rows=layout.exact_row_count)


def _attend(q: Tensor, layout: CacheLayout, codec: KVCodec, k: Tensor | None, v: Tensor | None,
            sinks: Tensor | None, scale: float | None, softcap: float | None, plan: DecodePlan, impl: str) -> Tensor:
    """cached_attention's body on a layout, its codec and a plan."""
    # Positional arguments throughout: a keyword costs the call a dict.
    return eager_body("cached_attention", impl)(q, layout, codec, k, v, scale, softcap, sinks, plan)


def run_cached_attention(q: Tensor, layout: CacheLayout, codec: KVCodec, k: Tensor | None, v: Tensor | None,
                         sinks: Tensor | None, scale: float | None, softcap: float | None, plan: DecodePlan | None,
                         num_splits: int | None, impl: str) -> Tensor:
    """The cached_attention op on a cache's layout and codec (the fields spelled out under torch.compile).  plan
    None: the op plans for the capacity with num_splits (None: chosen), as a static cache wants; otherwise plan is
    used."""
    v_bits = codec.v_bits
    if torch.compiler.is_compiling():
        k_bits, key_groups = op_key_groups(codec)
        plan_list = plan.to_list() if plan is not None else [] if num_splits is None else [num_splits]
        return torch.ops.turboattn.cached_attention(
            q, layout.k_codes, layout.k_scales, layout.v_codes, layout.v_scales, layout.seen, layout.starts, k, v,
            layout.key_shift, layout.key_gain, layout.key_gain_inv, layout.key_shifted, sinks,
            layout.sliding_window, k_bits, v_bits, scale, softcap, plan_list, layout.merge_counters,
            layout.recent_k, layout.recent_v, layout.exact_recent, layout.first_k, layout.first_v,
            layout.exact_first, key_groups, layout.key_order, impl)
    if plan is None:
        plan = capacity_plan(q, layout, codec.key_code, v_bits, num_splits, impl)
    return _attend(q, layout, codec, k, v, sinks, scale, softcap, plan, impl)


cached_attention = torch.library.custom_op("turboattn::cached_attention", _cached_attention,
                                           mutates_args=("merge_counters",))


@cached_attention.register_fake
def _(q, k_codes, k_scales, v_codes, v_scales, seen, starts, k, v, key_shift, key_gain, key_gain_inv, key_shifted,
      sinks, sliding_window, k_bits, v_bits, scale, softcap, plan, merge_counters, recent_k, recent_v, exact_recent,
      first_k, first_v, exact_first, key_groups, key_order, impl):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, sliding_window: int | None, mask: Tensor | None,
                    scale: float | None, softcap: float | None, sinks: Tensor | None, alibi_slopes: Tensor | None,
                    return_lse: bool, impl: str) -> tuple[Tensor, Tensor]:
    """Dense attention; returns (out, lse [B, Hq, Lq] float32), lse empty unless return_lse."""
    with _on(q.device):
        result = backend.load("flash_attention", impl)(q, k, v, causal=causal, sliding_window=sliding_window,
                                                       mask=mask, scale=scale, softcap=softcap, sinks=sinks,
                                                       alibi_slopes=alibi_slopes, return_lse=return_lse)
    if return_lse:
        return result
    # A fresh tensor: an op's outputs may not alias each other.
    return result, q.new_empty(0, dtype=torch.float32)


flash_attention = torch.library.custom_op("turboattn::flash_attention", _flash_attention, mutates_args=())


@flash_attention.register_fake
def _(q, k, v, causal, sliding_window, mask, scale, softcap, sinks, alibi_slopes, return_lse, impl):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(q.shape[:3] if return_lse else (0,), dtype=torch.float32)
    return out, lse


_BODIES = {"quantize_append": _quantize_append, "cached_attention": _cached_attention,
           "flash_attention": _flash_attention}


def run(op: str, *args):
    """torch.ops.turboattn.<op>(*args) under torch.compile; its body directly in eager mode (same result)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.turboattn, op)(*args)
    return _BODIES[op](*args)
