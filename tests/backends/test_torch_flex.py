"""The flex backend (torch's compiled FlexAttention) against the float64 oracle (tests/helpers/oracle.py).

On CUDA (marked ``gpu``) every option it supports runs forward and backward: the output, the lse
and the gradients of q, k, v, the sinks and a score_mod's table, in float32 within torch's default
tolerances and in bfloat16 within twice the naive bf16 error (three times for gradients). Each case
combines several options, so that few kernels are compiled. On a CPU, where torch's kernel has no
backward, ``auto`` never takes it and naming it raises; with the CPU allowed (``flex.DEVICES``, for
the tests only) the mapping of masks and modifiers is checked forward, compiled by torch there.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from attnkit import attention, create_block_mask
from attnkit.backends import AUTO_ORDER, BACKENDS
from attnkit.backends import torch_flex as flex
from attnkit.functional import which_backend
from helpers.devices import CUDA
from helpers.oracle import naive_attention, selected_attention
from helpers.zoo import document_of

# name: (b, h, h_kv, t, s, d) and the options (see make)
CASES = {
    "causal gqa t<s key_mask sinks": (
        (2, 4, 2, 48, 80, 64),
        {"causal": True, "key_mask": True, "sinks": True, "return_lse": True},
    ),
    "causal t>s float mask alibi softcap": (
        (1, 2, 2, 40, 24, 16),
        {"causal": True, "attn_mask": "float", "alibi": True, "softcap": 2.5, "return_lse": True},
    ),
    "t=1 window bool mask alibi": (
        (2, 8, 2, 1, 37, 128),
        {"window": (5, 0), "attn_mask": "bool", "alibi": True, "return_lse": True},
    ),
    "relative bias and a document block mask": (
        (1, 4, 4, 300, 300, 64),
        {"relative": True, "document": "block_mask", "return_lse": True},
    ),
    "document mask_mod causal key_mask sinks d=80": (
        (2, 6, 2, 260, 260, 80),
        {"document": "mask_mod", "causal": True, "key_mask": True, "sinks": True},
    ),
    "plain d=128": ((1, 2, 2, 130, 130, 128), {"return_lse": True}),
}
BF16_CASES = ["causal gqa t<s key_mask sinks", "relative bias and a document block mask"]
GPU = [pytest.mark.gpu, *CUDA.marks]


@pytest.fixture
def room_to_compile():
    """Room for every case's kernels in one process (torch recompiles a function 8 times, then
    runs it uncompiled)."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.fixture
