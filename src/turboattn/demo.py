"""`turboattn demo`: quantize realistic K/V and report error and memory per preset."""

from __future__ import annotations

import argparse

import torch

from .codec import KVCodec

PRESETS = ((8, 8), (6, 6), (5, 4), (4, 4), (4, 3), (3, 3), (2, 2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-dim", type=int, default=128)


def _realistic_kv(n: int, d: int, generator: torch.Generator):
    """Keys with outlier channels and a shared offset (as in real models); Gaussian-ish values."""
    channel_scale = torch.exp(torch.randn(d, generator=generator) * 0.8)
    k = (torch.randn(n, d, generator=generator) + 0.5 * torch.randn(d, generator=generator)) * channel_scale
    v = torch.randn(n, d, generator=generator)
    return k, v


def run_demo(args) -> int:
    from rich.console import Console
    from rich.table import Table
    g = torch.Generator().manual_seed(0)
    k, v = _realistic_kv(4096, args.head_dim, g)
    table = Table(title=f"TurboQuant K/V coding, head_dim={args.head_dim}, 4096 tokens")
    for col in ("preset", "bytes/token", "vs bf16", "K rel. error", "V rel. error"):
        table.add_column(col, justify="right")
    for kb, vb in PRESETS:
        codec = KVCodec(args.head_dim, kb, vb)
        errs = []
        for kind, x in (("k", k), ("v", v)):
            x_hat = codec.dequantize(codec.quantize(x, kind), kind)
            errs.append(float((x_hat - x).norm() / x.norm()))
        ratio = 4 * args.head_dim / codec.bytes_per_token()
        table.add_row(f"k{kb}v{vb}", str(codec.bytes_per_token()), f"{ratio:.2f}x", f"{errs[0]:.4f}", f"{errs[1]:.4f}")
    Console().print(table)
    return 0
