"""transformers' composed mask functions read back as attnkit's compact masks, and any other
function evaluated block by block: each against the dense mask transformers itself builds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as hf

from attnkit import attention
from attnkit.hf.masks import HFMask, Pattern, mask_builder, read_pattern


def test_the_pieces_transformers_composes_are_read_back():
    assert read_pattern(hf.causal_mask_function) == Pattern(causal=True)
    assert read_pattern(hf.bidirectional_mask_function) == Pattern()
    sliding = read_pattern(hf.sliding_window_causal_mask_function(4))
    assert (sliding.causal, sliding.window) == (True, (3, -1))  # the query and 3 keys before
    both = read_pattern(hf.sliding_window_bidirectional_mask_function(2))
    assert (both.causal, both.window) == (False, (2, 2))
    documents = torch.tensor([[0, 0, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    remap = getattr(hf, "remap_positions_for_packed_sequence", None)  # from transformers 5.23
    causal = hf.causal_mask_function if remap is None else remap(hf.causal_mask_function, positions)
    packed = read_pattern(hf.and_masks(causal, hf.packed_sequence_mask_function(documents)))
    assert packed.causal and packed.documents is documents
    assert read_pattern(hf.chunked_causal_mask_function(3, torch.zeros(1))) is None
    two = hf.and_masks(
        hf.packed_sequence_mask_function(documents), hf.packed_sequence_mask_function(documents)
    )
    assert read_pattern(two) is None  # two sets of documents: evaluated as it is
    assert read_pattern(lambda b, h, q, kv: q >= kv) is None


def dense(batch, q_length, kv_length, q_offset, kv_offset, mask_function, padding):
    """transformers' own dense bool mask for the same request."""
    return hf.sdpa_mask(
        batch_size=batch, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=padding,
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
    )  # fmt: skip


CASES = {  # (mask function, q_length, kv_length, q_offset, kv_offset, padded)
    "causal": (hf.causal_mask_function, 6, 6, 0, 0, False),
    "causal, a cache": (hf.causal_mask_function, 2, 9, 7, 0, True),
    "causal, a static cache's buffer": (hf.causal_mask_function, 3, 16, 5, 0, True),
    "sliding window cache": (hf.sliding_window_causal_mask_function(4), 2, 5, 9, 6, False),
    "bidirectional, padded": (hf.bidirectional_mask_function, 7, 7, 0, 0, True),
    "bidirectional window, padded": (
        hf.sliding_window_bidirectional_mask_function(2), 7, 7, 0, 0, True
    ),
    "cross-attention: 3 queries, 9 keys": (hf.bidirectional_mask_function, 3, 9, 0, 0, True),
    "packed rows of a batch of 2": (
        hf.and_masks(
            hf.causal_mask_function,
            hf.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])),
        ),
        6, 6, 0, 0, False,
    ),
    "chunked (evaluated as it is)": (
        hf.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)), 8, 8, 0, 0, True
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_attention_under_the_mask_equals_attention_under_transformers_dense_mask(case):
    fn, t, kv_length, q_offset, kv_offset, padded = CASES[case]
    padding = torch.ones(2, kv_offset + kv_length, dtype=torch.bool)
    if padded:
        padding[1, :2] = False
    mask = mask_builder(2, t, kv_length, q_offset, kv_offset, fn, padding)
    assert isinstance(mask, HFMask)
    q = torch.randn(2, 4, t, 8)
    k, v = torch.randn(2, 2, kv_length, 8), torch.randn(2, 2, kv_length, 8)
    keys, options = mask.options(kv_length)
    if case.startswith(("chunked", "packed")):
        assert "mask_mod" in options
    else:
        assert "mask_mod" not in options and "attn_mask" not in options
    out = attention(q, k[:, :, :keys], v[:, :, :keys], **options)
    allowed = dense(2, t, kv_length, q_offset, kv_offset, fn, padding)
    expected = attention(q, k, v, attn_mask=allowed, backend="reference")
    torch.testing.assert_close(out, expected)


def test_older_transformers_cache_position_gives_the_queries():
    mask = mask_builder(1, kv_length=9, cache_position=torch.arange(7, 9))
    assert (mask.q_length, mask.q_offset) == (2, 7)


def test_offsets_that_are_tensors_are_evaluated_as_they_are_past_the_padding_given():
    """Under tracing the offsets are tensors: the keys are not cut, and a 2-D mask shorter than
    the cache's buffer counts its missing columns as padding."""
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[1, :2] = False
    mask = HFMask(2, 3, 16, torch.tensor(5), 0, hf.causal_mask_function, padding)
    keys, options = mask.options(16)
    assert keys == 16 and "mask_mod" in options
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    out = attention(q, k, v, **options)
    allowed = dense(2, 3, 16, 5, 0, hf.causal_mask_function, padding)
    torch.testing.assert_close(out, attention(q, k, v, attn_mask=allowed, backend="reference"))


def test_the_builder_keeps_a_static_caches_steps_in_tensors_of_one_shape():
    """generate builds the mask outside the compiled forward at each step: the 2-D mask grows and
    the offset moves, which would specialise the graph to each step if they reached it as such."""
    masks = [
        mask_builder(2, 1, 16, torch.tensor(n), 0, hf.causal_mask_function, torch.ones(2, n + 1))
        for n in (9, 10)
    ]
    assert [m.padding.shape for m in masks] == [(2, 16), (2, 16)]
    assert [m.padding[:, : n + 1].all().item() for m, n in zip(masks, (9, 10))] == [True, True]
    assert [m.padding[:, n + 1 :].any().item() for m, n in zip(masks, (9, 10))] == [False, False]
    assert all(isinstance(m.q_offset, torch.Tensor) for m in masks)
    assert [m.q_start for m in masks] == [9, 10]


def test_indexed_as_a_tensor_it_is_the_dense_mask_it_stands_for():
    """DeepSeek-V3.2's indexer reads ``attention_mask[:, 0, :, :]``; a tuple's own items stay."""
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[1, :2] = False
    mask = HFMask(2, 4, 6, 2, 0, hf.causal_mask_function, padding)
    rows = mask[:, 0, :, :]
    assert rows.dtype == torch.bool and rows.shape == (2, 4, 6)
    torch.testing.assert_close(rows, mask.allowed(6)[:, 0])
    assert not rows[1, :, :2].any() and rows[0, 0].tolist() == [True] * 3 + [False] * 3
    assert mask[1] == 4 and mask[:2] == (2, 4) and mask.q_length == 4
    on_meta = mask_builder(2, 4, 6, 2, 0, hf.causal_mask_function, device=torch.device("meta"))
    assert on_meta[:, 0].device.type == "meta"  # the model's device, as transformers names it
