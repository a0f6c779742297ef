"""attnkit.mods.inspection: which mods add to the score (and so run in the C++ kernel, a tile
of their bias at a time), told at each call; and the tensors a mod reads, whose gradients
reach them however the mod reads them."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from attnkit import functional as F
from attnkit import mods
from helpers.zoo import (
    BACKENDS,
    SLOPES,
    T5_TABLE,
    TABLE,
    H,
    alibi,
    causal,
    inputs,
    oracle,
    prefix_lm,
    relative_bias,
    softcap,
    t5_bias,
)


def test_which_backend_says_which_path_runs_mods():
    """A mod that adds to the score runs in the C++ kernel where it runs; others in the loop."""
    q, k, v = inputs(1, H, 29, 29)
    choice = F.which_backend(q, k, v, score_mod=softcap)
    assert (choice.backend, choice.path) == ("tiled", "loop")
    assert "sdpa does not support score_mod" in choice.reason
    adds = F.which_backend(q, k, v, score_mod=relative_bias(TABLE))
    assert (adds.backend, adds.path) == ("tiled", "native")  # the kernel builds on every test CPU
    with pytest.raises(ValueError, match=r"sdpa.*block_mask"):
        F.attention(q, k, v, mask_mod=causal, backend="sdpa")


def _branches_on_values(score, b, h, q_idx, kv_idx):
    return score + 1.0 if bool(q_idx.max() > 3) else score * 2.0


def _clamps_then_adds(score, b, h, q_idx, kv_idx):
    score.clamp_(-1.0, 1.0)
    return score + TABLE[h, q_idx - kv_idx + 28]


def _adds_then_clamps_a_view(score, b, h, q_idx, kv_idx):
    out = score + TABLE[h, q_idx - kv_idx + 28]
    out.view(-1).clamp_(max=0.0)
    return out


ADDS_TO_SCORE = {  # name: (score_mod, whether it is score + f(b, h, q_idx, kv_idx))
    "relative bias": (relative_bias(TABLE), True),
    "ALiBi (score - f)": (alibi, True),
    "T5 buckets": (t5_bias(T5_TABLE), True),
    "f + score": (lambda score, b, h, q, kv: TABLE[h, q - kv + 28] + score, True),
    "a constant": (lambda score, b, h, q, kv: score + 1.5, True),
    "soft-cap": (softcap, False),
    "a scale": (lambda score, b, h, q, kv: score * SLOPES[h], False),
    "(score + a) + b, rounded otherwise": (lambda score, b, h, q, kv: score + q + kv, False),
    "f reads the score": (lambda score, b, h, q, kv: score + score.sigmoid(), False),
    "score - f, other way round": (lambda score, b, h, q, kv: q - score, False),
    "masks with where": (
        lambda score, b, h, q, kv: torch.where(q >= kv, score + 1.0, -math.inf),
        False,
    ),
    "in place": (lambda score, b, h, q, kv: score.add_(1.0), False),
    "float64 result": (lambda score, b, h, q, kv: score + TABLE.double()[h, q - kv + 28], False),
    "branches on values": (_branches_on_values, False),
    "changes the score in place first": (_clamps_then_adds, False),
    "writes into its result": (_adds_then_clamps_a_view, False),
    "reads the score through tolist": (
        lambda score, b, h, q, kv: score + torch.tensor(score.tolist()),
        False,
    ),
}


class _StatefulBias:
    """A mod whose Python state decides what it computes (and that cannot be hashed)."""

    __hash__ = None

    def __init__(self):
        self.cap = None

    def __call__(self, score, b, h, q_idx, kv_idx):
        score = score + TABLE[h, q_idx - kv_idx + 28]
        return score if self.cap is None else self.cap * torch.tanh(score / self.cap)


@pytest.mark.parametrize("name", ADDS_TO_SCORE)
def test_mods_that_add_to_the_score_are_told_from_their_graph(name):
    from attnkit import mods

    score_mod, adds = ADDS_TO_SCORE[name]
    assert mods.adds_to_score(score_mod) is adds
    q, k, v = inputs(1, H, 13, 13)
    assert F.which_backend(q, k, v, score_mod=score_mod).path == ("native" if adds else "loop")


def test_a_mod_is_told_at_each_call_so_its_state_may_change():
    q, k, v = inputs(1, H, 13, 13, dtype=torch.float64)
    mod = _StatefulBias()
    for cap in (None, 0.5):  # score + f, then a soft-cap of it: the kernel, then the loop
        mod.cap = cap
        x = q.float()
        assert F.which_backend(x, x, x, score_mod=mod).path == ("native" if cap is None else "loop")
        out = F.attention(q.float(), k.float(), v.float(), score_mod=mod)
        torch.testing.assert_close(
            out, F.attention(q, k, v, score_mod=mod, backend="reference").float()
        )


def test_a_per_head_scale_read_by_score_mod_gets_its_gradient():
    scale = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64, requires_grad=True)
    q, k, v = (x.requires_grad_() for x in inputs(1, 2, 13, 29, dtype=torch.float64))

    def per_head(score, b, h, q_idx, kv_idx):
        return score * scale[h]

    for backend in BACKENDS:
        got = torch.autograd.grad(
            F.attention(q, k, v, score_mod=per_head, mask_mod=prefix_lm, backend=backend).sum(),
            (q, scale),
        )
        exact = [x.detach().requires_grad_() for x in (q, k, v, scale)]

        def per_head64(score, b, h, q_idx, kv_idx, s=exact[3]):
            return score * s[h]

        out, _ = oracle(*exact[:3], per_head64, prefix_lm)
        want = torch.autograd.grad(out.sum(), (exact[0], exact[3]))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


class _Holder:
    """A plain object holding a tensor, as a user's model code might."""

    def __init__(self, weight):
        self.weight = weight

    def scale(self, score, b, h, q_idx, kv_idx):
        return score * self.weight[h]


