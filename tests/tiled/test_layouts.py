"""The C++ kernel reads its operands where they lie and writes its results in the caller's dtypes
and layouts: a module's heads, split from its projections as ``(b, t, h, d)`` in memory, come out
in that layout, so that they merge back without a copy. Nothing changes in the numbers: every
result is the same, bit for bit, as from contiguous operands."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from attnkit import functional as F
from attnkit.force import forced
from attnkit.tiled import plans as tiled_plans
from helpers import tiled_calls

KERNEL = tiled_plans.KERNEL


def _kernel():
    kernel = KERNEL.load()
    if kernel is None:
        pytest.skip("the C++ kernel could not be built here")
    return kernel


def _options(kernel, route=0, tile=(64, 64), dropout=0.0):
    options = kernel.TiledOptions()
    options.block_q, options.block_k = 16, 32
    options.tile_rows, options.tile_keys = tile
    options.route = route  # 0: bf16 blocks by the portable sums, on any CPU
    options.dropout_p, options.dropout_seed = dropout, 7
    return options


def _heads(b, n, h, d, dtype):
    """``(b, h, n, d)`` views of ``(b, n, h, d)`` memory, as a module's projections split."""
    return torch.randn(b, n, h, d).to(dtype).transpose(1, 2)


def _with_nonfinite(x):
    x = x.clone()
    x[0, 0, 3, 1] = math.nan
    x[-1, -1, -1, 0] = math.inf
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_kernel_reads_strided_operands_in_place_with_the_same_results(dtype, dropout):
    kernel = _kernel()
    b, h, h_kv, t, s, d = 2, 4, 2, 37, 45, 8
    q = _with_nonfinite(_heads(b, t, h, d, dtype))
    k, v = _heads(b, s, h_kv, d, dtype), _with_nonfinite(_heads(b, s, h_kv, d, dtype))
    assert not q.is_contiguous()
    options = _options(kernel, dropout=dropout)
    strided = kernel.forward(q, k, v, torch.empty(b, h, t, d), options)
    contiguous = kernel.forward(
        *(x.contiguous() for x in (q, k, v)), torch.empty(b, h, t, d), options
    )
    for got, want in zip(strided, contiguous):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert strided[0].isnan().any() and not strided[0].isnan().all()

    dout = _heads(b, t, h, d, dtype)
    lse, delta = contiguous[1].nan_to_num(0.0), torch.randn(b, h, t)

    def grads(dout, q, k, v, layout):
        into = tuple(layout(torch.empty_like(x, dtype=torch.float32)) for x in (q, k, v))
        return tiled_calls.backward(kernel, dout, q, k, v, lse, delta, *into, 0.5, options)[:3]

    strided = grads(dout, q, k, v, lambda x: x)
    wanted = grads(*(x.contiguous() for x in (dout, q, k, v)), lambda x: x.contiguous())
    for got, want in zip(strided, wanted):
        assert not got.is_contiguous()  # written in the operands' layout
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [(64, 64), (16, 32)])  # one tile; several, as with a score_mod
def test_the_output_is_written_in_its_dtype_and_layout_as_torch_would_round_it(dtype, tile):
    """A row with no key is 0 and a row that sees a NaN is NaN, in every dtype and layout, also
    where the accumulator is never set (uninitialised memory must not leak). A float32 output is
    the accumulator itself: in another layout, the BLAS may sum the products of P V in another
    order (ulps); a half-precision one is the float32 result, rounded as torch rounds it."""
    kernel = _kernel()
    b, h, t, s, d = 2, 3, 40, 50, 6
    q, k, v = _heads(b, t, h, d, torch.float32), *(_heads(b, s, h, d, torch.float32) for _ in "kv")
    q = _with_nonfinite(q)
    options = _options(kernel, tile=tile)
    options.window_left, options.window_right = 20, -1  # queries 0..9 of t=40 see keys from 0
    options.key_mask = torch.ones(b, s, dtype=torch.bool)
    options.key_mask[1] = False  # the second sequence has no key: its rows are 0
    wide, lse = kernel.forward(q, k, v, torch.full((b, h, t, d), 5.0), options)
    for layout in ("contiguous", "heads apart"):
        out = torch.full((b, h, t, d), 5.0).to(dtype)
        if layout == "heads apart":
            out = torch.full((b, t, h, d), 5.0).to(dtype).transpose(1, 2)
        written, lse2 = kernel.forward(q, k, v, out, options)
        assert written.data_ptr() == out.data_ptr()
        exact = {} if dtype == torch.float32 and layout != "contiguous" else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(out, wide.to(dtype), equal_nan=True, **exact)
        torch.testing.assert_close(lse2, lse, rtol=0, atol=0, equal_nan=True)
    assert (wide[1] == 0).all() and wide[0, 0, 3].isnan().all()
    assert not wide[0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_modules_heads_come_out_laid_out_as_they_went_in(dtype):
    """attention() on heads split from ``(b, t, h * d)`` projections gives an output laid out as
    ``(b, t, h, d)``: its heads merge with a view. The values and gradients are those of the
    same call on contiguous heads, bit for bit."""
    path = None if dtype == torch.float32 else "tiled:portable"
    b, t, h, d = 2, 33, 4, 16
    x = [torch.randn(b, t, h * d).to(dtype).requires_grad_() for _ in "qkv"]
    heads = [y.view(b, t, h, d).transpose(1, 2) for y in x]
    same = [y.detach().view(b, t, h, d).transpose(1, 2).contiguous().requires_grad_() for y in x]
    with forced(path) if path else contextlib.nullcontext():
        out = F.attention(*heads, causal=True, backend="tiled")
        want = F.attention(*same, causal=True, backend="tiled")
    assert out.transpose(1, 2).is_contiguous()  # merges back with a view
    assert not out._is_view()  # autograd refuses in-place changes to a function's output view
    # float32 products read rows in place, where the BLAS may sum in another order (ulps)
    exact = {} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(out, want, **exact)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    for y, z in zip(x, same):
        torch.testing.assert_close(y.grad.view(b, t, h, d).transpose(1, 2), z.grad, **exact)
    with forced(path) if path else contextlib.nullcontext():
        merged = F.attention(*heads, backend="tiled").transpose(1, 2).reshape(b, t, h * d)
    merged.add_(1.0)  # changed in place, as a residual stream is


def test_heads_whose_pairs_do_not_line_up_are_copied_not_refused():
    """bf16 rows are read as pairs: an odd head dim is padded, odd strides copied."""
    b, h, t, d = 1, 2, 9, 5
    q, k, v = (torch.randn(b, t, h, d).bfloat16().transpose(1, 2) for _ in "qkv")
    want = F.attention(*(x.double() for x in (q, k, v)), backend="reference")
    with forced("tiled:portable"):
        out = F.attention(q, k, v, backend="tiled")
    naive = F.attention(q, k, v, backend="reference")
    error, naive_error = (out.double() - want).abs().max(), (naive.double() - want).abs().max()
    assert error <= 2 * naive_error + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_queries_of_a_panel_that_sees_no_key_are_zero_whatever_the_output_held(dtype):
    """With t > s and the causal mask aligned bottom-right, the first t - s queries see no key:
    in tiles of 16 queries, whole panels of them visit no block at all."""
    kernel = _kernel()
    b, h, t, s, d = 1, 2, 70, 40, 6
    q, k, v = (torch.randn(b, h, n, d) for n in (t, s, s))
    results = {}
    for tile in ((16, 32), (80, 64)):
        options = _options(kernel, tile=tile)
        options.window_right = 0  # causal: query i sees the keys up to i - (t - s)
        out = torch.full((b, h, t, d), 5.0).to(dtype)
        results[tile] = kernel.forward(q, k, v, out, options)
    for out, lse in results.values():
        assert (out[:, :, : t - s] == 0).all() and (lse[:, :, : t - s] == -math.inf).all()
        assert out[:, :, t - s :].isfinite().all() and not (out[:, :, t - s :] == 5.0).any()
    (tiled, tiled_lse), (whole, whole_lse) = results.values()
    torch.testing.assert_close(tiled, whole)
    torch.testing.assert_close(tiled_lse, whole_lse)


def test_the_gradients_of_q_summed_over_parts_of_the_keys_are_those_of_one_part():
    """With more threads than key/value heads, the backward splits each head's key blocks into
    parts, each with its own dq, summed at the end."""
    kernel = _kernel()
    q, k, v, dout = (torch.randn(1, 1, n, 8) for n in (20, 130, 130, 20))
    lse = kernel.forward(q, k, v, torch.empty(1, 1, 20, 8), _options(kernel))[1]
    delta = torch.randn(1, 1, 20)

    def grads():
        into = tuple(torch.empty_like(x) for x in (q, k, v))
        return tiled_calls.backward(
            kernel, dout, q, k, v, lse, delta, *into, 0.5, _options(kernel)
        )[:3]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads()
        torch.set_num_threads(4)  # 5 key blocks of 32: 4 parts
        parts = grads()
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(parts, one):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_the_float32_ones_rounded_once(dtype):
    kernel = _kernel()
    b, h, t, s, d = 2, 2, 23, 41, 8
    q, k, v = _heads(b, t, h, d, torch.float32), *(_heads(b, s, h, d, torch.float32) for _ in "kv")
    dout, delta = torch.randn(b, h, t, d), torch.randn(b, h, t)
    options = _options(kernel, dropout=0.2)
    lse = kernel.forward(q, k, v, torch.empty(b, h, t, d), options)[1]

    def grads(dtype):
        into = tuple(torch.empty_like(x, dtype=dtype) for x in (q, k, v))
        return tiled_calls.backward(kernel, dout, q, k, v, lse, delta, *into, 0.125, options)[:3]

    for got, wide in zip(grads(dtype), grads(torch.float32)):
        torch.testing.assert_close(got, wide.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_summed_in_each_threads_scratch_are_those_summed_in_buffers(dtype):
    """In one tile, each key/value head one item, the backward sums a query block's dq and a
    head's dk and dv in the thread's scratch and writes them when whole; tile by tile it sums
    them in buffers of the whole call. The same gradients bit for bit, and every row written
    whatever the tensors held: 0 for the queries that see no key (t > s, causal)."""
    kernel = _kernel()
    b, h, t, s, d = 2, 2, 70, 40, 8
    q, k, v, dout = (_heads(b, n, h, d, dtype) for n in (t, s, s, t))
    delta = torch.randn(b, h, t)

    def grads(tile):
        options = _options(kernel, tile=tile)
        options.window_right = 0  # causal: the first t - s queries see no key
        lse = kernel.forward(q, k, v, torch.empty(b, h, t, d), options)[1]
        lse = lse.masked_fill(lse == -math.inf, 0.0)  # as attnkit passes it
        into = tuple(torch.full_like(x, math.nan) for x in (q, k, v))
        return tiled_calls.backward(kernel, dout, q, k, v, lse, delta, *into, 0.5, options)[:3]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # b h_kv = 4 items: no part of a head's keys
        in_scratch, in_buffers = grads((80, 64)), grads((16, 32))
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(in_scratch, in_buffers):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (in_scratch[0][:, :, : t - s] == 0).all() and in_scratch[0][
        :, :, t - s :
    ].abs().sum() > 0


def test_a_call_whose_queries_see_no_key_writes_zero_gradients():
    """Queries shifted before every key (a ring's chunk of queries ahead of its keys): no tile is
    visited, and the gradients are still written, as zeros."""
    kernel = _kernel()
    q, k, v, dout = (torch.randn(2, 2, n, 8) for n in (20, 30, 30, 20))
    options = _options(kernel, tile=(80, 64))
    options.window_right, options.shift = 0, -40  # causal, the queries 30 positions before key 0
    out, lse = kernel.forward(q, k, v, torch.full((2, 2, 20, 8), 5.0), options)
    assert (out == 0).all() and (lse == -math.inf).all()
    into = tuple(torch.full_like(x, math.nan) for x in (q, k, v))
    zeros = torch.zeros_like(lse)
    grads = tiled_calls.backward(
        kernel, dout, q, k, v, zeros, torch.randn(2, 2, 20), *into, 0.5, options
    )[:3]
    assert all((g == 0).all() for g in grads)
