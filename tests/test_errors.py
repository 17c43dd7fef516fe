"""Bad input raises a clear ValueError / TypeError, naming the argument, before any work.

`no_work` replaces the functions that do the work (the rotation, the codec's
coding, and every op implementation behind the torch ops) with ones that fail the test,
so an error that surfaces only after work started is caught.  A device
mismatch is faked on a CPU-only machine with the 'meta' device.
"""

from __future__ import annotations

import pytest
import torch

import turboattn as ta
from turboattn.format import codec as codec_mod, rotation
from turboattn.ops import backend


def _forbidden(*args, **kwargs):
    raise AssertionError("work started before the input was validated")


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(rotation, "walsh_hadamard", _forbidden)
    monkeypatch.setattr(codec_mod.KVCodec, "quantize_rotated", _forbidden)
    monkeypatch.setattr(codec_mod.KVCodec, "dequantize_rotated", _forbidden)
    monkeypatch.setattr(backend, "load", _forbidden)  # every op implementation, PyTorch or kernel


@pytest.fixture
def cache():
    c = ta.QuantizedKVCache(ta.KVCodec(64, 4, 4), batch_size=2, num_kv_heads=2, capacity=8)
    g = torch.Generator().manual_seed(0)
    c.append(torch.randn(2, 2, 3, 64, generator=g), torch.randn(2, 2, 3, 64, generator=g))
    return c


def raises(exc, match):
    return pytest.raises(exc, match=match)