def on_cpu(monkeypatch, room_to_compile):
    """The flex backend allowed on the CPU, where these tests check attnkit's mapping onto torch's
    FlexAttention, forward only, run uncompiled: torch 2.13's kernel compiled for a CPU gives rows
    of zeros now and then (seen on an AVX2-only AMD EPYC, without a score_mod too), and attnkit's
    `auto` never takes flex on a CPU."""
    monkeypatch.setattr(flex, "DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(flex, "_compiled", lambda: torch_flex.flex_attention)
    monkeypatch.setattr(torch_flex, "_warn_once", lambda *args, **kwargs: None)
    torch._dynamo.reset()  # (as in eager_with_graph below: no lengths marked dynamic)
    yield
    torch._dynamo.reset()


def make(shape, options, device, dtype=torch.float32, grad=True):
    """``(leaves, kwargs, oracle_kwargs)``: the tensors that get gradients, the arguments of
    ``attention``, and the oracle's (on the CPU, the mods folded into its float mask)."""
    b, h, h_kv, t, s, d = shape
    leaves = {
        "q": torch.randn(b, h, t, d, device=device, dtype=dtype),
        "k": torch.randn(b, h_kv, s, d, device=device, dtype=dtype),
        "v": torch.randn(b, h_kv, s, d, device=device, dtype=dtype),
    }
    if options.get("sinks"):
        leaves["sinks"] = torch.randn(h, device=device, dtype=dtype) * 2
    if options.get("relative"):
        leaves["table"] = torch.randn(h, t + s - 1, device=device) * 0.5
    for x in leaves.values():
        x.requires_grad_(grad)
    kwargs = {n: options[n] for n in ("causal", "window", "softcap", "return_lse") if n in options}
    oracle = {n: options[n] for n in ("causal", "window", "softcap") if n in options}
    bias = torch.zeros(b, h, t, s, dtype=torch.float64)
    if options.get("key_mask"):
        key_mask = torch.rand(b, s, device=device) > 0.3
        key_mask[0, -1] = True
        key_mask[-1] = False  # a whole batch row of padding: its queries see nothing
        kwargs["key_mask"] = oracle["key_mask"] = key_mask
    if options.get("attn_mask") == "bool":
        allowed = torch.rand(b, 1, t, s, device=device) > 0.4
        allowed[0, :, 0] = False  # a query that sees nothing
        kwargs["attn_mask"] = allowed
        bias = bias.masked_fill(~allowed.cpu(), float("-inf"))
    if options.get("attn_mask") == "float":
        added = torch.randn(1, h, t, s, device=device, dtype=dtype)
        added[..., -1, :] = float("-inf")  # the last query sees nothing
        kwargs["attn_mask"] = added
        bias = bias + added.cpu().double()
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.linspace(0.1, 0.5, h, device=device)
        oracle["alibi_slopes"] = kwargs["alibi_slopes"].cpu().double()
    if "document" in options:
        document, dense = document_of(t, device)
        if options["document"] == "mask_mod":
            kwargs["mask_mod"] = document
        else:  # "block_mask", or "block_mask16", whose blocks of 16 are regridded
            size = 16 if options["document"] == "block_mask16" else 128
            kwargs["block_mask"] = create_block_mask(document, None, None, t, s, device, size)
        bias = bias.masked_fill(~dense.cpu(), float("-inf"))
    oracle["bias"] = bias
    return leaves, kwargs, oracle


def run_flex(leaves, kwargs, backend="flex"):
    table = leaves.get("table")
    s = leaves["k"].shape[2]

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + s - 1]

    mods = {"score_mod": relative} if table is not None else {}
    result = attention(
        leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"), **kwargs, **mods,
        backend=backend,
    )  # fmt: skip
    return result if kwargs.get("return_lse") else (result, None)


def run_oracle(leaves, oracle, dtype=torch.float64):
    """The oracle on the CPU in ``dtype`` (float64 for the truth, bf16 for the naive error)."""
    given = {n: x.detach().cpu().to(dtype).requires_grad_() for n, x in leaves.items()}
    t, s = given["q"].shape[2], given["k"].shape[2]
    bias = oracle.pop("bias", None)
    options = dict(oracle)
    if "table" in given:
        distance = torch.arange(t)[:, None] - torch.arange(s)[None, :] + s - 1
        bias = bias + given["table"][:, distance].to(torch.float64)
    if bias is not None and bool((bias != 0).any()):
        options["attn_mask"] = bias.to(dtype)
    options = {n: x.to(dtype) if _is_float(x) else x for n, x in options.items()}
    options = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in options.items()}
    out, lse, _ = naive_attention(
        given["q"], given["k"], given["v"], sinks=given.get("sinks"), **options
    )
    return given, out, lse


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and torch.is_floating_point(x)


def gradients(out, lse, leaves, dout, dlse):
    outputs, cotangents = [out], [dout]
    if lse is not None:
        outputs.append(lse)
        cotangents.append(dlse.masked_fill(lse.detach().cpu().isinf().to(dlse.device), 0))
    return torch.autograd.grad(outputs, list(leaves.values()), cotangents)


@pytest.mark.usefixtures("room_to_compile")
@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("name", CASES)
def test_fp32_outputs_lse_and_gradients_match_the_oracle(name, device):
    shape, options = CASES[name]
    leaves, kwargs, oracle = make(shape, options, device)
    assert which_backend(**{n: leaves[n] for n in "qkv"}, backend="flex").path == "compiled"
    out, lse = run_flex(leaves, kwargs)
    given, out64, lse64 = run_oracle(leaves, oracle)
    torch.testing.assert_close(out.cpu(), out64.float())
    if lse is not None:
        torch.testing.assert_close(lse.cpu(), lse64.float())
    dout, dlse = torch.randn_like(out), None if lse is None else torch.randn_like(lse)
    got = gradients(out, lse, leaves, dout, dlse)
    dlse64 = None if dlse is None else dlse.cpu().double()
    want = gradients(out64, None if lse is None else lse64, given, dout.cpu().double(), dlse64)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w.float())


