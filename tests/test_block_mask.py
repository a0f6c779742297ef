"""attnkit.create_block_mask: torch's block tables, built without the dense mask; and a block
mask's mask_mod evaluated at every batch and head of a call."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import attnkit
from attnkit import flex_attention
from attnkit import functional as F
from attnkit.block_mask import create_block_mask, window_of
from attnkit.functional import attention, which_backend
from helpers.devices import CUDA
from helpers.zoo import BACKENDS, ZOO, H, inputs, zoo_on

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize(
    ("block_size", "device"),
    [
        *(pytest.param(size, torch.device("cpu"), id=f"{size}-cpu") for size in (4, (4, 8), 8, 16)),
        pytest.param(128, torch.device("cpu"), id="128-cpu"),
        pytest.param((4, 8), torch.device("cuda"), id="(4, 8)-cuda", marks=CUDA.marks),
    ],
)
@pytest.mark.parametrize("heads", [None, H])
@pytest.mark.parametrize("mod", [m for m, (_, mask_mod) in ZOO.items() if mask_mod is not None])
def test_create_block_mask_gives_torch_block_tables(mod, heads, block_size, device):
    _, mask_mod = zoo_on(device)[mod]
    ours = attnkit.create_block_mask(mask_mod, 2, heads, 29, 29, device, block_size)
    theirs = torch_flex.create_block_mask(mask_mod, 2, heads, 29, 29, device, block_size)
    assert type(ours) is torch_flex.BlockMask
    assert (ours.BLOCK_SIZE, ours.seq_lengths) == (theirs.BLOCK_SIZE, theirs.seq_lengths)
    for num, indices in (
        ("kv_num_blocks", "kv_indices"),
        ("full_kv_num_blocks", "full_kv_indices"),
    ):
        n = getattr(ours, num)
        assert torch.equal(n, getattr(theirs, num))
        flat_ours = getattr(ours, indices).flatten(0, 2)
        flat_theirs = getattr(theirs, indices).flatten(0, 2)
        for a, b, count in zip(flat_ours, flat_theirs, n.flatten().tolist()):  # past n: padding
            assert set(a[:count].tolist()) == set(b[:count].tolist())


def test_create_block_mask_never_builds_the_dense_mask(tmp_path):
    """A subprocess builds the causal mask of 65536 x 65536 (4 GiB as a dense bool mask) and
    reports how much its peak memory grew."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import resource, torch, attnkit\n"
        "def mask(b, h, q, kv):\n"
        "    return q >= kv\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "m = attnkit.create_block_mask(mask, None, None, 65536, 65536, 'cpu')\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(int(m.kv_num_blocks.sum()), int(m.full_kv_num_blocks.sum()), (after - before) // 1024)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    partial, full, extra_mib = map(int, run.stdout.split())
    assert (partial, full) == (512, 512 * 511 // 2)  # the diagonal's blocks, and those below it
    assert extra_mib < 256, f"{extra_mib} MiB: the dense mask would be 4096 MiB"


def test_a_block_mask_for_one_batch_and_head_still_sees_every_batch_and_head(device):
    """torch evaluates a mask_mod at the call's batches and heads, even in tables built with
    B=None, H=None (for batch 0 and head 0)."""

    def depends(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((kv_idx % 2 == 0) | (h == 1) | (b == 1))

    q, k, v = inputs(2, H, 29, 29, device=device)
    block_mask = torch_flex.create_block_mask(depends, None, None, 29, 29, device, BLOCK_SIZE=8)
    want = torch_flex.flex_attention(q, k, v, block_mask=block_mask)
    for backend in BACKENDS:
        out = F.attention(q, k, v, block_mask=block_mask, backend=backend)
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    ("name", "mask_mod", "t", "s", "window"),
    [
        ("causal", lambda b, h, q, k: q >= k, 300, 300, (-1, 0)),
        ("causal, bottom-right", lambda b, h, q, k: q + 50 >= k, 250, 300, (-1, 0)),
        ("causal, top-left", lambda b, h, q, k: q >= k, 250, 300, None),
        ("sliding", lambda b, h, q, k: (q >= k) & (q - k < 64), 500, 500, (63, 0)),
        ("band", lambda b, h, q, k: (k - q).abs() <= 5, 300, 300, (5, 5)),
        ("everything", lambda b, h, q, k: q >= 0, 200, 300, (-1, -1)),
        ("documents", lambda b, h, q, k: q // 100 == k // 100, 300, 300, None),
        ("strictly before", lambda b, h, q, k: q > k, 300, 300, None),
        ("a hole", lambda b, h, q, k: (q >= k) & ((q != 5) | (k != 3)), 64, 64, None),
    ],
)
def test_a_block_mask_that_is_a_window_is_known_as_one(name, mask_mod, t, s, window):
    mask = create_block_mask(mask_mod, None, None, t, s, "cpu", 64)
    assert window_of(mask, 1, 2) == window
    q = torch.randn(1, 2, t, 8)
    k = torch.randn(1, 2, s, 8)
    got = attention(q, k, k, block_mask=mask, backend="tiled")
    torch.testing.assert_close(got, attention(q, k, k, block_mask=mask, backend="reference"))


def test_a_causal_block_mask_runs_the_kernel_of_causal_true():
    """FlexAttention's way of writing it, and attnkit's, run one kernel: a causal block mask
    needs no mask per score."""
    table = torch.randn(2, 511, requires_grad=True)

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 255]

    q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, "cpu")
    by_mask = which_backend(q, k, v, score_mod=rel, block_mask=mask)
    assert by_mask == which_backend(q, k, v, score_mod=rel, causal=True)
    out = flex_attention(q, k, v, score_mod=rel, block_mask=mask)
    want = attention(q, k, v, score_mod=rel, causal=True, backend="reference")
    torch.testing.assert_close(out, want)
    for got, expected in zip(
        torch.autograd.grad(out.sum(), (q, k, v, table)),
        torch.autograd.grad(want.sum(), (q, k, v, table)),
    ):
        torch.testing.assert_close(got, expected)


def test_a_mask_per_batch_or_head_is_not_looked_at():
    mask = create_block_mask(lambda b, h, q, k: q >= k, 1, 2, 64, 64, "cpu")
    assert window_of(mask, 1, 2) is None


def test_a_shared_table_whose_mask_differs_by_head_is_no_window():
    """Tables built with H None, a mask_mod that reads the head: the call applies it per head in
    the partial blocks, so it is a window for head 0 only, and runs as the block mask it is."""

    def causal_or_even_keys(b, h, q, k):
        return (q >= k) & ((h == 0) | (k % 2 == 0))

    mask = create_block_mask(causal_or_even_keys, None, None, 256, 256, "cpu")
    assert window_of(mask, 1, 1) == (-1, 0) and window_of(mask, 1, 2) is None
    q = torch.randn(1, 2, 256, 8)
    got = attention(q, q, q, block_mask=mask, backend="tiled")
    torch.testing.assert_close(got, attention(q, q, q, block_mask=mask, backend="reference"))
