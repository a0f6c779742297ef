"""attnkit.linear.kernel: the chunked C++ kernel against the book's token loop in float64, outputs,
final states and every gradient, across its chunks of 64 tokens (one token, one short of a chunk,
one chunk, one over, several), each form of the family, value heads sharing query and key heads,
head dims that fit no vector, packed sequences of mixed lengths, q and k normalised and scaled in
the kernel, and the backward from kept states and from recomputed ones alike."""

from __future__ import annotations

import pytest
import torch

from attnkit.linear import kernel
from attnkit.linear.reference import delta_rule_loop

pytestmark = pytest.mark.skipif(not kernel.KERNEL.usable()[0], reason="no C++ kernel here")

FORMS = {
    "gated delta rule": (True, True),
    "delta rule (g=None)": (False, True),
    "gated linear attention (beta=None)": (True, False),
    "linear attention": (False, False),
}


def inputs(lengths, h_k=2, r=2, d_k=8, d_v=6, form=(True, True)):
    t, h = sum(lengths), h_k * r
    q = torch.nn.functional.normalize(torch.randn(t, h_k, d_k), dim=-1) * d_k**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h_k, d_k), dim=-1)
    v = torch.randn(t, h, d_v)
    g = -torch.rand(t, h) * 0.3 if form[0] else None
    beta = torch.rand(t, h) if form[1] else None
    states = torch.randn(len(lengths), h, d_k, d_v)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [q, k, v, g, beta, states], bounds


def loop(q, k, v, g, beta, states, bounds):
    """Each sequence alone, token by token, in float64."""
    r = v.shape[1] // q.shape[1]
    outputs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        part = [None if x is None else x[start:end] for x in (q, k, v, g, beta)]
        part[:2] = [x.repeat_interleave(r, 1) for x in part[:2]]
        o, final = delta_rule_loop(*part, states[n])
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs), torch.stack(finals)


def check(tensors, bounds, eps=-1.0, scale=1.0):
    """The kernel against the loop: outputs, final states, and the gradients of every input
    (through the normalisation and the scale, where asked, as autograd takes them)."""
    leaves = [None if x is None else x.requires_grad_() for x in tensors]
    exact = [None if x is None else x.detach().double().requires_grad_() for x in leaves]
    out, final = kernel.chunked(*leaves, bounds, eps=eps, scale=scale)
    q, k = exact[:2]
    if eps >= 0:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps) for x in (q, k))
    want, want_final = loop(q * scale, k, *exact[2:], bounds)
    torch.testing.assert_close(out, want.float())
    torch.testing.assert_close(final, want_final.float())
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    given = [x for x in leaves if x is not None]
    got = torch.autograd.grad((out, final), given, (d_out, d_final))
    wanted = torch.autograd.grad(
        (want, want_final), [x for x in exact if x is not None], (d_out.double(), d_final.double())
    )
    for a, b in zip(got, wanted):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b.float())


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130], ids=lambda t: f"t={t}")
def test_every_result_and_gradient_match_the_loop_across_chunks(t):
    check(*inputs([t]))


@pytest.mark.parametrize("form", FORMS)
def test_each_form_of_the_family(form):
    check(*inputs([70], form=FORMS[form]))


def test_head_dims_that_fit_no_vector_and_one_value_head_per_key_head():
    check(*inputs([66], h_k=1, r=1, d_k=40, d_v=59))


def test_packed_sequences_of_mixed_lengths_restart_at_every_boundary():
    check(*inputs([1, 40, 64, 65, 3], r=3))


def test_it_normalises_and_scales_q_and_k_as_it_reads_them():
    (q, k, *rest), bounds = inputs([100, 30], r=3)
    check([q * 3.0, k * 0.2, *rest], bounds, eps=1e-6, scale=0.7)  # rows far from norm 1


@pytest.mark.parametrize("keep", [True, False], ids=["kept states", "recomputed states"])
def test_the_backward_from_kept_or_recomputed_states(keep, monkeypatch):
    monkeypatch.setattr(kernel, "KEEP_STATES", keep)
    check(*inputs([130, 7]))


def test_only_the_gradients_asked_for_and_the_final_state_alone():
    (q, k, v, g, beta, states), bounds = inputs([70])
    v.requires_grad_()
    _, final = kernel.chunked(q, k, v, g, beta, states, bounds, eps=-1.0, scale=1.0)
    (dv,) = torch.autograd.grad(final.sum(), v)  # no gradient of o reaches the backward
    exact = [x.detach().double() for x in (q, k, v, g, beta, states)]
    exact[2].requires_grad_()
    _, want = loop(*exact, bounds)
    torch.testing.assert_close(dv, torch.autograd.grad(want.sum(), exact[2])[0].float())


def test_it_refuses_where_it_cannot_run():
    x = torch.randn(2, 3)
    assert kernel.refuses([x]) is None
    assert kernel.refuses([x.to("meta")]) == "not CPU tensors"
    refused = []
    torch.func.grad(lambda y: (refused.append(kernel.refuses([y])), y.sum())[1])(x)
    assert refused == ["inside torch.compile or a torch.func transform"]


def test_offsets_that_are_a_strided_view_are_read_as_their_values():
    (q, k, v, g, beta, states), bounds = inputs([40, 90])
    strided = torch.tensor([0, 99, 40, 99, 130, 99])[::2]  # [0, 40, 130], not contiguous
    got = kernel.chunked(q, k, v, g, beta, states, strided, eps=-1.0, scale=1.0)
    want = kernel.chunked(q, k, v, g, beta, states, bounds, eps=-1.0, scale=1.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
