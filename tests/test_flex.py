"""score_mod, mask_mod and block masks: attnkit against torch's FlexAttention and a float64 oracle.

Every mod of the zoo runs through both backends that take mods (``tiled``, the PyTorch loop, and
``reference``), with small block sizes so that skipped, partial and full blocks all occur on small
shapes, GQA, ``t != s`` and lengths that do not divide the blocks.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import attnkit
from attnkit import functional as F
from attnkit.backends import tiled_function, tiled_loop
from attnkit.block_mask import create_block_mask
from attnkit.mods import compiling

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

H = 4
DOCS = torch.tensor([0] * 9 + [1] * 13 + [2] * 7)  # 29 tokens in three documents
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def _t5_bucket(relative: torch.Tensor, buckets: int = 8, max_distance: int = 20) -> torch.Tensor:
    """T5's bidirectional relative-position bucket, written with tensor operations."""
    half = buckets // 2
    sign = (relative > 0).long() * half
    distance = relative.abs()
    exact = half // 2
    scaled = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    log_bucket = (exact + (scaled * (half - exact)).long()).clamp(max=half - 1)
    return sign + torch.where(distance < exact, distance, log_bucket)


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv <= 6)


def prefix_lm(b, h, q, kv):
    return (kv < 8) | (q >= kv)


def document(b, h, q, kv):
    return DOCS[q] == DOCS[kv]


def empties_rows(b, h, q, kv):
    return (q >= kv) & (q % 5 != 2)


def alibi(score, b, h, q, kv):
    return score - SLOPES[h] * (q - kv).abs()


def softcap(score, b, h, q, kv):
    return 20 * torch.tanh(score / 20)


def relative_bias(table):
    def score_mod(score, b, h, q, kv):
        return score + table[h, q - kv + 28]

    return score_mod


def t5_bias(table):
    def score_mod(score, b, h, q, kv):
        return score + table[h, _t5_bucket(kv - q)]

    return score_mod


TABLE = torch.randn(H, 2 * 29 - 1)
T5_TABLE = torch.randn(H, 8)
ZOO = {  # name: (score_mod, mask_mod)
    "causal": (None, causal),
    "sliding window": (None, sliding),
    "prefix-LM": (None, prefix_lm),
    "document": (None, document),
    "empty rows": (None, empties_rows),
    "ALiBi": (alibi, None),
    "softcap, causal": (softcap, causal),
    "relative bias, causal": (relative_bias(TABLE), causal),
    "T5 buckets": (t5_bias(T5_TABLE), None),
    "relative bias, document": (relative_bias(TABLE), document),
}
SHAPES = {  # name: (b, h_kv, t, s)
    "t = s": (2, H, 29, 29),
    "GQA, t < s": (1, 2, 13, 29),
    "MQA": (2, 1, 29, 29),
}
BACKENDS = ["tiled", "reference"]


def assert_bf16_rule(got, naive, exact):
    """bf16 results (the output, then gradients) within 2x (the output) and 3x (gradients) the
    error of the naive formula in bf16, both against float64."""

    def error(x, y):
        return (x.double() - y).abs().max().item()

    for i, (g, n, e) in enumerate(zip(got, naive, exact, strict=True)):
        assert error(g, e) <= (2 if i == 0 else 3) * error(n, e), i


def inputs(b, h_kv, t, s, d=8, dtype=torch.float32):
    return torch.randn(b, H, t, d, dtype=dtype), *(
        torch.randn(b, h_kv, s, d, dtype=dtype) for _ in range(2)
    )


