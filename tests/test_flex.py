"""score_mod, mask_mod and block masks: attnkit against torch's FlexAttention and a float64 oracle.

Every mod of the zoo runs through both backends that take mods (``tiled``, the PyTorch loop, and
``reference``), with small block sizes so that skipped, partial and full blocks all occur on small
shapes, GQA, ``t != s`` and lengths that do not divide the blocks.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import attnkit
from attnkit import functional as F
from attnkit.block_mask import create_block_mask
from helpers.devices import CUDA
from helpers.zoo import (
    BACKENDS,
    CASES,
    SHAPES,
    TABLE,
    H,
    assert_bf16_rule,
    causal,
    empties_rows,
    inputs,
    oracle,
    prefix_lm,
    relative_bias,
    softcap,
    torch_block_mask,
    zoo_on,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def cases_on_devices(cuda_shape: str) -> list:
    """``(mod, shape, backend, device)``: every case on both backends on the CPU; on CUDA every mod
    on one shape, in the tiled backend's loop (the reference backend evaluates mods with the same
    code on every device, and runs them on CUDA in tests/rules/test_nonfinite.py)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    return [
        *(
            pytest.param(mod, shape, backend, cpu, id=f"{mod}-{shape}-{backend}-cpu")
            for backend in BACKENDS
            for mod, shape in CASES
        ),
        *(
            pytest.param(
                mod, shape, "tiled", cuda, id=f"{mod}-{shape}-tiled-cuda", marks=CUDA.marks
            )
            for mod, shape in CASES
            if shape == cuda_shape
        ),
    ]


@pytest.mark.parametrize(("mod", "shape", "backend", "device"), cases_on_devices("GQA, t < s"))
def test_forward_equals_torch_flex_attention(mod, shape, backend, device):
    score_mod, mask_mod = zoo_on(device)[mod]
    b, h_kv, t, s = SHAPES[shape]
    q, k, v = inputs(b, h_kv, t, s, device=device)
    block_mask = torch_block_mask(mask_mod, t, s, (4, 8), device)
    want, want_lse = torch_flex.flex_attention(
        q, k, v, score_mod, block_mask, enable_gqa=True, return_aux=torch_flex.AuxRequest(lse=True)
    )
    out, lse = F.attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True, backend=backend
    )
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.lse)
    oracle_out, _ = oracle(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, oracle_out.float())


@pytest.mark.parametrize(("mod", "shape", "backend", "device"), cases_on_devices("t = s"))
def test_gradients_equal_the_float64_oracle(mod, shape, backend, device):
    score_mod, mask_mod = zoo_on(device)[mod]
    b, h_kv, t, s = SHAPES[shape]
    tensors = [x.requires_grad_() for x in inputs(b, h_kv, t, s, device=device)]
    table = TABLE.to(device).clone().requires_grad_()
    if score_mod is not None and "relative" in mod:
        score_mod = relative_bias(table)
    block_mask = create_block_mask(mask_mod, None, None, t, s, device, 8) if mask_mod else None
    out, lse = F.attention(
        *tensors, score_mod=score_mod, block_mask=block_mask, return_lse=True, backend=backend
    )
    cotangent, lse_cotangent = torch.randn_like(out), torch.randn_like(lse)
    wrt = [*tensors, table] if "relative" in mod else tensors
    got = torch.autograd.grad(
        (out, lse), wrt, (cotangent, lse_cotangent.masked_fill(lse.isinf(), 0))
    )
    wrt64 = [x.detach().double().requires_grad_() for x in wrt]
    mod64 = relative_bias(wrt64[3]) if "relative" in mod else score_mod
    out64, lse64 = oracle(*wrt64[:3], mod64, mask_mod)
    lse_cotangent64 = lse_cotangent.double().masked_fill(lse64.isinf(), 0)
    finite = torch.where(lse64.isinf(), 0, lse64)
    want = torch.autograd.grad((out64, finite), wrt64, (cotangent.double(), lse_cotangent64))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float())


@pytest.mark.parametrize(
    ("path", "device"),
    [
        *(pytest.param(p, torch.device("cpu"), id=f"{p}-cpu") for p in ("loop", "native")),
        pytest.param("loop", torch.device("cuda"), id="loop-cuda", marks=CUDA.marks),
    ],
)
def test_the_backward_stores_no_score_sized_tensor(path, device):
    """The loop (given a mask_mod) and the C++ kernel (given causal=True and a mod that adds)."""
    t, s = 37, 53
    q, k, v = (x.requires_grad_() for x in inputs(1, H, t, s, device=device))
    table = torch.randn(H, 2 * 53, requires_grad=True, device=device)
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 52]

    mask = {"mask_mod": causal} if path == "loop" else {"causal": True}
    if device.type == "cpu":
        assert F.which_backend(q, k, v, score_mod=score_mod, **mask).path == path
    else:  # auto may take another backend on CUDA; the tiled one runs its loop
        assert F.which_backend(q, k, v, score_mod=score_mod, **mask, backend="tiled").path == path
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = F.attention(q, k, v, score_mod=score_mod, backend="tiled", **mask)
    assert shapes, "the hook saw nothing: the test would pass vacuously"
    assert all(t not in shape[-2:] or s not in shape[-2:] for shape in shapes), shapes
    out.sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


