"""Quantize-append: rotate, normalize, find Lloyd–Max cells, pack and write into the cache slots."""

from ..backend import register
from ..cached import TRITON_HEAD_DIMS

register("quantize_append", "torch", "turboattn.ops.quantize.naive:quantize_append_naive", priority=0,
         devices=("*",))
register("quantize_append", "triton", "turboattn.ops.quantize.triton:quantize_append_triton", priority=10,
         devices=("cuda",), requires=("triton",), head_dims=TRITON_HEAD_DIMS)
