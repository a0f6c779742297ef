"""attnkit.backends.base: the checked call (the options call_of finds in use, Call.with_tensors),
the results' bytes a backend holds by default, and the questions about autograd backends ask."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad

import attnkit
from attnkit.backends.base import Backend, result_bytes
from attnkit.call import call_of, forward_ad_active, gradient_levels, wants_grad
from attnkit.functional import checked_call
from attnkit.masks import Masks

B, H, H_KV, T, S, D, D_V = 2, 4, 2, 5, 7, 8, 6


def qkv(dtype=torch.float32):
    return (
        torch.randn(B, H, T, D, dtype=dtype),
        torch.randn(B, H_KV, S, D, dtype=dtype),
        torch.randn(B, H_KV, S, D_V, dtype=dtype),
    )


def _adds(score, b, h, q_idx, kv_idx):
    return score + 1.0


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def case(name):
    """``(masks, fields, options in use)`` of one call."""
    key_mask = torch.ones(B, S, dtype=torch.bool)
    cases = {
        "nothing": lambda: (Masks(), {}, set()),
        "causal": lambda: (Masks((-1, 0)), {}, {"causal"}),
        "causal window": lambda: (Masks((3, 0)), {}, {"causal", "window"}),
        "two-sided window": lambda: (Masks((2, 2)), {}, {"window"}),
        "key mask": lambda: (Masks(key_mask=key_mask), {}, {"key_mask"}),
        "bool attn_mask": lambda: (
            Masks(attn_mask=torch.ones(T, S, dtype=torch.bool)),
            {},
            {"attn_mask"},
        ),
        "float attn_mask that trains": lambda: (
            Masks(attn_mask=torch.zeros(T, S, requires_grad=True)),
            {},
            {"attn_mask", "attn_mask_grad"},
        ),
        "shift": lambda: (Masks(shift=2), {}, {"shift"}),
        "softcap, ALiBi": lambda: (
            Masks(),
            {"softcap": 2.0, "alibi_slopes": torch.ones(H)},
            {"softcap", "alibi_slopes"},
        ),
        "dropout, lse, weights": lambda: (
            Masks(),
            {"dropout_p": 0.1, "return_lse": True, "return_weights": True},
            {"dropout_p", "return_lse", "return_weights"},
        ),
        "options at their defaults": lambda: (
            Masks(),
            {"dropout_p": 0.0, "return_lse": False, "softcap": None, "score_mod": None},
            set(),
        ),
        "score_mod, block_mask": lambda: (
            Masks(),
            {
                "score_mod": _adds,
                "block_mask": attnkit.create_block_mask(_causal, None, None, T, S),
            },
            {"score_mod", "block_mask"},
        ),
    }
    return cases[name]()


CASES = [  # the names of case()'s calls
    "nothing",
    "causal",
    "causal window",
    "two-sided window",
    "key mask",
    "bool attn_mask",
    "float attn_mask that trains",
    "shift",
    "softcap, ALiBi",
    "dropout, lse, weights",
    "options at their defaults",
    "score_mod, block_mask",
]


@pytest.mark.parametrize("name", CASES)
def test_call_of_names_the_options_in_use(name):
    masks, fields, in_use = case(name)
    call = call_of(*qkv(), masks, 0.5, **fields)
    assert call.options == frozenset(in_use)
    assert call.masks is masks and call.scale == 0.5


def test_the_options_of_a_checked_call_are_those_its_user_gave():
    q, k, v = qkv()
    assert checked_call(q, k, v).options == frozenset()
    assert checked_call(q, k, v, causal=True).options == {"causal"}
    assert checked_call(q, k, v, causal=True, window=(2, 0), softcap=3.0).options == {
        "causal",
        "window",
        "softcap",
    }
    key_mask = torch.ones(B, S, dtype=torch.bool)
    assert checked_call(q, k, v, key_mask=key_mask, return_lse=True).options == {
        "key_mask",
        "return_lse",
    }


def same(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def test_with_tensors_replaces_the_tensors_and_keeps_the_rest():
    q, k, v = qkv()
    slopes, key_mask = torch.rand(H), torch.rand(B, S) > 0.2
    bias = torch.randn(T, S)
    table = torch.randn(H, requires_grad=True)
    call = call_of(
        q,
        k,
        v,
        Masks((3, 0), key_mask, bias, 1),
        0.5,
        softcap=2.0,
        alibi_slopes=slopes,
        return_lse=True,
        mod_tensors=(table,),
    )
    assert same(call.tensors(), (q, k, v, slopes, bias, key_mask))  # mod_tensors apart
    others = (*qkv(), torch.rand(H), torch.randn(T, S), torch.rand(B, S) > 0.5)
    other = call.with_tensors(*others)
    assert same(other.tensors(), others) and other.mod_tensors == ()
    assert (other.masks.window, other.masks.shift) == ((3, 0), 1)
    assert (other.scale, other.softcap, other.return_lse) == (0.5, 2.0, True)
    assert other.options == call.options  # nothing is checked or computed again
    back = other.with_tensors(*call.tensors(), call.mod_tensors)
    assert same(back.tensors(), call.tensors()) and same(back.mod_tensors, (table,))
    bare = call.with_tensors(*[None] * 6)  # what an autograd function keeps of a call
    assert bare.tensors() == (None,) * 6 and bare.options == call.options


@pytest.mark.parametrize(("dtype", "size"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_result_bytes_are_the_output_the_float32_lse_and_the_weights_if_asked(dtype, size):
    q, k, v = qkv(dtype)
    output_and_lse = B * H * T * (D_V * size + 4)
    assert result_bytes(call_of(q, k, v, Masks(), 1.0)) == output_and_lse
    with_weights = call_of(q, k, v, Masks(), 1.0, return_weights=True)
    assert result_bytes(with_weights) == output_and_lse + B * H * T * S * size
    assert Backend().memory(with_weights) == (result_bytes(with_weights), "the results")


def test_a_backend_by_default_refuses_nothing_and_claims_no_speed():
    call = call_of(*qkv(), Masks(), 1.0)
    backend = Backend()
    assert backend.refuses(call) is None and backend.faster_than(backend, call) is None
    for question in (backend.path, backend.run):
        with pytest.raises(NotImplementedError):
            question(call)
    backend.name = "mine"
    assert repr(backend) == "<backend 'mine'>"


def test_wants_grad_needs_grad_mode_and_a_tensor_that_requires_it():
    x, y = torch.randn(2), torch.randn(2, requires_grad=True)
    assert not wants_grad(x, None)
    assert wants_grad(x, None, y)
    with torch.no_grad():
        assert not wants_grad(y)


def test_gradient_levels_count_the_enclosing_gradient_transforms():
    seen = []

    def f(x):
        seen.append(gradient_levels(x))
        return (x * x).sum()

    x = torch.randn(3)
    f(x)
    torch.func.grad(f)(x)
    torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x)
    x_grad = x.clone().requires_grad_()
    torch.func.grad(f)(x_grad).sum().backward()  # ordinary autograd around torch.func.grad
    assert seen == [0, 1, 2, 2]


def test_forward_ad_is_seen_inside_jvp_and_dual_levels_only():
    seen = []

    def f(x):
        seen.append(forward_ad_active())
        return x * 2

    x = torch.randn(3)
    f(x)
    torch.func.jvp(f, (x,), (torch.ones(3),))
    with forward_ad.dual_level():
        f(forward_ad.make_dual(x, torch.ones(3)))
    torch.func.grad(lambda x: f(x).sum())(x)
    assert seen == [False, True, True, False]