def oracle(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """Materialised attention in float64 with torch's own semantics for the mods (``torch.vmap``
    over scalars, ``create_mask``): ``(out, lse)``, 0 and -inf for a query with no key."""
    b, h, t, d = q.shape
    s = k.shape[-2]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (scale or d**-0.5)
    if score_mod is not None:
        fn = score_mod
        for dim in reversed(range(4)):
            fn = torch.vmap(fn, in_dims=(0, *(0 if i == dim else None for i in range(4))))
        scores = fn(scores, torch.arange(b), torch.arange(h), torch.arange(t), torch.arange(s))
    if mask_mod is not None:
        scores = scores.masked_fill(~torch_flex.create_mask(mask_mod, b, h, t, s, "cpu"), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(lse.isinf(), 0)[..., None])
    return weights @ v, lse


def torch_block_mask(mask_mod, t, s, block_size):
    if mask_mod is None:
        return None
    return torch_flex.create_block_mask(mask_mod, None, None, t, s, "cpu", BLOCK_SIZE=block_size)


def fits(shape_name, mod_name):
    _, _, t, s = SHAPES[shape_name]
    return t == s or "document" not in mod_name  # the document ids are for 29 tokens


CASES = [(mod, shape) for mod in ZOO for shape in SHAPES if fits(shape, mod)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("mod", "shape"), CASES)
def test_forward_equals_torch_flex_attention(mod, shape, backend):
    score_mod, mask_mod = ZOO[mod]
    b, h_kv, t, s = SHAPES[shape]
    q, k, v = inputs(b, h_kv, t, s)
    block_mask = torch_block_mask(mask_mod, t, s, (4, 8))
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("mod", "shape"), CASES)
def test_gradients_equal_the_float64_oracle(mod, shape, backend):
    score_mod, mask_mod = ZOO[mod]
    b, h_kv, t, s = SHAPES[shape]
    tensors = [x.requires_grad_() for x in inputs(b, h_kv, t, s)]
    table = TABLE.clone().requires_grad_()
    if score_mod is not None and "relative" in mod:
        score_mod = relative_bias(table)
    block_mask = create_block_mask(mask_mod, None, None, t, s, "cpu", 8) if mask_mod else None
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


@pytest.mark.parametrize("block_size", [4, (4, 8), 8, 16, 128])
@pytest.mark.parametrize("heads", [None, H])
@pytest.mark.parametrize("mod", [m for m, (_, mask_mod) in ZOO.items() if mask_mod is not None])
def test_create_block_mask_gives_torch_block_tables(mod, heads, block_size):
    _, mask_mod = ZOO[mod]
    ours = attnkit.create_block_mask(mask_mod, 2, heads, 29, 29, "cpu", block_size)
    theirs = torch_flex.create_block_mask(mask_mod, 2, heads, 29, 29, "cpu", block_size)
    assert type(ours) is torch_flex.BlockMask
    assert (ours.BLOCK_SIZE, ours.seq_lengths) == (theirs.BLOCK_SIZE, theirs.seq_lengths)
    for num, indices in (
        ("kv_num_blocks", "kv_indices"),
        ("full_kv_num_blocks", "full_kv_indices"),
    ):
        n = getattr(ours, num)
        assert torch.equal(n, getattr(theirs, num))
        flat_ours = getattr(ours, indices).flatten(0, 2)
        flat_theirs = getattr(theirs, indices).flatten(0, 2)
        for a, b, count in zip(flat_ours, flat_theirs, n.flatten().tolist()):  # past n: padding
            assert set(a[:count].tolist()) == set(b[:count].tolist())


