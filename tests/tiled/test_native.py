"""The tiled backend's C++ kernel as attnkit.tiled.native drives it: when it runs
(kernel_for) and how it multiplies bf16 blocks (pair_products, products); a mod that adds to
the score, asked for its bias a tile at a time (tiles), and its gradients; against the
float64 reference and the 2x/3x rule in bf16."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import functional as F
from attnkit.force import forced
from attnkit.functional import checked_call
from attnkit.tiled import plans as tiled_plans
from attnkit.tiled.loop import Plan
from attnkit.tiled.native import tiles
from attnkit.tiled.plans import KERNEL, TiledRoute, kernel_for, pair_products, products
from helpers.zoo import (
    SHAPES,
    SLOPES,
    T5_TABLE,
    TABLE,
    H,
    alibi,
    assert_bf16_rule,
    inputs,
    relative_bias,
    t5_bias,
)


def test_bf16_runs_the_kernel_only_where_its_build_has_avx512_bf16():
    """Elsewhere the portable pair products would be the slow way: the loop multiplies in bf16."""
    kernel = tiled_plans.KERNEL.load()
    has = bool(kernel.has_avx512_bf16())
    assert pair_products(KERNEL) == ("avx512_bf16" if has else None)
    cpu = torch.device("cpu")
    assert (kernel_for(cpu, torch.bfloat16) is not None) == has
    assert kernel_for(cpu, torch.float32) is KERNEL
    # a build has vdpbf16ps exactly when it was built for a CPU with AVX512-BF16
    assert kernel.has_avx512_bf16() == ("avx512bf16" in tiled_plans.KERNEL.name())
    assert tiled_plans.KERNEL.name() == kernel.__name__  # once loaded, the loaded build's name


def _adding_mods(table, t5_table):
    """Mods that add to the score, reading ``table`` and ``t5_table``."""

    def per_head(score, b, h, q_idx, kv_idx):  # f of shape (1, H, 1, 1)
        return score + table[h, 0]

    def every_third_key_masked(score, b, h, q_idx, kv_idx):  # causal: query 0 has no key left
        return score + torch.where(kv_idx % 3 == 0, -math.inf, table[h, q_idx - kv_idx + 28])

    return {
        "relative bias": relative_bias(table),
        "ALiBi": alibi,
        "T5 buckets": t5_bias(t5_table),
        "per head": per_head,
        "every third key masked": every_third_key_masked,
    }


def _adding_options(name, b, t, s):
    allowed = torch.rand(b, 1, t, s) > 0.2
    allowed[..., 1] = True
    return {
        "plain": {},
        "causal": {"causal": True},
        "window, key padding": {
            "window": (6, 2),
            "key_mask": torch.arange(s).expand(b, s) < s - 3,
        },
        "ALiBi, soft-cap, scale": {"alibi_slopes": SLOPES, "softcap": 2.0, "scale": 0.5},
        "bool attn_mask": {"attn_mask": allowed},
        "float attn_mask": {"attn_mask": torch.randn(1, H, t, s).masked_fill(~allowed[:1], -1e9)},
    }[name]


ADDING_OPTIONS = [
    "plain",
    "causal",
    "window, key padding",
    "ALiBi, soft-cap, scale",
    "bool attn_mask",
    "float attn_mask",
]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("options", ADDING_OPTIONS)
@pytest.mark.parametrize("mod", list(_adding_mods(TABLE, T5_TABLE)))
def test_mods_that_add_run_in_the_kernel_tile_by_tile_and_equal_the_oracle(
    mod, options, shape, monkeypatch
):
    """Outputs, lse and the gradients of q, k, v and of the tables the mod reads, against the
    reference backend in float64, with the mod's bias asked for in many tiles."""
    from attnkit import mods

    b, h_kv, t, s = SHAPES[shape]
    given = _adding_options(options, b, t, s)
    tables = [TABLE.clone().requires_grad_(), T5_TABLE.clone().requires_grad_()]
    score_mod = _adding_mods(*tables)[mod]
    tensors = [x.requires_grad_() for x in inputs(b, h_kv, t, s)]
    assert F.which_backend(*tensors, score_mod=score_mod, **given).path == "native"
    tiles = []
    bias = mods.bias
    monkeypatch.setattr(
        mods, "bias", lambda fn, at, **kw: tiles.append(at.shape) or bias(fn, at, **kw)
    )
    out, lse = F.attention(*tensors, score_mod=score_mod, return_lse=True, **given)
    assert len(tiles) > 2, tiles  # panels of 5 queries, tiles of 14 keys
    cotangent, lse_cotangent = (
        torch.randn_like(out),
        torch.randn_like(lse).masked_fill(lse.isinf(), 0),
    )
    got = torch.autograd.grad(
        (out, lse), [*tensors, *tables], (cotangent, lse_cotangent), allow_unused=True
    )

    wrt64 = [x.detach().double().requires_grad_() for x in [*tensors, *tables]]
    mod64 = _adding_mods(*wrt64[3:])[mod]
    given64 = {
        key: value.double()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for key, value in given.items()
    }
    out64, lse64 = F.attention(
        *wrt64[:3], score_mod=mod64, return_lse=True, backend="reference", **given64
    )
    torch.testing.assert_close(out, out64.float())
    torch.testing.assert_close(lse, lse64.float())
    finite_lse = torch.where(lse64.isinf(), 0, lse64)
    want = torch.autograd.grad(
        (out64, finite_lse), wrt64, (cotangent.double(), lse_cotangent.double()), allow_unused=True
    )
    for g, w in zip(got, want):
        if w is None or not w.any():
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w.float())


