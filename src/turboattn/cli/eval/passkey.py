"""Passkey retrieval: a key hidden in corpus text, asked for after the context was read from the cache."""

from __future__ import annotations

import torch

from ..corpus import corpus_text

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