@pytest.mark.usefixtures("room_to_compile")
@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_within_twice_the_naive_error_and_three_times_for_gradients(name, device):
    shape, options = CASES[name]
    leaves, kwargs, oracle = make(shape, options, device, torch.bfloat16)
    kwargs.pop("return_lse", None)
    out, _ = run_flex(leaves, kwargs)
    given, out64, _ = run_oracle(leaves, dict(oracle))
    naive, naive_out, _ = run_oracle(leaves, oracle, torch.bfloat16)
    dout = torch.randn_like(out)

    def error(x, truth):
        return (x.detach().cpu().double() - truth.detach()).abs().max().item()

    assert out.dtype == torch.bfloat16
    assert error(out, out64) <= 2 * error(naive_out, out64) + 1e-6
    got = gradients(out, None, leaves, dout, None)
    want = gradients(out64, None, given, dout.cpu().double(), None)
    baseline = gradients(naive_out, None, naive, dout.cpu(), None)
    for g, w, n in zip(got, want, baseline, strict=True):
        assert error(g, w) <= 3 * error(n, w) + 1e-6


@pytest.mark.usefixtures("room_to_compile")
@pytest.mark.parametrize("device", [CUDA])
def test_second_derivatives_are_the_reference_backends(device):
    """A backward with create_graph=True differentiates the reference backend's recomputation."""
    shape, options = CASES["causal gqa t<s key_mask sinks"]
    leaves, kwargs, _ = make(shape, options, device)
    twins = {n: x.detach().clone().requires_grad_() for n, x in leaves.items()}
    second = []
    for tensors, backend in ((leaves, "flex"), (twins, "reference")):
        out, lse = run_flex(tensors, kwargs, backend)
        first = torch.autograd.grad((out * out).sum() + lse.sum(), tensors["q"], create_graph=True)
        second.append(torch.autograd.grad(first[0].square().sum(), tensors["k"])[0])
    torch.testing.assert_close(*second, rtol=1e-4, atol=1e-4)  # float32 sums by two routes


@pytest.mark.usefixtures("room_to_compile")
@pytest.mark.parametrize("device", [CUDA])
def test_inside_torch_compile_the_masks_become_scores(device):
    shape, options = CASES["causal gqa t<s key_mask sinks"]
    options = {**options, "window": (20, 0)}
    leaves, kwargs, oracle = make(shape, options, device)
    compiled = torch.compile(run_flex)
    out, lse = compiled(leaves, kwargs)
    given, out64, lse64 = run_oracle(leaves, oracle)
    torch.testing.assert_close(out.cpu(), out64.float())
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = gradients(out, lse, leaves, dout, dlse)
    want = gradients(out64, lse64, given, dout.cpu().double(), dlse.cpu().double())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w.float())


@pytest.mark.usefixtures("room_to_compile")
@pytest.mark.parametrize("device", [CUDA])
def test_non_finite_inputs_follow_attnkits_rule(device):
    """A score made infinite by q or k is NaN (under softcap too), a NaN or +inf in the float
    mask is a NaN score, -inf masks; a row with no key is 0 (tests/helpers/oracle.py, selected_attention)."""
    inf, nan = float("inf"), float("nan")
    q, k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    q[0, 0, 4, 3] = inf  # every score of this row: NaN
    q[0, 1, 0, 5] = inf  # a row that is not finite and sees no key: 0 all the same
    k[0, 1, 2, 0] = -inf  # a key whose scores are infinite: NaN where seen
    bias = torch.randn(1, 2, 6, 9)
    bias[0, 0, 5, 1], bias[0, 1, 4, 7], bias[..., 0, :] = inf, nan, -inf  # row 0 sees nothing
    options = {"causal": True, "softcap": 4.0, "attn_mask": bias}
    cuda = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in options.items()}
    with torch.no_grad():
        out = attention(q.to(device), k.to(device), v.to(device), **cuda, backend="flex")
    want, _, _ = selected_attention(q, k, v, **options)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out.cpu()), finite)
    torch.testing.assert_close(out.cpu()[finite], want[finite].float())
    assert bool((out[..., 0, :] == 0).all())


