"""The backend registry and "auto": which backend runs, and refusals that name the option."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from attnkit import attention
from attnkit.backends import AUTO_ORDER, BACKENDS, choose_backend, tiled
from attnkit.backends.tiled import HALF_NATIVE_FROM
from attnkit.call import Call, call_of
from attnkit.force import forced
from attnkit.functional import which_backend
from attnkit.kernels import cpu as _cpu
from attnkit.kernels import loader as _native
from attnkit.masks import Masks
from attnkit.tiled import plans as tiled_plans


def qkv(n=1024, h=12, dtype=torch.float32, requires_grad=False):
    return [torch.empty(1, h, n, 64, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


SHAPES = qkv()


def call(tensors=None, masks=None, **options) -> Call:
    return call_of(*(SHAPES if tensors is None else tensors), masks or Masks(), 1.0, **options)


def picked(name, the_call) -> str:
    return choose_backend(name, the_call).backend


def test_auto_picks_sdpa_for_plain_attention():
    assert picked("auto", call()) == "sdpa"


@pytest.mark.parametrize("option", ["return_weights", "return_lse", "softcap"])
def test_auto_picks_tiled_for_what_sdpa_cannot_do(option):
    value = 5.0 if option == "softcap" else True
    assert picked("auto", call(**{option: value})) == "tiled"


def test_auto_picks_the_tiled_kernel_for_dropout_with_weights():
    assert picked("auto", call(dropout_p=0.1, return_weights=True)) == "tiled"


def test_every_general_backend_supports_at_least_plain_attention():
    assert set(AUTO_ORDER) == set(BACKENDS)
    for name in ("reference", "sdpa", "tiled"):  # decode takes a few queries only
        assert picked(name, call()) == name and BACKENDS[name].name == name


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"return_weights": True}, "return_weights"),
        ({"return_lse": True}, "return_lse"),
        ({"softcap": 30.0}, "softcap"),
    ],
)
def test_sdpa_refuses_what_it_cannot_do_and_names_it(options, named):
    q = k = v = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match=rf"backend 'sdpa' does not support {named}; use"):
        attention(q, k, v, backend="sdpa", **options)


def test_unknown_backend_name_lists_the_choices():
    q = k = v = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"unknown backend 'flash'; choose one of 'auto', "):
        attention(q, k, v, backend="flash")


def test_call_options_name_the_arguments():
    masks = Masks(window=(-1, 0), key_mask=torch.ones(1, 3, dtype=torch.bool))
    options = call(masks=masks, dropout_p=0.1, return_lse=True).options
    assert options == {"causal", "key_mask", "dropout_p", "return_lse"}
    assert "window" in call(masks=Masks(window=(2, 0))).options


def test_tiled_refuses_mask_gradients():
    q = k = v = torch.randn(1, 1, 3, 4)
    bias = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(ValueError, match="backend 'tiled' does not support attn_mask_grad"):
        attention(q, k, v, backend="tiled", attn_mask=bias)


@pytest.mark.usefixtures("pytorch_loop")
def test_auto_takes_tiled_for_a_narrow_window():
    narrow = call(masks=Masks(window=(255, 0)))
    assert picked("auto", narrow) == "tiled"  # sees 256 of 1024 keys
    wide = call(masks=Masks(window=(600, 0)))
    assert picked("auto", wide) == "tiled"  # without the C++ kernel too: no dense mask on a CPU
    assert picked("auto", call(masks=Masks(window=(-1, 0)))) == "sdpa"


@pytest.mark.usefixtures("pytorch_loop")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_takes_tiled_where_sdpa_would_need_a_dense_causal_mask(dtype):
    """On a CPU, SDPA's causal kernel aligns top-left and knows no padding: causal with t != s, or
    with padding, would make it read a dense mask, which the tiled backend never builds."""
    q, k, v = (torch.empty(1, 2, n, 8, dtype=dtype) for n in (64, 80, 80))
    pad = torch.ones(1, 80, dtype=torch.bool)
    causal = Masks(window=(-1, 0))
    assert picked("auto", call((q, k, v), causal)) == "tiled"  # t = 64, s = 80
    assert picked("auto", call((k, k, v), Masks(window=(-1, 0), key_mask=pad))) == "tiled"
    assert picked("auto", call((k, k, v), causal)) == "sdpa"  # t = s: SDPA's own causal kernel
    assert picked("auto", call((k, k, v), Masks(key_mask=pad))) == "sdpa"  # no positions
    assert picked("auto", call((q, k, v), Masks(key_mask=pad))) == "sdpa"


@pytest.mark.usefixtures("pytorch_loop")
def test_auto_takes_tiled_rather_than_a_huge_dense_alibi_mask():
    causal = Masks(window=(-1, 0))
    long = call(qkv(n=2048), causal, alibi_slopes=torch.ones(12))
    assert picked("auto", long) == "tiled"  # 12 x 2048^2 > 2^24
    small = call(qkv(n=64, h=2), causal, alibi_slopes=torch.ones(2))
    assert picked("auto", small) == "sdpa"


def test_auto_takes_tiled_for_half_precision_training_without_fast_half_products(monkeypatch):
    monkeypatch.setenv(_cpu.ENV, "avx2")  # a CPU without bf16 units
    assert picked("auto", call(qkv(dtype=torch.bfloat16, requires_grad=True))) == "tiled"
    assert picked("auto", call(qkv(dtype=torch.bfloat16))) == "sdpa"  # inference
    assert picked("auto", call(qkv(requires_grad=True))) == "sdpa"  # fp32
    monkeypatch.delenv(_cpu.ENV)
    with forced("tiled:half-loop"):  # fast bf16 products, in the loop
        assert picked("auto", call(qkv(dtype=torch.bfloat16, requires_grad=True))) == "sdpa"


@pytest.fixture
def avx512_bf16_cpu(monkeypatch, every_extension):
    """A CPU with AVX512-BF16 and no AMX, and a tiled kernel not yet loaded (whose build for
    that CPU would multiply bf16 with vdpbf16ps): for choices only, nothing runs."""
    monkeypatch.setenv(_cpu.ENV, "avx512_bf16")
    monkeypatch.setattr(tiled_plans, "KERNEL", _native.Kernel("tiled"))


@pytest.mark.usefixtures("avx512_bf16_cpu")
@pytest.mark.parametrize("requires_grad", [False, True])
def test_auto_takes_tiled_for_bf16_where_the_kernel_multiplies_with_avx512_bf16(
    monkeypatch, requires_grad
):
    """Decided from the CPU's features (the kernel's route for bf16 blocks, no AMX) and sizes."""
    rows, scores = HALF_NATIVE_FROM["training" if requires_grad else "inference"]

    def backend(t, s, dtype=torch.bfloat16):
        q = torch.empty(1, 12, t, 64, dtype=dtype, requires_grad=requires_grad)
        k, v = (torch.empty(1, 12, s, 64, dtype=dtype, requires_grad=requires_grad) for _ in "kv")
        return picked("auto", call([q, k, v]))

    side = math.isqrt(scores)
    assert backend(max(side, rows), max(side, rows)) == "tiled"
    assert backend(side // 2, side // 2) == "sdpa"  # too few scores
    assert backend(rows // 2, 4 * scores // rows) == "sdpa"  # too few rows: packing K, V dominates
    # fp16: no pair products; training takes tiled only for SDPA's slow fp16 backward (no AMX-FP16)
    assert backend(side, side, torch.float16) == ("tiled" if requires_grad else "sdpa")
    monkeypatch.setenv(_cpu.ENV, "amx")
    assert backend(side, side) == "sdpa"  # with AMX, SDPA's kernel has it: not measured
    monkeypatch.setenv(_cpu.ENV, "avx512_bf16")
    with forced("tiled:portable"):
        assert backend(side, side) == "sdpa"  # the slow, portable route


@pytest.mark.parametrize(
    "masks, slopes",
    [
        (Masks(window=(-1, 0)), torch.ones(12)),
        (Masks(window=(600, 0)), None),
        (Masks(), torch.ones(12)),
    ],
    ids=["causal alibi", "wide window", "alibi"],
)
def test_auto_takes_the_cpp_kernel_over_sdpa_with_a_dense_positional_mask(masks, slopes):
    assert tiled.BACKEND.path(call(masks=masks, alibi_slopes=slopes)).path == "native"
    assert picked("auto", call(masks=masks, alibi_slopes=slopes)) == "tiled"  # 1024 x 1024
    small = call(qkv(n=128), masks, alibi_slopes=slopes)
    float64 = call(qkv(dtype=torch.float64), masks, alibi_slopes=slopes)
    if slopes is None:  # a window: on a CPU never a dense mask, at any size, on any path
        assert picked("auto", small) == picked("auto", float64) == "tiled"
    else:  # ALiBi's float mask: SDPA below NATIVE_MIN_SCORES and where only the loop runs
        assert picked("auto", small) == picked("auto", float64) == "sdpa"
    assert picked("auto", call()) == "sdpa"  # no mask: SDPA is as fast


def test_which_backend_reports_what_attention_runs(monkeypatch):
    """The public answer agrees with the backend that runs, for calls that reach each backend."""
    ran = []
    for name, backend in BACKENDS.items():
        run = backend.run
        monkeypatch.setattr(
            backend, "run", lambda c, *plan, run=run, name=name: ran.append(name) or run(c, *plan)
        )
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1024, 8), torch.randn(1, 2, 1024, 8)
    calls = [
        ({}, (q, k, v)),  # one query over a long cache: decode
        ({"causal": True}, (k, k, k)),
        ({"softcap": 5.0}, (k, k, k)),
        ({"dropout_p": 0.1, "return_weights": True}, (k, k, k)),
    ]
    for options, tensors in calls:
        with torch.no_grad():
            choice = which_backend(*tensors, **options)
            attention(*tensors, **options)
        assert ran.pop() == choice.backend
    with torch.no_grad():
        picked = [which_backend(*t, **o).backend for o, t in calls]
    assert picked == ["decode", "sdpa", "tiled", "tiled"]


def test_which_backend_says_why():
    q = k = v = torch.randn(1, 2, 16, 8)
    choice = which_backend(q, k, v, softcap=5.0)
    assert choice == (choice.backend, choice.path, choice.reason, choice.products)  # a NamedTuple
    assert choice.backend == "tiled" and "sdpa does not support softcap" in choice.reason
    assert which_backend(q, k, v, softcap=5.0, backend="reference") == (
        "reference",
        "float64",
        "named by the caller",
        "float64",
    )
    assert which_backend(q.double(), k.double(), v.double(), softcap=5.0).path == "loop"
    with pytest.raises(ValueError, match="backend 'sdpa' does not support softcap"):
        which_backend(q, k, v, softcap=5.0, backend="sdpa")


def test_which_backend_follows_transforms_and_tracing():
    q = k = v = torch.randn(1, 2, 16, 8)

    def traced(q):
        assert which_backend(q, k, v, softcap=5.0).backend == "reference"  # tiled cannot trace
        return q

    torch.jit.trace(traced, q, check_trace=False)  # the check reruns it untraced
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        assert which_backend(dual, k, v).backend == "reference"  # only it has a jvp rule


DECIDING = """
import json, sys, torch
from attnkit.functional import which_backend
q = torch.randn(1, 4, 64, 32)
kv = torch.randn(1, 2, 64, 32)
cases = [
    ({}, (q, kv, kv)),
    ({"causal": True, "softcap": 5.0}, (q, kv, kv)),
    ({"window": (7, 0), "backend": "tiled"}, (q.bfloat16(), kv.bfloat16(), kv.bfloat16())),
    ({}, (q[:, :, :1], kv, kv)),
    ({"score_mod": lambda s, b, h, i, j: s + (i - j)}, (q, kv, kv)),
]
with torch.no_grad():
    chosen = [list(which_backend(*x, **o)[:2]) for o, x in cases]
