"""`turboattn bench host`: host time (Python and torch dispatch) of turboattn per layer and decode step, kernels
stubbed out; runs on any machine, a CPU one included.

A tiny Llama-shaped model (random weights, bf16; 8 query and 2 KV heads, hidden size 64 so that its own work
barely touches the CPU's caches) with attn_implementation="turboattn" and a TurboQuantCache decodes on the CPU.
The GPU path is forced: `backend="auto"` picks the CUDA decode and quantize-append kernels as it would for CUDA
tensors, and their Python wrappers run up to the launch, which does nothing (the CUDA extension's `decode` and
`quantize_append` are stubs; the output is an uninitialized tensor).  What is timed is the host work of our code
only, without the launch calls themselves (the pybind calls into the extension), which only a GPU can time.  CPU tensors also differ from CUDA
ones in small ways: the device guard (`torch.cuda.device`) is skipped, and a small torch op costs a CPU kernel
instead of a kernel launch.

Each piece is timed where the model calls it, between the model's own code (a loop calling one function alone
runs it about twice as fast, its code and data hot in the CPU's caches); µs per layer and step, medians:
- `layer step`: TurboQuantLayer.update plus the "turboattn" attention function: everything turboattn does;
- `cached_attention`: the step's ta.cached_attention call, of which `cuda wrapper` is the kernel's wrapper (a decode
  step's launcher: ops/cached/cuda.py's decode_launcher);
- `append`: the step's append (QuantizedKVCache._append_validated), of which `cuda append wrapper` is the kernel's
  wrapper;
- `glue`: the layer step less the two calls (the handoff, the cache layer's checks and growth, the output's layout).
`--profile` prints cProfile's busiest functions of turboattn over the decode steps.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import datetime
import platform
import pstats
import statistics
import time

import torch

from ..args import non_negative_int, positive_int, preset
from .args import add_out
from .common import print_table, write_results

PIECES = ("layer step", "cached_attention", "cuda wrapper", "append", "cuda append wrapper", "glue")


def add_arguments(parser) -> None:
    add_out(parser)
    parser.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    parser.add_argument("--head-dim", type=int, choices=(64, 128, 256), default=128, help="head_dim")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences")
    parser.add_argument("--steps", type=positive_int, default=200, help="decode steps timed")
    parser.add_argument("--bits", type=preset, default="k4v4", help="bits of the cache")
    parser.add_argument("--exact-recent", type=non_negative_int, default=0, help="TurboQuantCache(exact_recent=)")
    parser.add_argument("--exact-first", type=non_negative_int, default=0, help="TurboQuantCache(exact_first=)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's busiest turboattn functions")


class _StubExtension:
    """The CUDA extension with kernels that launch nothing."""

    @staticmethod
    def decode(q, *args) -> torch.Tensor:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)   # the output the binding allocates

    @staticmethod
    def quantize_append(*args) -> None:
        return None


@contextlib.contextmanager
def _patched(patches):
    """Inside: each (owner, attribute, value) set; the old values come back after."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


@contextlib.contextmanager
def stubbed_gpu_path(wrap=lambda name, fn: fn):
    """Inside: backend="auto" on CPU tensors picks the GPU implementations (the CUDA decode and quantize-append
    kernels), whose wrappers run up to a launch that does nothing.  wrap(name, function) may replace the two
    wrappers (a timer)."""
    from ...ops import backend
    from ...ops.cached import cuda
    from ...ops.quantize import cuda as quantize_cuda
    saved = [backend._REGISTRY[op]["cuda"] for op in ("cached_attention", "quantize_append")]
    patches = [(module, name, value) for module in (cuda, quantize_cuda)
               for name, value in (("extension", lambda: _StubExtension), ("capable", lambda device: True))]
    def timed_launchers(name, make):   # a decode step's launches (library.*_launcher): the wrappers' fast paths
        def timed(*args):
            launch = make(*args)
            return None if launch is None else wrap(name, launch)
        return timed
    patches += [(cuda, "cached_attention_cuda", wrap("cuda wrapper", cuda.cached_attention_cuda)),
                (cuda, "decode_launcher", timed_launchers("cuda wrapper", cuda.decode_launcher)),
                (quantize_cuda, "quantize_append_cuda",
                 wrap("cuda append wrapper", quantize_cuda.quantize_append_cuda)),
                (quantize_cuda, "append_launcher",
                 timed_launchers("cuda append wrapper", quantize_cuda.append_launcher))]
    try:
        for impl in saved:
            _register(dataclasses.replace(impl, devices=(*impl.devices, "cpu")))
        backend.load.cache_clear()
        with _patched(patches):
            yield
    finally:
        for impl in saved:
            _register(impl)
        backend.load.cache_clear()