def test_gradcheck_in_float64():
    q, k, v = (x.requires_grad_() for x in inputs(1, 2, 6, 9, d=3, dtype=torch.float64))
    table = torch.randn(H, 16, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, table):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + 8]

        block_mask = create_block_mask(prefix_lm, None, None, 6, 9, "cpu", (2, 4))
        out, lse = F.attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True, backend="tiled"
        )
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v, table))


def test_bf16_stays_within_twice_the_naive_error_and_three_times_for_gradients(device):
    b, h_kv, t, s = SHAPES["t = s"]
    tensors = [x.bfloat16().requires_grad_() for x in inputs(b, h_kv, t, s, device=device)]
    score_mod, mask_mod = zoo_on(device)["relative bias, causal"]
    out = F.attention(*tensors, score_mod=score_mod, mask_mod=mask_mod, backend="tiled")
    grads = torch.autograd.grad(out, tensors, torch.ones_like(out))
    naive = [x.detach().requires_grad_() for x in tensors]  # the oracle's formula, in bf16
    scores = naive[0] @ naive[1].transpose(-2, -1) * 8**-0.5
    arange = functools.partial(torch.arange, device=device)
    bias = TABLE.to(device).bfloat16()[
        arange(H)[:, None, None], arange(t)[:, None] - arange(s) + 28
    ]
    causal_mask = torch.ones(t, s, dtype=torch.bool, device=device).tril()
    scores = (scores + bias).masked_fill(~causal_mask, -math.inf)
    naive_out = torch.softmax(scores, dim=-1) @ naive[2]
    naive_grads = torch.autograd.grad(naive_out, naive, torch.ones_like(naive_out))
    exact = [x.detach().double().requires_grad_() for x in tensors]
    exact_out, _ = oracle(*exact, score_mod, mask_mod)
    exact_grads = torch.autograd.grad(exact_out, exact, torch.ones_like(exact_out))
    assert_bf16_rule((out, *grads), (naive_out, *naive_grads), (exact_out, *exact_grads))


def test_flex_attention_is_a_drop_in_for_torch(device):
    q, k, v = inputs(2, 2, 29, 29, device=device)
    block_mask = torch_flex.create_block_mask(empties_rows, None, None, 29, 29, device, 16)
    alibi = zoo_on(device)["ALiBi"][0]
    out, aux = attnkit.flex_attention(
        q,
        k,
        v,
        alibi,
        block_mask,
        enable_gqa=True,
        return_aux=torch_flex.AuxRequest(lse=True),
        kernel_options={"BLOCK_M": 64},
    )
    want, want_aux = torch_flex.flex_attention(
        q, k, v, alibi, block_mask, enable_gqa=True, return_aux=torch_flex.AuxRequest(lse=True)
    )
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(aux.lse, want_aux.lse)
    empty = torch.arange(29, device=device) % 5 == 2
    assert bool((out[:, :, empty] == 0).all()) and bool(aux.lse[:, :, empty].isneginf().all())
    with pytest.warns(FutureWarning, match="return_lse is deprecated"):
        out_lse = attnkit.flex_attention(
            q, k, v, alibi, block_mask, enable_gqa=True, return_lse=True
        )
    torch.testing.assert_close(out_lse[1], want_aux.lse)
    assert torch.equal(
        attnkit.flex_attention(q, k, v, enable_gqa=True, scale=0.5),
        attnkit.flex_attention(q, k, v, enable_gqa=True, scale=0.5),
    )
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attnkit.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="not max_scores"):
        attnkit.flex_attention(
            q, k, v, enable_gqa=True, return_aux=torch_flex.AuxRequest(max_scores=True)
        )
    # trains on a CPU, where torch's raises (and on CUDA)
    q.requires_grad_()
    attnkit.flex_attention(q, k, v, alibi, block_mask, enable_gqa=True).sum().backward()
    assert q.grad is not None
    if device.type == "cpu":
        with pytest.raises(NotImplementedError, match="backward on CPU"):
            torch_flex.flex_attention(q, k, v, alibi, block_mask, enable_gqa=True)


def test_under_torch_func_the_reference_runs_the_mods(device):
    q, k, v = inputs(1, H, 13, 13, device=device)

    def loss(q):
        return F.attention(q, k, v, score_mod=softcap, mask_mod=causal).sum()

    if device.type == "cpu":  # on CUDA auto may take another backend with mods outside torch.func
        assert F.which_backend(q, k, v, score_mod=softcap).backend == "tiled"
    grad = torch.func.grad(loss)(q)
    qg = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(qg), qg)
    torch.testing.assert_close(grad, want)
    queries = torch.stack([q, q * 0.5])
    batched = torch.func.vmap(lambda x: F.attention(x, k, v, score_mod=softcap))(queries)
    each = torch.stack([F.attention(x, k, v, score_mod=softcap) for x in queries])
    torch.testing.assert_close(batched, each)
