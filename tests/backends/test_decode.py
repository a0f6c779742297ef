"""The decode backend (a C++ kernel, one pass over a key/value cache) against the float64 oracle, and
when "auto" takes it."""

from __future__ import annotations

import pytest
import torch

from attnkit import KVCache, MultiHeadAttention, attention, force
from attnkit.backends import BACKENDS, choose_backend, decode
from attnkit.call import call_of
from attnkit.kernels.loader import Kernel
from attnkit.masks import Masks
from helpers.oracle import naive_attention

pytestmark = pytest.mark.skipif(
    not decode.KERNEL.usable()[0], reason=f"decode kernel unavailable: {decode.KERNEL.usable()[1]}"
)

# (b, h, h_kv, t, s, d): head dims the kernel specialises (64, 128) and others (40, 59), lengths
# that do not divide its blocks of 64 keys, GQA/MQA groups, a few queries.
SHAPES = {
    "mha d=64": (2, 4, 4, 1, 200, 64),
    "gqa d=128": (1, 6, 2, 1, 129, 128),
    "mqa d=59, t=2": (2, 8, 1, 2, 77, 59),
    "t=3 d=40": (1, 2, 2, 3, 65, 40),
    "one key": (1, 2, 1, 1, 1, 8),
}


def inputs(shape, dtype=torch.float32, masked=False):
    b, h, h_kv, t, s, d = shape
    q, k, v = (torch.randn(b, n, m, d, dtype=dtype) for n, m in ((h, t), (h_kv, s), (h_kv, s)))
    key_mask = None
    if masked:
        key_mask = torch.rand(b, s) > 0.4
        key_mask[0, -1] = True
        if b > 1:
            key_mask[-1] = False  # a batch row of padding only: zeros out
    return q, k, v, key_mask


@pytest.fixture(params=[1024, 16], ids=["splits as in use", "many splits"])
def split_size(request):
    with force.splits(request.param):
        yield request.param


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("masked", [False, True])
def test_float32_matches_the_float64_oracle(shape, masked, split_size):
    q, k, v, key_mask = inputs(shape, masked=masked)
    out = attention(q, k, v, key_mask=key_mask, backend="decode")
    expected, _, _ = naive_attention(q.double(), k.double(), v.double(), key_mask=key_mask)
    torch.testing.assert_close(out, expected.float())
    if masked and shape[0] > 1:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_half_caches_within_twice_the_naive_error(dtype, masked, split_size):
    q, k, v, key_mask = inputs((2, 6, 2, 1, 300, 64), dtype, masked)
    out = attention(q, k, v, key_mask=key_mask, backend="decode")
    expected, _, _ = naive_attention(q.double(), k.double(), v.double(), key_mask=key_mask)
    naive, _, _ = naive_attention(q, k, v, key_mask=key_mask)
    assert out.dtype == dtype

    def err(x):
        return (x.double() - expected).abs().max().item()

    assert err(out) <= 2 * err(naive) + 1e-6


# (b, h, h_kv, t, s, d, d_v): from 8 query rows a key/value head, bf16 on AVX512-BF16 runs the rows
# as the lanes of its pair products; multi-head latent attention's absorbed step among them
MANY_ROWS = {
    "16 rows, latent 576 / 512": (1, 16, 1, 1, 300, 576, 512),
    "8 rows, d=128": (2, 8, 1, 1, 129, 128, 128),
    "2 x 8 rows, 4 queries": (1, 4, 2, 4, 77, 64, 64),
    "12 rows, d=96, d_v=32": (1, 12, 1, 1, 33, 96, 32),
}


