"""`turboattn info`: versions, device, and the table of cache formats."""

from __future__ import annotations

import platform
import time

import torch

from ..format.codec import SUPPORTED_BITS, KVCodec
from .args import COMMON_HEAD_DIMS as TABLE_HEAD_DIMS


def format_rows(head_dims=TABLE_HEAD_DIMS, bit_pairs=None):
    """(head_dim, k_bits, v_bits, bytes/token/head, bits/element, compression vs bf16).

    `bit_pairs` defaults to every (k_bits, v_bits) pair of SUPPORTED_BITS.
    """
    if bit_pairs is None:
        bit_pairs = [(kb, vb) for kb in reversed(SUPPORTED_BITS) for vb in reversed(SUPPORTED_BITS)]
    for d in head_dims:
        for kb, vb in bit_pairs:
            codec = KVCodec(d, kb, vb)
            bf16 = 2 * 2 * d
            yield d, kb, vb, codec.bytes_per_token(), codec.bits_per_element(), bf16 / codec.bytes_per_token()


def _print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A rich table when rich is installed (the bench/hf extras); plain aligned text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(title)
        for line in [columns] + rows:
            print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def print_info() -> None:
    import turboattn

    print(f"turboattn {turboattn.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton
        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed (PyTorch reference path only)")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    else:
        print("device: CPU only (kernels run under TRITON_INTERPRET=1, slowly)")
    # One row per K/V bit pair, one column per head_dim: a 144-row long table would not be read.
    cells: dict[tuple[int, int], list[str]] = {}
    for d, kb, vb, nbytes, bpe, ratio in format_rows():
        cells.setdefault((kb, vb), []).append(f"{nbytes} B  {ratio:.2f}x")
    _print_table("Cache formats: K+V bytes per token per KV head (float32 scales included), "
                 "and compression vs bf16",
                 ["k_bits", "v_bits"] + [f"D={d}" for d in TABLE_HEAD_DIMS],
                 [[str(kb), str(vb), *row] for (kb, vb), row in cells.items()])


def build_kernels() -> int:
    """`turboattn info --build-kernels`: build the CUDA kernels (decode, quantize-append) ahead of the first step."""
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to build (the CPU path runs plain PyTorch)")
        return 0
    from ..ops.cuda_extension import build_extension
    t0 = time.time()
    built = build_extension()
    what = "ready" if built else "not built (the Triton kernels serve every call instead)"
    print(f"CUDA kernels: {what}, {time.time() - t0:.0f} s; torch keeps the build under $TORCH_EXTENSIONS_DIR "
          "(default ~/.cache/torch_extensions)")
    return 0