def test_create_block_mask_never_builds_the_dense_mask(tmp_path):
    """A subprocess builds the causal mask of 65536 x 65536 (4 GiB as a dense bool mask) and
    reports how much its peak memory grew."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import resource, torch, attnkit\n"
        "def mask(b, h, q, kv):\n"
        "    return q >= kv\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "m = attnkit.create_block_mask(mask, None, None, 65536, 65536, 'cpu')\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(int(m.kv_num_blocks.sum()), int(m.full_kv_num_blocks.sum()), (after - before) // 1024)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    partial, full, extra_mib = map(int, run.stdout.split())
    assert (partial, full) == (512, 512 * 511 // 2)  # the diagonal's blocks, and those below it
    assert extra_mib < 256, f"{extra_mib} MiB: the dense mask would be 4096 MiB"


def test_partial_blocks_call_mask_mod_full_blocks_skip_it_empty_blocks_are_never_computed(
    monkeypatch,
):
    t = s = 32  # blocks of 8: 4 x 4, of which the causal mask leaves 4 partial and 6 full
    calls = []

    def counted(b, h, q, kv):
        calls.append((int(q.min()), int(kv.min())))
        return q >= kv

    block_mask = create_block_mask(counted, None, None, t, s, "cpu", 8)
    calls.clear()
    computed = []
    original = tiled_loop.Plan.scores

    def scores(self, *args, **kwargs):
        computed.append(args[2:6])  # i0, i1, j0, j1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tiled_loop.Plan, "scores", scores)
    F.attention(*inputs(1, H, t, s), block_mask=block_mask, backend="tiled")
    assert sorted(computed) == sorted(
        (i, i + 8, j, j + 8) for i in range(0, 32, 8) for j in range(0, i + 1, 8)
    )
    assert sorted(calls) == [(i, i) for i in range(0, 32, 8)]  # the diagonal's blocks only


@pytest.mark.parametrize("path", ["loop", "native"])
def test_the_backward_stores_no_score_sized_tensor(path):
    """The loop (given a mask_mod) and the C++ kernel (given causal=True and a mod that adds)."""
    t, s = 37, 53
    q, k, v = (x.requires_grad_() for x in inputs(1, H, t, s))
    table = torch.randn(H, 2 * 53, requires_grad=True)
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 52]

    mask = {"mask_mod": causal} if path == "loop" else {"causal": True}
    assert F.which_backend(q, k, v, score_mod=score_mod, **mask).path == path
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


def test_bf16_stays_within_twice_the_naive_error_and_three_times_for_gradients():
    b, h_kv, t, s = SHAPES["t = s"]
    tensors = [x.bfloat16().requires_grad_() for x in inputs(b, h_kv, t, s)]
    score_mod, mask_mod = ZOO["relative bias, causal"]
    out = F.attention(*tensors, score_mod=score_mod, mask_mod=mask_mod, backend="tiled")
    grads = torch.autograd.grad(out, tensors, torch.ones_like(out))
    naive = [x.detach().requires_grad_() for x in tensors]  # the oracle's formula, in bf16
    scores = naive[0] @ naive[1].transpose(-2, -1) * 8**-0.5
    bias = TABLE.bfloat16()[
        torch.arange(H)[:, None, None], torch.arange(t)[:, None] - torch.arange(s) + 28
    ]
    scores = (scores + bias).masked_fill(~torch.ones(t, s, dtype=torch.bool).tril(), -math.inf)
    naive_out = torch.softmax(scores, dim=-1) @ naive[2]
    naive_grads = torch.autograd.grad(naive_out, naive, torch.ones_like(naive_out))
    exact = [x.detach().double().requires_grad_() for x in tensors]
    exact_out, _ = oracle(*exact, score_mod, mask_mod)
    exact_grads = torch.autograd.grad(exact_out, exact, torch.ones_like(exact_out))
    assert_bf16_rule((out, *grads), (naive_out, *naive_grads), (exact_out, *exact_grads))


def test_a_mod_that_broadcasting_does_not_fit_runs_under_vmap():
    shapes = []

    def per_head_then_distance(score, b, h, q_idx, kv_idx):  # bias[h] then [distance]: 1-D only
        shapes.append(tuple(q_idx.shape))
        return score + TABLE[h][q_idx - kv_idx + 28]

    q, k, v = inputs(1, H, 29, 29)
    out = F.attention(q, k, v, score_mod=per_head_then_distance, backend="tiled")
    assert (1, 1, 5, 1) in shapes and () in shapes  # tried broadcast, then ran scalar by scalar
    torch.testing.assert_close(out, oracle(q, k, v, relative_bias(TABLE))[0].float())


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


def test_the_gradient_of_a_mod_that_needs_vmap_reaches_its_table():
    """f runs one score at a time (broadcasting does not fit it), forward and backward."""
    table = TABLE.clone().requires_grad_()

    def stacks(score, b, h, q_idx, kv_idx):
        d = torch.stack([q_idx, kv_idx])
        return score + table[h, d[0] - d[1] + 28]

    q, k, v = inputs(1, H, 13, 13)
    assert F.which_backend(q, k, v, score_mod=stacks).path == "native"
    (got,) = torch.autograd.grad(F.attention(q, k, v, score_mod=stacks).sum(), table)
    table64 = TABLE.double().requires_grad_()
    want = F.attention(
        q.double(), k.double(), v.double(), score_mod=relative_bias(table64), backend="reference"
    )
    (want,) = torch.autograd.grad(want.sum(), table64)
    torch.testing.assert_close(got, want.float())


def test_a_mod_that_fails_on_a_later_tile_in_the_kernel_names_itself_and_the_block():
    """The mod passes the one-score check (indices 0), then indexes past its table."""
    small = torch.randn(H, 5)

    def too_short(score, b, h, q_idx, kv_idx):
        return score + small[h, q_idx - kv_idx + 2]

    q, k, v = inputs(1, H, 13, 13)
    assert F.which_backend(q, k, v, score_mod=too_short).path == "native"
    with pytest.raises(IndexError, match=r"score_mod .*too_short failed on the block of queries"):
        F.attention(q, k, v, score_mod=too_short)


def _adding_mods(table, t5_table):
    """Mods that add to the score, reading ``table`` and ``t5_table``."""

    def per_head(score, b, h, q_idx, kv_idx):  # f of shape (1, H, 1, 1)
        return score + table[h, 0]

    def every_third_key_masked(score, b, h, q_idx, kv_idx):  # causal: query 0 has no key left
        return score + torch.where(kv_idx % 3 == 0, -math.inf, table[h, q_idx - kv_idx + 28])

    return {
        "relative bias": relative_bias(table),
        "ALiBi": alibi,
        "T5 buckets": t5_bias(t5_table),
        "per head": per_head,
        "every third key masked": every_third_key_masked,
    }


def _adding_options(name, b, t, s):
    allowed = torch.rand(b, 1, t, s) > 0.2
    allowed[..., 1] = True
    return {
        "plain": {},
        "causal": {"causal": True},
        "window, key padding": {
            "window": (6, 2),
            "key_mask": torch.arange(s).expand(b, s) < s - 3,
        },
        "ALiBi, soft-cap, scale": {"alibi_slopes": SLOPES, "softcap": 2.0, "scale": 0.5},
        "bool attn_mask": {"attn_mask": allowed},
        "float attn_mask": {"attn_mask": torch.randn(1, H, t, s).masked_fill(~allowed[:1], -1e9)},
    }[name]


ADDING_OPTIONS = [
    "plain",
    "causal",
    "window, key padding",
    "ALiBi, soft-cap, scale",
    "bool attn_mask",
    "float attn_mask",
]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("options", ADDING_OPTIONS)
@pytest.mark.parametrize("mod", list(_adding_mods(TABLE, T5_TABLE)))
def test_mods_that_add_run_in_the_kernel_tile_by_tile_and_equal_the_oracle(
    mod, options, shape, monkeypatch
):
    """Outputs, lse and the gradients of q, k, v and of the tables the mod reads, against the
    reference backend in float64, with the mod's bias asked for in many tiles."""
    from attnkit import mods

    b, h_kv, t, s = SHAPES[shape]
    given = _adding_options(options, b, t, s)
    tables = [TABLE.clone().requires_grad_(), T5_TABLE.clone().requires_grad_()]
    score_mod = _adding_mods(*tables)[mod]
    tensors = [x.requires_grad_() for x in inputs(b, h_kv, t, s)]
    assert F.which_backend(*tensors, score_mod=score_mod, **given).path == "native"
    tiles = []
    bias = mods.bias
    monkeypatch.setattr(
        mods, "bias", lambda fn, at, **kw: tiles.append(at.shape) or bias(fn, at, **kw)
    )
    out, lse = F.attention(*tensors, score_mod=score_mod, return_lse=True, **given)
    assert len(tiles) > 2, tiles  # panels of 5 queries, tiles of 14 keys
    cotangent, lse_cotangent = (
        torch.randn_like(out),
        torch.randn_like(lse).masked_fill(lse.isinf(), 0),
    )
    got = torch.autograd.grad(
        (out, lse), [*tensors, *tables], (cotangent, lse_cotangent), allow_unused=True
    )

    wrt64 = [x.detach().double().requires_grad_() for x in [*tensors, *tables]]
    mod64 = _adding_mods(*wrt64[3:])[mod]
    given64 = {
        key: value.double()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for key, value in given.items()
    }
    out64, lse64 = F.attention(
        *wrt64[:3], score_mod=mod64, return_lse=True, backend="reference", **given64
    )
    torch.testing.assert_close(out, out64.float())
    torch.testing.assert_close(lse, lse64.float())
    finite_lse = torch.where(lse64.isinf(), 0, lse64)
    want = torch.autograd.grad(
        (out64, finite_lse), wrt64, (cotangent.double(), lse_cotangent.double()), allow_unused=True
    )
    for g, w in zip(got, want):
        if w is None or not w.any():
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w.float())


