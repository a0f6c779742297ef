"""attnkit.explain_delta: the walkthrough of the gated delta rule shows the numbers of the book's
loop (attnkit.linear.reference), step by step; its settings are checked; the command prints it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.cli import main
from attnkit.explain import Example
from attnkit.explain_delta import delta_steps, explain_delta_rule
from attnkit.linear.reference import delta_rule_loop


def test_each_step_is_the_loops_and_the_memory_is_its_state():
    example = Example.journey()
    steps = delta_steps(example, beta=0.3, decay=0.8)
    x = example.embeddings.double()
    k = F.normalize(x, dim=-1)[:, None]  # (t, 1 head, d)
    t = x.shape[0]
    g = torch.full((t, 1), 0.8, dtype=torch.float64).log()
    beta = torch.full((t, 1), 0.3, dtype=torch.float64)
    outputs, state = delta_rule_loop(k, k, x[:, None], g, beta, x.new_zeros(1, 3, 3))
    torch.testing.assert_close(torch.stack([s["output"] for s in steps]), outputs[:, 0])
    torch.testing.assert_close(steps[-1]["state"], state[0])
    for step, token_k, token_v in zip(steps, k[:, 0], x):  # each line as the chapter writes it
        torch.testing.assert_close(step["predicted"], step["decayed"].T @ token_k)
        torch.testing.assert_close(step["delta"], (token_v - step["predicted"]) * 0.3)


def test_the_text_shows_each_tokens_step_with_its_numbers():
    example = Example.journey()
    text = explain_delta_rule(example)
    first = delta_steps(example)[0]
    assert text.count("Token '") == 6 and "S = decay * S + k delta^T" in text
    assert " ".join(f"{x:.4f}" for x in first["delta"].tolist()) in " ".join(text.split())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"beta": 1.5}, r"--beta must be in \[0, 1\]"),
        ({"decay": 0.0}, r"--decay must be in \(0, 1\]"),
    ],
)
def test_bad_settings_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        explain_delta_rule(Example.journey(), **options)


def test_too_wide_or_too_long_an_example_is_refused():
    with pytest.raises(ValueError, match=r"at most 8 x 8 \(--dim 8 or less\)"):
        explain_delta_rule(Example.random("a b", 9, 0))
    with pytest.raises(ValueError, match="shows at most 12"):
        explain_delta_rule(Example.random(" ".join("abcdefghijklm"), 3, 0))


def test_the_command_prints_it_and_refuses_what_does_not_apply(capsys):
    assert main(["explain", "--delta-rule", "--decay", "0.5"]) == 0
    assert "decay exp(g) = 0.5" in capsys.readouterr().out
    assert main(["explain", "--delta-rule", "--causal"]) == 2
    assert "do not apply to --delta-rule" in capsys.readouterr().err


def test_the_gates_alone_ask_for_the_delta_rule(capsys):
    assert main(["explain", "--beta", "0.3"]) == 2
    assert "add --delta-rule" in capsys.readouterr().err
