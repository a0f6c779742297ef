"""A plain-text walkthrough of linear attention with the gated delta rule, token by token, as the
book's bonus chapter writes the loop: for each token, the memory ``S`` decayed, what it predicts
for the token's key, the correction (the delta), the memory after the write, and what the query
reads.

As the chapter's first walkthrough uses the embeddings themselves as queries, keys and values, so
does this one (keys and queries L2-normalised, as Gated DeltaNet does), with one ``beta`` and one
decay for every token. The numbers are those of
[`attnkit.linear.reference.delta_rule_loop`][attnkit.linear.reference.delta_rule_loop] (a test
holds them equal).
"""

from __future__ import annotations

import math
import textwrap

import torch
import torch.nn.functional as F

from attnkit.explain import MAX_COLUMNS, Example, format_table

MAX_TOKENS = 12
"""The most tokens a walkthrough shows step by step (each step prints four small tables)."""


def delta_steps(
    example: Example, *, beta: float = 0.5, decay: float = 0.9
) -> list[dict[str, torch.Tensor]]:
    """Each token's step: ``decayed`` (the memory times ``decay``), ``predicted`` (``S^T k``),
    ``delta`` (``(v - S^T k) * beta``), ``state`` (after the write ``S + k delta^T``) and
    ``output`` (``S^T q``), in float64."""
    x = example.embeddings.double()
    k = F.normalize(x, dim=-1)
    q, v = k, x
    state = x.new_zeros(x.shape[1], x.shape[1])
    steps = []
    for i in range(x.shape[0]):
        decayed = state * decay
        predicted = decayed.T @ k[i]
        delta = (v[i] - predicted) * beta
        state = decayed + torch.outer(k[i], delta)
        output = state.T @ q[i]
        step = {"decayed": decayed, "predicted": predicted, "delta": delta, "state": state}
        steps.append({**step, "output": output})
    return steps


def explain_delta_rule(example: Example, *, beta: float = 0.5, decay: float = 0.9) -> str:
    """The walkthrough as text: the setting, each token's step, then every output.

    Raises:
        ValueError: ``beta`` outside ``[0, 1]``, ``decay`` outside ``(0, 1]``, or more tokens than
            [`MAX_TOKENS`][attnkit.explain_delta.MAX_TOKENS].
    """
    if not 0 <= beta <= 1:
        raise ValueError(f"--beta must be in [0, 1] (how strongly a token writes), got {beta:g}")
    if not 0 < decay <= 1:
        raise ValueError(f"--decay must be in (0, 1] (what the memory keeps), got {decay:g}")
    tokens, d = example.tokens, example.embeddings.shape[1]
    if len(tokens) > MAX_TOKENS:
        raise ValueError(
            f"--text has {len(tokens)} tokens; the walkthrough shows at most {MAX_TOKENS}"
        )
    if d > MAX_COLUMNS:
        raise ValueError(
            f"the embeddings have {d} dims; the walkthrough shows memories of at most "
            f"{MAX_COLUMNS} x {MAX_COLUMNS} (--dim {MAX_COLUMNS} or less)"
        )
    dims = [f"d{j}" for j in range(d)]
    header = (
        f"The gated delta rule on {' '.join(tokens)!r} ({len(tokens)} tokens, {d} dims): a memory "
        f"S ({d} x {d}) instead of attention weights. q = k = the embeddings, L2-normalised; "
        f"v = the embeddings; beta = {beta:g} and decay exp(g) = {decay:g} for every token "
        f"(g = {math.log(decay):.4f})."
    )
    sections = [textwrap.fill(header, 100)]
    for token, step in zip(tokens, delta_steps(example, beta=beta, decay=decay)):
        rows = [
            ["S^T k: what the decayed memory predicts", *_numbers(step["predicted"])],
            ["delta = (v - S^T k) * beta: the correction", *_numbers(step["delta"])],
            ["output S^T q: what the query reads", *_numbers(step["output"])],
        ]
        state = [[f"row {j}", *_numbers(row)] for j, row in enumerate(step["state"])]
        sections.append(
            f"Token {token!r}\n\n{format_table(['', *dims], rows)}\n\n"
            f"The memory after the write, S = decay * S + k delta^T\n\n"
            f"{format_table(['S', *dims], state)}"
        )
    return "\n\n".join(sections) + "\n"


def _numbers(values: torch.Tensor) -> list[str]:
    return [f"{x:.4f}" for x in values.tolist()]
