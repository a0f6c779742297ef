"""Properties of the tiled kernel beyond its numbers (those are in tests/test_functional.py):
what it stores, which blocks it visits, determinism, autocast, and its memory at a large N."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from attnkit import attention
from attnkit.functional import which_backend
from attnkit.kernels import cpu as _cpu
from attnkit.kernels import loader as _native
from attnkit.tiled import loop as tiled_loop
from attnkit.tiled import plans as tiled_plans
from helpers import tiled_calls
from helpers.oracle import naive_attention


def qkv(b=1, h=2, h_kv=1, t=40, s=40, d=8, dtype=torch.float32):
    tensors = (
        torch.randn(b, h, t, d, dtype=dtype),
        torch.randn(b, h_kv, s, d, dtype=dtype),
        torch.randn(b, h_kv, s, d, dtype=dtype),
    )
    return [x.requires_grad_() for x in tensors]


def test_backward_stores_no_score_sized_tensor():
    t, s = 37, 53
    q, k, v = qkv(t=t, s=s)
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = attention(q, k, v, causal=True, softcap=5.0, backend="tiled")
    assert shapes, "the hook saw nothing: the test would pass vacuously"
    assert all(t not in shape[-2:] or s not in shape[-2:] for shape in shapes), shapes

    # ctx attributes: the plan holds none of the call's tensors; the masks and slopes are saved
    # inputs (None here)
    ctx = out.grad_fn
    tensors = [x for x in vars(ctx).values() if isinstance(x, torch.Tensor)]
    tensors += [x for x in vars(ctx.plan).values() if isinstance(x, torch.Tensor)]
    assert ctx.plan.call.tensors() == (None,) * 6
    assert all(x.numel() < t * s for x in tensors)
    saved = {tuple(x.shape) for x in ctx.saved_tensors if x is not None}
    assert saved == {(1, 2, t, 8), (1, 1, s, 8), (1, 2, t)}


def count_blocks(monkeypatch, **options):
    calls = []
    original = tiled_loop.Plan.scores

    def counting(self, *args):
        calls.append(args[2:6])  # i0, i1, j0, j1
        return original(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(tiled_loop.Plan, "scores", counting)
        q, k, v = qkv(t=60, s=60)
        attention(q, k, v, backend="tiled", **options)
    return calls


@pytest.mark.usefixtures("pytorch_loop")
def test_causal_and_window_skip_the_blocks_they_empty(monkeypatch):
    full = count_blocks(monkeypatch)
    causal = count_blocks(monkeypatch, causal=True)
    window = count_blocks(monkeypatch, causal=True, window=(6, 0))
    assert len(full) == 12 * 9  # ceil(60 / 5) query blocks x ceil(60 / 7) key blocks
    assert len(causal) < 0.6 * len(full)
    assert len(window) <= 12 * 3
    for _i0, i1, j0, _j1 in causal:
        assert j0 <= i1 - 1  # never a block wholly above the diagonal
    for i0, i1, j0, j1 in window:
        assert j1 - 1 >= i0 - 6 and j0 <= i1 - 1


@pytest.mark.usefixtures("pytorch_loop")
def test_fully_visible_blocks_skip_the_positional_mask(monkeypatch):
    needs_mask = []
    original = tiled_loop.Plan.scores

    def spy(self, q_blk, k_blk, i0, i1, j0, j1, window):
        needs_mask.append(window)
        return original(self, q_blk, k_blk, i0, i1, j0, j1, window)

    monkeypatch.setattr(tiled_loop.Plan, "scores", spy)
    q, k, v = qkv(t=60, s=60)
    attention(q, k, v, backend="tiled", causal=True)
    assert any(needs_mask) and not all(needs_mask)


def test_deterministic_forward_and_backward():
    q, k, v = qkv(h=4, h_kv=2, t=33, s=45)
    slopes = torch.rand(4)
    runs = []
    for _ in range(2):
        out = attention(q, k, v, causal=True, alibi_slopes=slopes, backend="tiled")
        runs.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_weights_leave_the_output_bit_identical():
    q, k, v = qkv(t=23, s=31)
    plain = attention(q, k, v, causal=True, backend="tiled")
    out, weights = attention(q, k, v, causal=True, return_weights=True, backend="tiled")
    assert torch.equal(out, plain)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 23))


def test_lse_is_float32_and_carries_gradients():
    q, k, v = qkv()
    _, lse = attention(q, k, v, return_lse=True, backend="tiled")
    assert lse.dtype == torch.float32 and lse.requires_grad
    with torch.no_grad():
        assert not attention(q, k, v, return_lse=True, backend="tiled")[1].requires_grad


@pytest.mark.parametrize("causal", [False, True])
def test_production_block_sizes(monkeypatch, causal, tiled_blocks):
    tiled_blocks(256, 512)
    q, k, v = qkv(h=2, h_kv=2, t=300, s=700, d=16)
    out = attention(q, k, v, causal=causal, backend="tiled")
    expected, _, _ = naive_attention(*(x.detach().double() for x in (q, k, v)), causal=causal)
    torch.testing.assert_close(out, expected.float())


def test_autocast_bf16_runs_the_kernel_in_bf16():
    q, k, v = qkv(t=21, s=29, d=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, causal=True, softcap=4.0, backend="tiled")
    assert out.dtype == torch.bfloat16
    exact, _, _ = naive_attention(
        *(x.detach().double() for x in (q, k, v)), causal=True, softcap=4.0
    )
    low = [x.detach().bfloat16() for x in (q, k, v)]
    naive_low, _, _ = naive_attention(*low, causal=True, softcap=4.0)
    error = (out.double() - exact).abs().max()
    assert error <= 2 * (naive_low.double() - exact).abs().max() + 1e-6
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


PROBE = textwrap.dedent(
    """
    import json, resource, sys, torch
    from attnkit import attention
    n, backend = int(sys.argv[1]), sys.argv[2]
    q, k, v = (torch.randn(1, 1, n, 64, requires_grad=True) for _ in range(3))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = attention(q, k, v, causal=True, softcap=30.0, backend=backend)
    out.sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mib": (after - before) / 1024}))
    """
)


@pytest.mark.slow
def test_memory_stays_linear_at_large_n():
    """fwd+bwd at N = 16384: a single (N, N) fp32 score matrix would be 1 GiB; the tiled kernel
    needs its inputs, outputs and gradients (a few MiB) plus cache-sized blocks."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "16384", "tiled"], capture_output=True, text=True, check=True
    )
    extra = json.loads(done.stdout)["extra_mib"]
    assert extra < 256, f"peak memory grew by {extra:.0f} MiB"