WEIGHTS = {}


def _reads_a_global_dict(score, b, h, q_idx, kv_idx):
    return score * WEIGHTS["w"][h]


@pytest.mark.parametrize("how", ["bound method of an object", "global dict", "generator"])
def test_gradients_reach_a_tensor_however_the_mod_reads_it(how):
    weight = torch.tensor([0.5, 1.5, 1.0, 2.0], requires_grad=True)
    WEIGHTS["w"] = weight
    mod = {
        "bound method of an object": _Holder(weight).scale,
        "global dict": _reads_a_global_dict,
        "generator": lambda score, b, h, q_idx, kv_idx: sum(score * w[h] for w in [weight]),
    }[how]
    q, k, v = (x.requires_grad_() for x in inputs(1, 2, 13, 13))
    cotangent = torch.randn(1, H, 13, 8)
    grads = []
    for backend in BACKENDS:
        (grad,) = torch.autograd.grad(
            F.attention(q, k, v, score_mod=mod, backend=backend), (weight,), cotangent
        )
        grads.append(grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])


class _Scaler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(H))
        self.unused = torch.nn.Parameter(torch.ones(H))

    def mod(self, score, b, h, q_idx, kv_idx):
        return score * self.scale[h]


def test_captured_tensors_are_those_a_mod_holds_or_reads_that_require_grad():
    held = torch.ones(H, requires_grad=True)
    frozen = torch.ones(H)  # needs no gradient

    def closure(score, b, h, q_idx, kv_idx):
        return score * held[h] + frozen[h]

    def default(score, b, h, q_idx, kv_idx, w=held):
        return score * w[h]

    def made_inside(score, b, h, q_idx, kv_idx):
        return score * torch.ones(H, requires_grad=True)[h]  # its own tensor: not the user's

    partial = functools.partial(lambda score, b, h, q_idx, kv_idx, w: score * w[h], w=held)
    scaler = _Scaler()
    found = {
        name: mods.captured_tensors(fn, torch.float32, "cpu")
        for name, fn in {
            "closure": closure,
            "default": default,
            "made inside": made_inside,
            "partial": partial,
            "module method": scaler.mod,
        }.items()
    }
    assert [x is held for x in found["closure"]] == [True]
    assert [x is held for x in found["default"]] == [True]
    assert found["made inside"] == ()
    assert [x is held for x in found["partial"]] == [True]
    # a module's parameters: only those the mod reads on one score, not every one it holds
    assert [x is scaler.scale for x in found["module method"]] == [True]


def test_tensors_to_train_are_none_without_a_mod_or_grad_mode():
    held = torch.ones(H, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score * held[h]

    q = torch.randn(1, H, 3, 8)
    assert mods.tensors_to_train(None, q) == ()
    assert [x is held for x in mods.tensors_to_train(mod, q)] == [True]
    with torch.no_grad():
        assert mods.tensors_to_train(mod, q) == ()
