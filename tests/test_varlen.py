"""Packed sequences: document_mask and varlen_attention equal each sequence run alone."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import attnkit
from attnkit import functional as F
from helpers.devices import CUDA

LENGTHS_Q = [5, 1, 12, 9]
LENGTHS_K = [5, 7, 12, 14]  # a sequence may hold more keys than queries (bottom-right aligned)


def cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)


@pytest.mark.parametrize(
    ("block_size", "device"),
    [
        *(pytest.param(size, torch.device("cpu"), id=f"{size}-cpu") for size in (4, (4, 8), 128)),
        pytest.param(128, torch.device("cuda"), id="128-cuda", marks=CUDA.marks),
    ],
)
@pytest.mark.parametrize(
    ("causal", "window"), [(False, None), (True, None), (True, (3, 0)), (False, (2, 1))]
)
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_varlen_equals_each_sequence_alone_forward_and_backward(
    causal, window, h_kv, block_size, device
):
    total_q, total_k = sum(LENGTHS_Q), sum(LENGTHS_K)
    q = torch.randn(total_q, 4, 8, requires_grad=True, device=device)
    k, v = (torch.randn(total_k, h_kv, 8, requires_grad=True, device=device) for _ in range(2))
    cu_q, cu_k = cu(LENGTHS_Q, device), cu(LENGTHS_K, device)
    out, lse = attnkit.varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(LENGTHS_Q),
        max(LENGTHS_K),
        causal=causal,
        window=window,
        return_lse=True,
        block_size=block_size,
    )
    assert out.shape == (total_q, 4, 8) and lse.shape == (4, total_q)
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), cotangent)
    alone_out, alone_grads = [], [torch.zeros_like(x) for x in (q, k, v)]
    for i in range(len(LENGTHS_Q)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        parts = [
            x[r].detach().transpose(0, 1)[None].requires_grad_()
            for x, r in ((q, rows), (k, keys), (v, keys))
        ]
        o = F.attention(*parts, causal=causal, window=window, backend="reference")
        g = torch.autograd.grad(o, parts, cotangent[rows].transpose(0, 1)[None])
        alone_out.append(o[0].transpose(0, 1))
        for acc, part, r in zip(alone_grads, g, (rows, keys, keys)):
            acc[r] = part[0].transpose(0, 1)
    torch.testing.assert_close(out, torch.cat(alone_out))
    for g, w in zip(grads, alone_grads):
        torch.testing.assert_close(g, w)


def test_document_mask_equals_torch_block_tables_of_the_same_mask(device):
    documents = torch.tensor([0] * 5 + [1] * 1 + [2] * 12 + [3] * 9, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)

    ours = attnkit.document_mask(documents, causal=True, BLOCK_SIZE=4)
    theirs = torch_flex.create_block_mask(mask_mod, None, None, 27, 27, device, BLOCK_SIZE=4)
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    same = attnkit.document_mask(cu_seqlens=cu([5, 1, 12, 9], device), causal=True, BLOCK_SIZE=4)
    assert torch.equal(same.kv_indices, ours.kv_indices)


def test_packed_training_through_document_mask_skips_the_blocks_between_documents(device):
    documents = torch.arange(64, device=device) // 16  # four documents of 16 tokens
    mask = attnkit.document_mask(documents, causal=True, BLOCK_SIZE=8)
    assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) == 4 * 3  # of 64 blocks


@pytest.mark.parametrize(
    ("cu_q", "message"),
    [
        (torch.tensor([0, 5, 3, 27]), "must not decrease"),
        (torch.tensor([0, 5, 20]), "must end at the total length 27"),
        (torch.tensor([1, 5, 27]), "must start at 0"),
        (torch.tensor([0.0, 27.0]), "1-D integer tensor"),
        (torch.tensor([0, 27]), "1 documents and the keys 4"),
    ],
)
def test_bad_cu_seqlens_raise_naming_them(cu_q, message):
    q = torch.randn(27, 2, 8)
    k = v = torch.randn(sum(LENGTHS_K), 2, 8)
    with pytest.raises((ValueError, TypeError), match=message):
        attnkit.varlen_attention(q, k, v, cu_q, cu(LENGTHS_K))


def test_documents_must_be_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        attnkit.document_mask(torch.tensor([0, 0, 1, 0]))
