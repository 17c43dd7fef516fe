"""Attention over the compressed cache (decode and extend): split-K over the codes, merged by LSE."""

from ..backend import register
from .config import CUDA_HEAD_DIMS, TRITON_HEAD_DIMS

register("cached_attention", "torch", "turboattn.ops.cached.naive:cached_attention_naive", priority=0,
         devices=("*",), grouped_keys=True)
register("cached_attention", "triton", "turboattn.ops.cached.triton:cached_attention_triton", priority=10,
         devices=("cuda",), requires=("triton",), head_dims=TRITON_HEAD_DIMS, grouped_keys=True)
# 15 K/V bit pairs (every preset) and the key groups of config.CUDA_KEY_GROUPS at head_dim 64/128/256/512 on tensor
# cores (built with nvcc on first use); other calls (other key groups among them) fall through to Triton.
register("cached_attention", "cuda", "turboattn.ops.cached.cuda:cached_attention_cuda", priority=20,
         devices=("cuda",), requires=("triton",), head_dims=CUDA_HEAD_DIMS, grouped_keys=True)
