"""Tensor parallelism through transformers with TurboQuantCache: a check to run on several devices.

    torchrun --nproc-per-node 2 -m turboattn.cli.tp

One GPU per rank (NCCL) when CUDA is available, else the CPU (gloo), as transformers chooses its TP device;
`CUDA_VISIBLE_DEVICES= torchrun ...` runs it on the CPU of a GPU machine.

Rank 0 builds a small random-weight Llama and saves it (save_pretrained) to a temporary folder; every
rank loads it with `tp_plan="auto"` (transformers shards q/k/v by heads, so each rank's attention layers
see Hkv / world KV heads; TurboQuantLayer.lazy_initialization takes its head count from the first K/V it
is given, so each rank's cache is built for its own heads) and runs greedy generate with TurboQuantCache
(k8v8) and with transformers' DynamicCache.  Rank 0 also runs the unsharded model on one device.  The
check fails (exit status 1) unless, for both caches:

- the greedy tokens equal the single-device run's, up to a near-tie: wherever both runs have seen the
  same tokens their logits agree within LOGIT_TOL, so they can part only at a step whose top-2 logit gap is
  below 2 LOGIT_TOL (after which nothing more is compared);

and, for TurboQuantCache:

- every rank's layers hold Hkv / world KV heads, and the cache bytes per rank are the single-device
  cache's divided by world (the same capacity, per-head storage only);
- the keys stored on the ranks, gathered in rank order, are the single-device cache's keys (first layer,
  dequantized: equal up to the codes of the few coordinates that TP's float rounding moves across a cell
  boundary).

The model is float32, so the only difference between the runs is the order of the float sums that TP
splits across ranks (and, on GPUs, the kernels' fp16 operands fed with those sums).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import torch

# Logits agree within this wherever the TP and single-device runs have seen the same tokens (absolute).  The
# random model is sensitive: k8v8 quantization itself moves its logits (std ~2.3) by up to ~0.4 against
# DynamicCache, and a key stored under the wrong head or rank moves them by more.  What TP changes is the order
# of float32 sums (DynamicCache: ~2e-5), which moves a few 8-bit codes by one cell (TurboQuantCache: 6.6e-3 on
# the CPU); on GPUs turboattn's kernels also round q and softmax weights to fp16 (2^-11) in both runs.
LOGIT_TOL = 0.1
# Dequantized first-layer keys: relative error of the ranks' gathered keys against the single-device cache's.
KEY_REL_TOL = 1e-2


@dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 1024
    vocab: int = 512


def build_model(path: str, shape: ModelShape = ModelShape(), seed: int = 0) -> None:
    """A random-weight Llama saved to `path` (float32).  Weights are drawn with std 0.1, not the usual 0.02:
    the logits then spread (std ~1.5) and few greedy steps are near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=1024,
                      initializer_range=0.1, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)


