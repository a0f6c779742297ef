"""The role scores on hand-built attention patterns."""

from __future__ import annotations

import pytest
import torch

from attnkit.learn.roles import (
    first_token_score,
    induction_score,
    previous_token_score,
    role_scores,
    self_score,
    uniform_causal,
)


def previous_token_head(t: int) -> torch.Tensor:
    weights = torch.zeros(t, t)
    weights[0, 0] = 1.0  # the first query has nothing before it
    weights[torch.arange(1, t), torch.arange(t - 1)] = 1.0
    return weights


def induction_head(n: int) -> torch.Tensor:
    """On a sequence of n tokens written twice: query n + j on key j + 1; uniform before."""
    weights = uniform_causal(2 * n)
    weights[n:] = 0.0
    weights[torch.arange(n, 2 * n), torch.arange(1, n + 1)] = 1.0
    return weights


@pytest.mark.parametrize("t", [2, 7, 32])
def test_an_exact_previous_token_head_scores_1_and_nothing_else(t):
    weights = previous_token_head(t)
    assert previous_token_score(weights).item() == 1.0
    assert self_score(weights).item() == 0.0
    assert first_token_score(weights).item() == pytest.approx(1 / (t - 1))  # query 1's previous


@pytest.mark.parametrize("t", [4, 16, 64])
def test_a_uniform_head_scores_about_1_over_t(t):
    weights = uniform_causal(t)
    expected = sum(1 / (i + 1) for i in range(1, t)) / (t - 1)  # mean of 1/(i+1), i = 1..t-1
    for score in (previous_token_score, first_token_score, self_score):
        assert score(weights).item() == pytest.approx(expected)
    assert expected < 2 * torch.log(torch.tensor(float(t))).item() / t  # about ln(t) / t


def test_self_and_first_token_heads():
    t = 6
    assert self_score(torch.eye(t)).item() == 1.0
    sink = torch.zeros(t, t)
    sink[:, 0] = 1.0
    assert first_token_score(sink).item() == 1.0
    assert previous_token_score(sink).item() == pytest.approx(1 / (t - 1))


def test_an_induction_head_scores_1_and_a_previous_token_head_does_not():
    n = 5
    assert induction_score(induction_head(n)).item() == 1.0
    assert induction_score(previous_token_head(2 * n)).item() == 0.0
    # a head one step off (on the first occurrence itself, not the token after it)
    off = torch.zeros(2 * n, 2 * n)
    off[torch.arange(n), torch.arange(n)] = 1.0
    off[torch.arange(n, 2 * n), torch.arange(n)] = 1.0
    assert induction_score(off).item() == 0.0


def test_scores_keep_leading_dimensions_and_role_scores_average_the_probes():
    t = 8
    prev, uniform = previous_token_head(t), uniform_causal(t)
    attn_weights = torch.stack([torch.stack([prev, uniform]), torch.stack([prev, prev])])
    attn_weights = attn_weights[:, None].expand(2, 3, 2, t, t)  # (L, p, h, t, t)
    repeated = induction_head(t // 2)[None, None, None].expand(2, 3, 2, t, t)
    scores = role_scores(attn_weights, repeated)
    assert set(scores) == {"previous_token", "first_token", "self", "induction"}
    assert scores["previous_token"].shape == (2, 2)
    assert scores["previous_token"][0, 0] == 1.0 and scores["previous_token"][1, 1] == 1.0
    assert scores["previous_token"][0, 1] < 0.5
    assert (scores["induction"] == 1.0).all()


@pytest.mark.parametrize(
    "weights, message",
    [
        (torch.ones(3, 4), r"\(\.\.\., t, t\), got shape \(3, 4\)"),
        (torch.ones(1, 1), "at least 2 tokens, got 1"),
    ],
)
def test_bad_shapes_are_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        previous_token_score(weights)


def test_the_induction_score_needs_an_even_length():
    with pytest.raises(ValueError, match="even t"):
        induction_score(uniform_causal(5))
