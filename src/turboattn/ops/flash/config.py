"""Launch policy of the dense flash kernels: block sizes, split count, and when torch SDPA serves instead."""

from __future__ import annotations

import torch
import triton

from ..launch import num_splits_for

# Lq * group at or below this goes to the split-K decode kernel.
DECODE_MAX_ROWS = 32
# Decode: about two programs per SM (the kernel holds a whole GQA group's rows), each split at
# least four key tiles long.
DECODE_PROGRAMS_PER_SM = 2
DECODE_MIN_TILES_PER_SPLIT = 4


def prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Block sizes for the prefill kernel (measured on H200; see BENCHMARKS.md)."""
    if device.type != "cuda":
        # Interpreter: small tiles are fast to simulate and exercise every multi-tile code path.
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, tma=False)
    # TMA loads (tensor descriptors) beat pointer loads at every head dim on H200
    # (`turboattn bench prefill --configs candidates`):
    # D=512 240 vs 182 TFLOP/s, D=256 508 vs 416, D=128 462 vs 388 (causal, L=8192).
    bd = triton.next_power_of_2(head_dim)
    if bd <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, tma=True)
    if bd <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True)
    if bd <= 256:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, tma=True)
    # D=512: a 64x512 fp32 accumulator already takes half the register file, and K+V tiles of
    # 64 keys fill shared memory, so one stage: wider key tiles beat deeper pipelining here.
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, tma=True)


def decode_config(head_dim: int, device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    bd = triton.next_power_of_2(head_dim)
    # D=512, 32K keys, 16 q / 2 KV heads on H200 (CUDA-graph time): 32-key tiles 83.5 us (2 or 3
    # stages), 16-key tiles x4 stages 91.4 us; ~128 splits, i.e. two programs per SM.
    if bd >= 512:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64 if bd <= 128 else 32, num_warps=4, num_stages=3)


def decode_num_splits(batch_kv_heads: int, lk: int, block_n: int, device: torch.device) -> int:
    return num_splits_for(device, batch_kv_heads, lk, DECODE_PROGRAMS_PER_SM, DECODE_MIN_TILES_PER_SPLIT * block_n)


def _sdpa_serves(q, k, causal, sliding_window, mask, softcap, sinks, alibi_slopes, kv_start, return_lse) -> bool:
    """torch SDPA computes exactly this and is at least as fast (measured: BENCHMARKS.md)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if mask is not None or sliding_window is not None or softcap is not None or sinks is not None:
        return False
    if alibi_slopes is not None or kv_start is not None or return_lse:
        return False
    lq, lk, d = q.shape[2], k.shape[2], q.shape[3]
    if causal and lq != lk:  # SDPA's is_causal is top-left aligned
        return False
    if q.shape[1] != k.shape[1]:  # GQA: measured separately (SDPA_GQA)
        return SDPA_GQA and d <= SDPA_MAX_HEAD_DIM and lq > DECODE_MAX_ROWS
    return d <= SDPA_MAX_HEAD_DIM and d % 8 == 0 and lq > DECODE_MAX_ROWS


# Up to this head dim torch SDPA has its flash / cuDNN kernels, measured 1.1-1.2x ahead of ours
# for plain causal prefill on H200 (BENCHMARKS.md); above it SDPA falls back to slower kernels.
SDPA_MAX_HEAD_DIM = 256
# GQA through SDPA's enable_gqa (torch >= 2.5): 532-552 vs our 443-465 TFLOP/s (D=128, 32 q / 8 KV heads).
SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def flash_path(q, k, causal=False, sliding_window=None, mask=None, softcap=None, sinks=None,
               alibi_slopes=None, kv_start=None, return_lse=False, allow_sdpa=True) -> str:
    """Which implementation flash_attention_triton runs for these arguments: 'sdpa', 'decode' or 'prefill'."""
    if allow_sdpa and _sdpa_serves(q, k, causal, sliding_window, mask, softcap, sinks, alibi_slopes,
                                   kv_start, return_lse):
        return "sdpa"
    group = q.shape[1] // k.shape[1]
    return "decode" if q.shape[2] * group <= DECODE_MAX_ROWS else "prefill"