def test_no_work_fixture_catches_work(cache, no_work, monkeypatch):
    """The guard itself: valid calls do reach the forbidden work."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(2, 2, 1, 64)
    for call in (lambda: ta.KVCodec(64).quantize(x), lambda: cache.append(x, x),
                 lambda: ta.cached_attention(torch.zeros(2, 4, 1, 64), cache),
                 lambda: ta.flash_attention(x, x, x, backend="torch"),
                 lambda: ta.flash_attention(x, x, x, backend="triton")):
        with pytest.raises(AssertionError, match="work started"):
            call()


# -- KVCodec ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [16, 24, 100, 520, 1024, 128.0, "128", None])
def test_codec_rejects_head_dim(head_dim):
    with raises(ValueError, rf"head_dim must be a multiple of 16 from 32 to 512, got {head_dim!r}"):
        ta.KVCodec(head_dim)


@pytest.mark.parametrize("field", ["k_bits", "v_bits"])
@pytest.mark.parametrize("bits", [1, 7, 9, 0, 4.0, True, "4"])
def test_codec_rejects_bits(field, bits):
    with raises(ValueError, rf"{field} must be one of \(2, 3, 4, 5, 6, 8\), got {bits!r}"):
        ta.KVCodec(128, **{field: bits})


def test_codec_rejects_scale_rule():
    with raises(ValueError, "scale_rule must be one of"):
        ta.KVCodec(128, scale_rule="max")


def test_quantize_rejects_bad_input(no_work):
    codec = ta.KVCodec(128)
    with raises(TypeError, "torch.Tensor"):
        codec.quantize([0.0] * 128)
    with raises(TypeError, "dtype"):
        codec.quantize(torch.zeros(2, 128, dtype=torch.int32))
    with raises(ValueError, r"head_dim=128, got shape \(2, 64\)"):
        codec.quantize(torch.zeros(2, 64))
    with raises(ValueError, "kind must be 'k' or 'v'"):
        codec.quantize(torch.zeros(2, 128), kind="q")


def test_dequantize_rejects_mismatched_packed(no_work):
    codec = ta.KVCodec(128, 4, 2)
    good = ta.Packed(torch.zeros(3, 64, dtype=torch.uint8), torch.zeros(3, 1))
    with raises(ValueError, r"codes must be uint8 \[\.\.\., 32\] for v_bits=2"):
        codec.dequantize(good, "v")  # packed with k's width
    with raises(ValueError, "codes must be uint8"):
        codec.dequantize(ta.Packed(torch.zeros(3, 64, dtype=torch.int32), torch.zeros(3, 1)), "k")
    with raises(ValueError, r"scales must have shape \(3, 1\)"):
        codec.dequantize(ta.Packed(good.codes, torch.zeros(3, 2)), "k")


# -- QuantizedKVCache ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=0), "batch_size must be a positive int"),
    (dict(num_kv_heads=2.0), "num_kv_heads must be a positive int"),
    (dict(capacity=0), "capacity must be a positive int"),
    (dict(capacity=None), "capacity must be a positive int"),
    (dict(sliding_window=0, capacity=None), "sliding_window must be a positive int"),
    (dict(sliding_window=4, capacity=8), "holds exactly sliding_window=4"),
])
def test_cache_rejects_bad_construction(kwargs, match):
    args = dict(batch_size=1, num_kv_heads=1, capacity=8) | kwargs
    with raises(ValueError, match):
        ta.QuantizedKVCache(ta.KVCodec(64), **args)


def test_cache_rejects_a_non_codec():
    with raises(TypeError, "codec must be a turboattn.KVCodec"):
        ta.QuantizedKVCache("k4v4", batch_size=1, num_kv_heads=1, capacity=8)


def _state(cache):
    return [t.clone() for t in (cache.k_codes, cache.v_codes, cache.k_scales, cache.v_scales, cache.seen)]


@pytest.mark.parametrize("make,exc,match", [
    (lambda: (torch.zeros(2, 2, 1, 64, dtype=torch.int8),) * 2, TypeError, "k dtype must be one of"),
    # The attention functions take float16, bfloat16 and float32; so does append (the kernels' dtypes).
    (lambda: (torch.zeros(2, 2, 1, 64, dtype=torch.float64),) * 2, TypeError,
     "k dtype must be one of float16, bfloat16, float32, got float64"),
    (lambda: (torch.zeros(2, 2, 1, 64), torch.zeros(2, 2, 1, 64, dtype=torch.float64)), TypeError,
     "v dtype must be one of float16, bfloat16, float32, got float64"),
    (lambda: (torch.zeros(2, 2, 1, 64), torch.zeros(2, 2, 1, 64, dtype=torch.float16)), TypeError, "v dtype .* differs from k dtype"),
    (lambda: (torch.zeros(2, 2, 1, 64, device="meta"),) * 2, ValueError, "k is on meta but the cache is on cpu"),
    (lambda: (torch.zeros(2, 2, 1, 64), torch.zeros(2, 2, 1, 64, device="meta")), ValueError, "v is on meta"),
    (lambda: (torch.zeros(3, 2, 1, 64),) * 2, ValueError, r"k must be \[B=2, Hkv=2, T>=1, D=64\], got \(3, 2, 1, 64\)"),
    (lambda: (torch.zeros(2, 4, 1, 64),) * 2, ValueError, "Hkv=2"),
    (lambda: (torch.zeros(2, 2, 1, 128),) * 2, ValueError, "D=64"),
    (lambda: (torch.zeros(2, 2, 0, 64),) * 2, ValueError, "T>=1"),
    (lambda: (torch.zeros(2, 2, 64),) * 2, ValueError, r"got \(2, 2, 64\)"),
    (lambda: (torch.zeros(2, 2, 2, 64), torch.zeros(2, 2, 1, 64)), ValueError, "v shape .* differs from k shape"),
    (lambda: (torch.zeros(2, 2, 6, 64),) * 2, ValueError, "would overflow the cache: .* 9 tokens, capacity is 8"),
])
def test_append_rejects_bad_input_and_changes_nothing(cache, no_work, make, exc, match):
    before = _state(cache)
    with raises(exc, match):
        cache.append(*make())
    assert all(torch.equal(a, b) for a, b in zip(before, _state(cache)))


@pytest.mark.parametrize("new_lengths", [[1], [1, 2, 3], [-1, 1], [1, 3], torch.tensor([0, 4])])
def test_append_rejects_bad_new_lengths(cache, no_work, new_lengths):
    with raises(ValueError, r"new_lengths must hold 2 ints in \[0, 2\]"):
        cache.append(torch.zeros(2, 2, 2, 64), torch.zeros(2, 2, 2, 64), new_lengths=new_lengths)


def test_overflow_counts_only_real_tokens(cache):
    k = torch.zeros(2, 2, 6, 64)
    cache.append(k, k, new_lengths=[5, 0])  # 3 + 5 = 8 fits
    with raises(ValueError, "overflow"):
        cache.append(k[:, :, :1], k[:, :, :1], new_lengths=[1, 0])
    ring = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=1, num_kv_heads=1, sliding_window=2)
    ring.append(torch.zeros(1, 1, 9, 64), torch.zeros(1, 1, 9, 64))  # a ring never overflows


def test_left_padding_rejects_bad_counts(cache):
    with raises(ValueError, "num_padding must hold 2 non-negative ints"):
        cache.set_left_padding([1])
    with raises(ValueError, "num_padding"):
        cache.set_left_padding([1, -2])


# -- backends ---------------------------------------------------------------------------------------

def test_bad_backend_everywhere(cache, no_work):
    q = torch.zeros(2, 4, 1, 64)
    k = torch.zeros(2, 2, 1, 64)
    with raises(ValueError, r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"):
        cache.append(k, k, backend="cuda")
    with raises(ValueError, "backend must be one of"):
        ta.cached_attention(q, cache, backend="gpu")
    with raises(ValueError, "backend must be one of"):
        ta.flash_attention(q, k, k, backend=None)


def test_triton_on_cpu_needs_the_interpreter(cache, no_work, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.zeros(2, 4, 1, 64)
    k = torch.zeros(2, 2, 1, 64)
    before = _state(cache)
    with raises(ValueError, "backend='triton' on CPU tensors needs TRITON_INTERPRET=1"):
        cache.append(k, k, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(before, _state(cache)))
    with raises(ValueError, "TRITON_INTERPRET=1"):
        ta.cached_attention(q, cache, backend="triton")
    with raises(ValueError, "TRITON_INTERPRET=1"):
        ta.flash_attention(q, k, k, backend="triton")


# -- cached_attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("make,exc,match", [
    (lambda c: dict(q="q", cache=c), TypeError, "q must be a torch.Tensor"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache="cache"), TypeError, "cache must be a turboattn.QuantizedKVCache"),
    (lambda c: dict(q=torch.zeros(2, 4, 64), cache=c), ValueError, "q must have 4 dims"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64, dtype=torch.float64), cache=c), TypeError,
     "q dtype must be one of float16, bfloat16, float32, got float64"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, k=torch.zeros(2, 2, 1, 64, dtype=torch.float64),
                    v=torch.zeros(2, 2, 1, 64, dtype=torch.float64)), TypeError, "k dtype must be one of float16, "
     "bfloat16, float32, got float64"),
    (lambda c: dict(q=torch.zeros(3, 4, 1, 64), cache=c), ValueError, r"q must be \[B=2, Hq, Tq>=1, D=64\]"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 128), cache=c), ValueError, "D=64"),
    (lambda c: dict(q=torch.zeros(2, 4, 0, 64), cache=c), ValueError, "Tq>=1"),
    (lambda c: dict(q=torch.zeros(2, 3, 1, 64), cache=c), ValueError, r"query heads \(3\) must be a multiple of the cache's KV heads \(2\)"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64, device="meta"), cache=c), ValueError, "q is on meta but the cache is on cpu"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, k=torch.zeros(2, 2, 1, 64)), ValueError, "pass both fresh k and v"),
    (lambda c: dict(q=torch.zeros(2, 4, 2, 64), cache=c, k=torch.zeros(2, 2, 1, 64), v=torch.zeros(2, 2, 1, 64)), ValueError, "Tq=2"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, k=torch.zeros(2, 1, 1, 64), v=torch.zeros(2, 1, 1, 64)), ValueError, "Hkv=2"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, k=torch.zeros(2, 2, 1, 64), v=torch.zeros(2, 2, 2, 64)), ValueError, "v shape"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, k=torch.zeros(2, 2, 1, 64, dtype=torch.float16), v=torch.zeros(2, 2, 1, 64, dtype=torch.float16)), TypeError, "fresh k/v dtype torch.float16 differs from q dtype torch.float32"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, k=torch.zeros(2, 2, 1, 64, device="meta"), v=torch.zeros(2, 2, 1, 64, device="meta")), ValueError, "k is on meta"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, scale=-1.0), ValueError, "scale must be a positive finite float"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, softcap=0.0), ValueError, "softcap must be a positive finite float"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, sinks=torch.zeros(2)), ValueError, r"sinks must have shape \[4\]"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, sinks=torch.zeros(4, device="meta")), ValueError, "sinks is on meta"),
    (lambda c: dict(q=torch.zeros(2, 4, 1, 64), cache=c, num_splits=0), ValueError, "num_splits must be a positive int"),
])
def test_cached_attention_rejects_bad_input(cache, no_work, make, exc, match):
    with raises(exc, match):
        ta.cached_attention(**make(cache))


def test_cached_attention_on_a_meta_cache(no_work):
    meta = ta.QuantizedKVCache(ta.KVCodec(64), batch_size=1, num_kv_heads=1, capacity=4, device="meta")
    with raises(ValueError, "q is on cpu but the cache is on meta"):
        ta.cached_attention(torch.zeros(1, 1, 1, 64), meta)
    with raises(ValueError, "k is on cpu but the cache is on meta"):
        meta.append(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64))


# -- flash_attention --------------------------------------------------------------------------------

Q = (1, 4, 3, 64)
KV = (1, 2, 5, 64)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: dict(q=torch.zeros(Q), k="k", v=torch.zeros(KV)), TypeError, "k must be a torch.Tensor"),
    (lambda: dict(q=torch.zeros(1, 4, 64), k=torch.zeros(KV), v=torch.zeros(KV)), ValueError, "q must have 4 dims"),
    (lambda: dict(q=torch.zeros(Q, dtype=torch.int32), k=torch.zeros(KV), v=torch.zeros(KV)), TypeError, "q dtype"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(1, 2, 4, 64)), ValueError, "k and v must be"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(2, 2, 5, 64), v=torch.zeros(2, 2, 5, 64)), ValueError, r"\[B=1, Hkv, Lk, D=64\]"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(1, 2, 5, 32), v=torch.zeros(1, 2, 5, 32)), ValueError, "D=64"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(1, 3, 5, 64), v=torch.zeros(1, 3, 5, 64)), ValueError, r"query heads \(4\) must be a multiple of KV heads \(3\)"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV, dtype=torch.float16), v=torch.zeros(KV, dtype=torch.float16)), TypeError, "must share a dtype"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV, device="meta"), v=torch.zeros(KV, device="meta")), ValueError, "must be on one device"),
    (lambda: dict(q=torch.zeros(1, 4, 0, 64), k=torch.zeros(KV), v=torch.zeros(KV)), ValueError, "at least one token"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(KV), sliding_window=0), ValueError, "sliding_window must be a positive int"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(KV), mask=[[True]]), TypeError, "mask must be a torch.Tensor"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(KV), mask=torch.ones(3, 4, dtype=torch.bool)), ValueError, r"mask shape \(3, 4\) does not broadcast to \(1, 4, 3, 5\)"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(KV), mask=torch.ones(3, 5, dtype=torch.bool, device="meta")), ValueError, "mask is on meta but q is on cpu"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(KV), alibi_slopes=torch.zeros(2)), ValueError, r"alibi_slopes must have shape \[4\]"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(KV), softcap=float("inf")), ValueError, "softcap"),
    (lambda: dict(q=torch.zeros(Q), k=torch.zeros(KV), v=torch.zeros(KV), scale=float("nan")), ValueError, "scale"),
])
def test_flash_attention_rejects_bad_input(no_work, make, exc, match):
    with raises(exc, match):
        ta.flash_attention(**make())


def test_codebook_and_rotation_errors():
    from turboattn.format import codebook
    with raises(ValueError, r"bits must be an int in \[1, 8\], got 9"):
        codebook.boundaries(9)
    with raises(ValueError, "head_dim must be a multiple of 16 from 32 to 512, got 40"):
        rotation.rotation_matrix(40)
