"""`gated_delta_rule`: linear attention with the gated delta rule, the layer beside softmax attention
in today's hybrid models (Gated DeltaNet in Qwen3.5 and Qwen3-Next), with the arguments and results
of flash-linear-attention's ``chunk_gated_delta_rule`` and transformers' reference.

The call is checked once, its queries and keys normalised and scaled, packed sequences cut at
their boundaries, and then one form runs each sequence: the book's token loop in float64
(``"reference"``, [`attnkit.linear.reference`][attnkit.linear.reference]), the same loop with
float32 states (``"recurrent"``), or the chunked form (``"chunked"``,
[`attnkit.linear.chunked`][attnkit.linear.chunked]); ``"auto"`` takes the float64 loop for float64
inputs, the float32 loop for sequences of at most
[`RECURRENT_UP_TO`][attnkit.linear.functional.RECURRENT_UP_TO] tokens, the chunks otherwise.

Shapes: ``b`` batch, ``t`` tokens, ``h_k`` query/key heads, ``h`` value heads (a multiple of
``h_k``), ``d_k`` and ``d_v`` head dims, ``N`` sequences.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import _checks, force
from attnkit.linear import kernel, step
from attnkit.linear.chunked import chunked
from attnkit.linear.reference import delta_rule_loop
from attnkit.rules.nonfinite import can_branch_on_data

BACKENDS = ("reference", "step", "recurrent", "chunked")
"""The forms that can run a call, beside ``"auto"``."""

RECURRENT_UP_TO = 16
"""The most tokens a sequence may have for ``auto`` to run it token by token (``"recurrent"``: the
book's loop in float32, one read and write of the state a token) rather than in chunks, which pad
every sequence to a whole chunk: a decoding step, a short prompt."""

LOG_DECAY_FLOOR = -30.0
"""The lowest ``g`` a call runs with: ``exp(-30)``, 1e-13, keeps less of the memory than float32
can tell from nothing, a memory wiped as by ``g = -inf``, whose running sums the chunked form could
not difference (``-inf - -inf`` is NaN); and a floor near 0 keeps those sums small, each decay
exact to float32's precision. Lower values, and ``-inf``, are raised to it."""

L2_EPS = 1e-6
"""Added to a row's squared norm before ``use_qk_l2norm`` divides by its root (as
flash-linear-attention and transformers do)."""


class LinearChoice(NamedTuple):
    """Which form runs a call of [`gated_delta_rule`][attnkit.linear.functional.gated_delta_rule],
    and why."""

    backend: str
    reason: str
    path: str = ""
    """The ``"chunked"`` backend's form: ``"kernel"`` (C++) or ``"torch"``; empty for the others."""


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str = "auto",
    inplace_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Linear attention with the gated delta rule. For each value head, token by token::

        S = S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S = S + k_t delta^T;  o_t = S^T q_t

    Args:
        q: ``(b, t, h_k, d_k)`` queries.
        k: ``(b, t, h_k, d_k)`` keys.
        v: ``(b, t, h, d_v)`` values; value head ``i`` reads query and key head ``i // (h / h_k)``
            (Qwen3.5's layout; the chunked form and the step read it where it lies, the token
            loops copy it).
        g: ``(b, t, h)`` log decays, ``<= 0`` (the state is multiplied by ``exp(g_t)``; below
            [`LOG_DECAY_FLOOR`][attnkit.linear.functional.LOG_DECAY_FLOOR], it is raised to it);
            None: no decay (DeltaNet).
        beta: ``(b, t, h)`` write strengths; None: no correction, the state adds ``k_t v_t^T``
            (gated linear attention).
        scale: multiplies the queries; default ``d_k ** -0.5``.
        initial_state: ``(N, h, d_k, d_v)``, the state before each sequence's first token;
            default zeros.
        output_final_state: also return each sequence's state after its last token.
        use_qk_l2norm: divide each query and key by its L2 norm first (``use_qk_l2norm_in_kernel``
            in flash-linear-attention and transformers, also taken by that name).
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences in ``t`` (``b`` must be
            1): each starts from its own initial state, and nothing crosses a boundary.
        inplace_final_state: write the final state into ``initial_state`` (a contiguous float32
            tensor) rather than a new one, where the one-token step runs: a layer's cache read and
            written once (as flash-linear-attention's recurrent step has it); elsewhere ignored.
        backend: ``"auto"``, ``"reference"``, ``"step"``, ``"recurrent"`` or ``"chunked"`` (see
            [`which_gated_delta_rule`][attnkit.linear.functional.which_gated_delta_rule]).

    Returns:
        ``(o, final_state)``: ``(b, t, h, d_v)`` in the inputs' dtype, and ``(N, h, d_k, d_v)``
        in float32 (float64 for float64 inputs), or None without ``output_final_state``. Both
        are differentiable with respect to ``q``, ``k``, ``v``, ``g``, ``beta`` and
        ``initial_state``. The state and every sum are float32 for bfloat16 and float16 inputs.

    Raises:
        TypeError: an input that is not a tensor; ``q``, ``k`` or ``v`` not of one floating-point
            dtype; ``g`` or ``beta`` not floating-point.
        ValueError: shapes that do not match, a positive ``g`` (looked for where Python may look
            at values: CPU tensors outside ``torch.compile``), bad ``cu_seqlens``, a batch above 1
            with ``cu_seqlens``, an ``initial_state`` of the wrong shape, an unknown backend or
            one that cannot run the call.
    """
    if use_qk_l2norm_in_kernel is not None:
        use_qk_l2norm = use_qk_l2norm or use_qk_l2norm_in_kernel
    choice = which_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                    cu_seqlens=cu_seqlens, backend=backend)  # fmt: skip
    b, d_k = q.shape[0], q.shape[3]
    h, d_v = v.shape[2:]
    if q.numel() == 0 or v.numel() == 0:  # no token, no row or an empty head: nothing to run
        return _nothing(q, v, initial_state, cu_seqlens, output_final_state)
    scale = d_k**-0.5 if scale is None else float(scale)
    if choice.backend == "step":  # the kernel normalises, scales and raises g itself
        eps = L2_EPS if use_qk_l2norm else -1.0
        prepare = {"eps": eps, "scale": scale, "g_floor": LOG_DECAY_FLOOR}
        state = _step_state(initial_state, inplace_final_state, q, v)
        o = step.step(q, k, v, g, beta, state, **prepare)
        return o.to(v.dtype), state if output_final_state else None
    if g is not None:
        g = g.clamp(min=LOG_DECAY_FLOOR)
    dtype = torch.float64 if choice.backend == "reference" else _state_dtype(q.dtype)
    if initial_state is None:
        initial_state = q.new_zeros(
            b if cu_seqlens is None else len(cu_seqlens) - 1, h, d_k, d_v, dtype=dtype
        )
    if choice.path == "kernel":  # every row a packed sequence: one run of the kernel for them all
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (b + 1) * q.shape[1], q.shape[1])
        tokens = [None if x is None else x.flatten(0, 1) for x in (q, k, v, g, beta)]
        eps = L2_EPS if use_qk_l2norm else -1.0
        o, final = kernel.chunked(*tokens, initial_state, cu_seqlens, eps=eps, scale=scale)
        final = final if output_final_state else None
        return o.unflatten(0, (b, -1)).to(v.dtype), final
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    inputs = [q, k, v, g, beta]
    if cu_seqlens is None:  # the batch rows as heads of one sequence: one run for them all
        sequences = [[_rows_as_heads(x) for x in inputs]]
        starting = [initial_state.flatten(0, 1)]
    else:  # each packed sequence alone: nothing crosses a boundary
        bounds = cu_seqlens.tolist()
        sequences = [
            [_cut(x, start, end) for x in inputs] for start, end in itertools.pairwise(bounds)
        ]
        starting = list(initial_state)
    outputs, states = [], []
    for one, state in zip(sequences, starting):
        one[2:] = [None if x is None else x.to(dtype) for x in one[2:]]
        o, state = _run(choice.backend, *one, state.to(dtype))
        outputs.append(o)
        states.append(state)
    if cu_seqlens is None:  # (t, b * h, d_v) -> (b, t, h, d_v)
        o = outputs[0].unflatten(1, (b, h)).transpose(0, 1)
        states = list(states[0].unflatten(0, (b, h)))
    else:
        o = torch.cat(outputs)[None]
    final = torch.stack(states).to(_state_dtype(v.dtype)) if output_final_state else None
    return o.to(v.dtype), final


def which_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    backend: str = "auto",
) -> LinearChoice:
    """Which form [`gated_delta_rule`][attnkit.linear.functional.gated_delta_rule] runs for these
    inputs, and why, after checking them as it does (nothing is computed)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend must be 'auto' or one of {', '.join(BACKENDS)}, got {backend!r}")
    if (
        backend == "step"
        and (why := step.refuses(q, k, v, g, beta, initial_state, cu_seqlens)) is not None
    ):
        raise ValueError(f"backend 'step' cannot run this call: {why}")
    if backend not in ("auto", "chunked"):
        return LinearChoice(backend, "asked for by name")
    if backend == "auto" and q.dtype == torch.float64:
        return LinearChoice("reference", "float64 inputs: the book's token loop, in float64")
    if backend == "auto" and step.refuses(q, k, v, g, beta, initial_state, cu_seqlens) is None:
        return LinearChoice(
            "step",
            "one token a sequence, no gradient: the C++ step reads each state twice, writes it once",
        )
    longest = q.shape[1] if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if backend == "auto" and longest <= RECURRENT_UP_TO:
        return LinearChoice(
            "recurrent",
            f"sequences of at most {RECURRENT_UP_TO} tokens: the token loop with float32 states "
            "(one read and write of the state a token; chunks would pad each sequence)",
        )
    why = _kernel_refuses([x for x in (q, k, v, g, beta, initial_state) if x is not None])
    if why is None:
        return LinearChoice(
            "chunked",
            "the chunked form in C++, forward and backward (states and sums in float32)",
            "kernel",
        )
    return LinearChoice(
        "chunked",
        f"the chunked form in PyTorch (states and sums in float32); not the C++ kernel: {why}",
        "torch",
    )


def _kernel_refuses(tensors: list[Tensor]) -> str | None:
    """Why the ``"chunked"`` backend cannot run these tensors on its C++ kernel, or None."""
    if force.torch_chunks():
        return "forced (attnkit.force)"
    if tensors[0].dtype == torch.float64:
        return "float64 inputs (the kernel computes in float32)"
    return kernel.refuses(tensors)


def _step_state(initial_state, inplace: bool, q: Tensor, v: Tensor) -> Tensor:
    """The float32 state the C++ step updates: ``initial_state`` itself where asked and it can be
    written as it lies, else a copy of it (zeros if none)."""
    if initial_state is None:
        return q.new_zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    if inplace and initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        return initial_state
    return initial_state.to(torch.float32, copy=True).contiguous()


def _nothing(q, v, initial_state, cu_seqlens, output_final_state) -> tuple[Tensor, Tensor | None]:
    """The results of a call with no token (or no row, or empty heads): zeros, and each state as
    it was given (zeros if none)."""
    b, t, h, d_v = v.shape
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    dtype = _state_dtype(v.dtype)
    if initial_state is None:
        initial_state = v.new_zeros(n, h, q.shape[3], d_v, dtype=dtype)
    final = initial_state.to(dtype, copy=True) if output_final_state else None
    return v.new_zeros(b, t, h, d_v), final


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The state's and the sums' dtype: float32, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _l2norm(x: Tensor) -> Tensor:
    """Each row ``x[..., :]`` divided by its L2 norm (``L2_EPS`` under the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _run(
    backend: str, q: Tensor, k: Tensor, v: Tensor, g, beta, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One sequence ``(t, heads, ...)`` on ``backend``'s form."""
    if backend == "chunked":
        return chunked(q, k, v, g, beta, state)
    r = v.shape[1] // q.shape[1]  # the loop: each value head with its query and key head
    return delta_rule_loop(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, g, beta, state)


def _rows_as_heads(x: Tensor | None) -> Tensor | None:
    """``(b, t, heads, ...)`` -> ``(t, b * heads, ...)``: value head ``j`` of row ``i`` still reads
    query and key head ``(i * h + j) // r = i * h_k + j // r``."""
    return None if x is None else x.transpose(0, 1).flatten(1, 2)


def _cut(x: Tensor | None, start: int, end: int) -> Tensor | None:
    """Tokens ``start:end`` of a packed row, ``(1, t, ...)`` -> ``(end - start, ...)``."""
    return None if x is None else x[0, start:end]


def _check(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Every input as `gated_delta_rule` takes it, or an error naming it and its values."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _checks.check_tensor(x, name)
        if not x.is_floating_point() or x.dtype != q.dtype:
            raise TypeError(
                f"{name} must be a floating-point tensor of q's dtype ({q.dtype}), got {x.dtype}"
            )
        if x.dim() != 4:
            raise ValueError(f"{name} must be (b, t, heads, head_dim), got shape {tuple(x.shape)}")
    b, t, h_k, d_k = q.shape
    h = v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (b, t):
        raise ValueError(f"v must be (b={b}, t={t}, heads, head_dim), got shape {tuple(v.shape)}")
    if h_k < 1 or h < 1:
        raise ValueError(f"q, k and v must have at least one head, got {h_k} and {h}")
    if h % h_k:
        raise ValueError(f"v's heads ({h}) must be a multiple of q's and k's heads ({h_k})")
    for x, name in ((g, "g"), (beta, "beta")):
        if x is None:
            continue
        _checks.check_tensor(x, name)
        if x.shape != (b, t, h):
            raise ValueError(f"{name} must be (b={b}, t={t}, h={h}), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if g is not None and can_branch_on_data(g) and g.numel() and bool((g > 0).any()):
        raise ValueError(
            f"g must be <= 0 (the log of a decay in (0, 1]), got a maximum of {g.max().item():g}"
        )
    sequences = b
    if cu_seqlens is not None:
        sequences = _check_cu_seqlens(cu_seqlens, b, t)
    if initial_state is not None:
        _checks.check_tensor(initial_state, "initial_state")
        want = (sequences, h, d_k, v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(
                f"initial_state must be (N={sequences}, h={h}, d_k={d_k}, d_v={v.shape[3]}), "
                f"got shape {tuple(initial_state.shape)}"
            )


def _check_cu_seqlens(cu_seqlens: Tensor, b: int, t: int) -> int:
    """The number of packed sequences, once ``cu_seqlens`` is a valid set of offsets in ``t``."""
    _checks.check_tensor(cu_seqlens, "cu_seqlens")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be 1-D integer offsets (N + 1,), got {cu_seqlens.dtype} of shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    if b != 1:
        raise ValueError(f"packed sequences (cu_seqlens) take a batch of 1, got b={b}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != t:
        raise ValueError(f"cu_seqlens must start at 0 and end at t={t}, got {bounds}")
    if any(a >= c for a, c in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {bounds}")
    return len(bounds) - 1