@pytest.mark.parametrize("shape", MANY_ROWS.values(), ids=MANY_ROWS.keys())
@pytest.mark.parametrize("masked", [False, True])
def test_many_query_rows_over_a_bf16_cache_within_twice_the_naive_error(shape, masked, split_size):
    b, h, h_kv, t, s, d, d_v = shape
    q, k, _, key_mask = inputs((b, h, h_kv, t, s, d), torch.bfloat16, masked)
    v = k[..., :d_v]  # the latent's first numbers, as the absorbed step reads them
    if key_mask is not None:  # padding holds anything
        k = k.masked_fill(~key_mask[:, None, :, None], float("nan"))
        v = k[..., :d_v]
    out = attention(q, k, v, key_mask=key_mask, backend="decode")
    exact_k = k.double().nan_to_num(0.0)
    expected, _, _ = naive_attention(q.double(), exact_k, exact_k[..., :d_v], key_mask=key_mask)
    naive, _, _ = naive_attention(
        q, k.nan_to_num(0.0), k.nan_to_num(0.0)[..., :d_v], key_mask=key_mask
    )
    assert not out.isnan().any()
    error, naive_error = ((x.double() - expected).abs().max().item() for x in (out, naive))
    assert error <= 2 * naive_error + 1e-6


def test_which_backend_names_the_pair_products_for_many_rows():
    from attnkit.kernels import cpu

    many = inputs((1, 16, 1, 1, 50, 64), torch.bfloat16)[:3]
    few = inputs((1, 4, 1, 1, 50, 64), torch.bfloat16)[:3]
    pairs = decode.KERNEL.has_avx512_bf16() and cpu.has("avx512_bf16")
    assert choose_backend("decode", call_of(*many, Masks(), 0.125)).products == (
        "bf16-avx512_bf16" if pairs else "float32"
    )
    assert choose_backend("decode", call_of(*few, Masks(), 0.125)).products == "float32"


def test_a_real_keys_nan_makes_every_row_that_sees_it_nan_with_many_rows():
    q, k, v, _ = inputs((1, 16, 1, 1, 70, 64), torch.bfloat16)
    k[0, 0, 40, 3] = float("nan")
    out = attention(q, k, v, backend="decode")
    assert out.isnan().all()


def test_scale_and_strided_views_of_a_cache():
    cache = KVCache(2, 2, 300, 16)
    keys, values = cache.update(torch.randn(2, 2, 150, 16), torch.randn(2, 2, 150, 16))
    wide_k = torch.randn(2, 150, 2, 16).transpose(1, 2)  # (b, s, h, d) -> (b, h, s, d), as modules
    q = torch.randn(2, 4, 1, 16)
    for k, v in ((keys, values), (wide_k, wide_k)):
        out = attention(q, k, v, scale=0.3, backend="decode")
        expected, _, _ = naive_attention(q.double(), k.double(), v.double(), scale=0.3)
        torch.testing.assert_close(out, expected.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("values", ["the first channels of the keys", "their own"])
def test_values_narrower_than_the_keys(values, dtype, split_size):
    """Multi-head latent attention's step: keys of a latent and a RoPE key (here 40 + 8 of DeepSeek's
    512 + 64), values the latent alone, a view of the same rows; or values of their own width."""
    cache = torch.randn(2, 1, 300, 48, dtype=dtype)
    k = cache
    v = (
        cache[..., :40]
        if values.startswith("the first")
        else torch.randn(2, 1, 300, 24, dtype=dtype)
    )
    q = torch.randn(2, 16, 1, 48, dtype=dtype)
    key_mask = torch.rand(2, 300) > 0.3
    out = attention(q, k, v, key_mask=key_mask, backend="decode")
    assert out.shape == (2, 16, 1, v.shape[-1]) and out.dtype == dtype
    expected, _, _ = naive_attention(q.double(), k.double(), v.double(), key_mask=key_mask)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected.float())
    else:
        naive, _, _ = naive_attention(q, k, v, key_mask=key_mask)
        assert (out.double() - expected).abs().max() <= 2 * (naive.double() - expected).abs().max()