@pytest.mark.parametrize("path", ["tiled", "tiled:half"])
def test_bf16_mods_that_add_in_the_kernel_keep_the_2x_3x_rule(path, forcing):
    """The kernel's bf16 inputs, multiplied in float32 or (``tiled:half``) in bf16 pairs."""
    backend = forcing(path)
    b, h_kv, t, s = SHAPES["GQA, t < s"]
    table = TABLE.bfloat16().requires_grad_()
    tensors = [x.bfloat16().requires_grad_() for x in inputs(b, h_kv, t, s)]
    score_mod = relative_bias(table)
    assert F.which_backend(*tensors, score_mod=score_mod, causal=True, backend=backend).path == (
        "native"
    )
    out = F.attention(*tensors, score_mod=score_mod, causal=True, backend=backend)
    wrt = [*tensors, table]
    grads = torch.autograd.grad(out, wrt, torch.ones_like(out))
    naive = [x.detach().requires_grad_() for x in wrt]  # the textbook formula, in bf16
    q, k, v = (
        x.repeat_interleave(H // x.shape[1], dim=1) if x.dim() == 4 else x for x in naive[:3]
    )
    rows, keys = torch.arange(t)[:, None], torch.arange(s)
    scores = (
        q @ k.transpose(-2, -1) * 8**-0.5
        + naive[3][torch.arange(H)[:, None, None], rows - keys + 28]
    )
    scores = scores.masked_fill(keys > rows + s - t, -math.inf)
    naive_out = torch.softmax(scores, dim=-1) @ v
    naive_grads = torch.autograd.grad(naive_out, naive, torch.ones_like(naive_out))
    exact = [x.detach().double().requires_grad_() for x in wrt]
    exact_out = F.attention(
        *exact[:3], score_mod=relative_bias(exact[3]), causal=True, backend="reference"
    )
    exact_grads = torch.autograd.grad(exact_out, exact, torch.ones_like(exact_out))
    assert_bf16_rule((out, *grads), (naive_out, *naive_grads), (exact_out, *exact_grads))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_mods_and_block_masks_raise_naming_them(backend):
    q, k, v = inputs(1, H, 29, 29)

    def raises(score, b, h, q_idx, kv_idx):
        raise ValueError("no")

    def not_bool(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def reshapes(score, b, h, q_idx, kv_idx):
        return score.unsqueeze(-1)  # one score becomes a vector of one

    def retypes(score, b, h, q_idx, kv_idx):
        return score.half()

    call = {"backend": backend}
    with pytest.raises(ValueError, match=r"score_mod .*raises.* failed on the block of queries"):
        F.attention(q, k, v, score_mod=raises, **call)
    with pytest.raises(TypeError, match=r"mask_mod .*not_bool.* returned torch.int64"):
        F.attention(q, k, v, mask_mod=not_bool, **call)
    with pytest.raises(ValueError, match=r"score_mod .*reshapes.* changed the shape"):
        F.attention(q, k, v, score_mod=reshapes, **call)
    with pytest.raises(TypeError, match=r"score_mod .*retypes.* returned torch.float16"):
        F.attention(q, k, v, score_mod=retypes, **call)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(29, 30\)"):
        F.attention(
            q, k, v, block_mask=create_block_mask(causal, None, None, 29, 30, "cpu"), **call
        )
    with pytest.raises(ValueError, match="block_mask or mask_mod, not both"):
        F.attention(
            q,
            k,
            v,
            block_mask=create_block_mask(causal, None, None, 29, 29, "cpu"),
            mask_mod=causal,
            **call,
        )
    with pytest.raises(TypeError, match="block_mask must be a torch BlockMask"):
        F.attention(q, k, v, block_mask=torch.ones(29, 29, dtype=torch.bool), **call)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        F.attention(q, k, v, score_mod=3.0, **call)


def test_flex_attention_is_a_drop_in_for_torch():
    q, k, v = inputs(2, 2, 29, 29)
    block_mask = torch_flex.create_block_mask(empties_rows, None, None, 29, 29, "cpu", 16)
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
    empty = torch.arange(29) % 5 == 2
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
    # trains on a CPU, where torch's raises
    q.requires_grad_()
    attnkit.flex_attention(q, k, v, alibi, block_mask, enable_gqa=True).sum().backward()
    assert q.grad is not None
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        torch_flex.flex_attention(q, k, v, alibi, block_mask, enable_gqa=True)


def test_the_module_decodes_with_a_relative_bias_as_its_full_forward():
    mha = attnkit.MultiHeadAttention(32, 32, 64, 0.0, H, num_kv_heads=2, rope=True).eval()
    table = torch.randn(H, 2 * 64 - 1)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 63]

    def local(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 9

    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        full = mha(x, score_mod=score_mod, mask_mod=local)
        cache = attnkit.KVCache(2, 2, max_len=64, head_dim=8)
        steps = [mha(x[:, :7], cache=cache, score_mod=score_mod, mask_mod=local)]
        steps += [
            mha(x[:, i : i + 1], cache=cache, score_mod=score_mod, mask_mod=local)
            for i in range(7, 20)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_a_packed_batch_trains_through_the_module_as_its_documents_alone():
    mha = attnkit.MultiHeadAttention(32, 32, 64, 0.0, H)
    lengths = [7, 12, 5]
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    x = torch.randn(1, 24, 32, requires_grad=True)
    packed = mha(x, documents=documents)
    alone = torch.cat([mha(part) for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone)
    (grad,) = torch.autograd.grad(packed.square().sum(), x)
    (want,) = torch.autograd.grad(alone.square().sum(), x)
    torch.testing.assert_close(grad, want)
    with pytest.raises(ValueError, match="with a cache, give mask_mod"), torch.no_grad():
        mha(x[:, :3], cache=attnkit.KVCache(1, H, 64, 8), documents=documents[:3])


@pytest.mark.parametrize(("mod", "shape"), CASES)
def test_the_kernel_walks_groups_of_mask_blocks_as_one(mod, shape, monkeypatch):
    """The tiled loop's blocks span 4 x 4 of the mask's (as 256 x 512 span 2 x 4 of 128 x 128),
    with some of them full, some partial, some empty; a head- and batch-dependent mask too."""
    monkeypatch.setattr(tiled_function, "BLOCK_Q", 16)
    monkeypatch.setattr(tiled_function, "BLOCK_K", 32)
    score_mod, mask_mod = ZOO[mod]
    b, h_kv, t, s = SHAPES[shape]
    q, k, v = (x.requires_grad_() for x in inputs(b, h_kv, t, s))
    block_mask = torch_block_mask(mask_mod, t, s, (4, 8))
    out = F.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, backend="tiled")
    out64, _ = oracle(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out, out64.float())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(
        F.attention(q, k, v, score_mod=score_mod, block_mask=block_mask, backend="reference").sum(),
        (q, k, v),
    )
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_a_mask_that_depends_on_batch_and_head_in_grouped_blocks(monkeypatch):
    monkeypatch.setattr(tiled_function, "BLOCK_Q", 16)
    monkeypatch.setattr(tiled_function, "BLOCK_K", 32)

    def per_row(b, h, q_idx, kv_idx):
        return ((q_idx >= kv_idx) & (h % 2 == 0)) | ((kv_idx < 9 + 4 * b) & (h % 2 == 1))

    q, k, v = inputs(2, H, 29, 29)
    block_mask = attnkit.create_block_mask(per_row, 2, H, 29, 29, "cpu", (4, 8))
    out = F.attention(q, k, v, block_mask=block_mask, backend="tiled")
    torch.testing.assert_close(out, oracle(q, k, v, None, per_row)[0].float())


@pytest.mark.slow
def test_a_mod_that_gathers_a_block_runs_compiled_from_long_calls(monkeypatch):
    from attnkit import mods

    monkeypatch.setattr(mods, "COMPILE_FROM", 0)  # as if the call were long
    table = TABLE.clone().requires_grad_()
    q, k, v = (x.requires_grad_() for x in inputs(1, H, 29, 29))
    block_mask = create_block_mask(causal, None, None, 29, 29, "cpu", 8)

    def gathers(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 28]

    def computes(score, b, h, q_idx, kv_idx):
        return score - SLOPES[h] * (q_idx - kv_idx).abs()

    torch._dynamo.utils.counters.clear()
    out = F.attention(q, k, v, score_mod=gathers, block_mask=block_mask, backend="tiled")
    grads = torch.autograd.grad(out.sum(), (q, table))
    assert compiling.worth_compiling(gathers) is True
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it was compiled
    want = F.attention(q, k, v, score_mod=gathers, block_mask=block_mask, backend="reference")
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, table))):
        torch.testing.assert_close(g, w)
    F.attention(q, k, v, score_mod=computes, block_mask=block_mask, backend="tiled")  # the loop
    assert compiling.worth_compiling(computes) is False  # arithmetic runs faster eager