@pytest.mark.parametrize("mod", ["relative bias", "T5 buckets"])
def test_mods_compiled_for_long_calls_equal_the_oracle_in_the_kernel(mod, monkeypatch):
    """From ``COMPILE_FROM`` scores the tiles' bias comes from the compiled mod: in the forward
    without autograd's graph, in the backward with it (one evaluation for both the weights and
    the tables' gradient). The same outputs, lse and gradients as the float64 reference."""
    from attnkit import mods

    monkeypatch.setattr(mods, "COMPILE_FROM", 0)  # as if the call were long
    compiled = []
    bias = mods.bias
    monkeypatch.setattr(
        mods, "bias", lambda fn, at, **kw: compiled.append(kw.get("compiled")) or bias(fn, at, **kw)
    )
    test_mods_that_add_run_in_the_kernel_tile_by_tile_and_equal_the_oracle(
        mod, "causal", "GQA, t < s", monkeypatch
    )
    assert compiled and all(compiled), compiled  # every tile, forward and backward


@pytest.mark.parametrize("path", ["tiled", "tiled:half"])
def test_bf16_mods_that_add_in_the_kernel_keep_the_2x_3x_rule(path, forcing):
    """The kernel's bf16 inputs, multiplied in float32 or (``tiled:half``) in bf16 pairs."""
    backend = forcing(path)
    b, h_kv, t, s = SHAPES["GQA, t < s"]
    table = TABLE.bfloat16().requires_grad_()
    tensors = [x.bfloat16().requires_grad_() for x in inputs(b, h_kv, t, s)]
    score_mod = relative_bias(table)
    assert F.which_backend(*tensors, score_mod=score_mod, causal=True, backend=backend).path == (
        "native"
    )
    out = F.attention(*tensors, score_mod=score_mod, causal=True, backend=backend)
    wrt = [*tensors, table]
    grads = torch.autograd.grad(out, wrt, torch.ones_like(out))
    naive = [x.detach().requires_grad_() for x in wrt]  # the textbook formula, in bf16
    q, k, v = (
        x.repeat_interleave(H // x.shape[1], dim=1) if x.dim() == 4 else x for x in naive[:3]
    )
    rows, keys = torch.arange(t)[:, None], torch.arange(s)
    scores = (
        q @ k.transpose(-2, -1) * 8**-0.5
        + naive[3][torch.arange(H)[:, None, None], rows - keys + 28]
    )
    scores = scores.masked_fill(keys > rows + s - t, -math.inf)
    naive_out = torch.softmax(scores, dim=-1) @ v
    naive_grads = torch.autograd.grad(naive_out, naive, torch.ones_like(naive_out))
    exact = [x.detach().double().requires_grad_() for x in wrt]
    exact_out = F.attention(
        *exact[:3], score_mod=relative_bias(exact[3]), causal=True, backend="reference"
    )
    exact_grads = torch.autograd.grad(exact_out, exact, torch.ones_like(exact_out))
    assert_bf16_rule((out, *grads), (naive_out, *naive_grads), (exact_out, *exact_grads))


def test_kernel_for_takes_float32_and_bf16_products_on_a_cpu_only():
    cpu = torch.device("cpu")
    assert kernel_for(cpu, torch.float32) is KERNEL
    for dtype in (torch.float64, torch.float16):
        assert kernel_for(cpu, dtype) is None
    assert kernel_for(torch.device("meta"), torch.float32) is None
    for path in ("tiled:loop", "tiled:half-loop"):
        with forced(path):
            assert kernel_for(cpu, torch.float32) is None
    for path in ("tiled:half", "tiled:portable"):  # bf16 products in the kernel on any CPU
        with forced(path):
            assert kernel_for(cpu, torch.bfloat16) is KERNEL


def test_products_name_how_the_kernel_multiplies_each_dtypes_blocks():
    built = "avx512_bf16" if KERNEL.load().has_avx512_bf16() else None
    assert products(KERNEL, torch.float32) == "float32"
    assert products(KERNEL, torch.bfloat16) == f"bf16-{built}"
    with forced("tiled:portable"):
        assert pair_products(KERNEL) == "portable"
        assert products(KERNEL, torch.bfloat16) == "bf16-portable"
    with forced("tiled:half"):  # the build's vdpbf16ps where it has it, else the portable sums
        assert pair_products(KERNEL) == (built or "portable")
    with forced("tiled:loop"):
        assert pair_products(KERNEL) == built


def _plan(score_mod=None, b=2, h=4, h_kv=2, t=29, s=41, tile_bytes=4 * 8 * 5 * 14):
    q, k = torch.randn(b, h, t, 8), torch.randn(b, h_kv, s, 8)
    call = checked_call(q, k, k, score_mod=score_mod)
    return Plan.of(call, TiledRoute(torch.float32, None, None, 5, 7, tile_bytes))


def test_a_call_without_score_mod_is_one_tile_of_whole_blocks():
    tiling = tiles(_plan())
    assert (tiling.rows, tiling.keys) == (30, 42)  # 29 and 41 rounded up to blocks of 5 and 7
    assert tiling.mod_bias is None and tiling.mod_bias_grad is None


def test_a_mod_that_adds_is_asked_for_its_bias_in_tiles_of_about_tile_bytes(monkeypatch):
    table = torch.randn(H, 80)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 40]

    plan = _plan(bias)
    tiling = tiles(plan)
    assert tiling.rows % 5 == 0 and 5 <= tiling.rows <= 30
    assert tiling.keys % 7 == 0 and 7 <= tiling.keys <= 42
    tile_bytes = 4 * 2 * H * tiling.rows * tiling.keys  # float32, every batch row and head
    assert tile_bytes <= plan.tile_bytes or tiling.keys == 7  # one key block at least
    assert tiling.keys < 42  # the tests' small tile_bytes: several tiles of keys
    got = tiling.mod_bias(5, 10, 14, 21)
    rows, keys = torch.arange(5, 10)[:, None], torch.arange(14, 21)
    want = table[torch.arange(H)[:, None, None], rows - keys + 40]  # (h, 5, 7)
    torch.testing.assert_close(got.expand(2, H, 5, 7), want.expand(2, H, 5, 7))
    assert tiling.mod_bias_grad is None  # no tensor to train
    assert tiles(_plan(bias, tile_bytes=2**30)).keys == 42  # a bias that fits: one tile of keys


