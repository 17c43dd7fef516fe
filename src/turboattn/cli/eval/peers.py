"""Other KV-cache quantizers, run through the same protocol as turboattn's presets (`turboattn eval --peers`)."""

from __future__ import annotations

import torch

from .methods import PEERS, Method


def peer_quantizer(peer: str, head_dim: int):
    """(quantize-dequantize function on [B, H, T, D], description) for a peer at its bit width.

    Each function quantizes every vector independently of the others (groups
    never span tokens), so quantizing a chunk equals quantizing token by token.
    """
    backend, bits = peer.rsplit("-", 1)
    bits = int(bits.removeprefix("int"))
    if backend == "quanto":
        from transformers.cache_utils import QuantoQuantizedLayer
        layer = QuantoQuantizedLayer(nbits=bits, q_group_size=64)  # HF's defaults: axis 0 = groups of 64 along D

        def fq(x):
            return layer._dequantize(layer._quantize(x.contiguous(), axis=0)).to(x.dtype)
        return fq, f"optimum-quanto int{bits}, groups of 64 along head_dim (transformers' QuantizedCache layout)"
    if backend == "hqq":
        from hqq.core.quantize import Quantizer

        def fq(x):
            # axis=1 groups 64 consecutive elements (one token's channels); axis=0, transformers'
            # default, groups strided elements across tokens and heads.
            q, meta = Quantizer.quantize(x.contiguous(), nbits=bits, axis=1, group_size=64,
                                         device=str(x.device), compute_dtype=torch.float32)
            return Quantizer.dequantize(q, meta).reshape(x.shape).to(x.dtype)
        return fq, f"HQQ {bits}-bit, axis=1, groups of 64 along head_dim"
    if backend == "turboquant":
        _patch_numpy_for_turboquant()
        from turboquant.core import TurboQuantMSE
        tq = TurboQuantMSE(dim=head_dim, bits=bits, device="cpu")

        def fq(x):
            flat = x.reshape(-1, head_dim).float().cpu()
            idx, norms = tq.quantize(flat)
            return tq.dequantize(idx, norms).reshape(x.shape).to(x.device, x.dtype)
        return fq, f"turboquant {bits}-bit (TurboQuantMSE: rotation + Beta codebook + norm)"
    raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")


def _patch_numpy_for_turboquant() -> None:
    # turboquant 0.2.0 calls np.trapz, which numpy 2 removed (renamed np.trapezoid); same function.
    import numpy as np
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid


def peer_strict_method(peer: str, head_dim: int, chunk: int = 256) -> Method:
    """A peer's quantizer with every token quantized once on arrival and read only quantized."""
    from transformers.cache_utils import DynamicLayer
    fq, desc = peer_quantizer(peer, head_dim)

    class FakeQuantLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return super().update(fq(key_states), fq(value_states))

    def make(model):
        # Plain full-length layers also for sliding-window models: the attention applies the window.
        n = model.config.get_text_config().num_hidden_layers
        return _cache_of([FakeQuantLayer() for _ in range(n)])
    return Method(f"{peer}-every-token", peer.rsplit("-", 1)[0], make, step=chunk,
                  info=dict(peer=peer, residual=0, bits=int(peer.rsplit("-", 1)[1].removeprefix("int")),
                            mode="strict", layout=desc))


def _cache_of(layers):
    from transformers.cache_utils import Cache
    return Cache(layers=layers)


def peer_default_method(peer: str, residual: int = 128) -> Method:
    """The peer's own cache class as users call it (residual recent tokens in full precision), token by token.

    Sliding-window models (Gemma-3) get the peer's layer class on every layer, built as a user would by hand:
    transformers' QuantizedCache refuses them."""
    backend, bits = peer.rsplit("-", 1)
    bits = int(bits.removeprefix("int"))
    if backend == "turboquant":
        _patch_numpy_for_turboquant()
        from turboquant import TurboQuantCache as PeerCache
        from turboquant.cache import TurboQuantLayer as PeerLayer

        def make(model):
            cache = PeerCache(bits=bits)
            n = model.config.get_text_config().num_hidden_layers
            cache.layers = [PeerLayer(bits=bits, residual_len=residual) for _ in range(n)]
            return cache
    else:
        from transformers import QuantizedCache
        from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

        def make(model):
            config = model.config.get_text_config(decoder=True)
            if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
                # QuantizedCache refuses sliding-window models; its layers do not: one full-length layer per model
                # layer, whose keys the attention's mask limits to the window (as peer_strict_method's layers).
                layer = QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer
                return _cache_of([layer(nbits=bits, residual_length=residual) for _ in range(config.num_hidden_layers)])
            return QuantizedCache(backend, model.config, nbits=bits, residual_length=residual)
    return Method(f"{peer}-r{residual}", backend, make, step=1,
                  info=dict(peer=peer, residual=residual, bits=bits, mode="default"))


def check_peer(peer: str) -> str | None:
    """None when the peer's package imports, else the reason it cannot run."""
    mod = {"quanto": "optimum.quanto", "hqq": "hqq.core.quantize", "turboquant": "turboquant"}[peer.rsplit("-", 1)[0]]
    try:
        __import__(mod)
    except Exception as e:  # an import error of any kind means the peer is not runnable here
        return f"{mod} not importable: {e}"
    return None
