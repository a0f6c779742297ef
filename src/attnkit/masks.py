"""The masks of a call (``attn_mask``, ``key_mask``, ``causal``, ``window``): one convention for all
of attnkit.

Boolean masks mean **True = may attend** (the convention of ``torch.nn.functional.
scaled_dot_product_attention``). A float ``attn_mask`` is *added* to the scores; a key is allowed
wherever it is not ``-inf`` (a NaN entry is a NaN score, not a mask). ``key_mask`` is ``(b, s)``,
True for a real token and False for padding.

Queries and keys are aligned **bottom-right**: query ``i`` of ``t`` sits at absolute position
``p(i) = i + s - t``, so the last query is level with the last key. This is what a decoder needs when
``t`` new tokens attend to ``s`` cached keys. For ``t = 2, s = 5`` a causal mask is:

    keys     0 1 2 3 4
    query 0  1 1 1 1 0      p(0) = 3
    query 1  1 1 1 1 1      p(1) = 4

(torch's ``is_causal=True`` aligns top-left instead: query 0 would see key 0 only.) When ``t > s``
the first ``t - s`` queries see no key at all; attnkit returns zeros for such rows, never NaN.

Shapes: ``b`` batch, ``h`` heads, ``t`` query length, ``s`` key length.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

Span = tuple[int, int] | None
"""A block's rows or columns, ``(start, stop)``; None for all of them."""


def query_positions(t: int, s: int, device: torch.device | None = None) -> Tensor:
    """Absolute positions ``p(i) = i + s - t`` of the ``t`` queries, aligned bottom-right."""
    return torch.arange(s - t, s, device=device)


def causal_mask(t: int, s: int, *, device: torch.device | None = None) -> Tensor:
    """``(t, s)`` bool, True where key ``j <= p(i)`` (bottom-right aligned, see module doc).

    Example:
        >>> causal_mask(2, 4).int()
        tensor([[1, 1, 1, 0],
                [1, 1, 1, 1]], dtype=torch.int32)
    """
    return window_mask(t, s, (-1, 0), device=device)


