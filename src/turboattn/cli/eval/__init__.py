"""`turboattn eval`: what a compressed KV cache costs a real model, measured against an exact cache.

Protocol (the same tokens for every method).  Each segment of the corpus is
`prefill` tokens processed as one chunk, then `scored` tokens fed as decode
steps with teacher forcing.  Only the logits of decode steps are scored: the
prefill attends to its own fresh K/V in every method, so it carries no
quantization error.  Compared with the reference run (the model's own dtype,
transformers' DynamicCache, no quantization):

  (A) cosine similarity of every layer's attention output (after o_proj) at
      every scored position: mean and 1st percentile;
  (B) next-token argmax disagreement;
  (C) perplexity change, with its noise: per-token NLL differences are
      paired, so the 95% interval is exp(mean(d) +- 2 se(d)) - 1;
  and passkey retrieval accuracy at several context lengths.

Methods.  All of them run through the same attention code (turboattn's; on
CPU the exact PyTorch reference), only the cache differs:
  - turboattn presets kKvV with a scale rule, in two modes: "decode" (the
    library default: a step attends to its own new K/V in full precision and
    stores them quantized; every earlier token is read quantized) and
    "strict" (the step's own K/V are quantized first, so every token is seen
    only quantized).  Strict mode is exact in chunks (append, then attend),
    so it is scored `chunk` tokens at a time; decode mode one token per step.
  - peers: transformers' QuantizedCache (quanto int4/int2, HQQ) and the
    `turboquant` package, one token per step, with residual 1 (every earlier
    token quantized, the current one full precision: like "decode" mode) and
    with their default residual of 128 full-precision recent tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...format.codec import KVCodec
from ..corpus import CORPUS_INFO, corpus_text

MAIN_PRESETS = ("k8v8", "k6v6", "k5v5", "k4v4", "k4v3", "k3v3", "k2v2")
# Mixed candidates at <= 4.25 bits/element, counting the float32 scales (per head_dim).
MIXED_CANDIDATES = {64: ("k5v2", "k4v3", "k3v4"), 128: ("k5v3", "k4v3"), 256: ("k4v4", "k5v3", "k3v5")}
RULES = ("rms", "corrected", "lsq")
PEERS = ("quanto-int4", "quanto-int2", "hqq-4", "hqq-2", "turboquant-4", "turboquant-2")


def parse_preset(name: str) -> tuple[int, int]:
    try:
        k, v = name.lower().removeprefix("k").split("v")
        return int(k), int(v)
    except ValueError:
        raise ValueError(f"preset must look like k4v4, got {name!r}") from None


def bits_per_element(preset: str, head_dim: int) -> float:
    kb, vb = parse_preset(preset)
    return KVCodec(head_dim, kb, vb).bits_per_element()


# -- methods -------------------------------------------------------------------------------
@dataclass
class Method:
    """One cache configuration: a name, how to build its cache, and how to feed it."""

    name: str
    family: str                 # "bf16" | "turboattn" | peer package
    make_cache: object          # callable(model) -> transformers Cache
    step: int = 1               # tokens per decode call (chunks only where exact)
    info: dict = field(default_factory=dict)


def reference_method() -> Method:
    from transformers import DynamicCache
    return Method("reference", "reference", lambda m: DynamicCache(config=m.config), step=256)


FIT_SUFFIX = {"balance": "", "center": "-center", "off": "-nofit"}   # method names, stable across defaults


def turbo_method(preset: str, rule: str, mode: str, chunk: int = 256, exact_decode: bool = False,
                 fit_keys: str | None = None) -> Method:
    """Our cache.  Strict mode is exact in chunks; decode mode is either stepped token by token
    (exact_decode) or emulated in chunks by DecodeEmulationLayer (tests prove the two agree).
    fit_keys picks the key transform (None: the library default); the name carries FIT_SUFFIX[fit_keys]."""
    from ...hf import KEY_FIT_DEFAULT, TurboQuantCache
    fit_keys = fit_keys or KEY_FIT_DEFAULT
    kb, vb = parse_preset(preset)
    strict = mode == "strict"

    def make(model):
        cache = TurboQuantCache(model.config, kb, vb, rule, quantize_current=strict, fit_keys=fit_keys)
        if not strict and not exact_decode:
            cache.layers = [DecodeEmulationLayer.from_layer(layer) for layer in cache.layers]
        return cache
    name = f"{preset}-{rule}-{mode}" + FIT_SUFFIX[fit_keys]
    return Method(name, "turboattn", make, step=1 if exact_decode else chunk,
                  info=dict(preset=preset, rule=rule, mode=mode, fit_keys=fit_keys))


def _decode_emulation_class():
    from ...hf import TurboQuantLayer
    from ...ops.flash.naive import attention_reference

    class DecodeEmulationLayer(TurboQuantLayer):
        """Scores a chunk of T teacher-forced tokens as T decode steps would, in one call (eval only).

        In decode mode, the query at position p reads every earlier token
        quantized and its own K/V in full precision.  Here the cache is
        dequantized once per chunk (the reference path does the same inside
        cached_attention), the chunk is attached twice, through a codec round
        trip and in full precision, and a mask lets query i see the round-trip
        keys of earlier chunk tokens and only its own full-precision one.
        """

        @classmethod
        def from_layer(cls, layer):
            new = cls.__new__(cls)
            new.__dict__.update(layer.__dict__)
            return new

        def attend(self, q, k, v, padding_mask, scale, softcap, sinks):
            if self.cache.max_seen == 0 or q.shape[2] == 1:
                return super().attend(q, k, v, padding_mask, scale, softcap, sinks)
            t, cache, dev = q.shape[2], self.cache, q.device
            k_past, v_past = cache.dequantize(torch.float32)          # before the chunk: nothing evicted yet
            past_pos = cache.slot_positions()                           # [B, N], -1 = empty
            k_hat, v_hat = (x.float() for x in cache.round_trip(k, v))  # the chunk as the cache will hold it
            q_pos = cache.seen.to(torch.int64)[:, None] + torch.arange(t, device=dev)[None]
            b = q.shape[0]
            earlier = torch.ones(t, t, dtype=torch.bool, device=dev).tril(-1)   # chunk keys before the query
            own = torch.eye(t, dtype=torch.bool, device=dev)                    # the query's own fresh K/V
            keep = torch.cat([torch.ones(b, t, past_pos.shape[1], dtype=torch.bool, device=dev),
                              earlier.expand(b, t, t), own.expand(b, t, t)], dim=2)[:, None]
            out = attention_reference(q, torch.cat([k_past, k_hat, k.float()], 2),
                                      torch.cat([v_past, v_hat, v.float()], 2),
                                      causal=True, sliding_window=self.sliding_window, mask=keep, scale=scale,
                                      softcap=softcap, sinks=sinks, q_positions=q_pos,
                                      k_positions=torch.cat([past_pos, q_pos, q_pos], 1))
            self.store(k, v)
            return out

    return DecodeEmulationLayer


class _Lazy:
    """DecodeEmulationLayer is built on first use so that importing this module needs no transformers."""

    def __getattr__(self, name):
        return getattr(_decode_emulation_class(), name)

    def __call__(self, *a, **k):
        return _decode_emulation_class()(*a, **k)


DecodeEmulationLayer = _Lazy()


# -- peers -----------------------------------------------------------------------------------
def peer_quantizer(peer: str, head_dim: int):
    """(quantize-dequantize function on [B, H, T, D], description) for a peer at its bit width.

    Each function quantizes every vector independently of the others (groups
    never span tokens), so quantizing a chunk equals quantizing token by token.
    """
    backend, bits = peer.rsplit("-", 1)
    bits = int(bits.removeprefix("int"))
    if backend == "quanto":
        from transformers.cache_utils import QuantoQuantizedLayer
        layer = QuantoQuantizedLayer(nbits=bits, q_group_size=64)  # HF's defaults: axis 0 = groups of 64 along D

        def fq(x):
            return layer._dequantize(layer._quantize(x.contiguous(), axis=0)).to(x.dtype)
        return fq, f"optimum-quanto int{bits}, groups of 64 along head_dim (transformers' QuantizedCache layout)"
    if backend == "hqq":
        from hqq.core.quantize import Quantizer

        def fq(x):
            # axis=1 groups 64 consecutive elements (one token's channels); axis=0, transformers'
            # default, groups strided elements across tokens and heads.
            q, meta = Quantizer.quantize(x.contiguous(), nbits=bits, axis=1, group_size=64,
                                         device=str(x.device), compute_dtype=torch.float32)
            return Quantizer.dequantize(q, meta).reshape(x.shape).to(x.dtype)
        return fq, f"HQQ {bits}-bit, axis=1, groups of 64 along head_dim"
    if backend == "turboquant":
        _patch_numpy_for_turboquant()
        from turboquant.core import TurboQuantMSE
        tq = TurboQuantMSE(dim=head_dim, bits=bits, device="cpu")

        def fq(x):
            flat = x.reshape(-1, head_dim).float().cpu()
            idx, norms = tq.quantize(flat)
            return tq.dequantize(idx, norms).reshape(x.shape).to(x.device, x.dtype)
        return fq, f"turboquant {bits}-bit (TurboQuantMSE: rotation + Beta codebook + norm)"
    raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")


def _patch_numpy_for_turboquant() -> None:
    # turboquant 0.2.0 calls np.trapz, which numpy 2 removed (renamed np.trapezoid); same function.
    import numpy as np
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid


def peer_strict_method(peer: str, head_dim: int, chunk: int = 256) -> Method:
    """A peer's quantizer with every token quantized once on arrival and read only quantized."""
    from transformers.cache_utils import DynamicLayer
    fq, desc = peer_quantizer(peer, head_dim)

    class FakeQuantLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return super().update(fq(key_states), fq(value_states))

    def make(model):
        # Plain full-length layers also for sliding-window models: the attention applies the window.
        n = model.config.get_text_config().num_hidden_layers
        return _cache_of([FakeQuantLayer() for _ in range(n)])
    return Method(f"{peer}-every-token", peer.rsplit("-", 1)[0], make, step=chunk,
                  info=dict(peer=peer, residual=0, bits=int(peer.rsplit("-", 1)[1].removeprefix("int")),
                            mode="strict", layout=desc))


