"""The mods of the FlexAttention tests: a zoo of ``score_mod`` and ``mask_mod`` functions, the
shapes they run on, and a float64 oracle with torch's own semantics for them. Shared by
tests/test_flex.py, tests/test_block_mask.py, tests/mods/ and tests/backends/."""

from __future__ import annotations

import functools
import math

import torch
from torch.nn.attention import flex_attention as torch_flex

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


def _zoo(document, alibi, table, t5_table) -> dict:
    """The zoo, its mods reading these tensors (those of ``document`` and ``alibi`` too)."""
    return {  # name: (score_mod, mask_mod)
        "causal": (None, causal),
        "sliding window": (None, sliding),
        "prefix-LM": (None, prefix_lm),
        "document": (None, document),
        "empty rows": (None, empties_rows),
        "ALiBi": (alibi, None),
        "softcap, causal": (softcap, causal),
        "relative bias, causal": (relative_bias(table), causal),
        "T5 buckets": (t5_bias(t5_table), None),
        "relative bias, document": (relative_bias(table), document),
    }


TABLE = torch.randn(H, 2 * 29 - 1)
T5_TABLE = torch.randn(H, 8)
ZOO = _zoo(document, alibi, TABLE, T5_TABLE)


@functools.cache
def zoo_on(device: torch.device) -> dict:
    """ZOO for inputs on ``device``: the same mods, reading copies of their tensors there (a mod
    indexes them with the call's indices, which live on the inputs' device). ZOO on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return ZOO
    docs, slopes = DOCS.to(device), SLOPES.to(device)

    def document(b, h, q, kv):
        return docs[q] == docs[kv]

    def alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv).abs()

    return _zoo(document, alibi, TABLE.to(device), T5_TABLE.to(device))


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


def inputs(b, h_kv, t, s, d=8, dtype=torch.float32, device="cpu"):
    return torch.randn(b, H, t, d, dtype=dtype, device=device), *(
        torch.randn(b, h_kv, s, d, dtype=dtype, device=device) for _ in range(2)
    )


def oracle(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """Materialised attention in float64 with torch's own semantics for the mods (``torch.vmap``
    over scalars, ``create_mask``): ``(out, lse)``, 0 and -inf for a query with no key. On q's
    device (the mods read tensors there: ``zoo_on``)."""
    b, h, t, d = q.shape
    s = k.shape[-2]
    device = q.device
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (scale or d**-0.5)
    if score_mod is not None:
        fn = score_mod
        for dim in reversed(range(4)):
            fn = torch.vmap(fn, in_dims=(0, *(0 if i == dim else None for i in range(4))))
        indices = (torch.arange(n, device=device) for n in (b, h, t, s))
        scores = fn(scores, *indices)
    if mask_mod is not None:
        allowed = torch_flex.create_mask(mask_mod, b, h, t, s, device)
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(lse.isinf(), 0)[..., None])
    return weights @ v, lse


def torch_block_mask(mask_mod, t, s, block_size, device="cpu"):
    if mask_mod is None:
        return None
    return torch_flex.create_block_mask(mask_mod, None, None, t, s, device, BLOCK_SIZE=block_size)


def fits(shape_name, mod_name):
    _, _, t, s = SHAPES[shape_name]
    return t == s or "document" not in mod_name  # the document ids are for 29 tokens


CASES = [(mod, shape) for mod in ZOO for shape in SHAPES if fits(shape, mod)]


def document_of(n: int, device) -> tuple:
    """A mask_mod of three documents over ``n`` tokens, and the dense mask it stands for."""
    ids = torch.arange(n, device=device) * 3 // n

    def document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    return document, ids[:, None] == ids[None, :]
