"""Quantize-append: rotate, normalize, find codebook cells, pack and write into the cache slots."""

from ..backend import register
from ..cached import TRITON_HEAD_DIMS

register("quantize_append", "torch", "turboattn.ops.quantize.naive:quantize_append_naive", priority=0,
         devices=("*",), grouped_keys=True)
register("quantize_append", "triton", "turboattn.ops.quantize.triton:quantize_append_triton", priority=10,
         devices=("cuda",), requires=("triton",), head_dims=TRITON_HEAD_DIMS, grouped_keys=True)
# head_dim 64/128/256/512, every bit width, the key groups the decode kernel reads (built with nvcc on first use,
# with the decode kernel); without the extension, and for other key groupings, it hands the call to Triton.
register("quantize_append", "cuda", "turboattn.ops.quantize.cuda:quantize_append_cuda", priority=20,
         devices=("cuda",), requires=("triton",), head_dims=(64, 128, 256, 512), grouped_keys=True)
