"""The chapter's own numbers (tests/data/textbook.json) through the public API, to 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnkit import AttentionResult, SelfAttention, attend, simple_self_attention
from attnkit.textbook import JOURNEY_EMBEDDINGS, JOURNEY_TOKENS

SHARED_GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "textbook.json"


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-4, rtol=0
    )


@pytest.mark.skipif(not SHARED_GOLDEN.exists(), reason="no shared/ folder beside this clone")
def test_the_golden_copy_is_the_shared_file(golden):
    assert json.loads(SHARED_GOLDEN.read_text()) == golden


def test_builtin_example_is_the_golden_one(golden):
    journey = golden["journey"]
    assert list(JOURNEY_TOKENS) == journey["tokens"]
    assert torch.equal(torch.tensor(JOURNEY_EMBEDDINGS), torch.tensor(journey["inputs"]))


def test_simplified_self_attention_journey(golden):
    journey = golden["journey"]
    result = simple_self_attention(torch.tensor(journey["inputs"]))
    i = journey["query_index"]
    close(result.scores, journey["scores"])
    close(result.weights, journey["weights"])
    close(result.context, journey["context"])
    close(result.scores[i], journey["scores_for_query"])
    close(result.weights[i], journey["softmax_weights_for_query"])
    close(result.context[i], journey["context_for_query"])
    assert result.queries is None and result.keys is None and result.values is None


def test_sum_normalisation_journey(golden):
    journey = golden["journey"]
    result = simple_self_attention(torch.tensor(journey["inputs"]), normalize="sum")
    close(result.weights[journey["query_index"]], journey["sum_normalized_weights_for_query"])
    torch.testing.assert_close(result.weights.sum(-1), torch.ones(6))


def test_attend_for_one_query_is_the_journey_step(golden):
    """The chapter's first step by hand: one query's scores, then weights and context."""
    journey = golden["journey"]
    inputs = torch.tensor(journey["inputs"])
    query = inputs[journey["query_index"]]
    result = attend(inputs @ query, inputs)  # scores (s,), values (s, e)
    close(result.weights, journey["softmax_weights_for_query"])
    close(result.context, journey["context_for_query"])


def test_explicit_integer_weights_unscaled(golden):
    example = golden["explicit_weights"]
    W = {name: torch.tensor(example[name], dtype=torch.float32) for name in ("W_q", "W_k", "W_v")}
    attn = SelfAttention.from_matrices(W["W_q"], W["W_k"], W["W_v"], scale=1.0)
    trace = attn.trace(torch.tensor(example["inputs"], dtype=torch.float32))
    close(trace.queries, example["queries"])
    close(trace.keys, example["keys"])
    close(trace.values, example["values"])
    close(trace.scores, example["scores"])
    close(trace.weights[0], example["weights_row0"])
    close(trace.context[0], example["context_row0"])
    torch.testing.assert_close(
        attn(torch.tensor(example["inputs"], dtype=torch.float32)), trace.context
    )


def test_encoder_decoder_step(golden):
    example = golden["encoder_decoder"]
    hidden = torch.tensor(example["encoder_hidden_states"])
    result = attend(torch.tensor(example["scores"], dtype=torch.float32), hidden)
    close(result.weights, example["weights"])
    close(result.context, example["context"])
    # the chapter's warning: an elementwise product summed per row is a different, wrong answer
    wrong = (result.weights[:, None] * hidden).sum(dim=1)
    assert not torch.allclose(wrong, result.context, atol=1e-2)


def test_batched_self_attention_equals_each_item():
    x = torch.rand(3, 5, 4)
    batched = simple_self_attention(x)
    for i in range(3):
        one = simple_self_attention(x[i])
        torch.testing.assert_close(batched.context[i], one.context)
        torch.testing.assert_close(batched.weights[i], one.weights)


def test_causal_simplified_attention_sees_only_the_past():
    x = torch.rand(6, 3)
    result = simple_self_attention(x, causal=True)
    assert torch.equal(result.weights.triu(1), torch.zeros(6, 6))
    torch.testing.assert_close(result.weights.sum(-1), torch.ones(6))
    torch.testing.assert_close(result.context[0], x[0])  # the first token sees only itself


def test_attend_mask_and_empty_rows():
    scores = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], requires_grad=True)
    values = torch.randn(3, 2)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    for normalize in ("softmax", "sum"):
        result = attend(scores, values, mask=mask, normalize=normalize)
        assert result.weights[0, 1] == 0
        torch.testing.assert_close(result.weights[0].sum(), torch.tensor(1.0))
        assert torch.equal(result.context[1], torch.zeros(2))
        (grad,) = torch.autograd.grad(result.context.sum(), scores)
        assert torch.isfinite(grad).all() and torch.equal(grad[1], torch.zeros(3))


def test_attention_result_is_frozen():
    result = simple_self_attention(torch.rand(2, 3))
    assert isinstance(result, AttentionResult)
    with pytest.raises(AttributeError):
        result.context = torch.zeros(1)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: simple_self_attention(torch.rand(3)), ValueError, r"inputs must be \(tokens, features\)"),
        (lambda: simple_self_attention([[1.0]]), TypeError, "inputs must be a torch.Tensor, got list"),
        (lambda: simple_self_attention(torch.rand(2, 3), normalize="max"), ValueError, "normalize must be 'softmax' or 'sum', got 'max'"),
        (lambda: attend(torch.rand(4), torch.rand(3, 2)), ValueError, r"scores \(shape \(4,\)\) must end in the number of value rows \(3"),
        (lambda: attend(torch.rand(3), torch.rand(3, 2), mask=torch.ones(3)), TypeError, "mask must be a bool tensor"),
        (lambda: attend(torch.rand(3), torch.rand(3, 2), mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, r"mask of shape \(2, 3\) does not broadcast"),
        (lambda: attend(torch.rand(3), torch.rand(3, 2, dtype=torch.float64)), TypeError, "scores and values must have the same dtype"),
    ],
)  # fmt: skip
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()