loaded = sorted(name for name in sys.modules if name.startswith("attnkit_"))
print(json.dumps({"chosen": chosen, "loaded": loaded}))
"""


def test_which_backend_in_a_fresh_extensions_folder_builds_loads_and_writes_nothing(tmp_path):
    import json
    import os
    import subprocess
    import sys

    folder = tmp_path / "extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}
    result = subprocess.run(
        [sys.executable, "-c", DECIDING], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not folder.exists() and report["loaded"] == []
    assert "attnkit:" not in result.stderr  # no build announced
    if tiled_plans.KERNEL.usable()[0]:  # a compiler here: the kernels are chosen, to be built
        assert report["chosen"][1] == ["tiled", "native"]
        assert report["chosen"][3] == ["decode", "native"]


@pytest.mark.parametrize("loop_only", [False, True], ids=["kernel", "without the kernel"])
def test_on_a_cpu_no_call_gives_sdpa_a_dense_mask_of_positions_or_padding(loop_only):
    """The masks a model describes (a chunk after a cache, a window, padding with causal) go to
    the tiled backend at any size, so no t x s mask is built; no mask, or causal with t == s,
    stays with SDPA's fused kernel."""
    q = torch.randn(1, 4, 4, 16)
    k = torch.randn(1, 2, 40, 16)
    key_mask = torch.ones(1, 40, dtype=torch.bool)
    key_mask[0, :3] = False
    with forced("tiled:loop") if loop_only else contextlib.nullcontext():
        for tensors, options in [
            ((q, k, k), {"causal": True}),  # 4 queries after 36 cached keys
            ((k, k, k), {"window": (19, 0)}),
            ((k, k, k), {"causal": True, "key_mask": key_mask}),
        ]:
            choice = which_backend(*tensors, **options)
            assert choice.backend == "tiled", (options, choice.reason)
        assert which_backend(k, k, k, causal=True).backend == "sdpa"
        assert which_backend(k, k, k).backend == "sdpa"


