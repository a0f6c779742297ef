"""A Hugging Face model's masks (causal, sliding window, chunks, padding, packed sequences), kept
compact: what transformers asks its mask builder for, read back as attnkit's masks (``causal``,
``window``, ``key_mask``, documents), never a ``t x s`` tensor outside compiled code.

transformers composes a mask as a function of ``(batch, head, q_idx, kv_idx)`` from small
pieces (causal, a sliding window, a padding mask, packed sequences, joined by ``and_masks``) and
hands it to the registered mask builder with the lengths and offsets that a cache implies.
[`mask_builder`][attnkit.hf.masks.mask_builder] keeps all of that in a
[`HFMask`][attnkit.hf.masks.HFMask]; [`HFMask.options`][attnkit.hf.masks.HFMask.options] reads
the pieces it knows back as attnkit's options and evaluates any other function block by block,
as a ``mask_mod``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from transformers import masking_utils as hf

from attnkit._tracing import traced
from attnkit.varlen import document_mask


def _cells(fn: Callable) -> dict[str, Any]:
    """The variables a closure holds, by name."""
    cells = fn.__closure__ or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def _code(factory: str, *args) -> Any:
    """The code of the closures ``factory`` makes; a fresh object where this version of
    transformers has no such factory (it then matches nothing)."""
    made = getattr(hf, factory, None)
    return object() if made is None else made(*args).__code__


# The code of each piece transformers composes masks from, to recognise the closures it makes.
_AND = _code("and_masks", hf.causal_mask_function)
_SLIDING = _code("sliding_window_overlay", 1)
_SLIDING_BOTH = _code("sliding_window_bidirectional_overlay", 1)
_PADDING = _code("padding_mask_function", torch.ones(1, 1, dtype=torch.bool))
_PACKED = _code("packed_sequence_mask_function", torch.zeros(1, 1))
_REMAPPED = _code("remap_positions_for_packed_sequence", hf.causal_mask_function, None)


class Pattern(NamedTuple):
    """A mask function read as attnkit's options (positions relative to the queries' own)."""

    causal: bool = False
    window: tuple[int, int] | None = None  # (left, right), -1 unbounded
    documents: Tensor | None = None  # (b, t) ids of packed sequences
    padding: Tensor | None = None  # (b, kv) True for a real token


def read_pattern(fn: Callable) -> Pattern | None:
    """``fn`` as a [`Pattern`][attnkit.hf.masks.Pattern], or None where it holds a piece that
    is not known here (it is then evaluated as it is)."""
    if fn is hf.causal_mask_function:
        return Pattern(causal=True)
    if fn is hf.bidirectional_mask_function:
        return Pattern()
    code = getattr(fn, "__code__", None)
    if code is None or traced():  # dynamo cannot read a closure's cells: evaluated as it is
        return None
    cells = _cells(fn)
    if code is _SLIDING:  # kv_idx > q_idx - w: the query and the w - 1 keys before it
        return Pattern(window=(cells["sliding_window"] - 1, -1))
    if code is _SLIDING_BOTH:  # |q_idx - kv_idx| <= w
        return Pattern(window=(cells["sliding_window"], cells["sliding_window"]))
    if code is _PADDING:
        return Pattern(padding=cells["padding_mask"])
    if code is _PACKED:
        return Pattern(documents=cells["packed_sequence_mask"])
    if code is _REMAPPED:  # positions restart in each document: the same as indices within it
        return read_pattern(cells["mask_function"])
    if code is _AND:
        joined = Pattern()
        for part in cells["mask_functions"]:
            pattern = read_pattern(part)
            joined = None if pattern is None else _both(joined, pattern)
            if joined is None:
                return None
        return joined
    return None


def _both(a: Pattern, b: Pattern) -> Pattern | None:
    """Both patterns at once, or None where that is not one pattern (two sets of documents)."""
    if a.documents is not None and b.documents is not None:
        return None
    window = a.window or b.window
    if a.window is not None and b.window is not None:
        window = tuple(_tighter(x, y) for x, y in zip(a.window, b.window))
    documents = a.documents if b.documents is None else b.documents
    padding = a.padding
    if b.padding is not None:
        padding = b.padding if padding is None else padding & b.padding
    return Pattern(a.causal or b.causal, window, documents, padding)


def _tighter(x: int, y: int) -> int:
    return y if x < 0 else x if y < 0 else min(x, y)


class HFMask(NamedTuple):
    """What transformers asked the mask builder for, as it asked: the model's attention layers
    pass it to the attention function unchanged.

    Attributes:
        batch_size: the batch.
        q_length: the queries of the call.
        kv_length: the keys the layer holds (with a static cache, its whole buffer).
        q_offset: the position of the first query, as transformers gave it (a static cache's
            is a tensor, so that a compiled forward is not specialised to each step's).
        kv_offset: the position of the first key.
        mask_function: transformers' composed ``(batch, head, q_idx, kv_idx) -> bool``.
        padding: the 2-D mask ``(b, positions)``, True for a real token, or None; as many
            positions as the layer's keys reach (``kv_offset + kv_length``) when the builder
            made it, so that its shape stays put from one decoding step to the next.
        q_start: ``q_offset`` as a whole number where the builder ran outside a trace; read
            only outside one (under a trace dynamo would specialise the graph to its value).
        device: the model's device, as transformers names it to the builder, where it does.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int | Tensor
    kv_offset: int
    mask_function: Callable
    padding: Tensor | None
    q_start: int | None = None
    device: torch.device | str | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of the dense mask it stands for, ``(b, 1, t, s)``: transformers reads it
        (a mask of 4 dims is one already made, passed on as it is)."""
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        return 4

    def __getitem__(self, index):
        """A tuple's item for a whole number or a slice; for a tensor's index (``mask[:, 0]``, as
        DeepSeek-V3.2's indexer reads its mask), that index of the dense ``(b, 1, t, s)`` bool
        mask it stands for, made on the model's device (else its padding's or its offset's)."""
        if not isinstance(index, tuple):
            return tuple.__getitem__(self, index)
        tensors = (x.device for x in (self.padding, self.q_offset) if isinstance(x, Tensor))
        device = self.device if self.device is not None else next(tensors, None)
        return self.allowed(self.kv_length, device)[index]

    def options(self, s: int, device: torch.device | None = None) -> tuple[int, dict[str, Any]]:
        """How many of the ``s`` keys given to attend to, and attnkit's mask options for them.
        Under a causal mask a static cache's empty slots after the last query are cut off;
        other masks (cross-attention to an encoder, say) keep every key.

        Under ``torch.compile`` a mask that is not plainly causal or bidirectional at whole
        positions is transformers' function evaluated into a dense ``(b, 1, t, s)`` mask on
        ``device``, as transformers' ``sdpa`` builds it there: dynamo can read neither a
        closure's cells nor a tensor offset's value."""
        pattern = read_pattern(self.mask_function)
        q_end = self._first_query() + self.q_length
        keys = s
        if pattern is not None and pattern.causal and isinstance(q_end, int):
            keys = max(min(s, q_end - self.kv_offset), 0)
        if traced() and not self._compact(pattern, keys):
            return s, {"attn_mask": self.allowed(s, device)}
        options: dict[str, Any] = {}
        padding = _keys_of(self.padding, self.kv_offset, keys)
        if pattern is not None and pattern.padding is not None:
            more = _keys_of(pattern.padding, self.kv_offset, keys)
            padding = more if padding is None else padding & more
        if padding is not None and (traced() or not bool(padding.all())):  # no branch on data
            options["key_mask"] = padding
        if not self._compact(pattern, keys):
            options["mask_mod"] = self._mask_mod()
            return keys, options
        window = _with_causal(pattern.window, pattern.causal)
        if pattern.documents is not None:  # packed sequences of one row, no cache
            options["block_mask"] = document_mask(
                pattern.documents[0], causal=pattern.causal, window=window
            )
        else:
            options["causal"] = pattern.causal
            options["window"] = window
        return keys, options

    def _compact(self, pattern: Pattern | None, keys: int) -> bool:
        """Whether ``pattern`` holds as attnkit's compact masks over ``keys`` keys: positions
        (causal, a window) need the last query to sit at the last key, as attnkit aligns them;
        documents, a row of queries that are its keys."""
        if pattern is None:
            return False
        q_end = self._first_query() + self.q_length
        aligned = isinstance(q_end, int) and q_end == self.kv_offset + keys
        if (pattern.causal or pattern.window is not None) and not aligned:
            return False
        if pattern.documents is not None:
            return aligned and self.batch_size == 1 and keys == self.q_length
        return True

    def _first_query(self) -> int | Tensor:
        """The first query's position: the whole number outside a trace, where it is known."""
        if not traced() and self.q_start is not None:  # read under a trace, it would be guarded
            return self.q_start
        return self.q_offset

    def allowed(self, s: int, device: torch.device | None = None) -> Tensor:
        """The dense ``(b, 1, t, s)`` bool mask, True where a query sees a key: transformers'
        function on broadcast index tensors, and the padding."""
        b = torch.arange(self.batch_size, device=device)[:, None, None, None]
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        q_idx = (
            torch.arange(self.q_length, device=device)[None, None, :, None] + self._first_query()
        )
        kv_idx = torch.arange(s, device=device)[None, None, None, :] + self.kv_offset
        allowed = self.mask_function(b, h, q_idx, kv_idx)
        padding = _keys_of(self.padding, self.kv_offset, s)
        if padding is not None:
            allowed = allowed & padding[:, None, None, :].to(allowed.device)
        return allowed.expand(self.batch_size, 1, self.q_length, s)

    def _mask_mod(self) -> Callable:
        """transformers' function at the call's positions, evaluated by attnkit block by block
        (the padding goes as ``key_mask``)."""
        fn, q_offset, kv_offset = self.mask_function, self._first_query(), self.kv_offset

        def mask_mod(b, h, q_idx, kv_idx):
            return fn(b, h, q_idx + q_offset, kv_idx + kv_offset)

        return mask_mod


def _keys_of(padding: Tensor | None, offset: int, n: int) -> Tensor | None:
    """Columns ``offset .. offset + n`` of a 2-D mask, padded with False (a static cache's empty
    slots) where it is shorter."""
    if padding is None:
        return None
    padding = padding[:, offset : offset + n].to(torch.bool)
    if padding.shape[1] < n:
        padding = torch.nn.functional.pad(padding, (0, n - padding.shape[1]), value=False)
    return padding


def _with_causal(window: tuple[int, int] | None, causal: bool) -> tuple[int, int] | None:
    """attnkit's window for a pattern: a causal sliding window looks back only."""
    if window is None:
        return None
    return (window[0], 0) if causal else window


def mask_builder(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable = hf.causal_mask_function,
    attention_mask: Tensor | None = None,
    cache_position: Tensor | None = None,
    **kwargs: Any,
) -> HFMask:
    """transformers' mask interface, for ``attn_implementation="attnkit"``: the request itself,
    as an [`HFMask`][attnkit.hf.masks.HFMask], with no mask tensor built (older versions of
    transformers give ``cache_position`` instead of ``q_length`` and ``q_offset``)."""
    if isinstance(attention_mask, HFMask):  # made before, for the same call (generate does)
        return attention_mask
    if q_length is None:
        q_length = cache_position.shape[0]
        q_offset = cache_position[0] if cache_position.numel() else 0
    q_start = None
    if not traced():
        q_start = int(q_offset)
    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = _keys_of(attention_mask, 0, kv_offset + kv_length)
    return HFMask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                  attention_mask, q_start, kwargs.get("device"))  # fmt: skip