@pytest.mark.parametrize("device", [CUDA])
def test_auto_takes_flex_on_cuda_for_what_sdpa_cannot_do_and_for_dense_masks(device):
    def qkv(n, h=4):
        return [torch.empty(1, h, n, 64, device=device) for _ in range(3)]

    choice = which_backend(*qkv(256), softcap=30.0)
    assert (choice.backend, choice.path) == ("flex", "compiled")
    assert "torch's FlexAttention" in choice.reason
    assert which_backend(*qkv(256), sinks=torch.zeros(4, device=device)).backend == "flex"
    assert which_backend(*qkv(256), causal=True).backend == "sdpa"
    wide = which_backend(*qkv(1024), window=(700, 0))
    assert wide.backend == "flex" and "dense mask of 1024 x 1024" in wide.reason
    assert which_backend(*qkv(256), window=(200, 0)).backend == "sdpa"  # a small mask


@pytest.mark.parametrize("device", [CUDA])
def test_head_dims_it_cannot_take_are_named(device):
    q = torch.randn(1, 2, 8, 8, device=device)
    with pytest.raises(ValueError, match=r"backend 'flex' cannot run head dims 8 \(q, k\)"):
        attention(q, q, q, softcap=5.0, backend="flex")
    assert which_backend(q, q, q, softcap=5.0).backend == "tiled"


# On a CPU.

CPU_OPTIONS = [
    {"softcap": 5.0},
    {"sinks": torch.zeros(4)},
    {"return_lse": True},
    {"window": (3, 0)},
    {"alibi_slopes": torch.ones(4)},
    {"score_mod": lambda score, b, h, q, kv: score + (q - kv)},
    {"mask_mod": lambda b, h, q, kv: q >= kv},
]


def test_auto_asks_flex_after_sdpa_and_before_tiled():
    assert AUTO_ORDER.index("sdpa") < AUTO_ORDER.index("flex") < AUTO_ORDER.index("tiled")
    assert BACKENDS["flex"] is flex.BACKEND


@pytest.mark.parametrize("options", CPU_OPTIONS, ids=lambda o: next(iter(o)))
def test_auto_never_takes_flex_on_a_cpu(options):
    q = k = v = torch.randn(1, 4, 64, 16)
    choice = which_backend(q, k, v, **options)
    assert choice.backend != "flex"
    if choice.reason.startswith("the first backend") and choice.backend != "sdpa":
        assert "flex cannot run cpu tensors" in choice.reason


def test_naming_flex_on_a_cpu_raises_the_reason():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="backend 'flex' cannot run cpu tensors: torch's Flex"):
        attention(q, q, q, softcap=5.0, backend="flex")
    with pytest.raises(ValueError, match="backend 'flex' does not support dropout_p; use"):
        attention(q, q, q, dropout_p=0.1, backend="flex")
    with pytest.raises(ValueError, match="backend 'flex' does not support return_weights; use"):
        attention(q, q, q, return_weights=True, backend="flex")


@pytest.mark.usefixtures("on_cpu")
def test_refusals_name_what_it_cannot_run():
    q = torch.randn(1, 2, 8, 16)

    def refusal(*tensors, **options):
        with pytest.raises(ValueError, match="backend 'flex' cannot run") as raised:
            attention(*tensors, **options, backend="flex")
        return str(raised.value)

    assert "torch.float64 tensors" in refusal(*[q.double()] * 3)
    assert "head dims 8 (q, k) and 8 (v)" in refusal(*[q[..., :8]] * 3)
    assert "head dims 16 (q, k) and 300 (v)" in refusal(q, q, torch.randn(1, 2, 8, 300))

    def holed(b, h, i, j):  # causal with a hole: no window, so the block mask reaches flex
        return (i >= j) & ((i != 5) | (j != 3))

    odd = create_block_mask(holed, None, None, 8, 8, "cpu", BLOCK_SIZE=48)
    assert "BLOCK_SIZE (48, 48)" in refusal(q, q, q, block_mask=odd)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        assert "forward-mode AD" in refusal(dual, q, q)
    with pytest.raises(ValueError, match=r"under a torch\.func transform"):
        torch.func.vmap(lambda x: attention(x, x, x, backend="flex"))(q[None])
    with pytest.raises(ValueError, match=r"under torch\.jit\.trace"):
        torch.jit.trace(lambda x: attention(x, x, x, backend="flex"), q, check_trace=False)


