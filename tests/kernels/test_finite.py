"""attnkit.kernels.finite: the C++ check of values (every kind of non-finite value in every float
dtype, on every thread's share; exact where a sum would overflow; no answer for what it cannot read
whole), and `values_finite`'s choice between it and torch's passes."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.kernels import finite


def _native_check():
    """The C++ check of values in the tiled kernel's build (skips where none can be had)."""
    kernel = finite.KERNEL.load()
    if kernel is None:
        pytest.skip(f"no build of the tiled kernel: {finite.KERNEL.available()[1]}")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 4095, 70_000, 199_999])  # past one thread's share too
def test_the_native_check_of_values_finds_each_kind_in_each_dtype(dtype, bad, where):
    """The C++ check reads each value's exponent bits, on each thread's share of a long tensor."""
    kernel = _native_check()
    x = torch.randn(200_000).to(dtype)
    assert kernel.all_finite([x])
    x[where] = bad
    assert not kernel.all_finite([x])
    assert not kernel.all_finite([torch.ones(3, dtype=dtype), x])  # found in the second tensor
    assert kernel.all_finite([x[where + 1 :]])  # a view that starts past it
    if where > 0:
        assert kernel.all_finite([x[:where]]) and not kernel.all_finite([x[where - 1 :]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_native_check_is_exact_where_a_sum_would_overflow(dtype):
    """The largest and the smallest (subnormal) finite values and -0 are finite, and a sum of
    huge values that overflows says nothing: the check reads values, not sums."""
    kernel = _native_check()
    info = torch.finfo(dtype)
    x = torch.tensor([info.max, info.max, -info.max, info.smallest_normal / 4, -0.0], dtype=dtype)
    assert not torch.isfinite(x[:2].sum())  # twice the largest: a sum in the dtype overflows
    assert kernel.all_finite([x]) and kernel.all_finite([x[:0], x[1:]])


def test_the_native_check_answers_only_for_what_it_reads_whole():
    """None, before reading anything, where a tensor is not a dense CPU tensor of a float type
    (the caller checks them all then); a transposed view of a contiguous tensor is dense."""
    kernel = _native_check()
    finite = torch.ones(4)
    heads_second = torch.randn(1, 6, 2, 8).transpose(1, 2)  # (b, t, h, d) seen as (b, h, t, d)
    assert kernel.all_finite([finite, heads_second]) is True
    heads_second[0, 1, 4, 0] = math.inf
    assert kernel.all_finite([finite, heads_second]) is False
    for other in (
        torch.randn(4, 6)[:, :3],  # not dense
        torch.ones(4, dtype=torch.int32),
        torch._efficientzerotensor((3,)),  # no memory
        torch.eye(3).to_sparse(),
        torch.eye(3).to_sparse_csr(),  # (whose is_contiguous() raises)
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    ):
        assert kernel.all_finite([finite, other]) is None
        assert kernel.all_finite([torch.tensor([math.nan]), other]) is None


@pytest.mark.parametrize("native", [True, False])
def test_values_are_checked_natively_where_they_can_be_and_alike_elsewhere(native, monkeypatch):
    """`all_finite` and `nonfinite_rows` call the C++ check for dense tensors where a build is
    at hand, and torch's passes elsewhere (no build, a slice of a cache): the same answers."""
    from attnkit.kernels import loader as _native
    from attnkit.rules import nonfinite

    if native:
        _native_check()
    else:  # no build: the kernel is disabled before it loads
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")
        monkeypatch.setattr(finite, "KERNEL", _native.Kernel("tiled"))
    seen = []
    torchs = finite._finite
    monkeypatch.setattr(finite, "_finite", lambda x: seen.append(x.shape) or torchs(x))
    q, k = torch.randn(1, 2, 5, 8, requires_grad=True), torch.randn(1, 1, 7, 8)
    k[0, 0, 3, 2] = math.inf
    assert nonfinite.all_finite(q) and not nonfinite.all_finite(q, k)
    assert torch.equal(nonfinite.nonfinite_rows(k)[0, 0], torch.arange(7) == 3)
    assert (seen == []) == native
    seen.clear()
    cache = torch.zeros(1, 2, 9, 8)  # 2 heads, room for 9 keys, 7 written
    cache[:, :, :7] = k
    assert not nonfinite.all_finite(q, cache[:, :, :7])  # not dense: torch's pass, for both
    assert seen == [q.shape, (1, 2, 7, 8)]