@pytest.mark.parametrize("path", ["kernel", "loop"])
def test_a_mod_that_cannot_be_compiled_runs_uncompiled_with_a_warning(monkeypatch, path):
    """The C++ kernel compiles the mod's bias; the loop (here given a block mask that masks
    nothing) compiles the mod and its softmax step."""
    from torch.nn.attention.flex_attention import noop_mask

    from attnkit import mods

    def fails(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(mods, "COMPILE_FROM", 0)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fails)
    compiling.forget()

    def gathers_too(score, b, h, q_idx, kv_idx):
        return score + TABLE[h, q_idx - kv_idx + 28]

    q, k, v = inputs(1, H, 29, 29)
    options = {"score_mod": gathers_too, "backend": "tiled"}
    if path == "loop":
        options["block_mask"] = create_block_mask(noop_mask, None, None, 29, 29, "cpu", 8)
    assert F.which_backend(q, k, v, **options).path == {"kernel": "native", "loop": "loop"}[path]
    try:
        with pytest.warns(UserWarning) as warned:  # the loop compiles the mod from its 2nd call
            out = F.attention(q, k, v, **options)
            F.attention(q, k, v, **options)
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            again = F.attention(q, k, v, **options)
    finally:
        compiling.forget()
    said = sorted(str(w.message).split(" (")[0].split(".")[-1] for w in warned)
    if path == "kernel":
        assert said == ["gathers_too could not be compiled"]
    else:
        assert said == [
            "gathers_too could not be compiled",
            "online_softmax_ could not be compiled",
        ]
    assert all("(RuntimeError: no C++ compiler)" in str(w.message) for w in warned)
    torch.testing.assert_close(out, oracle(q, k, v, relative_bias(TABLE))[0].float())
    assert later == []  # once failed, a function runs uncompiled without a word
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "dtype"),
    [("relative bias, document", torch.float32), ("empty rows", torch.float64)],
)
def test_long_calls_run_the_softmax_steps_compiled_with_the_same_results(monkeypatch, case, dtype):
    """From ``COMPILE_FROM`` scores, the loop's softmax steps run compiled; they give what the
    uncompiled steps and the float64 oracle give, forward and backward, with GQA, a NaN value at
    a hidden key (0 * NaN must stay out) and rows a mask empties."""
    from attnkit import mods

    score_mod, mask_mod = ZOO[case]
    table = TABLE.to(dtype).requires_grad_()
    if score_mod is not None:
        score_mod = relative_bias(table)
    q, k, v = inputs(1, 2, 29, 29, dtype=dtype)
    v[0, 0, 20, 3] = math.nan  # key 20: in the third document, hidden from the first two
    block_mask = torch_block_mask(mask_mod, 29, 29, 8)

    def run():
        q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
        out = F.attention(q_, k_, v_, score_mod=score_mod, block_mask=block_mask, backend="tiled")
        finite = ~out.isnan()  # rows that see key 20 are NaN, as the materialised formula says
        loss = out.where(finite, 0.0).sum()
        wrt = (q_, k_, v_, table) if score_mod is not None else (q_, k_, v_)
        return out, torch.autograd.grad(loss, wrt)

    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda fn, **kwargs: compiled.append(fn.__name__) or real_compile(fn, **kwargs),
    )
    compiling.forget()
    uncompiled = run()
    assert compiled == []  # a short call
    monkeypatch.setattr(mods, "COMPILE_FROM", 0)
    try:
        got = run()
    finally:
        compiling.forget()
    assert {"online_softmax_", "softmax_backward_"} <= set(compiled)
    want, _ = oracle(q, k, v.nan_to_num(0.0), score_mod, mask_mod)
    key_20 = torch.zeros_like(v)
    key_20[:, :, 20] = 1.0
    sees_key_20 = oracle(q, k, key_20, score_mod, mask_mod)[0][..., :1] > 0  # its weight
    assert sees_key_20.any() and not sees_key_20.all()
    nan_expected = torch.zeros_like(want, dtype=torch.bool)  # key/value head 0: query heads 0, 1
    nan_expected[:, :2, :, 3] = sees_key_20[:, :2, :, 0]
    assert torch.equal(got[0].isnan(), nan_expected)
    torch.testing.assert_close(got[0].nan_to_num(0.0), want.to(dtype).masked_fill(nan_expected, 0))
    torch.testing.assert_close(got[0], uncompiled[0], equal_nan=True)
    for g, u in zip(got[1], uncompiled[1]):  # NaN only where dP meets the NaN value
        assert not g.isnan().all()
        torch.testing.assert_close(g, u, equal_nan=True)


