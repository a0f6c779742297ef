"""attnkit.backends.torch_flex_masks: the block masks the flex backend hands torch's FlexAttention,
built from attnkit's masks and a caller's block mask, checked densely against their parts without
running a kernel."""

from __future__ import annotations

import pytest
import torch

from attnkit import block_mask as block_tables
from attnkit import create_block_mask
from attnkit.backends import torch_flex_masks as flex_masks
from attnkit.functional import checked_call
from helpers.oracle import allowed_positions
from helpers.zoo import document_of

COMBINED = {
    "window": {"window": (20, 0)},
    "blocks of 16": {"block_mask": 16},
    "causal and blocks of 16": {"causal": True, "block_mask": 16},
    "window and blocks of 256": {"window": (40, 3), "block_mask": 256},
}


@pytest.mark.parametrize("name", COMBINED)
@pytest.mark.parametrize("all_partial", [False, True])
def test_combined_block_masks_allow_what_their_parts_allow_and_are_built_once(name, all_partial):
    """The tables of a window and a caller's block mask (regridded to 128 where its blocks are
    smaller), checked densely against both parts, without running a kernel."""
    t = s = 300
    q = torch.randn(2, 2, t, 16)
    document, dense = document_of(t, "cpu")
    options = dict(COMBINED[name])
    if "block_mask" in options:
        size = options["block_mask"]
        options["block_mask"] = create_block_mask(document, 2, None, t, s, "cpu", BLOCK_SIZE=size)
    call = checked_call(q, q, q, **options)
    built = flex_masks.structure(call, all_partial=all_partial)
    assert flex_masks.structure(call, all_partial=all_partial) is built  # from the cache
    assert (
        built.BLOCK_SIZE[0] % flex_masks.BLOCK == 0 and built.BLOCK_SIZE[1] % flex_masks.BLOCK == 0
    )
    want = allowed_positions(t, s, options.get("causal", False), options.get("window"))
    if "block_mask" in options:
        want = want & dense
    torch.testing.assert_close(
        block_tables.allowed(built, 2, 2).expand(2, 2, t, s), want.expand(2, 2, t, s)
    )
    if all_partial:
        assert built.full_kv_num_blocks is None


def test_a_block_mask_alone_passes_as_it_is():
    q = torch.randn(1, 2, 300, 16)
    document, _ = document_of(300, "cpu")
    alone = create_block_mask(document, None, None, 300, 300, "cpu")
    assert flex_masks.structure(checked_call(q, q, q, block_mask=alone), all_partial=False) is alone