def prompt_ids(batch: int, length: int, vocab: int, device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


@dataclass
class Run:
    tokens: torch.Tensor      # [B, new] generated tokens (CPU)
    logits: torch.Tensor      # [new, B, vocab] the logits each was chosen from (CPU, float32)


def greedy(model, ids: torch.Tensor, cache, new_tokens: int) -> Run:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return Run(out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu())


def compare_greedy(got: Run, want: Run, tol: float = LOGIT_TOL) -> tuple[bool, str]:
    """Whether `got` chose `want`'s tokens up to a near-tie (module docstring), and a one-line summary.

    Per sequence: at every step where both runs had the same prefix (up to and including the first step
    where they chose differently) the logits must agree within `tol`; a different choice is then a near-tie
    (the top-2 gap of `want` is below 2 tol), and the steps after it are not compared."""
    problems, parted, worst = [], [], 0.0
    for b in range(want.tokens.shape[0]):
        differ = (got.tokens[b] != want.tokens[b]).nonzero()
        last = int(differ[0]) if len(differ) else want.tokens.shape[1] - 1   # last step with a shared prefix
        err = float((got.logits[:last + 1, b] - want.logits[:last + 1, b]).abs().max())
        worst = max(worst, err)
        if err > tol:
            problems.append(f"sequence {b}: logits differ by {err:.3g} > {tol:g} before the tokens part")
        if len(differ):
            top2 = want.logits[last, b].topk(2).values
            gap = float(top2[0] - top2[1])
            parted.append(f"sequence {b} parts at step {last} (top-2 gap {gap:.3g})")
            if gap >= 2 * tol:
                problems.append(f"sequence {b}: token {last} differs where the top-2 gap is {gap:.3g} >= {2 * tol:g}")
    summary = f"max logit difference {worst:.3g}" + ("; " + "; ".join(parted) if parted else "; tokens equal")
    return not problems, "; ".join(problems) if problems else summary


def gathered_keys_error(local_keys: torch.Tensor, full_keys: torch.Tensor | None, world: int) -> float | None:
    """Relative error of the ranks' keys [B, Hkv / world, N, D] concatenated in rank order against the
    single-device keys [B, Hkv, N, D] (rank 0 only; None elsewhere)."""
    import torch.distributed as dist

    parts = [torch.empty_like(local_keys) for _ in range(world)] if world > 1 else [local_keys]
    if world > 1:
        dist.all_gather(parts, local_keys.contiguous())
    if full_keys is None:
        return None
    joined = torch.cat([p.double().cpu() for p in parts], dim=1)
    full = full_keys.double().cpu()
    if joined.shape != full.shape:
        return float("inf")
    return float((joined - full).norm() / full.norm())


def layer_keys(cache, layer: int = 0) -> torch.Tensor:
    """A TurboQuantCache layer's held keys, dequantized (float32, model domain) [B, Hkv, N, D]."""
    c = cache.layers[layer].cache
    k, _ = c.dequantize(torch.float32)
    return k[:, :, :c.max_seen]


def load_tensor_parallel(path: str, **kwargs):
    """from_pretrained(path, tp_plan="auto"): through DistributedConfig where transformers has it (passing
    tp_plan directly is deprecated there), else the tp_plan argument."""
    import transformers

    config = getattr(transformers, "DistributedConfig", None)
    if config is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=config(tp_plan="auto"),
                                                                 **kwargs)
    return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node 2 -m turboattn.cli.tp",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2, help="sequences per generate call (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=48, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated (default: %(default)s)")
    p.add_argument("--layers", type=int, default=ModelShape.layers,
                   help="decoder layers of the random Llama (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("batch", "prompt", "new_tokens", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    import torch.distributed as dist
    import transformers

    import turboattn.hf  # noqa: F401  (registers attn_implementation="turboattn")
    from turboattn.hf import TurboQuantCache

    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc-per-node 2 -m turboattn.cli.tp", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    shape = ModelShape(layers=args.layers)
    if shape.kv_heads % world:
        print(f"{shape.kv_heads} KV heads do not split over {world} ranks", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        if torch.cuda.device_count() < world:
            print(f"{world} ranks need {world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    folder = [tempfile.mkdtemp(prefix="turboattn-tp-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    path = folder[0]
    ok = True
    try:
        if rank == 0:
            build_model(path, shape)
        dist.barrier()
        load = dict(attn_implementation="turboattn", dtype=torch.float32)
        tp = load_tensor_parallel(path, **load).eval()
        ids = prompt_ids(args.batch, args.prompt, shape.vocab, device)
        with torch.no_grad():
            tp_cache = TurboQuantCache(tp.config, 8, 8)
            tp_turbo = greedy(tp, ids, tp_cache, args.new_tokens)
            tp_plain = greedy(tp, ids, transformers.DynamicCache(config=tp.config), args.new_tokens)
        heads = sorted({layer.cache.num_kv_heads for layer in tp_cache.layers})
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (tp_cache.nbytes, heads))

        single_keys = None
        if rank == 0:
            single = transformers.AutoModelForCausalLM.from_pretrained(path, **load).to(device).eval()
            with torch.no_grad():
                single_cache = TurboQuantCache(single.config, 8, 8)
                one_turbo = greedy(single, ids, single_cache, args.new_tokens)
                one_plain = greedy(single, ids, transformers.DynamicCache(config=single.config), args.new_tokens)
            single_keys = layer_keys(single_cache)
        key_err = gathered_keys_error(layer_keys(tp_cache), single_keys, world)

        if rank == 0:
            lines, ok = [f"tensor parallel over {world} ranks ({device.type}), Llama {shape}"], True
            for name, got, want in (("TurboQuantCache k8v8", tp_turbo, one_turbo),
                                    ("DynamicCache", tp_plain, one_plain)):
                same, msg = compare_greedy(got, want)
                ok &= same
                lines.append(f"{name}: {'ok' if same else 'MISMATCH'}: {msg}")
            single_bytes = single_cache.nbytes
            for r, (nbytes, h) in enumerate(per_rank):
                good = h == [shape.kv_heads // world] and nbytes * world == single_bytes
                ok &= good
                lines.append(f"rank {r}: KV heads per layer {h}, cache {nbytes} bytes "
                             f"({nbytes / single_bytes:.3f} of the single-device {single_bytes}) "
                             f"{'ok' if good else 'MISMATCH'}")
            good = key_err <= KEY_REL_TOL
            ok &= good
            lines.append(f"layer-0 keys gathered from the ranks vs single device: relative error {key_err:.2e} "
                         f"{'ok' if good else 'MISMATCH'}")
            lines.append("PASS" if ok else "FAIL")
            print("\n".join(lines), flush=True)
        verdict = [ok]
        dist.broadcast_object_list(verdict, src=0)
        ok = bool(verdict[0])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
