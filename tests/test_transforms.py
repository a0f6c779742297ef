"""torch.func (vmap, grad, jvp), torch.jit.trace and torch.compile through attention and its modules:
each works on every backend `auto` may pick, or a named backend refuses it clearly."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from torch.func import grad, jacfwd, jacrev, jvp, vmap

from attnkit import (
    AdditiveAttention,
    CrossAttention,
    KVCache,
    MultiHeadAttention,
    SelfAttention,
    attention,
)
from attnkit.functional import which_backend
from attnkit.modules import CausalAttention, MultiHeadAttentionWrapper
from helpers.oracle import naive_attention

PATHS = ["reference", "sdpa", "tiled", "tiled:loop"]


def batch(n=3, b=2, h=4, h_kv=2, t=5, s=7, d=8):
    return torch.randn(n, b, h, t, d), torch.randn(n, b, h_kv, s, d), torch.randn(n, b, h_kv, s, d)


@pytest.mark.parametrize("backend", PATHS, indirect=True)
def test_vmap_equals_a_loop_over_examples(backend):
    q, k, v = batch()
    key_mask = torch.rand(3, 2, 7) > 0.3
    key_mask[..., 0] = True
    slopes = torch.rand(3, 4)

    def f(q, k, v, key_mask, slopes):
        return attention(
            q, k, v, key_mask=key_mask, alibi_slopes=slopes, causal=True, backend=backend
        )

    shared = vmap(f, in_dims=(0, 0, 0, 0, None))(q, k, v, key_mask, slopes[0])
    per_example = vmap(f)(q, k, v, key_mask, slopes)  # per-example slopes: one call each (tiled)
    for i in range(3):
        torch.testing.assert_close(shared[i], f(q[i], k[i], v[i], key_mask[i], slopes[0]))
        torch.testing.assert_close(per_example[i], f(q[i], k[i], v[i], key_mask[i], slopes[i]))


@pytest.mark.parametrize("backend", ["tiled", "tiled:loop"], indirect=True)
def test_vmap_folds_a_mapped_float_mask_and_shared_keys(backend):
    q, k, v = batch()
    bias = torch.randn(3, 4, 5, 7)  # per example, broadcast over the batch

    def f(q, bias):
        return attention(q, k[0], v[0], attn_mask=bias, return_lse=True, backend=backend)

    out, lse = vmap(f)(q, bias)
    for i in range(3):
        expected_out, expected_lse = f(q[i], bias[i])
        torch.testing.assert_close(out[i], expected_out)
        torch.testing.assert_close(lse[i], expected_lse)


@pytest.mark.parametrize("options", [{"causal": True}, {"softcap": 3.0}], ids=["causal", "softcap"])
def test_torch_func_gradients_in_every_composition(options):
    """grad, vmap(grad) with shared keys, autograd over grad, grad(grad), jacrev(jacrev): auto
    takes SDPA or the reference (softcap), never silently wrong, against the oracle's autograd."""
    q, k, v = (x[0].double() for x in batch(n=1, b=1, t=4, s=6))

    def f(q, k=k, v=v):
        return (attention(q, k, v, **options) ** 2).sum()

    def oracle(q, k=k, v=v):
        return (naive_attention(q, k, v, **options)[0] ** 2).sum()

    leaf = q.clone().requires_grad_()
    (first,) = torch.autograd.grad(oracle(leaf), leaf, create_graph=True)
    (second,) = torch.autograd.grad((first**2).sum(), leaf)
    torch.testing.assert_close(grad(f)(q), first.detach())
    per_example = vmap(grad(f), in_dims=(0, None, None))(torch.stack([q, 2 * q]), k, v)
    torch.testing.assert_close(per_example[0], first.detach())
    torch.testing.assert_close(grad(lambda q: (grad(f)(q) ** 2).sum())(q), second)
    x = q.clone().requires_grad_()  # ordinary autograd around torch.func.grad
    (around,) = torch.autograd.grad((grad(f)(x) ** 2).sum(), x)
    torch.testing.assert_close(around, second)
    hessian = jacrev(jacrev(f))(q)
    expected = torch.autograd.functional.hessian(oracle, q)
    torch.testing.assert_close(hessian, expected)


