"""Dense flash attention (prefill and split-K decode), head_dim up to 512, SDPA layout."""

from ..backend import register

register("flash_attention", "torch", "turboattn.ops.flash.naive:flash_attention_naive", priority=0, devices=("*",))
register("flash_attention", "triton", "turboattn.ops.flash.triton:flash_attention_triton", priority=10,
         devices=("cuda",), requires=("triton",))