def _register(impl) -> None:
    from ...ops import backend
    backend.register(impl.op, impl.name, impl.target, priority=impl.priority, devices=impl.devices,
                     requires=impl.requires, head_dims=impl.head_dims, grouped_keys=impl.grouped_keys)


def _model(layers: int, head_dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=head_dim, num_hidden_layers=layers,
                         max_position_embeddings=4096)
    config._attn_implementation = "turboattn"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


class _Timers:
    """Seconds per call of the wrapped functions, by piece; off until `on`."""

    def __init__(self):
        self.samples = {name: [] for name in PIECES}
        self.on = False

    def wrap(self, name: str, fn):
        samples = self.samples[name]

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - start)
        return timed

    def medians_us(self) -> dict[str, float]:
        s = self.samples
        # A layer step is an update and an attention call, back to back in every attention module.
        steps = [u + a for u, a in zip(s.pop("update"), s.pop("attention"))]
        s["layer step"] = steps
        s["glue"] = [x - c - p for x, c, p in zip(steps, s["cached_attention"], s["append"])]
        return {name: 1e6 * statistics.median(s[name]) for name in PIECES}


@contextlib.contextmanager
def _timed_model(timers: _Timers):
    """Inside: the model's calls of turboattn are timed into `timers` (stubbed_gpu_path wraps the kernel wrappers)."""
    from transformers import AttentionInterface

    from ...cache import QuantizedKVCache
    from ...integrations import hf
    timers.samples.update(update=[], attention=[])
    patches = [(hf.TurboQuantLayer, "update", timers.wrap("update", hf.TurboQuantLayer.update)),
               (hf, "cached_attention", timers.wrap("cached_attention", hf.cached_attention)),
               (QuantizedKVCache, "_append_validated", timers.wrap("append", QuantizedKVCache._append_validated))]
    AttentionInterface.register(hf.ATTN_NAME, timers.wrap("attention", hf.turboattn_attention))
    try:
        with _patched(patches):
            yield
    finally:
        hf.register()


def _decode(model, cache, batch: int, steps: int, timers: _Timers | None = None,
            profiler: cProfile.Profile | None = None) -> None:
    """Prefill a short prompt, then `steps` decode steps (timed when timers or profiler are given)."""
    prompt = 32
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
    model(ids, past_key_values=cache, cache_position=torch.arange(prompt), use_cache=True)
    token = ids[:, -1:]
    for step in range(steps):
        position = torch.tensor([prompt + step])
        if timers is not None:
            timers.on = True
        if profiler is not None:
            profiler.enable()
        model(token, past_key_values=cache, cache_position=position, use_cache=True)
        if profiler is not None:
            profiler.disable()
        if timers is not None:
            timers.on = False


@torch.no_grad()
def run(args) -> int:
    from ...hf import TurboQuantCache
    torch.manual_seed(0)
    model = _model(args.layers, args.head_dim)
    k_bits, v_bits = args.bits

    def new_cache():
        return TurboQuantCache(model.config, k_bits, v_bits, exact_recent=args.exact_recent,
                               exact_first=args.exact_first)
    timers = _Timers()
    with stubbed_gpu_path(timers.wrap), _timed_model(timers):
        _decode(model, new_cache(), args.batch, 3)   # warm-up: plans, tables, imports
        _decode(model, new_cache(), args.batch, args.steps, timers)
    results = timers.medians_us()
    if args.profile:
        profiler = cProfile.Profile()
        with stubbed_gpu_path():
            _decode(model, new_cache(), args.batch, args.steps, profiler=profiler)
        print(f"cProfile of {args.steps} decode steps x {args.layers} layers, turboattn's functions:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats("turboattn", 30)
    shape = f"B={args.batch} Hq=8 Hkv=2 D={args.head_dim} k{k_bits}v{v_bits}"
    for option in ("exact_recent", "exact_first"):
        if getattr(args, option):
            shape += f" {option}={getattr(args, option)}"
    print_table(f"host µs per layer and decode step, kernels stubbed ({shape}, {platform.machine()} CPU)",
                ["piece", "µs"], [[name, results[name]] for name in PIECES])
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "date": datetime.date.today().isoformat()}
    payload = {"env": env, "args": {k: v for k, v in vars(args).items() if k not in ("func", "out")}, "us": results}
    write_results(args.out, "host", payload)
    return 0
