"""torch.compile: a decode step traces as one graph and compiles once (transformers models and the ops).

A static TurboQuantCache (max_cache_len) keeps its lengths on the device, so
nothing a decode step reads on the host changes from step to step: compiled
with fullgraph=True (which raises on any graph break or data-dependent host
read) it must compile exactly once over 20 steps.  The backend is aot_eager:
dynamo's graph capture plus AOTAutograd's functionalization of the ops'
in-place writes (what inductor and CUDA graphs build on), without inductor's
C++ compile time; on the CPU the ops run their PyTorch twins, so compiled
and eager results differ only by float32 reduction order (test_hf.py's
ATOL).  The CUDA side (inductor, CUDA graphs, no host sync) is
tests/gpu/test_hf_gpu.py.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import random_ids, tiny_gemma3, tiny_llama  # noqa: E402
from torch._dynamo.backends.debugging import aot_eager  # noqa: E402
from turboattn import KVCodec, QuantizedKVCache, cached_attention  # noqa: E402
from turboattn.hf import TurboQuantCache  # noqa: E402
from turboattn.ops import library  # noqa: E402

ATOL = 1e-4   # float32, reduction order only (tests/test_hf.py)
STEPS = 20
PROMPT = 10   # Gemma-3's sliding layers (W = 8) wrap their rings during the prompt
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def counting_backend():
    """aot_eager that records each graph it compiles (a plain function: CompileConfig deep-copies its backend)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)
    return backend, graphs


def eager_logits(model, ids, prompt, **cache_options):
    """Teacher-forced logits of each decode step with the growing cache, eagerly."""
    cache = TurboQuantCache(model.config, **(cache_options or {"k_bits": 4, "v_bits": 4}))
    model(input_ids=ids[:, :prompt], past_key_values=cache)
    return [model(input_ids=ids[:, s:s + 1], past_key_values=cache).logits for s in range(prompt, ids.shape[1])]


def compiled_decode(model, ids, cache):
    """Prefill eagerly, then the decode steps compiled with fullgraph=True: (their logits, the graphs compiled)."""
    model(input_ids=ids[:, :PROMPT], past_key_values=cache)

    def step(token):
        return model(input_ids=token, past_key_values=cache).logits

    backend, graphs = counting_backend()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    return [compiled(ids[:, s:s + 1]) for s in range(PROMPT, ids.shape[1])], graphs


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@torch.no_grad()
def test_decode_step_compiles_once(factory):
    """Prefill eagerly, then 20 compiled decode steps: one graph, no recompile, the eager logits."""
    model = factory()
    ids = random_ids(PROMPT + STEPS, batch=2)
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=64)
    assert cache.is_compileable
    got, graphs = compiled_decode(model, ids, cache)
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    called = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {"turboattn.cached_attention", "turboattn.quantize_append"} <= called
    want = eager_logits(factory(), ids, PROMPT)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert cache.get_seq_length().item() == PROMPT + STEPS and not cache.overflowed


@torch.no_grad()
def test_decode_step_with_key_groups_compiles_once():
    """Keys in channel groups trace as the plain codes do: one graph over 20 steps, the eager logits."""
    ids = random_ids(PROMPT + STEPS, batch=2)
    options = {"v_bits": 4, "key_groups": ((32, 6), (32, 3))}
    model = tiny_gemma3()
    got, graphs = compiled_decode(model, ids, TurboQuantCache(model.config, max_cache_len=64, **options))
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    for g, w in zip(got, eager_logits(tiny_gemma3(), ids, PROMPT, **options), strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


@torch.no_grad()
def test_compiled_step_in_another_thread():
    """The update -> attention handoff is per thread and traced: a step compiled in one thread runs in another
    (compiling once more there: the thread's slot does not exist yet) with the eager logits."""
    model = tiny_llama()
    ids = random_ids(PROMPT + 4, batch=2)
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=64)
    model(input_ids=ids[:, :PROMPT], past_key_values=cache)
    backend, graphs = counting_backend()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: model(input_ids=t, past_key_values=cache).logits, backend=backend,
                             fullgraph=True)
    got = [compiled(ids[:, PROMPT:PROMPT + 1])]

    def other():
        with torch.no_grad():
            got.extend(compiled(ids[:, s:s + 1]) for s in range(PROMPT + 1, PROMPT + 3))
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    got.append(compiled(ids[:, PROMPT + 3:]))
    for g, w in zip(got, eager_logits(model, ids, PROMPT), strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert len(graphs) <= 2


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")  # the growing plan
@torch.no_grad()
def test_growing_cache_recompiles_where_the_static_one_does_not():
    """The contrast that makes the test above meaningful: the growing cache's host lengths change every
    step, so torch.compile re-specializes on them (how often is dynamo's heuristics' business).  Both
    trace without a graph break."""
    model = tiny_llama()
    ids = random_ids(PROMPT + 3)
    counts = {}
    for kind, max_len in (("growing", None), ("static", 64)):
        cache = TurboQuantCache(model.config, 4, 4, max_cache_len=max_len)
        model(input_ids=ids[:, :PROMPT], past_key_values=cache)
        backend, graphs = counting_backend()
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: model(input_ids=t, past_key_values=cache).logits, backend=backend,
                                 fullgraph=True)
        for s in range(PROMPT, PROMPT + 3):
            compiled(ids[:, s:s + 1])
        counts[kind] = len(graphs)
    assert counts["static"] == 1 and counts["growing"] > 1, counts