def test_the_bias_gradient_of_each_tile_adds_into_the_tables():
    table = torch.randn(H, 80, requires_grad=True)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 40]

    plan = _plan(bias)
    assert plan.call.mod_tensors == (table,)
    grads = [None]
    tiling = tiles(plan, grads)
    dbias = torch.randn(2, H, 5, 7)
    tiling.mod_bias_grad(0, 5, 0, 7, dbias)
    tiling.mod_bias_grad(5, 10, 7, 14, dbias)
    rows, keys = torch.arange(5)[:, None], torch.arange(7)
    heads = torch.arange(H)[:, None, None]
    f = table[heads, rows - keys + 40] + table[heads, rows + 5 - (keys + 7) + 40]
    (want,) = torch.autograd.grad(f, table, dbias.sum(0))
    torch.testing.assert_close(grads[0], want)


def test_a_bias_gradient_that_is_the_kernels_buffer_is_kept_as_a_copy():
    """The kernel hands every tile's dbias over in one buffer, which it fills again for the next
    tile: a mod whose gradient is dbias itself (a tensor of the tile's shape, added as it is)
    keeps a copy, not the buffer."""
    w = torch.randn(2, H, 5, 7, requires_grad=True)

    def bias(score, b, h, q_idx, kv_idx):
        return score + w

    grads = [None]
    tiling = tiles(_plan(bias), grads)
    buffer = torch.empty(2, H, 5, 7)
    first, second = torch.randn(2, H, 5, 7), torch.randn(2, H, 5, 7)
    with torch.no_grad():  # as autograd runs a backward
        for r0, c0, dbias in [(0, 0, first), (5, 7, second)]:
            tiling.mod_bias(r0, r0 + 5, c0, c0 + 7)
            tiling.mod_bias_grad(r0, r0 + 5, c0, c0 + 7, buffer.copy_(dbias))
    torch.testing.assert_close(grads[0], first + second)