def _cache_of(layers):
    from transformers.cache_utils import Cache
    return Cache(layers=layers)


def peer_default_method(peer: str, residual: int = 128) -> Method:
    """The peer's own cache class as users call it (residual recent tokens in full precision), token by token."""
    backend, bits = peer.rsplit("-", 1)
    bits = int(bits.removeprefix("int"))
    if backend == "turboquant":
        _patch_numpy_for_turboquant()
        from turboquant import TurboQuantCache as PeerCache
        from turboquant.cache import TurboQuantLayer as PeerLayer

        def make(model):
            cache = PeerCache(bits=bits)
            n = model.config.get_text_config().num_hidden_layers
            cache.layers = [PeerLayer(bits=bits, residual_len=residual) for _ in range(n)]
            return cache
    else:
        from transformers import QuantizedCache

        def make(model):
            return QuantizedCache(backend, model.config, nbits=bits, residual_length=residual)
    return Method(f"{peer}-r{residual}", backend, make, step=1,
                  info=dict(peer=peer, residual=residual, bits=bits, mode="default"))


def check_peer(peer: str) -> str | None:
    """None when the peer's package imports, else the reason it cannot run."""
    mod = {"quanto": "optimum.quanto", "hqq": "hqq.core.quantize", "turboquant": "turboquant"}[peer.rsplit("-", 1)[0]]
    try:
        __import__(mod)
    except Exception as e:  # an import error of any kind means the peer is not runnable here
        return f"{mod} not importable: {e}"
    return None


