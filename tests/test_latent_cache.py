"""attnkit.latent_cache: LatentCache writes where it stands, gives its tokens as views of one
buffer (keys, latents, RoPE keys), says its bytes, resets, and names bad input."""

from __future__ import annotations

import pytest
import torch

from attnkit.latent_cache import LatentCache


def test_tokens_are_written_in_order_and_read_as_views():
    cache = LatentCache(2, max_len=8, latent_dim=5, rope_dim=2)
    first, second = torch.randn(2, 3, 5), torch.randn(2, 1, 5)
    rope_first, rope_second = torch.randn(2, 3, 2), torch.randn(2, 1, 2)
    cache.append(first, rope_first)
    cache.append(second, rope_second)
    assert cache.position == 4 and cache.keys().shape == (2, 1, 4, 7)
    torch.testing.assert_close(cache.latents()[:, 0], torch.cat([first, second], dim=1))
    torch.testing.assert_close(cache.rope_keys()[:, 0], torch.cat([rope_first, rope_second], 1))
    assert cache.latents().data_ptr() == cache.tokens.data_ptr()  # no copy
    assert cache.bytes_per_token() == 7 * 4
    cache.reset()
    assert cache.position == 0 and not cache.tokens.any()


def test_bad_input_is_named():
    cache = LatentCache(1, max_len=4, latent_dim=3, rope_dim=2)
    with pytest.raises(ValueError, match=r"latent must be \(b=1, t, 3\)"):
        cache.append(torch.randn(1, 2, 4), torch.randn(1, 2, 2))
    with pytest.raises(TypeError, match="float32 as the cache"):
        cache.append(torch.randn(1, 2, 3).double(), torch.randn(1, 2, 2).double())
    with pytest.raises(ValueError, match="latent has 2 tokens, rope_key 1"):
        cache.append(torch.randn(1, 2, 3), torch.randn(1, 1, 2))
    cache.append(torch.randn(1, 3, 3), torch.randn(1, 3, 2))
    with pytest.raises(ValueError, match="holds 3 of max_len=4 tokens; 2 more do not fit"):
        cache.append(torch.randn(1, 2, 3), torch.randn(1, 2, 2))
    with pytest.raises(ValueError, match="latent_dim"):
        LatentCache(1, 4, 0, 2)