def test_two_tables_given_one_gradient_tensor_by_autograd_each_get_it_once():
    """``(t1 + t2)[...]``: autograd hands the same gradient tensor to both tables, tile by tile;
    each table's gradient adds the tiles' once, as the reference's."""
    b, h_kv, t, s = SHAPES["t = s"]
    t1, t2 = (TABLE.clone().requires_grad_() for _ in range(2))

    def two_tables(x, y):
        return lambda score, b, h, q_idx, kv_idx: score + (x + y)[h, q_idx - kv_idx + 28]

    tensors = [x.requires_grad_() for x in inputs(b, h_kv, t, s)]
    out = F.attention(*tensors, score_mod=two_tables(t1, t2), causal=True)
    assert F.which_backend(*tensors, score_mod=two_tables(t1, t2), causal=True).path == "native"
    cotangent = torch.randn_like(out)
    got = torch.autograd.grad(out, [t1, t2], cotangent)
    wrt64 = [x.detach().double().requires_grad_() for x in [*tensors, t1, t2]]
    out64 = F.attention(
        *wrt64[:3], score_mod=two_tables(*wrt64[3:]), causal=True, backend="reference"
    )
    want = torch.autograd.grad(out64, wrt64[3:], cotangent.double())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.float())


def test_the_backward_evaluates_each_tiles_bias_once():
    """The backward asks for a tile's bias, then hands back its gradient: the bias it gave (with
    autograd's graph kept) gives the gradient, without evaluating the score_mod again."""
    table = torch.randn(H, 80, requires_grad=True)
    calls = []

    def bias(score, b, h, q_idx, kv_idx):
        calls.append(q_idx.shape)
        return score + table[h, q_idx - kv_idx + 40]

    grads = [None]
    tiling = tiles(_plan(bias), grads)
    calls.clear()  # (the plan's own look at the mod)
    dbias = torch.randn(2, H, 5, 7)
    with torch.no_grad():  # as autograd runs a backward
        got = tiling.mod_bias(5, 10, 7, 14)
        assert not got.requires_grad and len(calls) == 1  # the kernel reads it as plain values
        tiling.mod_bias_grad(5, 10, 7, 14, dbias)
    assert len(calls) == 1
    rows, keys = torch.arange(5, 10)[:, None], torch.arange(7, 14)
    want = table[:, rows - keys + 40]  # (h, 5, 7)
    torch.testing.assert_close(got.expand(2, H, 5, 7), want.expand(2, H, 5, 7))
    torch.testing.assert_close(grads[0], torch.autograd.grad(want, table, dbias.sum(0))[0])
    with torch.no_grad():
        tiling.mod_bias(0, 5, 0, 7)
        with pytest.raises(RuntimeError, match=r"before \(0, 5, 0, 7\)'s gradient"):
            tiling.mod_bias(5, 10, 0, 7)  # a walk that would hold every tile's bias
