"""The 4-bit register lookup: inline PTX that turns packed code bytes into float16 centroids."""

from __future__ import annotations

from functools import lru_cache

import torch

from ...format import codebook


def _lut4_asm(table: list[float]) -> str:
    """PTX mapping 4 packed code bytes (low nibble: coordinate c, high: c + D/2) to 8 float16 centroids.

    Each nibble i selects a byte from two 8-entry byte tables (prmt picks from 8
    bytes with a 3-bit selector): entries 0-7 with selector i, entries 8-15 with
    i ^ 8.  prmt's sign-replicate mode (selector bit 3) fills the wrong table's
    pick with junk, so a full-byte mask (0xFF where i < 8) chooses between them;
    the mask itself comes from prmt on a 0x7F table, whose replicate byte is 0.
    """
    bits = torch.tensor(table, dtype=torch.float16).view(torch.int16).tolist()
    lo = [b & 0xFF for b in bits]
    hi = [(b >> 8) & 0xFF for b in bits]

    def word(bytes4):
        return "0x%08X" % sum(v << (8 * k) for k, v in enumerate(bytes4))

    tables = {"al0": word(lo[0:4]), "al1": word(lo[4:8]), "bl0": word(lo[8:12]), "bl1": word(lo[12:16]),
              "ah0": word(hi[0:4]), "ah1": word(hi[4:8]), "bh0": word(hi[8:12]), "bh1": word(hi[12:16])}
    lines = ["{", ".reg .b32 n, t, s, s8, m, f, al, bl, ah, bh, l, h, c7;"]
    lines += [f".reg .b32 {name};" for name in tables]
    lines += [f"mov.b32 {name}, {value};" for name, value in tables.items()]
    lines.append("mov.b32 c7, 0x7F7F7F7F;")
    for half, (out0, out1) in enumerate((("$0", "$1"), ("$2", "$3"))):
        # Nibbles of the 4 bytes -> 4 selector nibbles, in element order 0, 2, 1, 3.
        lines.append("and.b32 n, $4, 0x0F0F0F0F;" if half == 0 else "shr.b32 n, $4, 4;\nand.b32 n, n, 0x0F0F0F0F;")
        lines += ["shr.b32 t, n, 12;", "or.b32 s, n, t;", "xor.b32 s8, s, 0x8888;",
                  "prmt.b32 m, c7, c7, s;", "shl.b32 t, m, 1;", "or.b32 f, m, t;",
                  "prmt.b32 al, al0, al1, s;", "prmt.b32 bl, bl0, bl1, s8;",
                  "prmt.b32 ah, ah0, ah1, s;", "prmt.b32 bh, bh0, bh1, s8;",
                  "lop3.b32 l, al, bl, f, 0xE4;", "lop3.b32 h, ah, bh, f, 0xE4;",
                  f"prmt.b32 {out0}, l, h, 0x6240;", f"prmt.b32 {out1}, l, h, 0x7351;"]
    lines.append("}")
    return "\n".join(lines)


@lru_cache(maxsize=None)
def lut4_asm() -> str:
    """The lookup for the 4-bit Lloyd–Max codebook, built once."""
    return _lut4_asm(codebook.centroids(4, torch.float64).tolist())