@pytest.mark.usefixtures("on_cpu")
def test_which_backend_says_torch_flex_attention_runs():
    q = torch.randn(1, 2, 8, 16)
    choice = which_backend(q, q, q, softcap=5.0, backend="flex")
    assert choice.path == "compiled" and choice.products is None
    assert choice.reason == f"named by the caller; {flex.BACKEND.runs} runs it"
    assert "FlexAttention" in choice.reason


# name: shape and options, forward only on the CPU (torch's CPU kernel returns no lse; torch
# 2.13's C++ code for it fails to compile a window, a key_mask and ALiBi at once with t = 1)
CPU_CASES = {
    "gqa t>s causal key_mask float mask alibi softcap relative bias": (
        (2, 4, 2, 11, 7, 16),
        {"causal": True, "key_mask": True, "attn_mask": "float", "alibi": True}
        | {"softcap": 3.0, "relative": True},
    ),
    "gqa of 3 window bool mask and a document block mask of 16": (
        (2, 6, 2, 29, 29, 16),
        {"window": (6, 2), "attn_mask": "bool", "document": "block_mask16"},
    ),
    "t=1 window key_mask": ((2, 2, 1, 1, 23, 32), {"window": (5, 0), "key_mask": True}),
}


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("name", CPU_CASES)
def test_the_mapping_matches_the_oracle_forward_on_a_cpu(name):
    shape, options = CPU_CASES[name]
    leaves, kwargs, oracle = make(shape, options, "cpu", grad=False)
    with torch.no_grad():
        out, _ = run_flex(leaves, kwargs)
    _, out64, _ = run_oracle(leaves, oracle)
    torch.testing.assert_close(out, out64.float())
    if "key_mask" in kwargs:  # a batch row of padding: every query of it sees nothing
        assert bool((out[-1] == 0).all())


@pytest.mark.usefixtures("on_cpu")
def test_kernels_that_do_not_fit_are_compiled_again_with_smaller_blocks(monkeypatch):
    """Triton can find no configuration of torch's kernels that fits the GPU's shared memory (a
    score_mod that reads a table, say): such a kind of call runs with smaller blocks from then on."""
    tried = []
    run_kernel = flex._run_kernel

    def failing_once(call, small_blocks=False):
        tried.append(small_blocks)
        if not small_blocks:
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource")
        return run_kernel(call)

    monkeypatch.setattr(flex, "_run_kernel", failing_once)
    monkeypatch.setattr(flex, "_NEEDS_SMALL_BLOCKS", set())
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    want = attention(q, k, v, softcap=3.0, backend="reference")
    torch.testing.assert_close(attention(q, k, v, softcap=3.0, backend="flex"), want)
    torch.testing.assert_close(attention(q, k, v, softcap=3.0, backend="flex"), want)
    assert tried == [False, True, True]  # the second call goes straight to small blocks

    def other_error(call, small_blocks=False):
        raise RuntimeError("something else")

    monkeypatch.setattr(flex, "_run_kernel", other_error)
    with pytest.raises(RuntimeError, match="something else"):
        attention(q, k, v[:, :, :, :16], alibi_slopes=torch.ones(2), backend="flex")


@pytest.fixture
def eager_with_graph(monkeypatch):
    """The backend on the CPU with a graph: torch's FlexAttention uncompiled, which materialises
    the scores and has a backward there, in place of the compiled kernel (attnkit's own autograd
    around it is what these tests check on any machine)."""
    monkeypatch.setattr(flex, "DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(flex, "GRAPH_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(flex, "_compiled", lambda: torch_flex.flex_attention)
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(torch_flex, "_warn_once", lambda *args, **kwargs: None)
    # torch runs FlexAttention uncompiled through one compiled wrapper, process-wide: after a few
    # lengths it would mark them dynamic for the tests that follow, which its CPU path cannot take
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("eager_with_graph")
@pytest.mark.parametrize(
    "name", ["causal gqa t<s key_mask sinks", "relative bias and a document block mask"]
)
def test_gradients_of_every_input_reach_the_callers_graph(name):
    """q, k, v, the sinks and the table a score_mod reads get the oracle's gradients through the
    kernel's own leaves."""
    shape, options = CASES[name]
    leaves, kwargs, oracle = make(shape, options, torch.device("cpu"))
    out, lse = run_flex(leaves, kwargs)
    given, out64, lse64 = run_oracle(leaves, oracle)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = gradients(out, lse, leaves, dout, dlse)
    want = gradients(out64, lse64, given, dout.double(), dlse.double())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.float())