# -- scoring -------------------------------------------------------------------------------
class AttnRecorder:
    """Forward hooks that keep each layer's attention output for the positions being scored."""

    def __init__(self, model):
        self.modules = [m for n, m in model.named_modules() if n.endswith("self_attn")]
        self.active = False
        self.outputs: list[list[torch.Tensor]] = [[] for _ in self.modules]
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]

    def _hook(self, i):
        def hook(module, args, output):
            if self.active:
                self.outputs[i].append(output[0][0].detach().float())
        return hook

    def take(self) -> list[torch.Tensor]:
        out = [torch.cat(o) for o in self.outputs]
        self.outputs = [[] for _ in self.modules]
        return out

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def score_segment(model, tokens: torch.Tensor, prefill: int, method: Method, recorder: AttnRecorder):
    """Teacher-forced decode over tokens[prefill:]: NLL [S], argmax [S], attention outputs per layer."""
    cache = method.make_cache(model)
    ids = tokens[None].to(model.device)
    # Only decode positions are scored: skip the prefill's logits (Gemma's vocabulary is 262k wide).
    model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True, logits_to_keep=1)
    nll, top = [], []
    recorder.active = True
    end = ids.shape[1] - 1  # the last token is only a target
    for s in range(prefill, end, method.step):
        e = min(s + method.step, end)
        logits = model(input_ids=ids[:, s:e], past_key_values=cache, use_cache=True).logits[0].float()
        nll.append(torch.nn.functional.cross_entropy(logits, ids[0, s + 1:e + 1], reduction="none"))
        top.append(logits.argmax(-1))
    recorder.active = False
    return torch.cat(nll), torch.cat(top), recorder.take(), cache