def window_mask(
    t: int,
    s: int,
    window: tuple[int, int],
    *,
    device: torch.device | None = None,
    rows: Span = None,
    cols: Span = None,
    query_slots: Tensor | None = None,
    shift: int = 0,
) -> Tensor:
    """``(t, s)`` bool, True where ``p(i) - left <= j <= p(i) + right``; -1 means unbounded.

    ``window=(-1, 0)`` is the causal mask; ``(W - 1, 0)`` a causal sliding window of ``W`` keys.
    ``rows``/``cols`` build only that block, in ``O(block)`` memory. ``query_slots`` ``(t,)`` gives
    the queries' positions ``p(i)`` explicitly, instead of bottom-right (a compiled decoding step,
    whose keys are a whole cache buffer, filled or not); ``shift`` moves every query that many
    positions right of bottom-right alignment (a chunk of a longer sequence, see
    [`Masks`][attnkit.masks.Masks]).
    """
    left, right = window
    q_pos = query_positions(t, s, device) + shift if query_slots is None else query_slots
    k_pos = _span(torch.arange(s, device=device), cols)
    distance = _span(q_pos, rows)[:, None] - k_pos  # p(i) - j, (rows, cols)
    allowed = torch.ones(distance.shape, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= distance <= left
    if right >= 0:
        allowed &= distance >= -right
    return allowed


def alibi_bias(
    slopes: Tensor, t: int, s: int, *, query_slots: Tensor | None = None, shift: int = 0
) -> Tensor:
    """``(h, t, s)`` ALiBi bias ``-slope * |p(i) - j|`` (Press et al., 2022), in the slopes' dtype;
    ``query_slots`` and ``shift`` as in [`window_mask`][attnkit.masks.window_mask]."""
    q_pos = query_positions(t, s, slopes.device) + shift if query_slots is None else query_slots
    distance = q_pos[:, None] - torch.arange(s, device=slopes.device)
    return -slopes[:, None, None] * distance.abs().to(slopes.dtype)  # (h, 1, 1) * (t, s)


def alibi_slopes(num_heads: int) -> Tensor:
    """The standard ALiBi slopes (Press et al., 2022): ``2^(-8 i / n)`` for heads ``i = 1..n`` when
    ``n`` is a power of two; otherwise the slopes of the nearest lower power of two ``m``, then every
    other slope of ``2m`` heads, as the paper's reference code does.

    Example:
        >>> alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    m = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(m) + geometric(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes)


def both_windows(a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    """The window of the keys both windows allow (-1: unbounded; None: no window)."""
    if a is None or b is None:
        return a if b is None else b

    def tighter(x: int, y: int) -> int:
        return y if x < 0 else x if y < 0 else min(x, y)

    return tighter(a[0], b[0]), tighter(a[1], b[1])


def merge_window(
    causal: bool, window: tuple[int, int] | None, t: int, s: int, shift: int = 0
) -> tuple[int, int] | None:
    """Fold ``causal`` into a window: causal is ``right = 0``. None when nothing limits positions for
    ``t`` queries over ``s`` keys (a single query under a causal mask sees every key: decoding),
    the queries ``shift`` positions right of bottom-right alignment."""
    if window is None:
        window = (-1, 0) if causal else (-1, -1)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    # Every query sees every key when p(t - 1) - left <= 0 and p(0) + right >= s - 1.
    left = -1 if left >= s - 1 + shift else left
    right = -1 if right >= t - 1 - shift else right
    return None if (left, right) == (-1, -1) else (left, right)


def selection_mask(indices: Tensor, heads: int, s: int) -> Tensor:
    """``(b, 1 or heads, t, s)`` bool, True at the keys that ``indices`` ``(b, 1 or h_kv, t, n)``
    (top-k sparse attention's) names for each query, -1 (or any index outside ``0..s-1``) naming
    none and a key named twice once;
    ``h_kv`` heads of indices are repeated to the ``heads`` query heads that share them. The dense
    form of a selection, for the reference maths and the weights."""
    b, given, t, _ = indices.shape
    spare = s  # a column for the -1s (and any index outside 0..s-1), dropped after
    where = indices.long().masked_fill((indices < 0) | (indices >= s), spare)
    chosen = torch.zeros(b, given, t, s + 1, dtype=torch.bool, device=indices.device)
    chosen = chosen.scatter_(-1, where, True)[..., :s]
    return chosen if given == 1 else chosen.repeat_interleave(heads // given, dim=1)


def zero_padding(x: Tensor, key_mask: Tensor | None) -> Tensor:
    """``x`` ``(b, h_kv, s, d)`` (keys or values) with the padding that ``key_mask`` ``(b, s)`` marks
    set to 0: padding may hold anything (``torch.empty``, NaN), and a masked key's weight of 0 times
    a NaN would still be NaN, in the output or in the gradients."""
    if key_mask is None:
        return x
    return x.masked_fill(~key_mask[:, None, :, None], 0.0)  # (b, s) -> (b, 1, s, 1)


class Masks(NamedTuple):
    """Everything that decides which keys a query may see, kept structured until a backend needs it.
    (A NamedTuple rather than a frozen dataclass: built on every call, in half the time.)

    The reference and SDPA backends materialise it with [`allowed`][attnkit.masks.Masks.allowed]; a tiled kernel asks for one
    block at a time (``rows``/``cols``) and skips the blocks that ``window`` empties.

    Attributes:
        window: ``(left, right)`` in positions around ``p(i)``, -1 unbounded, causal folded in; None
            when no positional limit applies.
        key_mask: ``(b, s)`` bool, True for a real token, or None.
        attn_mask: bool (True = may attend) or float (added to scores; ``-inf`` masks),
            broadcastable to ``(b, h, t, s)``, or None.
        shift: the queries sit this many positions right of bottom-right alignment,
            ``p(i) = i + s - t + shift``, for ``window`` and ALiBi: a chunk of queries and a chunk
            of keys cut from longer sequences (ring attention). 0 in every call of
            [`attention`][attnkit.functional.attention].
    """

    window: tuple[int, int] | None = None
    key_mask: Tensor | None = None
    attn_mask: Tensor | None = None
    shift: int = 0

    @property
    def is_causal_only(self) -> bool:
        return (
            self.window == (-1, 0)
            and self.key_mask is None
            and self.attn_mask is None
            and self.shift == 0
        )

    def bias(self, rows: Span = None, cols: Span = None) -> Tensor | None:
        """The float ``attn_mask`` to add to the scores (or its block ``rows x cols``), or None."""
        m = self.attn_mask
        return _block(m, rows, cols) if m is not None and m.dtype != torch.bool else None

    def allowed(
        self,
        t: int,
        s: int,
        device: torch.device,
        rows: Span = None,
        cols: Span = None,
        *,
        with_window: bool = True,
    ) -> Tensor | None:
        """Bool mask broadcastable to ``(b, h, t, s)`` (or to the block ``rows x cols`` of it),
        True = may attend; None when every key is allowed. ``with_window=False`` leaves out the
        positional part, for a block that a tiled kernel knows lies inside the window."""
        if self.window is None and self.key_mask is None and self.attn_mask is None:
            return None  # the usual call: nothing to build
        allowed: Tensor | None = None

        def combine(m: Tensor) -> None:
            nonlocal allowed
            allowed = m if allowed is None else allowed & m

        if self.window is not None and with_window:
            combine(
                window_mask(
                    t, s, self.window, device=device, rows=rows, cols=cols, shift=self.shift
                )
            )
        if self.key_mask is not None:
            combine(_span(self.key_mask, cols)[:, None, None])  # (b, s) -> (b, 1, 1, s)
        if self.attn_mask is not None:
            m = self.attn_mask
            m = m if m.dtype == torch.bool else m != float("-inf")  # NaN: allowed, a NaN score
            combine(_block(m, rows, cols))
        return allowed


def _span(x: Tensor, span: Span, dim: int = -1) -> Tensor:
    """``x`` cut to ``span`` along ``dim`` (all of it for None)."""
    return x if span is None else x.narrow(dim, span[0], span[1] - span[0])


def _block(m: Tensor, rows: Span, cols: Span) -> Tensor:
    """Cut a mask broadcastable to ``(..., t, s)`` to a block; broadcast dims of size 1 stay."""
    if m.dim() >= 2 and m.shape[-2] != 1:
        m = _span(m, rows, dim=-2)
    if m.shape[-1] != 1:
        m = _span(m, cols)
    return m