def test_auto_takes_the_decode_kernel_for_a_few_queries_over_a_long_cache():
    def picked(t=1, s=None, h_kv=4, dtype=torch.float32, grad=False, **options):
        s = 1024 if s is None else s
        q = torch.empty(1, 12, t, 64, dtype=dtype, requires_grad=grad)
        k = v = torch.empty(1, h_kv, s, 64, dtype=dtype)
        masks = Masks(key_mask=options.pop("key_mask", None), window=options.pop("window", None))
        return choose_backend("auto", call_of(q, k, v, masks, 1.0, **options)).backend

    assert picked() == "decode"
    mask = torch.ones(1, 1024, dtype=torch.bool)
    assert picked(dtype=torch.bfloat16, key_mask=mask) == "decode"
    assert picked(dtype=torch.bfloat16, s=16) == "decode"
    assert picked(t=5, h_kv=4) == "decode"  # 3 query heads per kv head x 5 queries: 15 rows
    assert picked(t=6, h_kv=4) == "sdpa"  # 18 rows
    assert picked(s=1) == "decode"  # every length: SDPA would scan k again for the NaN rule
    assert picked(grad=True) == "sdpa"
    assert picked(dtype=torch.float64) == "sdpa"
    assert picked(t=2, window=(-1, 0)) == "tiled"  # two causal queries: SDPA would need a mask
    assert picked(alibi_slopes=torch.ones(12)) == "sdpa"
    assert picked(return_lse=True) == "tiled"


def test_a_module_decoding_with_a_cache_runs_the_kernel_and_equals_the_full_forward(
    monkeypatch,
):
    calls = []
    real = BACKENDS["decode"].run
    monkeypatch.setattr(BACKENDS["decode"], "run", lambda call: calls.append(1) or real(call))
    prompt = 40
    module = MultiHeadAttention(32, 32, prompt + 4, 0.0, 4, num_kv_heads=2, rope=True).eval()
    x = torch.randn(1, prompt + 4, 32)
    with torch.no_grad():
        full = module(x)
        cache = KVCache(1, 2, x.shape[1], module.head_dim)
        module(x[:, :prompt], cache=cache)
        steps = [module(x[:, i : i + 1], cache=cache) for i in range(prompt, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, prompt:])
    assert len(calls) == 4  # one per decoded token; the prefill went elsewhere


def test_named_decode_refuses_what_it_cannot_run():
    q = torch.randn(1, 2, 2, 8)
    k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="backend 'decode' does not support causal"):
        attention(q, k, v, causal=True, backend="decode")
    with pytest.raises(ValueError, match="backend 'decode' cannot run inputs that require grad"):
        attention(q.requires_grad_(), k, v, backend="decode")
    with pytest.raises(ValueError, match=r"cannot run dtype torch\.float64"):
        attention(q.double().detach(), k.double(), v.double(), backend="decode")
    with pytest.raises(ValueError, match="cannot run 32 query rows per key/value head"):
        attention(torch.randn(1, 2, 32, 8), k, v, backend="decode")


def test_without_the_kernel_auto_uses_sdpa_and_a_named_call_says_why(monkeypatch):
    monkeypatch.setattr(decode, "KERNEL", Kernel("decode"))
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    q = torch.randn(1, 2, 1, 8)
    k = v = torch.randn(1, 2, 64, 8)
    assert choose_backend("auto", call_of(q, k, v, Masks(), 1.0)).backend == "sdpa"
    with pytest.raises(
        ValueError,
        match=r"backend 'decode' cannot run without its kernel: disabled by ATTNKIT_NATIVE=0",
    ):
        attention(q, k, v, backend="decode")


@pytest.mark.parametrize("backend", ["auto", "decode"])
def test_an_empty_batch_or_no_query_gives_an_empty_output(backend):
    k = v = torch.randn(0, 2, 2048, 64)
    with torch.no_grad():
        assert attention(torch.randn(0, 8, 1, 64), k, v, backend=backend).shape == (0, 8, 1, 64)
        k = v = torch.randn(1, 2, 2048, 64)
        assert attention(torch.randn(1, 8, 0, 64), k, v, backend=backend).shape == (1, 8, 0, 64)
