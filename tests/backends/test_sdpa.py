"""attnkit.backends.sdpa: which rows attnkit's NaN rule overwrites in torch's output
(rows_made_nan), and the memory it counts for a call besides the inputs."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.backends.sdpa import BACKEND, nans_seen, rows_made_nan
from attnkit.functional import attention, checked_call

NAN, INF = math.nan, math.inf
B, H, H_KV, T, D = 1, 4, 2, 6, 3


def finite_qk(s=T, device="cpu"):
    return torch.randn(B, H, T, D, device=device), torch.randn(B, H_KV, s, D, device=device)


def rows(*indices, heads=range(H), device="cpu"):
    """``(b, h, t, 1)`` True at rows ``indices`` of ``heads``."""
    bad = torch.zeros(B, H, T, 1, dtype=torch.bool, device=device)
    for h in heads:
        bad[0, h, list(indices)] = True
    return bad


def test_finite_inputs_make_no_row_nan(device):
    q, k = finite_qk(device=device)
    assert not rows_made_nan(q, k, None, False, None, None).any()
    assert not rows_made_nan(q, k, None, True, None, torch.ones(H, device=device)).any()


def test_a_non_finite_query_row_makes_only_its_own_row_nan(device):
    q, k = finite_qk(device=device)
    q[0, 1, 3, 2] = INF
    want = rows(3, heads=[1], device=device)
    assert torch.equal(rows_made_nan(q, k, None, False, None, None), want)


def test_a_non_finite_key_reaches_the_rows_that_see_it_in_the_heads_that_share_it(device):
    q, k = finite_qk(device=device)
    k[0, 1, 2, 0] = NAN  # key/value head 1: query heads 2 and 3
    everyone = rows_made_nan(q, k, None, False, None, None)
    assert torch.equal(everyone, rows(*range(T), heads=[2, 3], device=device))
    causal = rows_made_nan(q, k, None, True, None, None)  # query i sees keys 0..i
    assert torch.equal(causal, rows(2, 3, 4, 5, heads=[2, 3], device=device))
    allowed = torch.zeros(T, T, dtype=torch.bool, device=device)
    allowed[[0, 4], 2] = True  # only queries 0 and 4 see key 2
    allowed[:, 0] = True
    some = rows_made_nan(q, k, allowed, False, None, None)
    assert torch.equal(some, rows(0, 4, heads=[2, 3], device=device))


def test_causal_rows_see_the_keys_up_to_their_bottom_right_position(device):
    q, k = finite_qk(s=T + 3, device=device)  # query i sees keys 0..i + 3
    k[0, 0, 7, 1] = NAN  # key/value head 0: query heads 0 and 1
    assert torch.equal(
        rows_made_nan(q, k, None, True, None, None), rows(4, 5, heads=[0, 1], device=device)
    )


def test_a_nan_or_plus_inf_bias_that_a_row_sees_makes_it_nan_minus_inf_masks(device):
    q, k = finite_qk(device=device)
    bias = torch.zeros(T, T, device=device)
    bias[1, 4] = NAN
    bias[2, 0] = INF
    bias[3, 3] = -INF  # a mask, not a NaN
    assert torch.equal(rows_made_nan(q, k, None, False, bias, None), rows(1, 2, device=device))
    hidden = torch.ones(T, T, dtype=torch.bool, device=device)
    hidden[1, 4] = False  # the NaN lies where row 1 may not look
    assert torch.equal(rows_made_nan(q, k, hidden, False, bias, None), rows(2, device=device))


def test_a_non_finite_slope_makes_its_heads_rows_nan(device):
    q, k = finite_qk(device=device)
    slopes = torch.tensor([0.5, INF, 0.25, NAN], device=device)
    want = rows(*range(T), heads=[1, 3], device=device)
    assert torch.equal(rows_made_nan(q, k, None, True, None, slopes), want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("t", "s"), [(T, T), (T, T + 3), (1, T)])
@pytest.mark.parametrize("seed", range(4))
def test_the_gpus_form_of_the_rule_finds_the_same_rows(device, causal, t, s, seed):
    """nans_seen, the form without a look at the data (on a GPU, under torch.compile): NaN at
    exactly the rows rows_made_nan finds, and 0, not merely a finite value, at every other."""
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, t, D), torch.randn(B, H_KV, s, D)
    for x, infinity in ((q, INF), (k, -INF)):  # a NaN and an infinity in each, anywhere
        places = torch.randint(0, x.numel(), (2,), generator=generator)
        x.view(-1)[places] = torch.tensor([NAN, infinity])
    q, k = q.to(device), k.to(device)
    found = nans_seen(q, k, causal)
    assert found.shape == (B, H, t, 1)
    want = rows_made_nan(q, k, None, causal, None, None)
    assert torch.equal(found.isnan(), want) and not found[~want].any()


def test_sdpa_makes_those_rows_nan_as_the_reference_does(device):
    """On a CPU, torch's fused kernel makes a row of -inf scores zeros; on CUDA, its kernels their
    own answer: attnkit's rule holds on both. A key hidden by the causal mask may still reach a
    row through torch's CUDA kernels (its math kernel adds the mask to an infinite score: NaN),
    as the rule allows outside attnkit's own kernels; on a CPU it does not."""
    q, k = finite_qk(device=device)
    v = torch.randn(B, H_KV, T, D, device=device)
    k[0, 0, 4, 1] = -INF
    out = attention(q, k, v, causal=True, backend="sdpa")
    want = attention(q, k, v, causal=True, backend="reference")
    assert want.isnan().any() and bool((out.isnan() >= want.isnan()).all())
    if device.type == "cpu":
        assert torch.equal(out.isnan(), want.isnan())
    both = ~(out.isnan() | want.isnan())
    torch.testing.assert_close(out[both], want[both])