@pytest.mark.slow
def test_compiled_block_functions_take_every_length_without_recompiling_each(monkeypatch, caplog):
    """Blocks of every size (the last block of each length, a diagonal's) share compiled code
    after a few compilations, rather than running uncompiled once dynamo's recompile limit is
    reached."""
    from attnkit import mods

    monkeypatch.setattr(mods, "COMPILE_FROM", 0)
    compiling.forget()

    def gathers_again(score, b, h, q_idx, kv_idx):
        return score + TABLE[h, q_idx - kv_idx + 28]

    try:
        for n in range(9, 30, 2):
            q, k, v = inputs(1, H, n, n)
            out = F.attention(q, k, v, score_mod=gathers_again, causal=True, backend="tiled")
            want = oracle(q, k, v, relative_bias(TABLE), causal)[0]
            torch.testing.assert_close(out, want.float())
    finally:
        compiling.forget()
    assert "recompile_limit" not in caplog.text


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


def test_under_torch_func_the_reference_runs_the_mods():
    q, k, v = inputs(1, H, 13, 13)

    def loss(q):
        return F.attention(q, k, v, score_mod=softcap, mask_mod=causal).sum()

    assert F.which_backend(q, k, v, score_mod=softcap).backend == "tiled"
    grad = torch.func.grad(loss)(q)
    qg = q.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(qg), qg)
    torch.testing.assert_close(grad, want)
    queries = torch.stack([q, q * 0.5])
    batched = torch.func.vmap(lambda x: F.attention(x, k, v, score_mod=softcap))(queries)
    each = torch.stack([F.attention(x, k, v, score_mod=softcap) for x in queries])
    torch.testing.assert_close(batched, each)


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


