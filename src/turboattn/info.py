"""`turboattn info`: versions, device, and the table of cache formats."""

from __future__ import annotations

import platform

import torch

from .codec import SUPPORTED_BITS, KVCodec
from .rotation import SUPPORTED_HEAD_DIMS


def format_rows(head_dims=SUPPORTED_HEAD_DIMS, bits=SUPPORTED_BITS):
    """(head_dim, k_bits, v_bits, bytes/token/head, bits/element, compression vs bf16) for K=V bits."""
    for d in head_dims:
        for b in bits:
            codec = KVCodec(d, b, b)
            bf16 = 2 * 2 * d
            yield d, b, b, codec.bytes_per_token(), codec.bits_per_element(), bf16 / codec.bytes_per_token()


def print_info() -> None:
    from rich.console import Console
    from rich.table import Table

    import turboattn

    console = Console()
    console.print(f"turboattn {turboattn.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton
        console.print(f"triton {triton.__version__}")
    except ImportError:
        console.print("triton: not installed (PyTorch reference path only)")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        console.print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    else:
        console.print("device: CPU only (kernels run under TRITON_INTERPRET=1, slowly)")
    table = Table(title="Cache formats: K+V bytes per token per KV head (float32 scales included)")
    for col in ("head_dim", "k_bits", "v_bits", "bytes/token", "bits/element", "vs bf16"):
        table.add_column(col, justify="right")
    for d, kb, vb, nbytes, bpe, ratio in format_rows():
        table.add_row(str(d), str(kb), str(vb), str(nbytes), f"{bpe:.3f}", f"{ratio:.2f}x")
    console.print(table)