def compare(ref: dict, got: dict) -> dict:
    """Metrics (A), (B), (C) of one method against the reference, over all segments."""
    d = got["nll"] - ref["nll"]
    n = d.numel()
    mean, se = d.mean().item(), d.std().item() / math.sqrt(n)
    cos = torch.cat([torch.nn.functional.cosine_similarity(a, b, dim=-1)
                     for a, b in zip(ref["attn"], got["attn"])])
    return {
        "ppl": math.exp(got["nll"].mean().item()),
        "ppl_change_pct": 100 * (math.exp(mean) - 1),
        "ppl_change_ci95_pct": [100 * (math.exp(mean - 2 * se) - 1), 100 * (math.exp(mean + 2 * se) - 1)],
        "argmax_disagree_pct": 100 * (got["top"] != ref["top"]).float().mean().item(),
        "attn_cos_mean": cos.mean().item(),
        "attn_cos_p1": torch.quantile(cos, 0.01).item(),
        "scored_tokens": n,
    }


def eval_tokens(tokenizer, segments: int, length: int) -> list[torch.Tensor]:
    """`segments` disjoint windows of `length` tokens, spread over the corpus."""
    text = corpus_text()
    ids = tokenizer(text[: len(text) // 2], return_tensors="pt", add_special_tokens=False).input_ids[0]
    stride = (ids.numel() - length) // max(segments, 1)
    out = []
    for i in range(segments):
        seg = ids[i * stride: i * stride + length]
        if tokenizer.bos_token_id is not None and "gemma" in type(tokenizer).__name__.lower():
            seg = torch.cat([torch.tensor([tokenizer.bos_token_id]), seg[:-1]])
        out.append(seg)
    return out


def run_method(model, segments, prefill, method, recorder) -> dict:
    nll, top, attn = [], [], None
    t0 = time.time()
    for seg in segments:
        n, t, a, cache = score_segment(model, seg, prefill, method, recorder)
        nll.append(n)
        top.append(t)
        attn = a if attn is None else [torch.cat([x, y]) for x, y in zip(attn, a)]
    nbytes = cache.nbytes_used() if hasattr(cache, "nbytes_used") else None
    return {"nll": torch.cat(nll), "top": torch.cat(top), "attn": attn, "seconds": time.time() - t0,
            "cache_bytes": nbytes}


# -- passkey -------------------------------------------------------------------------------
PASSKEY_ANSWER_TOKENS = 12


@torch.no_grad()
def passkey_trial(model, tokenizer, make_cache, length: int, seed: int) -> bool:
    """Hide a 5-digit key at a random depth of `length` tokens of corpus text; ask for it back.

    The context is one prefill chunk; the question is a second chunk, so it
    reads the context from the (compressed) cache; the answer is decoded
    greedily one token at a time.
    """
    g = torch.Generator().manual_seed(seed)
    key = str(int(torch.randint(10000, 100000, (1,), generator=g)))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\n\nWhat is the pass key? The pass key is"
    text = corpus_text()
    start = int(torch.randint(0, len(text) // 2, (1,), generator=g))
    filler = tokenizer(text[start:start + 8 * length], add_special_tokens=False).input_ids
    n_needle = len(tokenizer(needle, add_special_tokens=False).input_ids)
    filler = filler[: max(0, length - n_needle)]
    depth = int(torch.randint(0, len(filler) + 1, (1,), generator=g))
    context = (tokenizer.decode(filler[:depth]) + needle + tokenizer.decode(filler[depth:]))
    ctx_ids = tokenizer(context, return_tensors="pt").input_ids.to(model.device)
    q_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    cache = make_cache(model)
    # Only the question's last position is read: logits_to_keep=1 spares a [T, vocab] matrix (262k wide for Gemma).
    model(input_ids=ctx_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = model(input_ids=q_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    answer = []
    # 12 tokens: Gemma spends one token per digit and often starts with a word (" a 22286."), so 6
    # tokens cut the key short and scored the wording, not the retrieval (QUALITY.md, passkey).
    for _ in range(PASSKEY_ANSWER_TOKENS):
        tok = logits.argmax()
        answer.append(int(tok))
        logits = model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1]
    return key in tokenizer.decode(answer).replace(" ", "")


def passkey_hits(model, tokenizer, make_cache, lengths, trials) -> dict:
    """{length: [hit of trial t]}; trial t of length n uses seed 1000 n + t, so every cache sees the same prompts."""
    return {str(n): [passkey_trial(model, tokenizer, make_cache, n, 1000 * n + t) for t in range(trials)]
            for n in lengths}


# -- command -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    parser.add_argument("--presets", default=",".join(MAIN_PRESETS) + ",mixed",
                        help="comma list of kKvV presets; 'mixed' adds the <=4.25 bits/element candidates")
    parser.add_argument("--rules", default="corrected", help="comma list of scale rules (rms, corrected, lsq)")
    parser.add_argument("--modes", default="decode,strict", help="decode (library default) and/or strict")
    parser.add_argument("--key-fit", default="center",
                        help="comma list of key transforms: center (library default), balance, off "
                             "(see key_transform.py)")
    parser.add_argument("--peers", default="", help=f"every-token runs of peers: comma list from {PEERS}, or 'all'")
    parser.add_argument("--peer-defaults", default="",
                        help="peers to run also with their default 128 full-precision recent tokens (token by token)")
    parser.add_argument("--exact-decode", action="store_true",
                        help="step decode mode token by token instead of the (tested-equal) chunked emulation")
    parser.add_argument("--segments", type=int, default=2, help="corpus windows")
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens per window")
    parser.add_argument("--scored", type=int, default=256, help="decode positions scored per window")
    parser.add_argument("--passkey-lengths", default="", help="comma list of context lengths, e.g. 512,1024")
    parser.add_argument("--passkey-trials", type=int, default=5)
    parser.add_argument("--passkey-presets", default="", help="presets (rule corrected, decode mode) for passkey")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/quality_<model>.json)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--markdown", metavar="JSON", default=None,
                        help="print the QUALITY.md tables (and redraw the plot) of an existing results JSON, run nothing")


def _resolve_presets(spec: str, head_dim: int) -> list[str]:
    out = []
    for p in spec.split(","):
        p = p.strip()
        if p == "mixed":
            out += [c for c in MIXED_CANDIDATES.get(head_dim, ()) if c not in out]
        elif p:
            parse_preset(p)
            out.append(p)
    return out


def run_eval(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from ..models import load_model

    console = Console()
    if args.markdown:
        saved = json.loads(Path(args.markdown).read_text())
        print(markdown_tables(saved))
        if not args.no_plot:
            plot(saved, Path(args.markdown).with_suffix(".png"))
        return 0
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tok = load_model(args.model, dtype=dtype, device=device, attn_implementation="turboattn")
    text_cfg = model.config.get_text_config()
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    presets = _resolve_presets(args.presets, head_dim)
    rules = [r for r in args.rules.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    peers = list(PEERS) if args.peers == "all" else [p for p in args.peers.split(",") if p]
    peer_defaults = list(PEERS) if args.peer_defaults == "all" else [p for p in args.peer_defaults.split(",") if p]

    fits = [f for f in args.key_fit.split(",") if f]
    if not fits or any(f not in FIT_SUFFIX for f in fits):
        raise SystemExit(f"--key-fit takes a comma list of {tuple(FIT_SUFFIX)}, got {args.key_fit!r}")
    methods = [turbo_method(p, r, m, exact_decode=args.exact_decode, fit_keys=f)
               for p in presets for r in rules for m in modes for f in fits]
    skipped = {}
    for peer in dict.fromkeys(peers + peer_defaults):
        why = check_peer(peer)
        if why:
            skipped[peer] = why
            continue
        if peer in peers:
            methods.append(peer_strict_method(peer, head_dim))
        if peer in peer_defaults:
            methods.append(peer_default_method(peer))

    segments = eval_tokens(tok, args.segments, args.prefill + args.scored + 1)
    recorder = AttnRecorder(model)
    results, passkey_trials = {}, {}
    out = Path(args.out or f"benchmarks/quality_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def report(passkey=None):
        return {
            "model": args.model, "head_dim": head_dim, "device": device, "dtype": str(dtype),
            "corpus": CORPUS_INFO, "segments": args.segments, "prefill": args.prefill,
            "scored_per_segment": args.scored, "results": results, "passkey": passkey or {},
            "passkey_trials": args.passkey_trials, "passkey_hits": passkey_trials, "skipped": skipped,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        }

    with Progress(console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"{args.model}: reference", total=len(methods) + 1)
        ref = run_method(model, segments, args.prefill, reference_method(), recorder)
        results["reference"] = {"ppl": math.exp(ref["nll"].mean().item()), "seconds": ref["seconds"]}
        progress.advance(task)
        for i, m in enumerate(methods):
            progress.update(task, description=f"{args.model}: {m.name}")
            try:
                got = run_method(model, segments, args.prefill, m, recorder)
            except Exception as e:  # a peer failing at run time is reported, not fatal
                if m.family == "turboattn":
                    raise
                skipped[m.name] = f"{type(e).__name__}: {e}"
                progress.advance(task)
                continue
            row = compare(ref, got) | m.info | {"family": m.family, "seconds": got["seconds"],
                                                 "cache_bytes": got["cache_bytes"]}
            if m.family == "turboattn":
                row["bits_per_element"] = bits_per_element(m.info["preset"], head_dim)
            results[m.name] = row
            progress.advance(task)
            if not console.is_terminal:  # logs: one line per method
                console.print(f"[{i + 1}/{len(methods)}] {m.name}: ppl {row['ppl_change_pct']:+.2f}% "
                              f"argmax {row['argmax_disagree_pct']:.2f}% cos {row['attn_cos_mean']:.5f} "
                              f"({row['seconds']:.0f} s)")
            out.write_text(json.dumps(report(), indent=1))
    recorder.close()

    passkey = {}
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x]
    if lengths:
        from transformers import DynamicCache
        pk_methods = {"reference": lambda m: DynamicCache(config=m.config)}
        for p in [p for p in args.passkey_presets.split(",") if p]:
            for fit in fits:
                pk_methods[p + FIT_SUFFIX[fit]] = turbo_method(p, "corrected", "decode", exact_decode=True,
                                                                         fit_keys=fit).make_cache
        for name, make in pk_methods.items():
            console.print(f"passkey {name} ...")
            hits = passkey_hits(model, tok, make, lengths, args.passkey_trials)
            passkey_trials[name] = hits
            passkey[name] = {n: sum(h) / len(h) for n, h in hits.items()}
            out.write_text(json.dumps(report(passkey), indent=1))

    final = report(passkey)
    out.write_text(json.dumps(final, indent=1))
    print_table(final, console)
    if passkey:
        print_passkey(final, console)
    if not args.no_plot:
        plot(final, out.with_suffix(".png"))
    console.print(f"wrote {out}")
    return 0


def print_table(report: dict, console) -> None:
    from rich.table import Table
    ref = report["results"]["reference"]
    t = Table(title=f"{report['model']}: {report['segments']}x{report['scored_per_segment']} scored tokens, "
                    f"reference ppl {ref['ppl']:.3f} ({report['corpus']['name']})")
    for col in ("method", "bits/el", "ppl change %", "95% interval", "argmax diff %", "cos mean", "cos p1"):
        t.add_column(col, justify="right")
    for name, r in report["results"].items():
        if name == "reference":
            continue
        lo, hi = r["ppl_change_ci95_pct"]
        bpe = f"{r['bits_per_element']:.3f}" if "bits_per_element" in r else ""
        t.add_row(name, bpe, f"{r['ppl_change_pct']:+.2f}", f"[{lo:+.2f}, {hi:+.2f}]",
                  f"{r['argmax_disagree_pct']:.2f}", f"{r['attn_cos_mean']:.5f}", f"{r['attn_cos_p1']:.4f}")
    console.print(t)


def print_passkey(report: dict, console) -> None:
    from rich.table import Table
    pk = report["passkey"]
    lengths = list(next(iter(pk.values())))
    t = Table(title=f"{report['model']}: passkey accuracy ({report['passkey_trials']} trials per length)")
    t.add_column("cache")
    for n in lengths:
        t.add_column(f"{n} tok", justify="right")
    for name, acc in pk.items():
        t.add_row(name, *[f"{acc[n]:.2f}" for n in lengths])
    console.print(t)


def plot(report: dict, path: Path) -> None:
    """Perplexity change (with its 95% interval) against bits per element, per mode and rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = {}
    for name, r in report["results"].items():
        if r.get("family") == "turboattn":
            fit = {True: "balance", False: "off"}.get(r.get("fit_keys", "balance"), r.get("fit_keys"))
            fit = "" if fit == "balance" else f" key fit {fit}"
            groups.setdefault(f"turboattn {r['mode']} {r['rule']}{fit}", []).append(r)
    for label, rows in sorted(groups.items()):
        rows.sort(key=lambda r: r["bits_per_element"])
        x = [r["bits_per_element"] for r in rows]
        y = [max(r["ppl_change_pct"], 1e-3) for r in rows]
        ax.plot(x, y, marker="o", label=label)
    for name, r in report["results"].items():
        if r.get("family") not in (None, "turboattn", "reference"):
            ax.scatter([r["bits"]], [max(r["ppl_change_pct"], 1e-3)], marker="x", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("bits per element (scales counted for turboattn)")
    ax.set_ylabel("perplexity change vs reference cache (%)")
    ax.set_title(f"{report['model']}: {report['segments']}x{report['scored_per_segment']} scored tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def quick_check(model, tokenizer, preset: str = "k4v4", rule: str = "corrected", mode: str = "decode",
                segments: int = 1, prefill: int = 128, scored: int = 128) -> dict:
    """Metrics of one preset against the reference on a small slice of the corpus (CI, demo)."""
    segs = eval_tokens(tokenizer, segments, prefill + scored + 1)
    recorder = AttnRecorder(model)
    try:
        ref = run_method(model, segs, prefill, reference_method(), recorder)
        got = run_method(model, segs, prefill, turbo_method(preset, rule, mode), recorder)
    finally:
        recorder.close()
    return compare(ref, got) | {"reference_ppl": math.exp(ref["nll"].mean().item())}


def markdown_tables(report: dict) -> str:
    """QUALITY.md tables from a results JSON: presets x rules (both modes), then the peers."""
    res, hd = report["results"], report["head_dim"]
    lines = [f"Reference perplexity {res['reference']['ppl']:.3f}; {report['segments']} x "
             f"{report['scored_per_segment']} scored tokens; 95% intervals in brackets.", "",
             "| preset | bits/el | rule | key fit | decode: ppl change | strict: ppl change | argmax diff (decode) "
             "| attn cos mean / p1 (decode) |", "|---|---|---|---|---|---|---|---|"]

    def pct(r):
        lo, hi = r["ppl_change_ci95_pct"]
        return f"{r['ppl_change_pct']:+.2f}% [{lo:+.1f}, {hi:+.1f}]"
    presets = dict.fromkeys(r["preset"] for r in res.values() if r.get("family") == "turboattn")
    for p in presets:
        for rule in RULES:
            for fit, suffix in FIT_SUFFIX.items():
                d, s = res.get(f"{p}-{rule}-decode{suffix}"), res.get(f"{p}-{rule}-strict{suffix}")
                if d is None and s is None:
                    continue
                any_row = d or s
                lines.append(f"| {p} | {bits_per_element(p, hd):.3f} | {rule} | {fit} | "
                             f"{pct(d) if d else ''} | {pct(s) if s else ''} | {any_row['argmax_disagree_pct']:.1f}% | "
                             f"{any_row['attn_cos_mean']:.4f} / {any_row['attn_cos_p1']:.3f} |")
    peers = {k: r for k, r in res.items() if r.get("family") not in (None, "turboattn")}
    if peers:
        lines += ["", "| peer | bits | residual | ppl change | argmax diff | attn cos mean / p1 |", "|---|---|---|---|---|---|"]
        for k, r in peers.items():
            lines.append(f"| {k} | {r['bits']} | {r['residual']} | {pct(r)} | {r['argmax_disagree_pct']:.1f}% | "
                         f"{r['attn_cos_mean']:.4f} / {r['attn_cos_p1']:.3f} |")
    if report.get("passkey"):
        pk = report["passkey"]
        lengths = list(next(iter(pk.values())))
        lines += ["", "| cache | " + " | ".join(f"passkey @{n}" for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for name, acc in pk.items():
            lines.append(f"| {name} | " + " | ".join(f"{acc[n]:.2f}" for n in lengths) + " |")
    if report.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in report["skipped"].items())]
    return "\n".join(lines)