@pytest.mark.usefixtures("eager_with_graph")
def test_non_finite_inputs_follow_attnkits_rule_where_the_kernel_gives_an_lse():
    """The rows fixed from the lse as on CUDA: NaN where a bad query sees a key, 0 without one."""
    test_non_finite_inputs_follow_attnkits_rule(torch.device("cpu"))


@pytest.mark.parametrize("hiding", [False, True])
@pytest.mark.parametrize("bad", [False, True])
def test_the_rows_are_fixed_in_one_pass_as_by_two_fills(hiding, bad):
    """`_rows_fixed`'s one ``where`` gives the output, lse and gradients of the two fills it
    replaced: NaN in a bad query's row that sees a key, then 0 in a row with no key."""
    out = torch.randn(2, 3, 8, 4, requires_grad=True)
    lse = torch.randn(2, 3, 8, requires_grad=True)
    with torch.no_grad():
        lse[0, 1, :3] = -float("inf")  # rows with no key, one of them bad
    bad_rows = torch.zeros(2, 3, 8, dtype=torch.bool)
    bad_rows[0, 1, 2:5] = bad_rows[1, 2, 7] = True
    bad_rows = bad_rows if bad else None
    got_out, got_lse = flex._rows_fixed(out, lse, bad_rows, hiding)
    want_out, want_lse = out, lse
    if bad_rows is not None:
        seen = bad_rows & (lse != -float("inf"))
        want_out = want_out.masked_fill(seen[..., None], float("nan"))
        want_lse = want_lse.masked_fill(seen, float("nan"))
    if hiding:
        want_out = want_out.masked_fill((lse == -float("inf"))[..., None], 0.0)
    torch.testing.assert_close(got_out, want_out, equal_nan=True)
    torch.testing.assert_close(got_lse, want_lse, equal_nan=True)
    assert got_out.isnan().any() == bad
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((got_out, got_lse), (out, lse), (dout, dlse))
    want = torch.autograd.grad((want_out, want_lse), (out, lse), (dout, dlse))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("eager_with_graph")
def test_second_derivatives_on_the_cpu_are_the_reference_backends():
    test_second_derivatives_are_the_reference_backends(torch.device("cpu"))


@pytest.mark.usefixtures("eager_with_graph")
def test_a_backward_that_does_not_fit_runs_again_with_smaller_blocks(monkeypatch):
    """Triton's backward kernels compile at the first backward: where they do not fit, the kernel
    runs again with smaller blocks and torch's backward of that gives the gradients."""
    tried = []
    run_kernel = flex._run_kernel

    class Unfit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource")

    def backward_unfit(call, small_blocks=False):
        tried.append(small_blocks)
        out, lse, bad_rows = run_kernel(call)
        return (out, lse, bad_rows) if small_blocks else (Unfit.apply(out), lse, bad_rows)

    monkeypatch.setattr(flex, "_run_kernel", backward_unfit)
    monkeypatch.setattr(flex, "_NEEDS_SMALL_BLOCKS", set())
    q, k, v = (torch.randn(1, 2, 12, 16, requires_grad=True) for _ in range(3))
    twins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    attention(q, k, v, softcap=3.0, backend="flex").sum().backward()
    attention(*twins, softcap=3.0, backend="reference").sum().backward()
    for x, twin in zip((q, k, v), twins):
        torch.testing.assert_close(x.grad, twin.grad)
    assert tried == [False, True]


@pytest.mark.usefixtures("eager_with_graph")
def test_a_second_backward_through_the_same_call_runs_the_kernel_again():
    """torch's compiled backward frees its graph (it takes retain_graph=False only): a caller's
    second backward (retain_graph=True) recomputes the kernel and gets the same gradients."""
    q, k, v = (torch.randn(1, 2, 12, 16, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, softcap=3.0, backend="flex")
    first = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)
