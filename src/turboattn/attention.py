"""Public attention entry points: validate, choose the implementation, then call the torch op."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import torch
from torch import Tensor

from .cache import QuantizedKVCache
from .format.codec import ATTENTION_DTYPES, META_DEVICE, check_attention_dtype
from .ops import backend as registry
from .ops.library import capacity_plan, decode_launcher, run, run_cached_attention
from .ops.backend import choose
from .ops.cached.config import DecodePlan, plan_decode


def _check_tensor(name: str, t, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    check_attention_dtype(name, t)


def _is_int(x) -> bool:
    """A Python int that is not a bool (True is no window size or split count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_flag(name: str, value) -> None:
    # bool("no") is True: a string or tensor flag would silently turn an option on.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _is_positive(x) -> bool:
    """Whether x is a positive finite number (not a bool); a plain float, the usual case, in one comparison."""
    if type(x) is float:
        return 0.0 < x < math.inf
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_options(hq: int, device, scale, softcap, sinks, alibi_slopes=None) -> None:
    if scale is not None and not _is_positive(scale):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if softcap is not None and not _is_positive(softcap):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    if sinks is None and alibi_slopes is None:
        return
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [{hq}], got {type(t).__name__}")
        if t.shape != (hq,):
            raise ValueError(f"{name} must have shape [{hq}] (one per query head), got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


class _DecodeStep:
    """What cached_attention derived from a call with fresh k, v (backend "auto", no sinks, plan or num_splits), kept
    on the cache (`_attention_step`) for the next call of the same signature: every layer of a decode loop repeats
    its call every step.  The signature that passed the checks (shapes, dtype, device, scale, softcap), the
    implementation's launcher for it (library.decode_launcher: the cache's layout and codec bound), and the plan of a
    static cache (a growing cache's depends on its lengths: planned each call).  The cache drops it when its tensors
    change (_tensors_changed), and the registry's generation dates the implementation's choice."""

    __slots__ = ("q_shape", "kv_shape", "dtype", "device", "scale", "softcap", "generation", "launch", "plan",
                 "plan_head", "plan_tail", "plans", "capacity")

    def __init__(self, q: Tensor, cache: QuantizedKVCache, scale: float | None, softcap: float | None, impl: str):
        b, hq, tq, d = q.shape
        hkv, codec, layout = cache.num_kv_heads, cache.codec, cache.layout
        self.q_shape, self.kv_shape = q.shape, torch.Size((b, hkv, tq, d))
        self.dtype, self.device, self.scale, self.softcap = q.dtype, q.device, scale, softcap
        self.generation = registry.generation
        self.launch = decode_launcher(q, layout, codec, scale, softcap, impl)
        self.capacity = cache.capacity
        # cached_attention's plans: a static cache's for its capacity, once; a growing cache's for the keys it holds,
        # plan_decode(*plan_head, keys, *plan_tail), looked up in `plans` (shared by the layers that plan alike).
        self.plan = capacity_plan(q, layout, codec.key_code, codec.v_bits, None, impl) if cache.is_static else None
        self.plan_head = (q.device, d, codec.key_code, codec.v_bits, b * hkv, tq * (hq // hkv))
        self.plan_tail = (None, None, impl, layout.exact_row_count)
        self.plans = _plans(self.plan_head, self.plan_tail)

    def plan_for(self, keys: int) -> DecodePlan:
        """The plan for `keys` held (a growing cache's; cached_attention's plan_decode call), kept in `plans`."""
        plans = self.plans
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[keys] = plan_decode(*self.plan_head, keys, *self.plan_tail)
        return plan


# A growing cache's decode step plans for a new number of keys every step, the same in every layer: one dict lookup
# per layer, where plan_decode's lru_cache hashes its eleven arguments.  Each table keeps the last _MAX_PLANS.
_MAX_PLANS = 4096


@lru_cache(maxsize=None)
def _plans(plan_head: tuple, plan_tail: tuple) -> dict[int, DecodePlan]:
    return {}


def cached_attention(q: torch.Tensor, cache: QuantizedKVCache, k: torch.Tensor | None = None,
                     v: torch.Tensor | None = None, scale: float | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     backend: str = "auto", num_splits: int | None = None,
                     plan: DecodePlan | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over the compressed cache (plus fresh k, v).

    Query t of sequence b sits at position seen[b] + t when fresh k, v
    [B, Hkv, Tq, D] are given (they follow the cache, causal among
    themselves), else at seen[b] - Tq + t (the cache already holds the chunk;
    queries are aligned to each sequence's last token).  The cache is not
    modified.  Returns [B, Hq, Tq, D] in q.dtype.

    A cache with an exact recent window (exact_recent=R) is read exactly at positions [seen - R, seen)
    (seen as before the call, for every query of the chunk) and through its codes below that.
    A cache with exact first tokens (exact_first=S) is read exactly at positions [starts, starts + S)
    (those stored), and through its codes between them and the window; a position in both is read once.

    With a ring cache and no fresh k, v, the early queries of a Tq > 1 chunk
    cannot see keys the chunk itself overwrote; for prefill, pass the chunk as
    fresh k, v and append it afterwards.

    num_splits fixes the split-K count (default: chosen from the lengths held now, or from the
    capacity for a static cache); a CUDA graph replayed as the cache grows wants it fixed.
    plan overrides the whole launch plan of the Triton kernel (ops/cached/config.py;
    benchmarks sweep it).

    A cache with a key transform (QuantizedKVCache.set_key_transform) is read
    in its stored domain: q / gain against (k - shift) * gain, which differs
    from q . k by a per-query constant that softmax ignores.  Softcap and sinks
    do not ignore it, so they need a transform without shift.
    """
    # Every layer of every decode step runs this.  A call that repeats the signature of the last one on this cache
    # (_DecodeStep) would pass every check of _checked_attention for the same reasons: it is checked in one expression
    # and goes straight to the implementation.  Not while torch.compile traces: the graph holds the checks and the op.
    if not torch.compiler.is_compiling() and isinstance(cache, QuantizedKVCache):
        step = cache._attention_step
        if (step is not None and sinks is None and plan is None and num_splits is None and backend == "auto"
                and (scale is step.scale or type(scale) is float and scale == step.scale)
                and (softcap is step.softcap or type(softcap) is float and softcap == step.softcap)
                and isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
                and q.shape == step.q_shape and k.shape == step.kv_shape and v.shape == step.kv_shape
                and q.dtype is step.dtype and k.dtype is step.dtype and v.dtype is step.dtype
                and q.device == step.device and k.device == step.device and v.device == step.device
                and step.generation == registry.generation):
            step_plan = step.plan
            if step_plan is None:
                keys = min(cache.max_seen, step.capacity)
                step_plan = step.plans.get(keys) or step.plan_for(keys)
            return step.launch(q, k, v, step_plan)
    return _checked_attention(q, cache, k, v, scale, softcap, sinks, backend, num_splits, plan)


def _checked_attention(q: torch.Tensor, cache: QuantizedKVCache, k: torch.Tensor | None, v: torch.Tensor | None,
                       scale: float | None, softcap: float | None, sinks: torch.Tensor | None, backend: str,
                       num_splits: int | None, plan: DecodePlan | None) -> torch.Tensor:
    """cached_attention's checks, choice of implementation and call; its _DecodeStep for the next call."""
    # Each fact is read once (tensor attributes, cache fields), and checks that need a call run only where they can
    # fail.
    if not isinstance(cache, QuantizedKVCache):
        raise TypeError(f"cache must be a turboattn.QuantizedKVCache, got {type(cache).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in ATTENTION_DTYPES:
        _check_tensor("q", q, 4)   # raises, naming what is wrong
    b, hq, tq, d = q.shape
    codec = cache.codec
    if b != cache.batch_size or d != codec.head_dim or tq < 1:
        raise ValueError(f"q must be [B={cache.batch_size}, Hq, Tq>=1, D={codec.head_dim}], got {tuple(q.shape)}")
    hkv = cache.num_kv_heads
    if hq % hkv != 0:
        raise ValueError(f"q has {hq} heads: query heads ({hq}) must be a multiple of the cache's KV heads "
                         f"({hkv})")
    device = q.device
    if device != cache.device:
        raise ValueError(f"q is on {device} but the cache is on {cache.device}")
    if device == META_DEVICE:
        raise ValueError("q is a meta tensor (a shape without data): cached_attention reads the cache's values")
    if (k is None) != (v is None):
        raise ValueError("pass both fresh k and v, or neither")
    # A decode step's fresh k, v pass in one expression (q's dtype and device, [B, Hkv, Tq, D]: every check
    # below); anything else runs them in order for the error.
    if k is not None and not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dtype == q.dtype
                              and v.dtype == q.dtype and k.device == device and v.device == device
                              and k.shape == (b, hkv, tq, d) and v.shape == (b, hkv, tq, d)):
        cache.check_kv(k, v, "cached_attention")
        if k.shape[2] != tq:
            raise ValueError(f"fresh k/v must have Tq={tq} tokens like q, got {k.shape[2]}")
        if k.dtype != q.dtype:
            raise TypeError(f"fresh k/v dtype {k.dtype} differs from q dtype {q.dtype}")
    # A model's call has no softcap or sinks and a plain positive float scale (_is_positive's first case, inline):
    # _check_options would find nothing.  Any other scale goes through it.
    plain_scale = scale is None or type(scale) is float and 0.0 < scale < math.inf
    if not plain_scale or softcap is not None or sinks is not None:
        _check_options(hq, device, scale, softcap, sinks)
        if (softcap is not None or sinks is not None) and cache.has_key_shift:
            raise ValueError("this cache centers its keys (key transform with a shift), which softcap and sinks "
                             "would see; fit it with center=False for such models")
    if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")

    if plan is not None and not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a turboattn.ops.cached.config.DecodePlan, got {type(plan).__name__}")
    plan_given = plan

    # Under torch.compile with dynamic shapes (dynamic=True, or shapes that changed between calls) q's sizes are
    # symbols: the implementation's name, a constant of the graph, takes the cache's head_dim (equal, as checked).
    impl = choose("cached_attention", backend, device, codec.head_dim, codec.grouped_keys)
    layout = cache.layout
    k_bits, v_bits = codec.key_code, codec.v_bits   # key groups plan as such (plan_decode)
    if plan is not None:
        if num_splits is not None:
            plan = replace(plan, num_splits=num_splits)
    elif not cache.is_static:
        # Positional: plan_decode's lru_cache builds a longer key for keywords.
        plan = plan_decode(device, d, k_bits, v_bits, b * hkv, tq * (hq // hkv), min(cache.max_seen, cache.capacity),
                           num_splits, None, impl, layout.exact_row_count)
    # A static cache leaves plan None: the op plans for the capacity (with num_splits, if given), the same plan every
    # step, where the lengths held now would be a host read that changes every step.
    scale, softcap = None if scale is None else float(scale), None if softcap is None else float(softcap)
    out = run_cached_attention(q, layout, codec, k, v, sinks, scale, softcap, plan, num_splits, impl)
    if (k is not None and sinks is None and num_splits is None and plan_given is None and backend == "auto"
            and not torch.compiler.is_compiling()):
        cache._attention_step = _DecodeStep(q, cache, scale, softcap, impl)
    return out


def _float(x):
    """Python floats for the op's float? arguments (an int scale is fine for users)."""
    return None if x is None else float(x)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sliding_window: int | None = None, mask: torch.Tensor | None = None,
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                    return_lse: bool = False, backend: str = "auto"):
    """Dense attention, q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (SDPA layout, GQA by head count).

    Semantics are those of reference.attention_reference (bottom-right causal
    alignment, sliding window, boolean keep-mask or additive mask, softcap,
    sinks, ALiBi).  Returns out [B, Hq, Lq, D] in q.dtype, and LSE [B, Hq, Lq]
    float32 when return_lse.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    b, hq, lq, d = q.shape
    if hq < 1 or d < 1:
        raise ValueError(f"q must have at least one head and D >= 1, got shape {tuple(q.shape)}")
    if k.shape[1] < 1:
        raise ValueError(f"k and v must have at least one head, got shape {tuple(k.shape)}")
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be [B={b}, Hkv, Lk, D={d}] and equal, got {tuple(k.shape)} and {tuple(v.shape)}")
    if hq % k.shape[1] != 0:
        raise ValueError(f"q has {hq} heads and k, v {k.shape[1]}: query heads ({hq}) must be a multiple of "
                         f"KV heads ({k.shape[1]})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if lq < 1 or k.shape[2] < 1:
        raise ValueError(f"q and k need at least one token, got Lq={lq}, Lk={k.shape[2]}")
    if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            # An integer 0/1 mask would be added to the scores, not read as keep / hide.
            raise TypeError(f"mask must be bool (True = keep) or floating point (added to the scores), "
                            f"got {mask.dtype}")
        full = (b, hq, lq, k.shape[2])
        try:
            # Equal to `full`: a size-1 dim of q, k may not be stretched by a wider mask either.
            fits = torch.broadcast_shapes(mask.shape, full) == full
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not broadcast to {full}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    _check_options(hq, q.device, scale, softcap, sinks, alibi_slopes)

    impl = choose("flash_attention", backend, q.device)
    out, lse = run("flash_attention", q, k, v, causal, sliding_window, mask, _float(scale), _float(softcap),
                   sinks, alibi_slopes, return_lse, impl)
    return (out, lse) if return_lse else out
