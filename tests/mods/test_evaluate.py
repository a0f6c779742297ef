"""attnkit.mods.evaluate: a mod over a block of scores (broadcast against the block, else one
score at a time under vmap; of fewer dims; without the score), and the errors that name the
function and the block."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from attnkit import functional as F
from attnkit import mods
from attnkit.block_mask import create_block_mask
from attnkit.mods import Block
from helpers.zoo import BACKENDS, TABLE, H, causal, inputs, oracle, relative_bias


def test_a_mod_that_broadcasting_does_not_fit_runs_under_vmap():
    shapes = []

    def per_head_then_distance(score, b, h, q_idx, kv_idx):  # bias[h] then [distance]: 1-D only
        shapes.append(tuple(q_idx.shape))
        return score + TABLE[h][q_idx - kv_idx + 28]

    q, k, v = inputs(1, H, 29, 29)
    out = F.attention(q, k, v, score_mod=per_head_then_distance, backend="tiled")
    assert (1, 1, 5, 1) in shapes and () in shapes  # tried broadcast, then ran scalar by scalar
    torch.testing.assert_close(out, oracle(q, k, v, relative_bias(TABLE))[0].float())


def test_the_gradient_of_a_mod_that_needs_vmap_reaches_its_table():
    """f runs one score at a time (broadcasting does not fit it), forward and backward."""
    table = TABLE.clone().requires_grad_()

    def stacks(score, b, h, q_idx, kv_idx):
        d = torch.stack([q_idx, kv_idx])
        return score + table[h, d[0] - d[1] + 28]

    q, k, v = inputs(1, H, 13, 13)
    assert F.which_backend(q, k, v, score_mod=stacks).path == "native"
    (got,) = torch.autograd.grad(F.attention(q, k, v, score_mod=stacks).sum(), table)
    table64 = TABLE.double().requires_grad_()
    want = F.attention(
        q.double(), k.double(), v.double(), score_mod=relative_bias(table64), backend="reference"
    )
    (want,) = torch.autograd.grad(want.sum(), table64)
    torch.testing.assert_close(got, want.float())


def test_a_mod_that_fails_on_a_later_tile_in_the_kernel_names_itself_and_the_block():
    """The mod passes the one-score check (indices 0), then indexes past its table."""
    small = torch.randn(H, 5)

    def too_short(score, b, h, q_idx, kv_idx):
        return score + small[h, q_idx - kv_idx + 2]

    q, k, v = inputs(1, H, 13, 13)
    assert F.which_backend(q, k, v, score_mod=too_short).path == "native"
    with pytest.raises(IndexError, match=r"score_mod .*too_short failed on the block of queries"):
        F.attention(q, k, v, score_mod=too_short)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_mods_and_block_masks_raise_naming_them(backend):
    q, k, v = inputs(1, H, 29, 29)

    def raises(score, b, h, q_idx, kv_idx):
        raise ValueError("no")

    def not_bool(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def reshapes(score, b, h, q_idx, kv_idx):
        return score.unsqueeze(-1)  # one score becomes a vector of one

    def retypes(score, b, h, q_idx, kv_idx):
        return score.half()

    call = {"backend": backend}
    with pytest.raises(ValueError, match=r"score_mod .*raises.* failed on the block of queries"):
        F.attention(q, k, v, score_mod=raises, **call)
    with pytest.raises(TypeError, match=r"mask_mod .*not_bool.* returned torch.int64"):
        F.attention(q, k, v, mask_mod=not_bool, **call)
    with pytest.raises(ValueError, match=r"score_mod .*reshapes.* changed the shape"):
        F.attention(q, k, v, score_mod=reshapes, **call)
    with pytest.raises(TypeError, match=r"score_mod .*retypes.* returned torch.float16"):
        F.attention(q, k, v, score_mod=retypes, **call)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(29, 30\)"):
        F.attention(
            q, k, v, block_mask=create_block_mask(causal, None, None, 29, 30, "cpu"), **call
        )
    with pytest.raises(ValueError, match="block_mask or mask_mod, not both"):
        F.attention(
            q,
            k,
            v,
            block_mask=create_block_mask(causal, None, None, 29, 29, "cpu"),
            mask_mod=causal,
            **call,
        )
    with pytest.raises(TypeError, match="block_mask must be a torch BlockMask"):
        F.attention(q, k, v, block_mask=torch.ones(29, 29, dtype=torch.bool), **call)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        F.attention(q, k, v, score_mod=3.0, **call)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mods_of_fewer_dims_or_without_the_score_and_blocks_without_mask_mod(backend):
    table = torch.randn(H, 13, requires_grad=True)
    q, k, v = (x.requires_grad_() for x in inputs(1, H, 13, 13))

    def per_head_only(score, b, h, q_idx, kv_idx):  # (1, H, 1, 1): a smaller block
        return score + table[h, 0]

    def ignores_the_score(score, b, h, q_idx, kv_idx):
        return table[h, (q_idx - kv_idx).abs()].to(score.dtype)

    for mod in (per_head_only, ignores_the_score):
        out = F.attention(q, k, v, score_mod=mod, backend=backend)
        out64, _ = oracle(q, k, v, mod)
        torch.testing.assert_close(out, out64.float())
        out.sum().backward()
    listed = torch_flex.BlockMask.from_kv_blocks(  # no mask_mod: torch's noop_mask
        torch.tensor([[[1, 1]]], dtype=torch.int32),
        torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32),
        BLOCK_SIZE=8,
        seq_lengths=(13, 13),
    )
    out = F.attention(q, k, v, block_mask=listed, backend=backend)
    # the tables decide, as in torch's compiled kernel (its eager path reads only the mask_mod)
    diagonal = torch.zeros(13, 13, dtype=torch.bool)
    diagonal[:8, :8] = diagonal[8:, 8:] = True
    torch.testing.assert_close(out, F.attention(q, k, v, attn_mask=diagonal, backend="reference"))


def test_a_block_is_four_broadcast_index_tensors_that_say_where_they_are():
    at = Block.of(range(2), range(1, 4), range(5, 9), range(10, 17))
    assert at.shape == (2, 3, 4, 7)
    assert [tuple(x.shape) for x in at] == [(2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 4, 1), (1, 1, 1, 7)]
    assert at.h.flatten().tolist() == [1, 2, 3] and at.kv.dtype == torch.int64
    assert at.where() == "the block of queries 5..8 and keys 10..16"


def test_a_mod_that_broadcasts_runs_once_over_the_block():
    calls = []

    def causal_mask(b, h, q_idx, kv_idx):
        calls.append(q_idx.shape)
        return q_idx >= kv_idx

    at = Block.of(range(1), range(2), range(4), range(6))
    allowed = mods.mask(causal_mask, at)
    assert calls == [(1, 1, 4, 1)] and allowed.shape == (1, 1, 4, 6)
    assert torch.equal(allowed[0, 0], torch.arange(4)[:, None] >= torch.arange(6))
    assert mods.mask(torch_flex.noop_mask, at).shape == (1, 1, 1, 1)  # torch's "no mask": all True


def test_a_score_mod_of_fewer_dims_gets_a_block_of_its_own_and_a_float64_one_is_cast_if_allowed():
    at = Block.of(range(1), range(2), range(3), range(4))
    scores = torch.zeros(1, 2, 3, 4)
    per_head = mods.score(lambda s, b, h, q, kv: h.to(s.dtype), scores, at)  # (1, 2, 1, 1)
    assert per_head.shape == scores.shape and per_head.is_contiguous()
    assert per_head[0, :, 0, 0].tolist() == [0.0, 1.0]
    in_float64 = lambda s, b, h, q, kv: s.double() + q  # noqa: E731
    assert mods.score(in_float64, scores, at, also=torch.float64).dtype == torch.float32
    with pytest.raises(TypeError, match=r"returned torch.float64 for the block of queries 0..2"):
        mods.score(in_float64, scores, at)


def test_the_bias_of_a_mod_that_adds_and_its_tables_gradient():
    table = torch.randn(2, 9, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 4]

    at = Block.of(range(1), range(2), range(3), range(5))
    f = mods.bias(relative, at)
    want = table[torch.arange(2)[:, None, None], torch.arange(3)[:, None] - torch.arange(5) + 4]
    torch.testing.assert_close(f.expand(1, 2, 3, 5)[0], want)
    dbias = torch.randn(1, 2, 3, 5)
    (grad,) = mods.bias_grads(relative, at, dbias, (table,))
    (expected,) = torch.autograd.grad(want, table, dbias[0])
    torch.testing.assert_close(grad, expected)
    constant = mods.bias_grads(lambda s, b, h, q, kv: s + 1.0, at, dbias, (table,))
    assert constant == (None,)  # a bias that reads no tensor


def test_mods_at_positions_see_the_chunks_place_in_the_sequence():
    def mod(score, b, h, q_idx, kv_idx):
        return score + q_idx * 100 + kv_idx

    def mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    given = {"score_mod": mod, "mask_mod": mask, "causal": True}
    assert mods.at_positions(given, 0, 0) is given
    shifted = mods.at_positions(given, 7, 3)
    assert shifted["causal"] is True and shifted["score_mod"].__wrapped__ is mod
    assert mods.name_of(shifted["mask_mod"]) == mods.name_of(mask)
    at = Block.of(range(1), range(1), range(2), range(2))
    score = mods.score(shifted["score_mod"], torch.zeros(1, 1, 2, 2, dtype=torch.int64), at)
    assert score[0, 0].tolist() == [[703, 704], [803, 804]]
    assert mods.mask(shifted["mask_mod"], at)[0, 0].all()  # queries 7, 8 see keys 3, 4
