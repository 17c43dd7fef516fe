"""Every public entry point on cuda:1 while cuda:0 is the current device (pytest -m gpu, 2 GPUs).

A Triton launch takes its device and stream from torch's current device, not from its arguments
(ops/library.py guards every op for that reason).  Each test here leaves cuda:0 current, builds its inputs on
the CPU, runs the call on cuda:1 and on cuda:0, and checks that

- the outputs (and the cache's tensors) are on cuda:1;
- they equal the cuda:0 call's bit for bit (the same kernels, plans and inputs on two GPUs of one kind), and,
  for attention, the float64 reference within the kernels' tolerance (tests/gpu/test_kernels_gpu.py's);
- the cuda:1 call left cuda:0 current and allocated nothing on cuda:0 (its peak memory did not move);
- (one test) every kernel the profiler saw during the cuda:1 calls ran on device 1.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import turboattn as ta
from turboattn.ops.cached.naive import cached_attention_naive
from turboattn.ops.flash.naive import attention_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

OTHER = torch.device("cuda", 1)
CURRENT = torch.device("cuda", 0)
# fp16 kernel operands (2^-11, a few add up) plus bf16 output rounding (2^-9): test_kernels_gpu.py's bound.
CACHED_TOL = 4 * 2.0 ** -11 + 2.0 ** -9
FLASH_TOL = 1.5e-2   # bf16, test_flash_gpu.py's


@pytest.fixture(autouse=True)
def current_is_cuda0():
    torch.cuda.set_device(CURRENT)
    yield
    assert torch.cuda.current_device() == 0, "a call changed the current device"


@contextlib.contextmanager
def leaves_cuda0_alone():
    """The block (work on cuda:1) keeps cuda:0 current and allocates nothing there."""
    torch.cuda.synchronize(CURRENT)
    before = torch.cuda.memory_allocated(CURRENT)
    torch.cuda.reset_peak_memory_stats(CURRENT)
    yield
    torch.cuda.synchronize(OTHER)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.max_memory_allocated(CURRENT) == before, "the cuda:1 call allocated memory on cuda:0"


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.device == OTHER, f"{what} is on {got.device}"
    assert torch.equal(got.cpu(), want.cpu()), f"{what} differs between cuda:1 and cuda:0"


def on_both(fn, *cpu_args):
    """fn(*args moved to cuda:1) under leaves_cuda0_alone, then fn(*args moved to cuda:0)."""
    move = lambda device: [a.to(device) if isinstance(a, torch.Tensor) else a for a in cpu_args]  # noqa: E731
    with leaves_cuda0_alone():
        got = fn(OTHER, *move(OTHER))
    return got, fn(CURRENT, *move(CURRENT))


def randn(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- the codec -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [(4, 4), (8, 3)])
def test_codec_quantize_dequantize(bits):
    codec = ta.KVCodec(128, *bits)
    x = randn(2, 4, 100, 128, seed=1)

    def run(device, x):
        p = codec.quantize(x, "k")
        return p.codes, p.scales, codec.dequantize(p, "k", torch.float32)

    got, want = on_both(run, x)
    for g, w, name in zip(got, want, ("codes", "scales", "dequantized")):
        assert_same(g, w, name)


# -- QuantizedKVCache and cached_attention -----------------------------------------------------------------

CACHES = [
    # D, bits, B, Hkv, G, tokens, ring W, Tq, fresh, options
    (128, (4, 4), 2, 4, 4, 3000, None, 1, False, {}),                         # CUDA decode kernel
    (128, (8, 5), 2, 4, 4, 3000, None, 3, True, {}),                          # Triton decode kernel
    (64, (4, 4), 3, 2, 2, 2500, 1024, 1, True, {}),                           # ring
    (128, (4, 4), 2, 2, 4, 1500, None, 1, False, {"static": True}),           # static, planned in the op
    (128, (4, 4), 2, 2, 4, 1500, None, 1, True, {"exact_recent": 32, "exact_first": 4}),
]


@pytest.mark.parametrize("case", CACHES, ids=[str(c[:8]) for c in CACHES])
def test_cache_append_and_cached_attention(case):
    d, bits, b, hkv, g, tokens, window, tq, fresh, options = case
    codec = ta.KVCodec(d, *bits)
    k, v = randn(b, hkv, tokens, d, seed=2), randn(b, hkv, tokens, d, seed=3)
    q = randn(b, hkv * g, tq, d, seed=4)
    kf, vf = (randn(b, hkv, tq, d, seed=5), randn(b, hkv, tq, d, seed=6)) if fresh else (None, None)
    sinks = randn(hkv * g, seed=7, dtype=torch.float32)
    capacity = None if window else tokens + tq

    def run(device, k, v, q, kf, vf, sinks):
        cache = ta.QuantizedKVCache(codec, b, hkv, capacity=capacity, sliding_window=window, device=device,
                                    **options)
        cache.append(k[:, :, :tokens // 3], v[:, :, :tokens // 3])
        cache.append(k[:, :, tokens // 3:], v[:, :, tokens // 3:], new_lengths=[tokens - tokens // 3 - i
                                                                                   for i in range(b)])
        out = ta.cached_attention(q, cache, kf, vf, sinks=sinks)
        return out, cache

    (out1, cache1), (out0, cache0) = on_both(run, k, v, q, kf, vf, sinks)
    assert cache1.device == OTHER and all(t.device == OTHER for t in (cache1.k_codes, cache1.seen, cache1.v_scales))
    for name in ("k_codes", "k_scales", "v_codes", "v_scales", "seen", "nonfinite"):
        assert_same(getattr(cache1, name), getattr(cache0, name), name)
    assert_same(out1, out0, "cached_attention's output")
    ref = cached_attention_naive(q.to(OTHER), cache1.layout, codec, None if kf is None else kf.to(OTHER),
                                 None if vf is None else vf.to(OTHER), sinks=sinks.to(OTHER),
                                 compute_dtype=torch.float64)
    assert rel_error(out1, ref) < CACHED_TOL


# -- flash_attention -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("lq", [700, 1], ids=["prefill", "decode"])
def test_flash_attention(lq):
    b, hq, hkv, lk, d = 2, 8, 2, 900, 128
    q, k, v = randn(b, hq, lq, d, seed=8), randn(b, hkv, lk, d, seed=9), randn(b, hkv, lk, d, seed=10)
    sinks = randn(hq, seed=11, dtype=torch.float32)
    # A window and sinks keep the call on the Triton kernels (SDPA serves plain causal attention).
    kw = dict(causal=True, sliding_window=300)

    def run(device, q, k, v, sinks):
        return ta.flash_attention(q, k, v, sinks=sinks, return_lse=True, **kw)

    (out1, lse1), (out0, lse0) = on_both(run, q, k, v, sinks)
    assert_same(out1, out0, "flash_attention's output")
    assert_same(lse1, lse0, "flash_attention's lse")
    ref = attention_reference(*(t.to(OTHER).double() for t in (q, k, v)), sinks=sinks.to(OTHER),
                              compute_dtype=torch.float64, **kw)
    assert rel_error(out1, ref) < FLASH_TOL


# -- persistence -----------------------------------------------------------------------------------------------

def test_save_on_cuda0_load_on_cuda1(tmp_path):
    codec = ta.KVCodec(128, 4, 4)
    cache = ta.QuantizedKVCache(codec, 2, 4, capacity=600, device=CURRENT)
    cache.append(randn(2, 4, 500, 128, seed=12).to(CURRENT), randn(2, 4, 500, 128, seed=13).to(CURRENT))
    cache.save(tmp_path / "cache.safetensors")
    q = randn(2, 16, 1, 128, seed=14)
    with leaves_cuda0_alone():
        loaded = ta.QuantizedKVCache.load(tmp_path / "cache.safetensors", device=OTHER)
        got = ta.cached_attention(q.to(OTHER), loaded)
    assert loaded.device == OTHER and loaded.seen.device == OTHER
    assert_same(loaded.k_codes, cache.k_codes, "loaded codes")
    assert_same(got, ta.cached_attention(q.to(CURRENT), cache), "attention over the loaded cache")


# -- transformers ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_len", [None, 96], ids=["growing", "static"])
@torch.no_grad()
def test_turboquant_cache_generate(max_len, tmp_path):
    pytest.importorskip("transformers")
    from hf_models import random_ids, tiny_llama

    from turboattn.hf import TurboQuantCache, load_turboquant_cache, save_turboquant_cache

    ids = random_ids(40, batch=2)

    def run(device, ids):
        model = tiny_llama().to(device)
        cache = TurboQuantCache(model.config, max_cache_len=max_len)
        # A static cache is compileable, so generate would compile the step: test_compiled_generate_on_cuda1
        # covers that; here the same kernels run eagerly on both devices.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=16,
                             min_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, disable_compile=True)
        return out, cache

    (out1, cache1), (out0, _) = on_both(run, ids)
    assert_same(out1.sequences, out0.sequences, "generated tokens")
    assert_same(torch.stack(out1.logits), torch.stack(out0.logits), "logits")
    assert all(layer.cache.device == OTHER for layer in cache1.layers)
    # A prompt cache saved from cuda:1 and loaded back there continues identically.
    save_turboquant_cache(cache1, tmp_path / "prompt.safetensors")
    model = tiny_llama().to(OTHER)
    with leaves_cuda0_alone():
        loaded = load_turboquant_cache(tmp_path / "prompt.safetensors", model.config, device=OTHER)
        step = out1.sequences[:, -1:]
        a = model(input_ids=step, past_key_values=loaded).logits
        b = model(input_ids=step, past_key_values=cache1).logits
    assert_same(a, b, "logits after reloading the cache")


@torch.no_grad()
def test_compiled_generate_on_cuda1():
    """generate with transformers' compiled decode step (inductor, reduce-overhead) on cuda:1 while cuda:0 is
    current: one graph, the current device untouched, the output on cuda:1, and the logits it chose its tokens
    from equal to the eager model's on those tokens within test_hf_gpu.py's kernel tolerance.  cuda:0's memory is
    not checked here: inductor's autotuner allocates its L2-flush buffer on the current device (torch's
    benchmarking.py, `device=device_type`; 60 MiB on an H200), which is torch's doing, not a kernel's."""
    import transformers
    from hf_models import random_ids, teacher_forced_logits, tiny_llama

    from turboattn.hf import TurboQuantCache

    prefill, new, rel_tol = 40, 16, 2.5e-2
    model = tiny_llama().to(OTHER)
    ids = random_ids(prefill, batch=2).to(OTHER)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=TurboQuantCache(
                             model.config, max_cache_len=96), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                         compile_config=transformers.CompileConfig(fullgraph=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert got.sequences.device == OTHER and torch.cuda.current_device() == 0
    forced = teacher_forced_logits(model, got.sequences, TurboQuantCache(model.config, max_cache_len=96),
                                   prefill)[:, prefill - 1:-1]
    logits = torch.stack(got.logits, 1)
    assert logits.device == OTHER
    assert rel_error(logits, forced) < rel_tol


# -- where the kernels ran ---------------------------------------------------------------------------------------

def test_kernels_run_on_the_tensors_device():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    codec = ta.KVCodec(128, 4, 4)
    k, v = (randn(2, 4, 700, 128, seed=s).to(OTHER) for s in (15, 16))
    q = randn(2, 16, 1, 128, seed=17).to(OTHER)
    cache = ta.QuantizedKVCache(codec, 2, 4, capacity=800, device=OTHER)
    cache.append(k, v)   # warm-up: compiles and caches outside the profile
    ta.cached_attention(q, cache)
    ta.flash_attention(q, k, v, sliding_window=64, causal=True)
    torch.cuda.synchronize(OTHER)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cache.append(k[:, :, :50], v[:, :, :50])
        ta.cached_attention(q, cache)
        ta.cached_attention(q, cache, backend="triton")
        ta.flash_attention(q, k, v, sliding_window=64, causal=True)
        torch.cuda.synchronize(OTHER)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        pytest.skip("the profiler recorded no CUDA kernels here")
    wrong = sorted({(e.name, e.device_index) for e in kernels if e.device_index != 1})
    assert not wrong, f"kernels ran on another device: {wrong}"
    names = " ".join(e.name for e in kernels)
    assert "quantize_append" in names and "flash" in names
