"""What only a GPU checks: attnkit on torch's fused CUDA kernels in half precision, no host-device
synchronisation on the common paths, ring attention over NCCL, and nothing moved to the CPU."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit.functional import attention, which_backend
from helpers.oracle import naive_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def _inputs(b, h, h_kv, t, s, d, dtype, grad=True):
    q = torch.randn(b, h, t, d, device=CUDA, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, h_kv, s, d, device=CUDA, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, h_kv, s, d, device=CUDA, dtype=dtype, requires_grad=grad)
    return q, k, v


def _oracle(q, k, v, dtype, **options):
    """The oracle's output and gradients in ``dtype`` on the CPU (float64 for the reference, the
    inputs' half precision for the naive path's error)."""
    leaves = [x.detach().cpu().to(dtype).requires_grad_() for x in (q, k, v)]
    out = naive_attention(*leaves, **options)[0]
    out.backward(torch.ones_like(out))
    return out, [x.grad for x in leaves]


def _error(x, reference):
    return (x.detach().cpu().double() - reference.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("h", "h_kv", "t", "s", "causal"),
    [(4, 4, 128, 128, False), (4, 4, 128, 128, True), (8, 2, 96, 160, True), (4, 1, 1, 257, True)],
)
def test_half_precision_on_the_fused_kernels_is_within_twice_the_naive_error(
    dtype, h, h_kv, t, s, causal
):
    q, k, v = _inputs(2, h, h_kv, t, s, 64, dtype)
    assert which_backend(q, k, v, causal=causal).backend == "sdpa"
    out = attention(q, k, v, causal=causal)
    out.backward(torch.ones_like(out))
    exact, exact_grads = _oracle(q, k, v, torch.float64, causal=causal)
    naive, naive_grads = _oracle(q, k, v, dtype, causal=causal)
    assert out.device == q.device and out.dtype == dtype
    assert _error(out, exact) <= 2 * _error(naive, exact) + 1e-3
    for x, g_exact, g_naive in zip((q, k, v), exact_grads, naive_grads):
        assert _error(x.grad, g_exact) <= 3 * _error(g_naive, g_exact) + 1e-3


@contextlib.contextmanager
def no_synchronisation():
    """Any operation that makes the host wait for the GPU raises inside."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"causal": True, "gqa": True},
        {"causal": True, "t": 1},
        {"causal": True, "t": 64},
        {"key_mask": True},
        {"window": (16, 0)},
    ],
    ids=str,
)
def test_common_calls_never_wait_for_the_gpu(options):
    options = dict(options)
    t = options.pop("t", 128)
    h_kv = 2 if options.pop("gqa", False) else 4
    q, k, v = _inputs(2, 4, h_kv, t, 128, 64, torch.bfloat16)
    if options.pop("key_mask", False):
        options["key_mask"] = torch.ones(2, 128, dtype=torch.bool, device=CUDA)
        options["key_mask"][1, 100:] = False
    out = attention(q, k, v, **options)  # warm: the first call may load kernels
    with no_synchronisation():
        out = attention(q, k, v, **options)
        out.backward(torch.ones_like(out))


def test_a_module_step_never_waits_for_the_gpu():
    mha = attnkit.MultiHeadAttention(64, 64, 32, 0.0, num_heads=4).to(CUDA)
    x = torch.randn(2, 32, 64, device=CUDA)
    mha(x)
    with no_synchronisation():
        mha(x).sum().backward()


def test_tensors_on_two_devices_are_refused_never_moved():
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32, grad=False)
    with pytest.raises(ValueError, match="same device"):
        attention(q, k.cpu(), v)
    with pytest.raises(ValueError, match="key_mask is on cpu"):
        attention(q, k, v, key_mask=torch.ones(1, 8, dtype=torch.bool))


def test_the_tiled_backend_runs_its_pytorch_loop_on_a_gpu():
    q, k, v = _inputs(1, 2, 2, 40, 56, 32, torch.float32)
    choice = which_backend(q, k, v, causal=True, backend="tiled")
    assert (choice.backend, choice.path) == ("tiled", "loop")
    out = attention(q, k, v, causal=True, backend="tiled")
    out.backward(torch.ones_like(out))
    exact, grads = _oracle(q, k, v, torch.float64, causal=True)
    torch.testing.assert_close(out.cpu().double(), exact, rtol=1.3e-6, atol=1e-5)
    for x, g in zip((q, k, v), grads):
        torch.testing.assert_close(x.grad.cpu().double(), g, rtol=1.3e-6, atol=1e-5)


@pytest.fixture
def nccl_world_of_one():
    if not dist.is_nccl_available():
        pytest.skip("torch here was built without NCCL")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ring_attention_over_nccl_at_world_size_one(nccl_world_of_one):
    from attnkit.distributed import ring_attention

    q, k, v = _inputs(1, 4, 2, 64, 64, 32, torch.float32)
    out = ring_attention(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    grads = [x.grad for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    expected = attention(q, k, v, causal=True)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out, expected)
    for x, g in zip((q, k, v), grads):
        torch.testing.assert_close(g, x.grad)


def test_the_bench_runs_every_case_on_the_gpu(tmp_path):
    from attnkit.cli import main

    assert main(["bench", "--device", "cuda", "--smoke", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "results.json").read_text())["results"]
    assert {r["device"] for r in records} == {"cuda"}
    ran = [r for r in records if not r["status"].startswith("n/a")]
    assert ran and all(r["status"] == "ok" and r["peak_mib"] is not None for r in ran), ran


def test_the_decoding_bench_reads_the_cache_against_a_copy(tmp_path):
    from attnkit.cli import main

    sizes = ["--n", "4096", "--b", "2", "--h", "8", "--kv-heads", "2", "--d", "64"]
    assert main(["bench", "--device", "cuda", "--decode", *sizes, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "decode.json").read_text())
    assert record["bytes_read"] == 2 * 2 * 2 * 4096 * 64 * 2
    assert [r["impl"] for r in record["rows"]] == ["attnkit", "attnkit, keys read", "torch-sdpa"]
    assert all(r["gbps"] > 0 for r in record["rows"]) and record["copy_gbps"] > 0