def test_a_row_whose_first_key_blocks_are_masked_keeps_exact_statistics():
    """The running max must stay -inf while a row has seen no key: were it reset to 0, scores of
    -2000 in a later block would underflow to exp() = 0 and the row would come out empty."""
    q = torch.full((1, 1, 3, 4), 10.0)
    k = torch.full((1, 1, 20, 4), -50.0)  # every score is 10 * -50 * 4 / 2 = -1000
    v = torch.randn(1, 1, 20, 4)
    key_mask = torch.zeros(1, 20, dtype=torch.bool)
    key_mask[0, 15:] = True  # the first two blocks of 7 keys are padding
    out, lse = attention(q, k, v, key_mask=key_mask, return_lse=True, backend="tiled")
    torch.testing.assert_close(out[0, 0], v[0, 0, 15:].mean(0).expand(3, 4))
    torch.testing.assert_close(lse, torch.full((1, 1, 3), -1000.0 + torch.log(torch.tensor(5.0))))


def paths_taken(fn) -> list[str]:
    """The ``attnkit::tiled_*`` profiler ranges that ``fn`` entered: which path ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({event.name for event in prof.events() if event.name.startswith("attnkit::")})


def forward_backward(dtype=torch.float32, **options):
    q, k, v = qkv(h=4, h_kv=2, t=23, s=31, dtype=dtype)
    return lambda: attention(q, k, v, backend="tiled", **options).sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_which_backend_names_the_path_that_runs(dtype):
    """The path depends on the CPU (half-precision products where it has them, float32 in the C++
    kernel elsewhere): the test asks which_backend, then checks that this path is the one taken."""
    q, k, v = qkv(h=4, h_kv=2, t=23, s=31, dtype=dtype)
    choice = which_backend(q, k, v, backend="tiled", causal=True, softcap=4.0)
    ran = paths_taken(
        lambda: attention(q, k, v, backend="tiled", causal=True, softcap=4.0).sum().backward()
    )
    path = choice.path
    assert ran == [f"attnkit::tiled_{path}_backward", f"attnkit::tiled_{path}_forward"]
    if dtype == torch.float32:
        assert (path, choice.products) == ("native", "float32")  # it builds on every test CPU
    if dtype == torch.float64:
        assert (path, choice.products) == ("loop", "float64")  # the C++ kernel has no float64
    if dtype in (torch.bfloat16, torch.float16):  # in that dtype where the CPU has the units
        fast = _cpu.fast_half_products(dtype)
        expected = {
            (torch.bfloat16, True): ("native", "bf16-"),
            (torch.float16, True): ("loop", "float16"),
        }.get((dtype, fast), ("native", "float32"))
        assert path == expected[0] and choice.products.startswith(expected[1])


@pytest.mark.parametrize("features", ["avx2", "avx512", "none"])
def test_a_narrowed_cpu_multiplies_bf16_in_float32(features, monkeypatch):
    """ATTNKIT_CPU_FEATURES=avx2 makes any CPU behave as one without bf16 units."""
    monkeypatch.setenv("ATTNKIT_CPU_FEATURES", features)
    q, k, v = qkv(dtype=torch.bfloat16)
    assert which_backend(q, k, v, backend="tiled").products == "float32"
    ran = paths_taken(lambda: attention(q, k, v, backend="tiled"))
    assert ran == ["attnkit::tiled_native_forward"]


def test_a_kernel_that_cannot_be_built_falls_back_to_the_loop_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    broken = _native.Kernel("tiled")
    monkeypatch.setattr(tiled_plans, "KERNEL", broken)
    q, k, v = qkv(t=23, s=31)
    with pytest.warns(UserWarning, match=r"tiled.cpp is unavailable: no C\+\+ compiler"):
        ran = paths_taken(lambda: attention(q, k, v, backend="tiled").sum().backward())
    assert ran == ["attnkit::tiled_loop_backward", "attnkit::tiled_loop_forward"]
    assert broken.available() == (False, broken._failure) and broken.origin is None
    expected, _, _ = naive_attention(*(x.detach().double() for x in (q, k, v)))
    torch.testing.assert_close(attention(q, k, v, backend="tiled"), expected.float())


def test_attnkit_native_0_disables_the_kernel(monkeypatch):
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    monkeypatch.setattr(tiled_plans, "KERNEL", _native.Kernel("tiled"))
    assert tiled_plans.KERNEL.available() == (False, "disabled by ATTNKIT_NATIVE=0")
    ran = paths_taken(forward_backward())
    assert ran == ["attnkit::tiled_loop_backward", "attnkit::tiled_loop_forward"]


def test_torch_compile_traces_the_loop_into_one_graph():
    """Dynamo cannot see into C++: compiled, the tiled backend is the PyTorch loop, in one graph
    (fullgraph=True), and computes what the eager C++ kernel computes."""
    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    q, k, v = qkv(h=4, h_kv=2, t=23, s=31)

    def f(q, k, v):
        return attention(q, k, v, causal=True, alibi_slopes=torch.ones(4), backend="tiled")

    compiled = torch.compile(f, backend=record, fullgraph=True)
    out = compiled(q, k, v)
    code = "".join(module.code for graph in graphs for module in graph.modules())
    assert "matmul" in code and "tiled_native" not in code
    torch.testing.assert_close(out, f(q, k, v))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for g, g_eager in zip(grads, torch.autograd.grad(f(q, k, v).sum(), (q, k, v))):
        torch.testing.assert_close(g, g_eager)


@pytest.mark.parametrize("window", [(3, 2), (0, 0), (2, -1), (-1, 1)])
def test_windows_that_end_before_or_start_after_a_key_block(window):
    """With 5 x 7 blocks, t=9 and s=13, some rows' windows lie wholly outside a key block that
    other rows of their query block need: the row is masked there, nothing is written outside it
    (a C++ kernel once did, and crashed in its backward)."""
    q, k, v = qkv(h=1, t=9, s=13, d=16)
    out = attention(q, k, v, window=window, backend="tiled")
    inputs64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected, _, _ = naive_attention(*inputs64, window=window)
    torch.testing.assert_close(out, expected.float())
    dout = torch.randn_like(out)
    for g, g64 in zip(
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(expected, inputs64, dout.double()),
    ):
        torch.testing.assert_close(g, g64.float())


def test_a_key_mask_over_a_single_key_with_any_stride():
    """(b, 1) masks are contiguous whatever their stride, which the kernel must accept."""
    q, k, v = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
    key_mask = torch.tensor([[True, False]]).t()  # (2, 1), strides (1, 2)
    out = attention(q, k, v, key_mask=key_mask, backend="tiled")
    torch.testing.assert_close(out[0], v[0].expand(1, 3, 4))
    assert torch.equal(out[1], torch.zeros(1, 3, 4))


def test_the_cpp_kernel_refuses_operands_that_do_not_fit_with_a_message():
    """The kernel reads masks without bounds checks, so it checks their sizes first (the Python
    side always passes fitting ones; this guards direct calls and future callers)."""
    kernel = tiled_plans.KERNEL.load()
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 4)
    empty_float, empty_bool = torch.empty(0), torch.empty(0, dtype=torch.bool)

    def forward(
        operands=(q, k, v),
        bias=empty_float,
        key_mask=empty_bool,
        alibi=empty_float,
        blocks=(4, 4),
        route=0,
        out=None,
    ):
        options = kernel.TiledOptions()
        options.bias, options.key_mask, options.alibi = bias, key_mask, alibi
        options.block_q, options.block_k = blocks
        options.route = route
        options.tile_rows = options.tile_keys = 8  # one tile: no score_mod
        out = torch.empty(1, 2, 5, operands[2].shape[-1]) if out is None else out
        return kernel.forward(*operands, out, options)

    assert forward()[0].shape == (1, 2, 5, 4)
    assert forward(out=torch.empty(1, 2, 5, 3))[0].shape == (1, 2, 5, 3)  # a padded column dropped
    with pytest.raises(RuntimeError, match=r"out \(b, h, t, dv\) must be float32, bfloat16"):
        forward(out=torch.empty(1, 2, 5, 2))
    with pytest.raises(RuntimeError, match=r"out \(b, h, t, dv\) must be float32, bfloat16"):
        forward(out=torch.empty(1, 2, 5, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="each row's entries must be contiguous"):
        forward((q, k, torch.randn(1, 1, 4, 7).transpose(2, 3)))
    with pytest.raises(RuntimeError, match=r"bias must be \(b, h, t, s\)"):
        forward(bias=torch.zeros(1, 2, 5, 6))
    with pytest.raises(RuntimeError, match=r"key_mask must be empty or bool \(b, s\)"):
        forward(key_mask=torch.ones(1, 6, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"alibi must be empty or contiguous float32 \(h,\)"):
        forward(alibi=torch.ones(3))
    with pytest.raises(RuntimeError, match="block sizes must be positive"):
        forward(blocks=(0, 4))
    with pytest.raises(RuntimeError, match=r"and v \(b, h_kv, s, dv\) disagree"):
        forward((q, k[:, :, :6], v))
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        forward((q.bfloat16(), k, v))
    with pytest.raises(RuntimeError, match="even last dim"):
        forward(tuple(x[..., :3].bfloat16().contiguous() for x in (q, k, v)))
    odd_rows = torch.randn(1, 1, 7, 5).bfloat16()[..., :4]  # rows 5 entries apart: not pairs
    with pytest.raises(RuntimeError, match="even strides"):
        forward((q.bfloat16(), k.bfloat16(), odd_rows))
    shifted = torch.randn(29).bfloat16()[1:].view(1, 1, 7, 4)  # 2 bytes past an aligned start
    with pytest.raises(RuntimeError, match="4-byte aligned"):
        forward((q.bfloat16(), k.bfloat16(), shifted))
    with pytest.raises(RuntimeError, match="no overlap"):
        forward(out=torch.empty(1, 2, 1, 4).expand(1, 2, 5, 4))
    bf16 = tuple(x.bfloat16() for x in (q, k, v))
    with pytest.raises(RuntimeError, match="unknown route 7"):
        forward(bf16, route=7)
    if not kernel.has_avx512_bf16():
        with pytest.raises(RuntimeError, match="this build has no AVX512-BF16 products"):
            forward(bf16, route=1)

    options = kernel.TiledOptions()  # the backward takes them, extended
    options.block_q = options.block_k = 4
    options.tile_rows = options.tile_keys = 8
    dout, lse, delta = torch.randn(1, 2, 5, 4), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5)

    def grads_of():
        return tuple(torch.empty_like(x) for x in (q, k, v))

    def backward(dout=dout, grads=None):
        grads = grads or grads_of()
        return tiled_calls.backward(kernel, dout, q, k, v, lse, delta, *grads, 0.5, options)

    assert backward()[1].shape == (1, 1, 7, 4)
    with pytest.raises(RuntimeError, match=r"dout must be \(b, h, t, dv\)"):
        backward(torch.randn(1, 2, 5, 3))
    with pytest.raises(RuntimeError, match=r"dk \(b, h_kv, s, d\) must be float32, bfloat16"):
        backward(grads=(torch.empty_like(q), torch.empty(1, 2, 7, 4), torch.empty_like(v)))
    with pytest.raises(RuntimeError, match=r"dv \(b, h_kv, s, dv\) must be"):
        backward(grads=(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v).int()))
    with pytest.raises(RuntimeError, match="alibi_grad without ALiBi slopes"):
        tiled_calls.backward(kernel, dout, q, k, v, lse, delta, *grads_of(), 0.5, options, True)


def test_the_quick_look_before_the_speed_rules_skips_no_rule(monkeypatch):
    """`faster_than` first asks `_may_be_faster`, on every call `auto` takes to SDPA: over
    dtypes, lengths, masks and options, its answer is the rules' own, asked with no quick look."""
    from attnkit.backends import sdpa, tiled
    from attnkit.call import call_of
    from attnkit.masks import Masks

    pad = torch.ones(1, 2048, dtype=torch.bool)
    masks = {
        "none": Masks(),
        "causal": Masks(window=(-1, 0)),
        "causal, padded": Masks(window=(-1, 0), key_mask=pad),
        "padded": Masks(key_mask=pad),
        "window": Masks(window=(63, 0)),
    }
    options = [{}, {"alibi_slopes": torch.ones(4)}, {"dropout_p": 0.1}]
    answers = []
    for dtype, (t, s), grad, name, extra in itertools.product(
        (torch.float32, torch.float64, torch.bfloat16),
        ((2048, 2048), (1024, 2048)),
        (False, True),
        masks,
        options,
    ):
        q, k, v = (torch.empty(1, 4, n, 64, dtype=dtype, requires_grad=grad) for n in (t, s, s))
        call = call_of(q, k, v, masks[name], 0.125, **extra)
        quick = tiled.BACKEND.faster_than(sdpa.BACKEND, call)
        with monkeypatch.context() as m:
            m.setattr(tiled, "_may_be_faster", lambda call: True)
            full = tiled.BACKEND.faster_than(sdpa.BACKEND, call)
            assert full == quick, (dtype, t, s, grad, name, sorted(extra))
        answers.append(quick)
    assert any(answers) and not all(answers)  # the rules took some calls and left others


@pytest.mark.parametrize("shape", [(0, 4, 5, 8), (2, 4, 0, 8)], ids=["no batch", "no query"])
@pytest.mark.parametrize("weights", [False, True, "dropped"])
def test_empty_calls_are_left_to_the_reference_backend(shape, weights):
    """The kernel's checks refuse empty rows; auto takes the reference backend for them, whose
    results and gradients are empty."""
    q = torch.randn(shape, requires_grad=True)
    k = torch.randn(shape[0], 2, 5, 8, requires_grad=True)
    assert which_backend(q, k, k, causal=True, return_weights=weights).backend != "tiled"
    result = attention(q, k, k, causal=True, return_weights=weights)
    out = result[0] if weights else result
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == shape and k.grad.shape == k.shape
