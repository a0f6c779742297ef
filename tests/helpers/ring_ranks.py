"""Running a function on real processes joined by torch.distributed (gloo over TCP on loopback),
for the ring attention tests; and the functions the ranks run. A module of its own, so that the
spawned processes can import what they run."""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit import distributed as ring
from attnkit import force
from attnkit import functional as F
from attnkit.bench.launch import run_local
from attnkit.distributed.transport import Ring
from attnkit.tiled import autograd as tiled_function


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(world: int, target: Callable, *args, lost: tuple[int, ...] = ()) -> list:
    """``target(rank, world, *args)`` on ``world`` processes (see ``run_local``)."""
    return run_local(world, target, *args, lost=lost, wait=180.0)


# The cases: each builds the whole sequence the same way on every rank (same seed), runs ring
# attention on this rank's shard and compares with float64 attention of the whole sequence.

TABLE_SIZE = 200  # relative-position table: positions -99 .. 100


def relative_bias(table: Tensor):
    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 99]

    return bias


def same_document(documents: Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return documents[q_idx] == documents[kv_idx]

    return mask_mod


_KEPT = contextlib.ExitStack()


def _small_blocks() -> None:
    """The tiled backend's blocks of 5 x 7 for the rest of this rank's process: many blocks, and
    lengths that do not divide them."""
    _KEPT.enter_context(force.blocks(5, 7))


def compare_case(rank: int, world: int, case: dict) -> dict[str, float]:
    """Ring attention of ``case`` on this rank against float64 attention of the whole sequence:
    the largest differences of the output, lse and gradients of this rank's shard (and of the
    slopes' or table's gradient, summed over the ranks)."""
    _small_blocks()
    # Pieces of about 2 keys and 3 queries a chunk: several rounds, pieces of unequal sizes.
    _KEPT.enter_context(force.pieces(*case.get("pieces", (2, 3))))
    dtype = case.get("dtype", torch.float64)
    b, h, h_kv, d = 2, case.get("h", 2), case.get("h_kv", 2), 8
    t, s = case["t"], case.get("s", case["t"])
    layout = case.get("layout", "contiguous")
    torch.manual_seed(case.get("seed", 0))
    q = torch.randn(b, h, t, d, dtype=torch.float64)
    k, v = (
        torch.randn(b, h_kv, s, d, dtype=torch.float64),
        torch.randn(b, h_kv, s, d, dtype=torch.float64),
    )
    d_out, d_lse = (
        torch.randn(b, h, t, d, dtype=torch.float64),
        torch.randn(b, h, t, dtype=torch.float64),
    )
    if case.get("nan_value"):  # a NaN value at a key the causal mask hides from earlier queries
        v[:, :, s // 2, 1] = math.nan
    if dtype in (torch.bfloat16, torch.float16):
        d_lse.zero_()  # the naive formula, the yardstick in half precision, has no lse
    options = {"causal": case.get("causal", False)}
    if case.get("key_mask"):
        key_mask = torch.rand(b, s) > 0.3
        key_mask[:, 0] = True
        options["key_mask"] = key_mask
        if case.get("nan_padding"):  # padding may hold anything
            k = k.masked_fill(~key_mask[:, None, :, None], math.nan)
            v = v.masked_fill(~key_mask[:, None, :, None], math.nan)
    for name in ("window", "softcap", "scale"):
        if name in case:
            options[name] = case[name]
    if case.get("documents"):  # three packed documents, each attending within itself
        options["mask_mod"] = same_document(torch.arange(t) * 3 // t)
    trained = {}
    if case.get("alibi"):
        trained["alibi_slopes"] = torch.linspace(0.1, 0.9, h, dtype=torch.float64)
    if case.get("sinks"):
        trained["sinks"] = torch.randn(h, dtype=torch.float64)
    table = None
    if case.get("relative_bias"):
        table = torch.randn(h, TABLE_SIZE, dtype=torch.float64) * 0.5

    def run_it(q, k, v, options, trained, table, attend):
        leaves = [x.requires_grad_() for x in (q, k, v, *trained.values())]
        extra = dict(options)
        extra.update(zip(trained, leaves[3:]))
        if table is not None:
            table = table.requires_grad_()
            leaves.append(table)
            extra["score_mod"] = relative_bias(table)
        out, lse = attend(*leaves[:3], **extra)
        return out, lse, leaves

    def whole(q, k, v, **options):
        backend = case.get("oracle", "reference")
        return F.attention(q, k, v, return_lse=True, backend=backend, **options)

    out, lse, leaves = run_it(q, k, v, options, trained, table, whole)
    finite = ~lse.isinf()
    loss = (out.nan_to_num(0.0) * d_out).sum() + (lse.where(finite, 0.0) * d_lse).sum()
    want = [out, lse, *torch.autograd.grad(loss, leaves)]

    def cut(x, dim):
        return ring.shard(x, dim, layout=layout)

    local = {"causal": options["causal"], "layout": layout}
    if "key_mask" in options:
        local["key_mask"] = cut(options["key_mask"], 1)
    for name in ("window", "softcap", "scale", "mask_mod"):
        if name in options:
            local[name] = options[name]
    local_trained = {n: x.detach().to(dtype) for n, x in trained.items()}
    local_table = None if table is None else table.detach().to(dtype)

    def in_ring(q, k, v, **options):
        return ring.ring_attention(q, k, v, return_lse=True, **options)

    shards = [cut(x.detach(), 2).to(dtype) for x in (q, k, v)]
    out_r, lse_r, leaves_r = run_it(*shards, local, local_trained, local_table, in_ring)
    d_out_r, d_lse_r = cut(d_out, 2).to(dtype), cut(d_lse, 2).to(dtype)
    finite_r = ~lse_r.isinf()
    loss_r = (out_r.nan_to_num(0.0) * d_out_r).sum() + (lse_r.where(finite_r, 0.0) * d_lse_r).sum()
    got = [out_r, lse_r, *torch.autograd.grad(loss_r, leaves_r)]
    naive = None
    if dtype in (torch.bfloat16, torch.float16):  # the same precision, materialised: the yardstick
        half = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out_n = _naive(*half, options["causal"])
        naive = [out_n, *torch.autograd.grad((out_n.float() * d_out).sum(), half)]
    for x in got[5:]:  # a tensor every rank holds: its gradient is the sum of the ranks' parts
        dist.all_reduce(x)
    differences = {}
    names = ["out", "lse", "dq", "dk", "dv", *trained, *(["table"] if table is not None else [])]
    for name, g, w in zip(names, got, want):
        w = w.detach() if name in ("alibi_slopes", "sinks", "table") else cut(w.detach(), 2)
        same_inf = torch.equal(g.isinf(), w.isinf()) and torch.equal(g.isnan(), w.isnan())
        g, w = g.detach().double().nan_to_num(posinf=0, neginf=0), w.nan_to_num(posinf=0, neginf=0)
        differences[name] = (g - w).abs().max().item() if same_inf else math.inf
        differences[name + " scale"] = w.abs().max().item()
    if naive is not None:
        for name, n, w in zip(["out", "dq", "dk", "dv"], naive, [want[0], *want[2:5]]):
            n, w = cut(n.detach().double(), 2), cut(w.detach(), 2)
            differences[name + " naive"] = (n - w).abs().max().item()
    return differences


def _naive(q, k, v, causal: bool) -> Tensor:
    """softmax(q kᵀ / sqrt(d)) v in the inputs' dtype (GQA by repeating k and v)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        t, s = scores.shape[-2:]
        allowed = torch.arange(s) <= torch.arange(t)[:, None] + s - t
        scores = scores.masked_fill(~allowed, -math.inf)
    return scores.softmax(dim=-1) @ v


def compare_cases(rank: int, world: int, cases: dict[str, dict]) -> dict[str, dict[str, float]]:
    return {name: compare_case(rank, world, case) for name, case in cases.items()}


# Bad input and faults.


def _error_of(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return "", "no error"


def mismatched_shards(rank: int, world: int) -> tuple[str, str]:
    """Rank 0 holds a shorter shard than the others: every rank must raise, none wait."""
    t = 4 if rank == 0 else 6
    q = k = v = torch.randn(1, 2, t, 8)
    return _error_of(lambda: ring.ring_attention(q, k, v, causal=True, timeout=20))


def mismatched_options(rank: int, world: int) -> tuple[str, str]:
    """Rank 0 passes float64 shards, rank 1 float32 ones with a window."""
    if rank == 0:
        q = k = v = torch.randn(1, 2, 4, 8, dtype=torch.float64)
        return _error_of(lambda: ring.ring_attention(q, k, v, timeout=20))
    q = k = v = torch.randn(1, 2, 4, 8)
    return _error_of(lambda: ring.ring_attention(q, k, v, window=(2, 0), timeout=20))


def in_a_subgroup(rank: int, world: int) -> list[float] | None:
    """Ring attention over the group of ranks 1 and 2 (their group ranks 0 and 1): the largest
    differences of the output and gradients from attention of the whole sequence."""
    group = dist.new_group(ranks=[1, 2])
    if rank == 0:
        return None
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    mine = [ring.shard(x, 2, group=group, layout="zigzag").requires_grad_() for x in (q, k, v)]
    out = ring.ring_attention(*mine, group=group, causal=True, layout="zigzag")
    out.sum().backward()
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.attention(*whole, causal=True)
    want.sum().backward()
    pairs = [(out, want), *((m.grad, w.grad) for m, w in zip(mine, whole))]
    return [
        (g - ring.shard(w, 2, group=group, layout="zigzag")).abs().max().item() for g, w in pairs
    ]


def double_backward(rank: int, world: int) -> tuple[str, str]:
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    out = ring.ring_attention(q, k, v, causal=True, timeout=20)
    return _error_of(lambda: torch.autograd.grad(out.pow(2).sum(), q, create_graph=True))


def zigzag_misfit(rank: int, world: int) -> tuple[str, str]:
    """Shards of 3: 3 * world tokens do not split into 2 * world equal chunks."""
    q = k = v = torch.randn(1, 2, 3, 8)
    return _error_of(lambda: ring.ring_attention(q, k, v, layout="zigzag", timeout=20))


def outside_the_group(rank: int, world: int) -> tuple[str, str]:
    """A group of rank 0 alone: rank 1 is not in it."""
    group = dist.new_group(ranks=[0])
    q = k = v = torch.randn(1, 2, 4, 8)
    return _error_of(lambda: ring.ring_attention(q, k, v, group=group, timeout=20))


def dies_or_hangs(rank: int, world: int, victim: int, how: str, timeout: float, where: str):
    """Ring attention in which rank ``victim`` dies (``how="die"``) or stops answering
    (``"hang"``) at its second block of the forward or the backward (``where``); the others'
    error and how long it took them."""
    import time

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    if rank == victim:
        calls = {"n": 0}
        original = tiled_function.partial if where == "forward" else tiled_function.backward

        def faulty(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                if how == "die":
                    os._exit(3)
                time.sleep(10 * timeout)  # a hung process: the others must not wait for it
            return original(*args, **kwargs)

        setattr(tiled_function, "partial" if where == "forward" else "backward", faulty)
    start = time.monotonic()
    try:
        out = ring.ring_attention(q, k, v, causal=True, timeout=timeout)
        out.sum().backward()
    except ring.RingError as error:
        return {
            "error": str(error),
            "seconds": time.monotonic() - start,
            "waited_on": error.waited_on,
            "failed": error.failed,
        }
    return {"error": None, "seconds": time.monotonic() - start}


def module_case(rank: int, world: int, layout: str) -> dict[str, float]:
    """A MultiHeadAttention (GQA, RoPE, causal, a window, soft-capping) run context-parallel on
    shards against the same module on the whole sequence, in float64: the largest differences of
    the output, the input's gradient and the parameters' gradients (summed over the ranks)."""
    from attnkit import MultiHeadAttention

    _small_blocks()
    _KEPT.enter_context(force.pieces(2, 3))
    torch.manual_seed(0)
    mha = MultiHeadAttention(
        16, 16, context_length=None, dropout=0.0, num_heads=4, num_kv_heads=2, rope=True,
        window=9, softcap=3.0, dtype=torch.float64,
    )  # fmt: skip
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    d_out = torch.randn(2, 24, 16, dtype=torch.float64)
    whole_x = x.clone().requires_grad_()
    want_out = mha(whole_x)
    want = [want_out, *torch.autograd.grad((want_out * d_out).sum(), [whole_x, *mha.parameters()])]
    shard_x = ring.shard(x, 1, layout=layout).requires_grad_()
    out = mha(shard_x, context_parallel=ring.ContextParallel(layout=layout))
    loss = (out * ring.shard(d_out, 1, layout=layout)).sum()
    got = [out, *torch.autograd.grad(loss, [shard_x, *mha.parameters()])]
    for g in got[2:]:
        dist.all_reduce(g)  # the parameters are every rank's: their gradient is the sum
    names = ["out", "dx", *(n for n, _ in mha.named_parameters())]
    differences = {}
    for i, (name, g, w) in enumerate(zip(names, got, want)):
        w = ring.shard(w, 1, layout=layout) if i < 2 else w
        differences[name] = (g.detach() - w.detach()).abs().max().item()
    return differences


def largest_transfer(rank: int, world: int, layout: str) -> int:
    """Forward and backward with key pieces of about 4 keys a chunk, over shards of 16 tokens: the
    most tokens of any tensor this rank sent or received (keys, values, their key mask and the
    gradients' sums)."""
    _KEPT.enter_context(force.pieces(4))
    tokens = []
    exchange = Ring.exchange

    def recorded(self, outgoing, incoming, what):
        tokens.extend(x.shape[-2] if x.dim() == 4 else x.shape[-1] for x in (*outgoing, *incoming))
        return exchange(self, outgoing, incoming, what)

    Ring.exchange = recorded
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    key_mask = torch.rand(1, 16) > 0.2
    out = ring.ring_attention(q, k, v, causal=True, layout=layout, key_mask=key_mask)
    out.sum().backward()
    return max(tokens)


def under_autocast(rank: int, world: int) -> list[float]:
    """The largest differences of the output and gradients of ring attention (causal, zigzag, a
    mask_mod: the PyTorch loop's products) under bf16 autocast from those without it."""
    _KEPT.enter_context(force.pieces(2, 3))
    torch.manual_seed(0)
    whole = [torch.randn(1, 2, 16, 8) for _ in range(3)]
    mine = [ring.shard(x, 2, layout="zigzag") for x in whole]
    documents = torch.arange(16) // 5

    def run(autocast: bool) -> list[Tensor]:
        leaves = [x.clone().requires_grad_() for x in mine]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ring.ring_attention(
                *leaves, causal=True, layout="zigzag", mask_mod=same_document(documents)
            )
        return [out, *torch.autograd.grad((out * out).sum(), leaves)]

    return [(a - b).abs().max().item() for a, b in zip(run(True), run(False))]


def mismatched_pieces(rank: int, world: int) -> tuple[str, str]:
    """Rank 0 cuts the keys into other pieces than the rest: the transfers could not match."""
    _KEPT.enter_context(force.pieces(2 if rank == 0 else 4))
    q = k = v = torch.randn(1, 2, 8, 8)
    return _error_of(lambda: ring.ring_attention(q, k, v, causal=True, timeout=20))