def memory(**options):
    t, s = options.pop("t", 8), options.pop("s", 8)
    q, k, v = torch.randn(2, 4, t, 16), torch.randn(2, 4, s, 16), torch.randn(2, 4, s, 16)
    return BACKEND.memory(checked_call(q, k, v, **options))


RESULTS = 2 * 4 * 8 * (16 * 4 + 4)  # the output, float32, and the lse of 2 x 4 x 8 rows
DENSE_FLOAT = 2 * 4 * 8 * 8 * 4  # a float mask of b x h x t x s


@pytest.mark.parametrize(
    ("options", "total", "what"),
    [
        ({}, RESULTS, "the results"),
        ({"causal": True}, RESULTS, "the results"),  # is_causal: no mask is built
        ({"causal": True, "s": 12}, RESULTS + 8 * 12, "the results and a dense mask"),
        ({"window": (2, 2)}, RESULTS + 8 * 8, "the results and a dense mask"),
        (
            {"key_mask": torch.ones(2, 8, dtype=torch.bool)},
            RESULTS + 2 * 8 * 8,  # one (t, s) bool mask per batch row
            "the results and a dense mask",
        ),
        (
            {"causal": True, "alibi_slopes": torch.ones(4)},
            RESULTS + DENSE_FLOAT,
            "the results and a dense float mask",
        ),
        (
            {"attn_mask": torch.zeros(8, 8)},
            RESULTS + DENSE_FLOAT,
            "the results and a dense float mask",
        ),
        (
            {"dropout_p": 0.1},
            RESULTS + 3 * DENSE_FLOAT,
            "the results and the scores, weights and dropout mask of torch's math path",
        ),
    ],
    ids=[
        "plain",
        "causal, t = s",
        "causal, t < s",
        "window",
        "key mask",
        "ALiBi",
        "float mask",
        "dropout",
    ],
)
def test_its_memory_counts_the_dense_masks_and_the_math_paths_matrices(options, total, what):
    assert memory(**options) == (total, what)


@pytest.mark.parametrize("causal", [False, True])
def test_the_gpus_form_gives_the_same_output_and_gradients_as_a_look(causal):
    """On a CPU inside force.blind, sdpa applies the rule as on a GPU (nans_seen): the same output
    and the same gradients, of the finite rows and of every row, NaN where they are NaN, as with a
    look."""
    from attnkit import force

    q, k = finite_qk()
    v = torch.randn(B, H_KV, T, D)
    q[0, 1, 2, 0], k[0, 1, 4, 2] = -INF, NAN
    results = []
    for context in (force.blind, torch.enable_grad):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with context():
            out = attention(*leaves, causal=causal, backend="sdpa")
        finite = torch.isfinite(out)
        grads = torch.autograd.grad(out[finite].sum(), leaves, retain_graph=True)
        everywhere = torch.autograd.grad(out, leaves, torch.ones_like(out))  # NaN rows too
        results.append((out.detach(), *grads, *everywhere))
    for blind, looked in zip(*results):
        torch.testing.assert_close(blind, looked, equal_nan=True, rtol=0, atol=0)
    assert results[0][0].isnan().any() and torch.isfinite(results[0][0]).any()