def test_a_block_mask_for_one_batch_and_head_still_sees_every_batch_and_head():
    """torch evaluates a mask_mod at the call's batches and heads, even in tables built with
    B=None, H=None (for batch 0 and head 0)."""

    def depends(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((kv_idx % 2 == 0) | (h == 1) | (b == 1))

    q, k, v = inputs(2, H, 29, 29)
    block_mask = torch_flex.create_block_mask(depends, None, None, 29, 29, "cpu", BLOCK_SIZE=8)
    want = torch_flex.flex_attention(q, k, v, block_mask=block_mask)
    for backend in BACKENDS:
        out = F.attention(q, k, v, block_mask=block_mask, backend=backend)
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mods_of_fewer_dims_or_without_the_score_and_blocks_without_mask_mod(backend):
    table = torch.randn(H, 13, requires_grad=True)
    q, k, v = (x.requires_grad_() for x in inputs(1, H, 13, 13))

    def per_head_only(score, b, h, q_idx, kv_idx):  # (1, H, 1, 1): a smaller block
        return score + table[h, 0]

    def ignores_the_score(score, b, h, q_idx, kv_idx):
        return table[h, (q_idx - kv_idx).abs()].to(score.dtype)

    for mod in (per_head_only, ignores_the_score):
        out = F.attention(q, k, v, score_mod=mod, backend=backend)
        out64, _ = oracle(q, k, v, mod)
        torch.testing.assert_close(out, out64.float())
        out.sum().backward()
    listed = torch_flex.BlockMask.from_kv_blocks(  # no mask_mod: torch's noop_mask
        torch.tensor([[[1, 1]]], dtype=torch.int32),
        torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32),
        BLOCK_SIZE=8,
        seq_lengths=(13, 13),
    )
    out = F.attention(q, k, v, block_mask=listed, backend=backend)
    # the tables decide, as in torch's compiled kernel (its eager path reads only the mask_mod)
    diagonal = torch.zeros(13, 13, dtype=torch.bool)
    diagonal[:8, :8] = diagonal[8:, 8:] = True
    torch.testing.assert_close(out, F.attention(q, k, v, attn_mask=diagonal, backend="reference"))
