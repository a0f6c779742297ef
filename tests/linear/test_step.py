"""attnkit.linear.step: the C++ decoding step of the gated delta rule against the float64 loop in
each form of the family and with value heads sharing query and key heads, the state written in
place where asked, and when auto takes it (one token, no gradient) and why it refuses."""

from __future__ import annotations

import pytest
import torch

from attnkit.linear import gated_delta_rule, which_gated_delta_rule
from attnkit.linear import step as native_step

pytestmark = pytest.mark.skipif(
    not native_step.KERNEL.usable()[0], reason="no build of the decode kernel here"
)


def one_token(b=2, h_k=2, h=6, d_k=16, d_v=12, dtype=torch.float32):
    q, k = torch.randn(b, 1, h_k, d_k), torch.randn(b, 1, h_k, d_k)
    v = torch.randn(b, 1, h, d_v)
    g = torch.nn.functional.logsigmoid(torch.randn(b, 1, h))
    beta = torch.rand(b, 1, h)
    state = torch.randn(b, h, d_k, d_v)
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [state]


@pytest.mark.parametrize("form", ["gated delta rule", "delta rule", "gated linear", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_is_the_float64_loops_step(form, dtype):
    q, k, v, g, beta, state = one_token(dtype=dtype)
    g = None if form in ("delta rule", "linear") else g
    beta = None if form in ("gated linear", "linear") else beta
    options = {"initial_state": state, "output_final_state": True, "use_qk_l2norm": True}
    with torch.no_grad():
        assert which_gated_delta_rule(q, k, v, g, beta, initial_state=state).backend == "step"
        out, final = gated_delta_rule(q, k, v, g, beta, **options)
    f64 = [None if x is None else x.double() for x in (q, k, v, g, beta)]
    want, want_final = gated_delta_rule(*f64, **{**options, "initial_state": state.double()})
    assert out.dtype == dtype and final.dtype == torch.float32
    torch.testing.assert_close(out, want.to(dtype))
    torch.testing.assert_close(final, want_final.float())
    assert not torch.equal(state, final)  # a new state: the given one is left as it was


def test_inplace_final_state_writes_into_the_given_state():
    q, k, v, g, beta, state = one_token()
    given = state.clone()
    with torch.no_grad():
        _, final = gated_delta_rule(
            q, k, v, g, beta, initial_state=given, output_final_state=True, inplace_final_state=True
        )
        _, want = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert final is given
    torch.testing.assert_close(given, want)


def test_auto_takes_the_step_for_one_token_without_gradients_and_says_why_not_otherwise():
    q, k, v, g, beta, _ = one_token()
    with torch.no_grad():
        assert "reads each state twice" in which_gated_delta_rule(q, k, v, g, beta).reason
    q.requires_grad_()
    assert which_gated_delta_rule(q, k, v, g, beta).backend == "recurrent"
    with pytest.raises(
        ValueError, match="backend 'step' cannot run this call: a gradient is wanted"
    ):
        gated_delta_rule(q, k, v, g, beta, backend="step")
    state = torch.randn(2, 6, 16, 12, requires_grad=True)  # a gradient for the state alone
    detached = [x.detach() for x in (q, k, v, g, beta)]
    assert which_gated_delta_rule(*detached, initial_state=state).backend == "recurrent"
    two = [x.detach().expand(-1, 2, *x.shape[2:]) for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="more than one token a sequence"):
        gated_delta_rule(*two, backend="step")