@pytest.mark.parametrize("name", ["tiled", "sdpa"])
def test_backends_without_a_rule_for_a_gradient_transform_refuse_it(name):
    q, k, v = (x[0] for x in batch(n=1, b=1, t=4, s=6))
    with pytest.raises(ValueError, match=rf"backend '{name}' cannot run "):
        if name == "tiled":  # its recomputing backward does not compose with torch.func levels
            grad(lambda q: attention(q, k, v, backend=name).sum())(q)
        else:  # torch's fused kernels have no double backward
            grad(lambda q: (grad(lambda q: attention(q, k, v, backend=name).sum())(q) ** 2).sum())(
                q
            )


def test_forward_mode_ad_runs_the_reference_and_other_backends_refuse_it():
    q, k, v = (x[0] for x in batch(n=1))
    tangent = torch.randn_like(q)

    def f(q):
        return attention(q, k, v, causal=True, softcap=3.0)  # auto would pick tiled without jvp

    def picked(q):
        return torch.tensor(len(which_backend(q, k, v, causal=True, softcap=3.0).backend))

    assert jvp(picked, (q,), (tangent,))[0] == len("reference")
    _, got = jvp(f, (q,), (tangent,))
    q64 = q.double().requires_grad_()
    expected = torch.autograd.functional.jvp(
        lambda q: naive_attention(q, k.double(), v.double(), causal=True, softcap=3.0)[0],
        q64,
        tangent.double(),
    )[1]
    torch.testing.assert_close(got, expected.float())
    assert jacfwd(lambda q: f(q).sum())(q).shape == q.shape
    for name in ("tiled", "sdpa", "decode"):
        with pytest.raises(ValueError, match=rf"backend '{name}' cannot run .*forward-mode AD"):
            jvp(lambda q, name=name: attention(q, k, v, backend=name), (q,), (tangent,))


CONFIGS = {
    "causal": {},
    "not causal": {"causal": False},
    "gqa": {"num_kv_heads": 2},
    "window": {"window": 3},
    "alibi": {"alibi": True},
    "rope": {"rope": True},
    "softcap": {"softcap": 5.0},
    "everything": {"num_kv_heads": 1, "window": 4, "alibi": True, "softcap": 5.0, "rope": True},
}


def traced_modules():
    yield from (
        (name, MultiHeadAttention(16, 16, 32, 0.0, 4, qkv_bias=True, **kwargs))
        for name, kwargs in CONFIGS.items()
    )
    yield "self", SelfAttention(16, 8)
    yield "causal head", CausalAttention(16, 8, 32, 0.0)
    yield "wrapper", MultiHeadAttentionWrapper(16, 8, 32, 0.0, 2)


