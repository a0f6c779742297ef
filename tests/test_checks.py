"""Bad input to attnkit.functional.attention: the right exception, naming the argument and values."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.functional import which_backend


def qkv(b=1, h=2, h_kv=2, t=3, s=4, d=8, dtype=torch.float32):
    return (
        torch.randn(b, h, t, d, dtype=dtype),
        torch.randn(b, h_kv, s, d, dtype=dtype),
        torch.randn(b, h_kv, s, d, dtype=dtype),
    )


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"q must be \(batch, heads, length, head_dim\), got shape \(2, 3, 8\)"
    ):
        attention(q[0], k, v)


def test_not_a_tensor():
    _, k, v = qkv()
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got list"):
        attention([1.0], k, v)


def test_integer_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k must have a floating-point dtype, got torch.int64"):
        attention(q, k.long(), v)


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(
        TypeError,
        match=r"q and v must have the same dtype, got q: torch.float32 and v: torch.float64",
    ):
        attention(q, k, v.double())


def test_device_mismatch():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"q and k must be on the same device, got q: cpu and k: meta"
    ):
        attention(q, k.to("meta"), v)


def test_k_and_v_of_different_lengths():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k and v must have the same length, got k: 4 and v: 3"):
        attention(q, k, v[:, :, :3])


def test_head_dims_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q and k must have the same head_dim, got q: 8 and k: 4"):
        attention(q, k[..., :4], v)


def test_batch_sizes_differ():
    q, k, v = qkv(b=2)
    with pytest.raises(ValueError, match=r"same batch size, got 2, 1 and 2"):
        attention(q, k[:1], v)


def test_query_heads_not_a_multiple_of_kv_heads():
    q, k, v = qkv(h=3, h_kv=2)
    with pytest.raises(
        ValueError, match=r"query heads \(3\) must be a multiple of the key/value heads \(2\)"
    ):
        attention(q, k, v)


def test_key_mask_wrong_shape():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"key_mask must have shape \(batch, key_length\) = \(1, 4\), got \(1, 3\)"
    ):
        attention(q, k, v, key_mask=torch.ones(1, 3, dtype=torch.bool))


def test_key_mask_wrong_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"key_mask must be a bool tensor .* got dtype torch.int64"):
        attention(q, k, v, key_mask=torch.ones(1, 4, dtype=torch.long))


def test_attn_mask_wrong_shape():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"attn_mask of shape \(3, 5\) does not broadcast to .* = \(1, 2, 3, 4\)"
    ):
        attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool))


def test_attn_mask_wrong_dtype():
    q, k, v = qkv()
    with pytest.raises(
        TypeError,
        match=r"attn_mask must be bool .* or the query's dtype torch.float32 .* got torch.float64",
    ):
        attention(q, k, v, attn_mask=torch.zeros(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_out_of_range(p):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"dropout_p must be in \[0, 1\), got {p}"):
        attention(q, k, v, dropout_p=p)


def test_window_must_be_a_pair():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"window must be a pair of ints"):
        attention(q, k, v, window=3)
    with pytest.raises(
        ValueError, match=r"window sizes must be >= 0, or -1 for unbounded, got \(-2, 0\)"
    ):
        attention(q, k, v, window=(-2, 0))


def test_softcap_and_scale_must_be_positive():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softcap must be > 0, got 0"):
        attention(q, k, v, softcap=0)
    with pytest.raises(ValueError, match=r"scale must be > 0, got -1.0"):
        attention(q, k, v, scale=-1.0)


def test_alibi_slopes_one_per_head():
    q, k, v = qkv(h=2)
    with pytest.raises(
        ValueError, match=r"alibi_slopes must have shape \(heads,\) = \(2,\), got \(3,\)"
    ):
        attention(q, k, v, alibi_slopes=torch.ones(3))


def test_alibi_slopes_on_another_device():
    q, k, v = qkv(h=2)
    with pytest.raises(ValueError, match="alibi_slopes is on meta but q is on cpu"):
        attention(q, k, v, alibi_slopes=torch.ones(2, device="meta"))


@pytest.mark.parametrize("name", ["key_mask", "attn_mask"])
def test_masks_on_another_device_than_q(name):
    q, k, v = qkv()
    mask = torch.ones(1, 4, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=rf"{name} is on meta but q is on cpu"):
        attention(q, k, v, **{name: mask})


def test_head_dim_zero():
    q, k, v = qkv(d=0)  # was a ZeroDivisionError from the default scale
    with pytest.raises(ValueError, match=r"q and k must have a head_dim of at least 1"):
        attention(q, k, v)


@pytest.mark.parametrize(
    ("name", "value"), [("causal", "yes"), ("return_lse", "x"), ("return_weights", 1)]
)
def test_switches_must_be_bools(name, value):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"{name} must be a bool(,| or .dropped.,) got"):
        attention(q, k, v, **{name: value})


@pytest.mark.parametrize("name", ["scale", "softcap"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_scale_and_softcap_must_be_finite(name, value):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"{name} must be"):
        attention(q, k, v, **{name: value})


def test_a_call_whose_results_exceed_the_memory_is_refused_before_any_work():
    import time

    q = torch.empty(1, 2, 200_000, 8)  # weights of 2 x 200,000^2 floats: 298 GiB
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"would need 298\.0 GiB for the results .* more than"):
        attention(q, q, q, return_weights=True)
    assert time.perf_counter() - started < 1.0
    with pytest.raises(ValueError, match=r"float64 scores"):
        attention(q, q, q, backend="reference")


def test_heads_of_zero_are_named():
    x = torch.randn(1, 0, 3, 4)
    with pytest.raises(
        ValueError, match=r"q must have at least one head, got shape \(1, 0, 3, 4\)"
    ):
        attention(x, x, x)
    with pytest.raises(ValueError, match=r"k and v must have at least one head"):
        attention(torch.randn(1, 2, 3, 4), x, x)


@pytest.mark.parametrize(
    ("record", "error", "message"),
    [
        (
            torch.zeros(1, 2, 3, dtype=torch.bool),
            ValueError,
            r"must have shape .* = \(1, 2, 4\), got \(1, 2, 3\)",
        ),
        (torch.zeros(1, 2, 4), TypeError, r"must be a bool tensor, got dtype torch.float32"),
        ([[False] * 4] * 2, TypeError, r"must be a torch.Tensor, got list"),
        (
            torch.zeros(1, 2, 4, dtype=torch.bool, device="meta"),
            ValueError,
            "is on meta but k is on cpu",
        ),
    ],
)
def test_nonfinite_keys_must_be_a_bool_record_of_each_key_row(record, error, message):
    q, k, v = qkv(h=4)
    for call in (attention, which_backend):
        with pytest.raises(error, match=f"^nonfinite_keys {message}"):
            call(q, k, v, nonfinite_keys=record)
