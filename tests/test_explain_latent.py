"""attnkit.explain_latent: one decoding step of multi-head latent attention, walked through on the
chapter's sentence: its numbers are the layer's own step and the decompressed computation's, its
weights sum to one, and the text shows the cache, the three products and DeepSeek-V3's shapes."""

from __future__ import annotations

import pytest
import torch

from attnkit.explain import Example
from attnkit.explain_latent import SIZES, explain_latent_step, latent_step


def test_the_step_is_the_layers_and_the_decompressed_one():
    step = latent_step(Example.journey())
    torch.testing.assert_close(step["output"], step["layer_output"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(step["output"], step["decompressed"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(step["weights"].sum(-1), torch.ones(2, dtype=torch.float64))
    c, r = SIZES["latent_dim"], SIZES["rope_dim"]
    assert step["keys"].shape == (6, c + r) and step["o_latent"].shape == (2, c)


def test_the_text_walks_the_three_products():
    text = explain_latent_step(Example.journey())
    assert text.startswith("One decoding step of multi-head latent attention")
    for part in ("The cache, (t=6, c + r = 4)", "1. The query in latent space",
                 "2. Multi-query attention", "3. Back to each head", "40,960"):  # fmt: skip
        assert part in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_a_seed_changes_the_layer_and_one_token_is_refused():
    assert explain_latent_step(Example.journey(), seed=1) != explain_latent_step(Example.journey())
    with pytest.raises(ValueError, match="at least 2 tokens"):
        explain_latent_step(Example.random("alone", 3, 0))


def test_the_command_prints_it_and_names_what_does_not_apply(capsys):
    from attnkit.cli import main

    assert main(["explain", "--latent", "--text", "a b c", "--seed", "3"]) == 0
    assert "on 'a b c'" in capsys.readouterr().out
    assert main(["explain", "--latent", "--causal"]) == 2
    assert "do not apply to --latent" in capsys.readouterr().err
    assert main(["explain", "--latent", "--model", "minilm"]) == 2
    assert "not --model" in capsys.readouterr().err