@pytest.mark.parametrize("blind", [False, True])
@pytest.mark.parametrize(
    "masks",
    [{}, {"causal": True}, {"window": (2, 0)}, {"key_mask": "pad"}],
    ids=["none", "causal", "window", "padding"],
)
@pytest.mark.parametrize(("t", "s"), [(T, T), (T, T + 3), (1, T + 3)])
def test_a_record_of_the_keys_rows_gives_what_a_read_of_the_keys_gives(device, blind, masks, t, s):
    """``nonfinite_keys`` in place of a pass over k (on a GPU, a whole cache each decoding step):
    the same output, NaN in the same rows, as or without force.blind (the GPU's form)."""
    from attnkit import force

    q, k = torch.randn(B, H, t, D, device=device), torch.randn(B, H_KV, s, D, device=device)
    v = torch.randn(B, H_KV, s, D, device=device)
    k[0, 1, s - 1, 2], q[0, 3, t - 1, 0] = INF, NAN
    if masks.get("key_mask") == "pad":
        key_mask = torch.ones(B, s, dtype=torch.bool, device=device)
        key_mask[0, 0] = False
        k[0, 0, 0, 1] = NAN  # padding: never seen, whatever the record says
        masks = {"key_mask": key_mask}
    record = ~torch.isfinite(k).all(dim=-1)
    with force.blind() if blind else torch.no_grad():
        read = attention(q, k, v, backend="sdpa", **masks)
        recorded = attention(q, k, v, backend="sdpa", nonfinite_keys=record, **masks)
    torch.testing.assert_close(recorded, read, equal_nan=True, rtol=0, atol=0)
    assert recorded[0, 2:, -1].isnan().all()  # the last queries of heads 2 and 3 see k[0, 1, s - 1]
    assert torch.isfinite(recorded[0, :2]).all()


@pytest.mark.parametrize(
    ("masks", "seeing"),
    [
        ({"causal": True}, [2, 3, 4, 5]),  # no mask tensor: the GPU's form, from the record
        ({"window": (2, 0)}, [2, 3, 4]),  # a mask: the record's keys counted by the rows
        ({"causal": True, "key_mask": torch.ones(B, T, dtype=torch.bool)}, [2, 3, 4, 5]),
    ],
    ids=["causal", "window", "padding"],
)
def test_the_record_is_what_the_rule_reads_for_the_keys(device, masks, seeing):
    """The record decides the keys' rows: a key it marks makes the rows that see it NaN, and the
    caller's record is trusted (attnkit does not read k for it)."""
    q, k = finite_qk(device=device)
    v = torch.randn(B, H_KV, T, D, device=device)
    record = torch.zeros(B, H_KV, T, dtype=torch.bool, device=device)
    record[0, 0, 2] = True
    masks = {name: m.to(device) if torch.is_tensor(m) else m for name, m in masks.items()}
    out = attention(q, k, v, backend="sdpa", nonfinite_keys=record, **masks)
    nan_rows = out.isnan().any(dim=-1)
    assert nan_rows[0, :2].equal(rows(*seeing, heads=[0], device=device)[0, :1, :, 0].expand(2, T))
    assert not nan_rows[0, 2:].any()
    if masks == {"causal": True}:
        assert nans_seen(q, k, True, record)[0, :2, 2:].isnan().all()


def test_a_record_of_keys_that_autocast_casts_is_left_out():
    """Under autocast, k is cast inside the call (float32 1e5 is infinite in float16): the caller's
    record, of the keys it passed, no longer says which rows are finite, and is not used."""
    q, k = -finite_qk()[0].abs(), finite_qk()[1]
    v = torch.randn(B, H_KV, T, D)
    k[0, 0, 1] = 1e5  # infinite in float16: a -inf score with each query, a NaN by the rule
    record = ~torch.isfinite(k).all(dim=-1)  # right for float32: no key marked
    with torch.autocast("cpu", dtype=torch.float16):
        out = attention(q, k, v, backend="sdpa", nonfinite_keys=record)
    assert out[0, :2].isnan().all() and torch.isfinite(out[0, 2:]).all()
