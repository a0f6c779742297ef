"""RotaryEmbedding against the rotation written out in float64 complex numbers."""

from __future__ import annotations

import pytest
import torch

from attnkit import RotaryEmbedding
from attnkit.positions import token_positions


def rotated_float64(x, positions, base=10000.0):
    """Channel pairs (i, i + d/2) as complex numbers, times exp(1j * p * base^(-2i/d))."""
    d = x.shape[-1]
    pairs = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[..., None] * theta  # (..., t, d/2)
    if positions.dim() == 2:
        angle = angle[:, None]  # (b, 1, t, d/2)
    turned = pairs * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([turned.real, turned.imag], dim=-1)


@pytest.mark.parametrize("head_dim", [2, 8, 64])
def test_rotation_matches_the_complex_form(head_dim):
    rope = RotaryEmbedding(head_dim, max_len=5000)
    x = torch.randn(2, 3, 7, head_dim)
    positions = torch.tensor([0, 1, 2, 50, 99, 2500, 4999])
    torch.testing.assert_close(rope(x, positions), rotated_float64(x, positions).float())


def test_per_row_positions():
    rope = RotaryEmbedding(16, base=500.0, max_len=32)
    x = torch.randn(2, 4, 3, 16)
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]])
    expected = rotated_float64(x, positions, base=500.0)
    torch.testing.assert_close(rope(x, positions), expected.float())
    torch.testing.assert_close(rope(x[1:], positions[1]), rope(x, positions)[1:])


def test_scores_depend_only_on_the_distance():
    rope = RotaryEmbedding(32, max_len=512)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(i, j):
        return (rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum()

    torch.testing.assert_close(score(5, 2), score(405, 402))
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_errors():
    with pytest.raises(ValueError, match="head_dim must be even for rotary embeddings, got 7"):
        RotaryEmbedding(7)
    rope = RotaryEmbedding(8, max_len=10)
    with pytest.raises(ValueError, match=r"position 10 is beyond the rotary table \(max_len=10\)"):
        rope(torch.randn(1, 1, 2, 8), torch.tensor([9, 10]))
    with pytest.raises(ValueError, match=r"head_dim=8\), got shape \(1, 1, 2, 6\)"):
        rope(torch.randn(1, 1, 2, 6), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"positions must be \(tokens,\) = \(2,\)"):
        rope(torch.randn(1, 1, 2, 8), torch.tensor([0, 1, 2]))


def test_token_positions_count_real_tokens_from_each_rows_start(device):
    key_mask = torch.tensor([[False, True, True], [True, True, True]], device=device)
    assert token_positions(3, key_mask).tolist() == [[0, 0, 1], [0, 1, 2]]
    starts = torch.tensor([2, 5], device=device)
    assert token_positions(3, key_mask, starts).tolist() == [[0, 2, 3], [5, 6, 7]]
    assert token_positions(2, None, 4, device).tolist() == [4, 5]