@pytest.mark.parametrize("factory", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@torch.no_grad()
def test_generate_with_compile_config(factory):
    """transformers' compiled generation (compile_config; a compileable cache is what enables it) on a
    left-padded batch: one graph for every decode step, the eager growing cache's tokens and scores.
    A reset() cache generates again, for another prompt, without compiling anew."""
    model = factory()
    backend, graphs = counting_backend()
    config = transformers.CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True   # transformers compiles only on accelerators unless told
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=40)
    torch._dynamo.reset()
    for seed in (1, 2):
        ids = random_ids(20, batch=2, seed=seed)
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        cache.reset()
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, compile_config=config, **kw)
        want = model.generate(ids, attention_mask=mask, past_key_values=TurboQuantCache(model.config, 4, 4), **kw)
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=ATOL, rtol=0)
        assert len(graphs) == 1, f"{len(graphs)} graphs after prompt {seed}"
    assert not cache.overflowed


@torch.no_grad()
def test_compiling_model_forward_as_a_new_user_would():
    """model.forward = torch.compile(model.forward) compiles the prefill too: it graph-breaks where it reads
    the prompt on the host (padding, key-transform fit), which is allowed there, and its first run meets
    a fresh cache (not yet allocated) where later prompts meet a reset one.  From the second prompt on
    nothing compiles anew, also for a longer generation: the decode step does not depend on the length."""
    model, ref = tiny_llama(), tiny_llama()
    backend, graphs = counting_backend()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    ids = random_ids(20, batch=2)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    cache = TurboQuantCache(model.config, 4, 4, max_cache_len=40)
    counts = []
    for new_tokens in (4, 4, 12):
        cache.reset()
        got = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        want = ref.generate(ids, past_key_values=TurboQuantCache(ref.config, 4, 4), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, **kw)
        assert torch.equal(got, want)
        counts.append(len(graphs))
    assert counts[1] == counts[2], counts   # the third, longer generation compiled nothing new


@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.no_grad()
def test_static_cache_step_compiles_once_on_its_own(backend, gen, monkeypatch):
    """QuantizedKVCache(static=True) without transformers: attention plus append, 20 steps, one graph; the
    plan comes from the capacity, so the Triton kernel runs several splits over a short cache."""
    if backend == "triton" and not INTERPRETER:
        pytest.skip("needs TRITON_INTERPRET=1")
    codec = KVCodec(64, 4, 3)
    static = QuantizedKVCache(codec, 2, 2, capacity=4096, static=True)
    growing = QuantizedKVCache(codec, 2, 2, capacity=64)
    k, v = (torch.randn(2, 2, 30, 64, generator=gen) for _ in range(2))
    for c in (static, growing):
        c.append(k[:, :, :10], v[:, :, :10], backend="torch")

    def step(q, k, v):
        out = cached_attention(q, static, k, v, backend=backend)
        static.append(k, v, backend=backend)
        return out

    planned = []   # (keys planned for, splits) of each step's plan, made inside the op

    def spy(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        planned.append((args[6], min(plan.num_splits, 2)))
        return plan
    real_plan = library.plan_decode
    monkeypatch.setattr(library, "plan_decode", spy)
    count, graphs = counting_backend()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=count, fullgraph=True)
    steps = STEPS if backend == "torch" else 6   # the interpreter takes ~1 s a step
    for s in range(10, 10 + steps):
        q = torch.randn(2, 4, 1, 64, generator=gen)
        got = compiled(q, k[:, :, s:s + 1], v[:, :, s:s + 1])
        want = cached_attention(q, growing, k[:, :, s:s + 1], v[:, :, s:s + 1], backend="torch")
        growing.append(k[:, :, s:s + 1], v[:, :, s:s + 1], backend="torch")
        # The PyTorch twin sums over 4096 slots instead of 64 (the empty ones weigh exactly 0): float32
        # summation order only, a few 2^-24 relative.  The Triton kernel's float16 dot operands round each
        # to 2^-11 relative (as in test_ops_library.py).
        rel = float((got.double() - want.double()).norm() / want.double().norm())
        assert rel < (4 * 2.0**-11 if backend == "triton" else 1e-5), (s, rel)
    assert len(graphs) == 1
    ops = [n.args for n in graphs[0].graph.nodes if str(n.target) == "turboattn.cached_attention"]
    assert ops[0][19] == []   # the op plans for the capacity itself
    assert planned and all(p == (4096, 2) for p in planned), planned   # 4096 slots, several splits, every step
    assert static.lengths.tolist() == [10 + steps] * 2 and static.max_seen == 10 + steps


@torch.no_grad()
def test_static_step_compiles_with_dynamic_shapes(gen):
    """After a shape changes between calls, torch.compile recompiles with that size as a symbol (automatic dynamic
    shapes), from which no constant plan can be made at trace time: the op plans inside, the steps match eager
    ones, and later sizes reuse the second graph."""
    codec = KVCodec(64, 4, 3)
    static, twin = (QuantizedKVCache(codec, 2, 2, capacity=256, static=True) for _ in range(2))
    k, v = (torch.randn(2, 2, 40, 64, generator=gen) for _ in range(2))
    for c in (static, twin):
        c.append(k[:, :, :10], v[:, :, :10], backend="torch")

    def step(cache, q, k, v):
        out = cached_attention(q, cache, k, v, backend="torch")
        cache.append(k, v, backend="torch")
        return out

    count, graphs = counting_backend()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: step(static, q, k, v), backend=count, fullgraph=True)
    s = 10
    for tq in (1, 2, 3, 1):
        q = torch.randn(2, 4, tq, 64, generator=gen)
        kk, vv = k[:, :, s:s + tq], v[:, :, s:s + tq]
        assert torch.allclose(compiled(q, kk, vv), step(twin, q, kk, vv), rtol=1e-5, atol=1e-6)
        s += tq
    assert len(graphs) == 2