@pytest.mark.parametrize(
    ("name", "module"), list(traced_modules()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_jit_trace_of_every_module_equals_eager_on_another_length(name, module):
    module.eval()
    with torch.no_grad():
        traced = torch.jit.trace(module, torch.randn(2, 5, 16), check_trace=False)
        x = torch.randn(2, 9, 16)
        torch.testing.assert_close(traced(x), module(x))


def test_a_trace_keeps_the_nan_rule_for_inputs_unlike_the_traced_ones():
    """The NaN rule's eager shortcut (no copy when every row is finite) must not be frozen into a
    trace made on finite inputs."""
    q, k, v = (x[0] for x in batch(n=1))
    traced = torch.jit.trace(lambda q, k, v: attention(q, k, v), (q, k, v), check_trace=False)
    q = q.clone()
    q[0, 1, 2, 3] = float("nan")
    out = traced(q, k, v)
    assert torch.isnan(out[0, 1, 2]).all() and torch.isfinite(out[0, 0]).all()


def test_meta_tensors_go_through():
    q, k, v = (torch.empty(1, 4, 5, 8, device="meta") for _ in range(3))
    assert attention(q, k, v, causal=True).shape == (1, 4, 5, 8)


def test_jit_trace_of_cross_attention_equals_eager_on_other_lengths():
    cross = CrossAttention(16, 12, 16, 4).eval()
    with torch.no_grad():
        traced = torch.jit.trace(cross, (torch.randn(1, 3, 16), torch.randn(1, 5, 12)))
        x, memory = torch.randn(1, 7, 16), torch.randn(1, 11, 12)
        torch.testing.assert_close(traced(x, memory), cross(x, memory))


def test_jit_trace_of_additive_attention_equals_eager_on_other_lengths():
    additive = AdditiveAttention(16, 12, 8).eval()
    with torch.no_grad():
        traced = torch.jit.trace(additive, (torch.randn(2, 3, 16), torch.randn(2, 5, 12)))
        query, keys = torch.randn(2, 7, 16), torch.randn(2, 11, 12)
        for got, expected in zip(traced(query, keys), additive(query, keys)):
            torch.testing.assert_close(got, expected)


def test_jit_trace_with_a_cache_raises_clearly():
    module = MultiHeadAttention(16, 16, 32, 0.0, 4).eval()
    cache = KVCache(1, 4, 32, 4)

    def step(x):
        return module(x, cache=cache)

    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"cannot be traced with torch\.jit\.trace"),
    ):
        torch.jit.trace(step, torch.randn(1, 1, 16))


@pytest.mark.parametrize("config", ["rope", "gqa", "window", "everything"])
def test_a_compiled_cached_decoding_step_compiles_once(config):
    """fullgraph=True, a growing cache: one compilation for every token (no recompile on the
    cache's position), the same outputs as the full forward."""
    torch._dynamo.reset()
    module = MultiHeadAttention(16, 16, 32, 0.0, 4, **CONFIGS[config]).eval()
    x = torch.randn(2, 14, 16)
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[1, :2] = False  # a ragged batch: row 1's prompt is left-padded
    counter = torch._dynamo.testing.CompileCounter()
    step = torch.compile(module, fullgraph=True, backend=counter)
    with torch.no_grad():
        cache = KVCache(2, module.num_kv_heads, 32, module.head_dim)
        module(x[:, :6], cache=cache, key_mask=key_mask)  # the prompt, eagerly
        steps = [step(x[:, i : i + 1], cache=cache) for i in range(6, 14)]
        full = module(x, key_mask=torch.cat([key_mask, torch.ones(2, 8, dtype=torch.bool)], 1))
    assert counter.frame_count == 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 6:])
    assert cache.position == cache.size == 14  # the ints catch up with the compiled steps
    with torch.no_grad():  # and eager decoding goes on from there
        more = module(torch.randn(2, 1, 16), cache=cache)
    assert more.shape == (2, 1, 16) and cache.position == 15


def test_a_compiled_step_refuses_what_it_cannot_do():
    torch._dynamo.reset()
    module = MultiHeadAttention(16, 16, 32, 0.0, 4, window=8).eval()
    step = torch.compile(module, fullgraph=True, backend="eager")
    with torch.no_grad():  # fullgraph: dynamo wraps the ValueError in its own, message inside
        with pytest.raises(
            Exception, match=r"a windowed KVCache cannot decode under torch\.compile"
        ):
            step(torch.randn(1, 1, 16), cache=KVCache(1, 4, 32, 4, window=8))
        with pytest.raises(RuntimeError, match="need_weights cannot be used with a KVCache under"):
            step(torch.randn(1, 1, 16), cache=KVCache(1, 4, 32, 4), need_weights=True)
        full = KVCache(1, 4, 3, 4)  # the room check, on the tensor position
        step(torch.randn(1, 3, 16), cache=full)
        with pytest.raises(RuntimeError, match=r"does not fit in max_len \(3\)"):
            step(torch.randn(1, 1, 16), cache=full)
