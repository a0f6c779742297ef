"""A plain-text walkthrough of one decoding step of multi-head latent attention (DeepSeek-V3's
MLA), with shapes: what the cache holds, the query folded into latent space, the scores and
weights over the cached latents, the output brought back to each head, and the same step
decompressed for comparison.

The layer is small and seeded (the chapter's sentence, its 3-dimensional embeddings, 2 heads);
its numbers are those of
[`MultiHeadLatentAttention`][attnkit.modules.latent.MultiHeadLatentAttention] (the walkthrough
checks its last output against the layer's own step). The shapes of DeepSeek-V3 come last.
"""

from __future__ import annotations

import textwrap

import torch

from attnkit.explain import Example, format_table
from attnkit.modules.latent import MultiHeadLatentAttention

SIZES = {"num_heads": 2, "latent_dim": 2, "head_dim": 2, "rope_dim": 2, "value_head_dim": 2}
"""The walkthrough's layer: 2 heads, a latent of 2, keys of 2 + 2 (RoPE), values of 2."""


def latent_step(example: Example, seed: int = 123) -> dict[str, torch.Tensor]:
    """The prompt (every token but the last) through a seeded layer into its cache, then the
    last token's absorbed step, every intermediate kept, in float64."""
    torch.manual_seed(seed)
    d_in = example.embeddings.shape[1]
    mla = MultiHeadLatentAttention(d_in, d_in, **SIZES).double().eval()
    x = example.embeddings.double()[None]  # (1, t, d_in)
    t = x.shape[1]
    cache = mla.new_cache(1, max_len=t)
    with torch.no_grad():
        mla(x[:, :-1], cache=cache)
        layer_output = mla(x[:, -1:], cache=cache)[0, 0]
        h, n, c, v = mla.num_heads, mla.head_dim, mla.latent_dim, mla.value_head_dim
        q = mla.W_query(x[:, -1:]).view(h, n + mla.rope_dim)
        q_rope = mla.rope(q[None, :, None, n:], torch.tensor([t - 1]))[0, :, 0]
        q_latent = torch.einsum("hn,hnc->hc", q[:, :n], mla.W_UK.weight.view(h, n, c))
        keys = cache.keys()[0, 0]  # (t, c + r)
        scores = torch.cat([q_latent, q_rope], dim=-1) @ keys.T * mla.scale  # (h, t)
        weights = scores.softmax(dim=-1)
        o_latent = weights @ keys[:, :c]  # (h, c)
        o = torch.einsum("hc,hvc->hv", o_latent, mla.W_UV.weight.view(h, v, c))
        output = mla.out_proj(o.reshape(h * v))
        full = mla(x)[0, -1]  # every token at once, decompressed
    return {"keys": keys, "q_latent": q_latent, "q_rope": q_rope, "scores": scores,
            "weights": weights, "o_latent": o_latent, "o": o, "output": output,
            "layer_output": layer_output, "decompressed": full}  # fmt: skip


def explain_latent_step(example: Example, seed: int = 123) -> str:
    """The walkthrough as text.

    Raises:
        ValueError: fewer than 2 tokens (a prompt and a step).
    """
    tokens = example.tokens
    if len(tokens) < 2:
        raise ValueError("--latent needs at least 2 tokens: a prompt and the token of the step")
    step = latent_step(example, seed)
    h, c, r = SIZES["num_heads"], SIZES["latent_dim"], SIZES["rope_dim"]
    names = [f"{token} ({i})" for i, token in enumerate(tokens)]
    heads = [f"head {i}" for i in range(h)]
    header = (
        f"One decoding step of multi-head latent attention on {' '.join(tokens)!r}: a layer of "
        f"{h} heads reads one latent of {c} numbers and one RoPE key of {r} a token, shared by "
        f"the heads. The prompt ({len(tokens) - 1} tokens) is in the cache; the step is "
        f"{tokens[-1]!r}, whose own latent the cache takes first."
    )
    latent_cols = [f"latent {j}" for j in range(c)]
    cache = format_table(
        ["token", *latent_cols, *(f"rope {j}" for j in range(r))],
        [[name, *_numbers(row)] for name, row in zip(names, step["keys"])],
    )
    query = [torch.cat([a, b]) for a, b in zip(step["q_latent"], step["q_rope"])]
    query = format_table(
        ["", *latent_cols, *(f"rope {j}" for j in range(r))],
        [[head, *_numbers(row)] for head, row in zip(heads, query)],
    )
    weights = format_table(
        ["weights", *names], [[head, *_numbers(w)] for head, w in zip(heads, step["weights"])]
    )
    read = format_table(
        ["o_latent", *latent_cols],
        [[head, *_numbers(o)] for head, o in zip(heads, step["o_latent"])],
    )
    output = format_table(
        ["output", *(f"d{j}" for j in range(step["output"].numel()))],
        [
            ["this step", *_numbers(step["output"])],
            ["decompressed, every token at once", *_numbers(step["decompressed"])],
        ],
    )
    steps = [
        f"1. The query in latent space: q_latent,h = W_UK,h^T q_nope,h, (h, c) = ({h}, {c}); "
        f"with its RoPE part q_rope,h, ({h}, {r})",
        "2. Multi-query attention over the cache: scores = [q_latent, q_rope] . [latent_j, "
        "rope_key_j] * scale, weights = softmax, o_latent = weights @ latents, (h, c)",
        "3. Back to each head: o_h = W_UV,h o_latent,h, then out_proj of the heads side by side",
    ]
    closing = (
        "The same numbers as the layer's own step "
        f"(largest difference {(step['output'] - step['layer_output']).abs().max():.1e}) "
        "and as attention over every head's decompressed keys and values "
        f"({(step['output'] - step['decompressed']).abs().max():.1e}). DeepSeek-V3's step: "
        "q_latent (128, 512), scores over rows of 512 + 64 for all 128 heads at once, "
        "o_latent (128, 512), o_h (128, 128): the cache keeps 576 numbers a token and layer, "
        "where every head's keys and values would take 128 x (192 + 128) = 40,960."
    )
    sections = [
        textwrap.fill(header, 100),
        f"The cache, (t={len(tokens)}, c + r = {c + r}): all it holds, for every head\n\n{cache}",
        f"{textwrap.fill(steps[0], 100)}\n\n{query}",
        f"{textwrap.fill(steps[1], 100)}\n\n{weights}\n\n{read}",
        f"{textwrap.fill(steps[2], 100)}\n\n{output}",
        textwrap.fill(closing, 100),
    ]
    return "\n\n".join(sections) + "\n"


def _numbers(values: torch.Tensor) -> list[str]:
    return [f"{x:.4f}" for x in values.tolist()]