def _calls_seen_by(names, monkeypatch):
    """The calls that the backends ``names`` are handed, by name."""
    seen = {}
    for name in names:
        backend = BACKENDS[name]

        def run(call, *plan, real=backend.run, name=name):
            seen[name] = call
            return real(call, *plan)

        monkeypatch.setattr(backend, "run", run)
    return seen


def test_padding_is_zeroed_before_each_backend_that_reads_it_and_the_decode_kernel_skips_it(
    monkeypatch,
):
    seen = _calls_seen_by(("sdpa", "tiled", "reference", "decode"), monkeypatch)
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    key_mask = torch.tensor([[True, False, True, True, False, True]])
    k[0, :, 1], v[0, :, 4] = math.nan, math.inf  # padding may hold anything
    names = ["sdpa", "tiled", "reference"]
    if BACKENDS["decode"].refuses(call_of(q, k, v, Masks(), 1.0)) is None:  # its kernel is here
        names.append("decode")
    outs = {name: attention(q, k, v, key_mask=key_mask, backend=name) for name in names}
    assert set(seen) == set(names)
    for name, call in seen.items():
        padded = ~key_mask[0]
        if BACKENDS[name].reads_padding:
            assert bool((call.k[0, :, padded] == 0).all()) and bool(
                (call.v[0, :, padded] == 0).all()
            )
        else:  # given as they are: the kernel never reads them
            assert call.k is k and call.v is v
    for out in outs.values():
        assert bool(out.isfinite().all())
        torch.testing.assert_close(out, outs["reference"])


def test_the_nan_rules_look_at_the_inputs_is_made_once_by_the_registry_where_a_backend_needs_it(
    monkeypatch,
):
    seen = _calls_seen_by(("sdpa", "tiled"), monkeypatch)
    q = torch.randn(1, 2, 8, 4)
    attention(q, q, q, backend="sdpa")
    attention(q, q, q, backend="tiled")
    assert seen["sdpa"].finite is True  # looked at, once, before SDPA ran
    assert seen["tiled"].finite is None  # its kernel keeps the rule itself: no look
    bad = q.clone()
    bad[0, 1, 3, 2] = math.inf
    attention(bad, q, q, backend="sdpa")
    assert seen["sdpa"].finite is False
    assert [name for name, b in BACKENDS.items() if b.looks_at_values] == ["sdpa", "flex"]
