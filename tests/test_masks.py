"""The mask convention: True = may attend, causal and windows aligned bottom-right."""

from __future__ import annotations

import pytest
import torch

from attnkit.masks import (
    Masks,
    alibi_bias,
    alibi_slopes,
    causal_mask,
    merge_window,
    window_mask,
)
from helpers.oracle import allowed_positions


@pytest.mark.parametrize(("t", "s"), [(1, 1), (1, 5), (2, 5), (5, 5), (5, 2), (7, 3)])
def test_causal_mask_is_bottom_right(t, s, device):
    mask = causal_mask(t, s, device=device)
    assert torch.equal(mask, allowed_positions(t, s, causal=True, window=None, device=device))
    assert mask[-1].all()  # the last query sees every key


def test_causal_mask_drawn_in_the_docstring():
    assert causal_mask(2, 5).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("window", [(0, 0), (2, 1), (3, -1), (-1, 2), (-1, -1)])
@pytest.mark.parametrize(("t", "s"), [(4, 4), (3, 7), (6, 2)])
def test_window_mask_matches_definition(window, t, s):
    assert torch.equal(window_mask(t, s, window), allowed_positions(t, s, False, window))


def test_merge_window_folds_causal_in():
    assert merge_window(False, None, 4, 6) is None
    assert merge_window(True, None, 4, 6) == (-1, 0)
    assert merge_window(True, (3, 5), 4, 6) == (3, 0)
    assert merge_window(True, (3, -1), 4, 6) == (3, 0)
    assert merge_window(False, (-1, -1), 4, 6) is None


def test_merge_window_drops_what_masks_nothing_for_this_shape():
    assert merge_window(True, None, 1, 6) is None  # one query (decoding) sees every key
    assert merge_window(True, (5, 0), 1, 6) is None
    assert merge_window(True, (4, 0), 1, 6) == (4, -1)
    assert merge_window(False, (5, 3), 4, 6) is None
    assert merge_window(False, (5, 2), 4, 6) == (-1, 2)
    assert merge_window(True, None, 7, 6) == (-1, 0)  # t > s: the first query sees nothing


def test_alibi_bias_penalises_distance(device):
    bias = alibi_bias(torch.tensor([1.0, 0.5], device=device), 2, 4)  # p = (2, 3)
    assert bias.shape == (2, 2, 4) and bias.device.type == device.type
    assert bias[0, 0].tolist() == [-2.0, -1.0, 0.0, -1.0]
    assert bias[1, 1].tolist() == [-1.5, -1.0, -0.5, 0.0]


def test_masks_combine_and_slice_into_blocks(device):
    key_mask = torch.tensor([[True, True, False, True, True]], device=device)
    attn_mask = torch.zeros(1, 1, 3, 5, device=device)
    attn_mask[..., 1, 0] = float("-inf")
    masks = Masks(window=(-1, 0), key_mask=key_mask, attn_mask=attn_mask)
    full = masks.allowed(3, 5, device)
    causal = causal_mask(3, 5, device=device)
    expected = causal & key_mask[:, None, None, :] & (attn_mask > float("-inf"))
    assert torch.equal(full.expand(1, 1, 3, 5), expected)
    block = masks.allowed(3, 5, device, rows=(1, 3), cols=(0, 2))
    assert torch.equal(block.expand(1, 1, 2, 2), expected[..., 1:3, 0:2])
    assert torch.equal(masks.bias(), attn_mask)
    assert torch.equal(masks.bias((1, 3), (0, 2)), attn_mask[..., 1:3, 0:2])
    assert Masks().allowed(3, 5, device) is None and Masks().bias() is None


def test_alibi_slopes_are_the_standard_geometric_ones():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0**-i for i in (2, 4, 6, 8)]
    # not a power of two: the 4-head slopes, then every other slope of 8 heads
    assert alibi_slopes(6).tolist() == [2.0**-i for i in (2, 4, 6, 8, 1, 3)]
    assert len(alibi_slopes(12)) == 12 and alibi_slopes(1).tolist() == [2.0**-8]
    with pytest.raises(ValueError, match="num_heads must be an int >= 1, got 0"):
        alibi_slopes(0)
