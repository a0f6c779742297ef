"""attnkit.backends.reference: the equations of attnkit.rules.exact run as a backend: the dtypes of
its results, its route, its memory, and that it takes every option (tests/rules/test_exact.py holds
the equations themselves)."""

from __future__ import annotations

import pytest
import torch

from attnkit.backends import BACKENDS
from attnkit.backends.base import Route
from attnkit.backends.reference import BACKEND
from attnkit.functional import attention, checked_call


@pytest.mark.parametrize(
    ("dtype", "lse_dtype"),
    [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ],
)
def test_results_come_back_in_the_inputs_dtype_and_the_lse_in_float32_or_float64(
    dtype, lse_dtype, device
):
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=dtype, device=device) for _ in range(3))
    out, lse, weights = BACKEND.run(
        checked_call(q, k, v, causal=True, return_lse=True, return_weights=True)
    )
    assert (out.dtype, lse.dtype, weights.dtype) == (dtype, lse_dtype, dtype)
    exact, exact_lse = attention(
        *(x.double() for x in (q, k, v)), causal=True, return_lse=True, backend="reference"
    )
    assert torch.equal(out, exact.to(dtype)) and torch.equal(lse, exact_lse.to(lse_dtype))
    assert BACKEND.path(checked_call(q, k, v)) == Route("float64", "float64")


def test_its_memory_is_the_results_and_three_float64_score_matrices():
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    call = checked_call(q, k, v)
    results = 2 * 3 * 5 * (4 * 4 + 4)
    assert BACKEND.memory(call) == (
        results + 3 * 2 * 3 * 5 * 7 * 8,
        "the results and float64 scores, weights, exponentials",
    )


def test_it_supports_every_option_any_backend_supports():
    every = frozenset().union(*(backend.supports for backend in BACKENDS.values()))
    assert every <= BACKEND.supports


def test_the_former_name_of_route_still_imports_with_a_deprecation_warning():
    import attnkit.backends

    with pytest.warns(DeprecationWarning, match="use attnkit.backends.Route"):
        assert attnkit.backends.Path is Route
    with pytest.raises(AttributeError, match="no attribute 'Paths'"):
        attnkit.backends.Paths  # noqa: B018
