"""attnkit.modules._common: the checks at a module's boundary and the head reshapes."""

from __future__ import annotations

import pytest
import torch

from attnkit.modules import _common


def test_an_unbatched_input_is_batched_and_squeezed_back():
    like = torch.nn.Linear(8, 8).weight
    x, unbatched = _common.as_batched(torch.randn(5, 8), "x", 8, "d_in", like)
    assert x.shape == (1, 5, 8) and unbatched
    out, weights = _common.unbatch((x, torch.ones(1, 5, 5)), unbatched)
    assert out.shape == (5, 8) and weights.shape == (5, 5)
    same, unbatched = _common.as_batched(torch.randn(2, 5, 8), "x", 8, "d_in", like)
    assert same.shape == (2, 5, 8) and not unbatched
    assert _common.unbatch(same, unbatched) is same


@pytest.mark.parametrize(
    "x, words",
    [
        (torch.randn(2, 5, 7), r"x has 7 features in its last dim, but d_in is 8"),
        (
            torch.randn(5),
            r"x must be \(batch, tokens, features\) or \(tokens, features\), got shape \(5,\)",
        ),
        (
            torch.ones(2, 5, 8, dtype=torch.long),
            "x must have a floating-point dtype, got torch.int64",
        ),
    ],
    ids=["features", "dimensions", "dtype"],
)
def test_bad_inputs_are_named(x, words):
    with pytest.raises((ValueError, TypeError), match=words):
        _common.as_batched(x, "x", 8, "d_in", torch.nn.Linear(8, 8).weight)


def test_heads_split_and_merge_back():
    x = torch.randn(2, 5, 12)
    heads = _common.split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    torch.testing.assert_close(heads[:, 1], x[..., 4:8])  # head 1 holds features 4..7
    torch.testing.assert_close(_common.merge_heads(heads), x)


def test_a_modules_window_counts_itself():
    assert _common.module_window(None, True) is None
    assert _common.module_window(4, causal=True) == (3, 0)  # itself and the 3 before it
    assert _common.module_window(5, causal=False) == (2, 2)  # centred
    assert _common.module_window(4, causal=False) == (2, 1)
    with pytest.raises(ValueError, match="window"):
        _common.module_window(0, causal=True)
