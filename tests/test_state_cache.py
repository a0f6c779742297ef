"""attnkit.state_cache: a linear layer's state between steps: the state it starts from (none before
the first token), the convolution's last inputs it keeps, a reset, and its arguments checked."""

from __future__ import annotations

import pytest
import torch

from attnkit import StateCache


def test_the_state_is_kept_after_each_chunk_and_forgotten_on_reset():
    cache = StateCache(2, 3, 4, 5)
    assert cache.initial_state() is None and cache.position == 0
    final = torch.randn(2, 3, 4, 5, requires_grad=True)
    cache.advance(final, 7)
    assert cache.position == 7 and torch.equal(cache.initial_state(), final.detach())
    assert not cache.state.requires_grad  # no graph is kept
    cache.reset()
    assert cache.initial_state() is None and not cache.state.any()


def test_the_convolution_reads_the_inputs_it_saw_last():
    cache = StateCache(1, 1, 1, 1, conv_channels=2, conv_size=3)
    first = torch.arange(8.0).view(1, 2, 4)
    joined = cache.convolve_inputs(first)  # two zeros before the first token
    assert torch.equal(joined[..., :2], torch.zeros(1, 2, 2)) and torch.equal(
        joined[..., 2:], first
    )
    nxt = torch.full((1, 2, 1), 9.0)
    assert torch.equal(cache.convolve_inputs(nxt), torch.cat([first[..., 2:], nxt], dim=-1))


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        ((0, 1, 1, 1), {}, "batch_size must be >= 1"),
        ((1, 1, 1, 1), {"conv_channels": 4}, "conv_size must be >= 1"),
    ],
)
def test_bad_sizes_are_named(args, options, message):
    with pytest.raises(ValueError, match=message):
        StateCache(*args, **options)
