"""The sparse backend as the registry sees it: auto takes every call with indices and no other;
the dense backends refuse indices by name; bad indices get clear errors; the path it reports; a
call under torch.compile (fullgraph) runs its PyTorch form and gives the kernel's results."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.functional import which_backend


def inputs(b=2, h=4, h_kv=2, t=9, s=12, d=16, n=5):
    q = torch.randn(b, h, t, d)
    k, v = torch.randn(2, b, h_kv, s, d)
    return q, k, v, torch.randint(-1, s, (b, t, n))


def test_auto_takes_calls_with_indices_and_no_other():
    q, k, v, indices = inputs()
    choice = which_backend(q, k, v, indices=indices, causal=True)
    assert choice.backend == "sparse"
    assert "tiled does not support indices" in choice.reason
    assert which_backend(q, k, v, causal=True).backend != "sparse"
    with pytest.raises(ValueError, match="backend 'sparse' cannot run a call without indices"):
        attention(q, k, v, backend="sparse")


@pytest.mark.parametrize("backend", ["sdpa", "tiled", "decode", "flex"])
def test_a_dense_backend_named_with_indices_says_so(backend):
    q, k, v, indices = inputs()
    with pytest.raises(ValueError, match=r"does not support.*indices"):
        attention(q, k, v, indices=indices, backend=backend)


@pytest.mark.parametrize(
    ("indices", "error", "message"),
    [
        (
            torch.zeros(2, 9, 5),
            TypeError,
            "indices must be int32 or int64, got dtype torch.float32",
        ),
        (
            torch.zeros(2, 8, 5, dtype=torch.long),
            ValueError,
            r"indices must have shape .*\(2, 9, n\)",
        ),
        (
            torch.zeros(2, 3, 9, 5, dtype=torch.long),
            ValueError,
            r"\(2, 2, 9, n\), got \(2, 3, 9, 5\)",
        ),
        (torch.full((2, 9, 5), 12), ValueError, r"a key in 0\.\.11, got values from 12 to 12"),
        (torch.full((2, 9, 5), -2), ValueError, "got values from -2 to -2"),
        ([[0]], TypeError, "indices must be a torch.Tensor, got list"),
    ],
)
def test_bad_indices_are_refused_by_name(indices, error, message):
    q, k, v, _ = inputs()
    with pytest.raises(error, match=message):
        attention(q, k, v, indices=indices)


def test_the_reported_path_is_the_kernel_on_a_cpu_and_pytorch_for_float64():
    q, k, v, indices = inputs()
    from attnkit.sparse import native

    kernel = native.KERNEL.usable()[0]
    assert which_backend(q, k, v, indices=indices).path == ("native" if kernel else "gather")
    f64 = [x.double() for x in (q, k, v)]
    assert which_backend(*f64, indices=indices).path == "gather"
    assert which_backend(*f64, indices=indices).products == "float64"


def test_no_query_or_no_key_gives_the_empty_results():
    q, k, v, indices = inputs(t=0)
    out = attention(q, k, v, indices=indices)
    assert out.shape == (2, 4, 0, 16)


def test_compiled_whole_it_gives_what_it_gives_eagerly():
    q, k, v, indices = inputs()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def f(q, k, v, indices):
        return attention(q, k, v, indices=indices, causal=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*leaves, indices)
    torch.testing.assert_close(out, f(q, k, v, indices))
    grads = torch.autograd.grad(out.sum(), leaves)
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(f(*eager, indices).sum(), eager)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected)


def test_under_vmap_and_func_grad_it_gives_the_reference_results():
    q, k, v = torch.randn(3, 2, 4, 5, 8), *torch.randn(2, 3, 2, 2, 7, 8)
    indices = torch.randint(-1, 7, (2, 5, 3))

    def f(q, k, v, backend="auto"):
        return attention(q, k, v, indices=indices, causal=True, backend=backend)

    want = torch.stack([f(q[i], k[i], v[i], "reference") for i in range(3)])
    torch.testing.assert_close(torch.vmap(f)(q, k, v), want)
    grad = torch.func.grad(lambda q: f(q, k[0], v[0]).sum())(q[0])
    leaf = q[0].clone().requires_grad_()
    f(leaf, k[0], v[0], "reference").sum().backward()
    torch.testing.assert_close(grad, leaf.grad)


def test_bf16_scores_are_pair_products_where_the_kernel_has_them():
    from attnkit.kernels import cpu
    from attnkit.sparse import native

    *tensors, indices = inputs(d=64)
    choice = which_backend(*(x.bfloat16() for x in tensors), indices=indices)
    if choice.path != "native":
        pytest.skip("no C++ kernel here")
    pairs = native.KERNEL.has_avx512_bf16() and cpu.has("avx512_bf16")
    assert choice.products == ("bf16-avx512_bf16" if pairs else "float32")
    odd = [torch.randn(2, 4, 9, 40, dtype=torch.bfloat16), *torch.randn(2, 2, 2, 12, 40).bfloat16()]
    assert which_backend(*odd, indices=indices).products == "float32"
