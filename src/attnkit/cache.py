"""A preallocated key/value cache for decoding one token (or one chunk) at a time.

The cache holds the keys and values of the tokens seen so far, in position order, in buffers
allocated once: an update writes the new chunk in place and returns views, never a ``torch.cat``.
With ``window=W`` it keeps only what a module with ``window=W`` can still see (the last ``W - 1``
positions plus the new chunk), shifting the kept keys to the front when the buffer fills.

Ragged batches (prompts of different lengths, left-padded) keep a key mask: padding positions stay in
the buffers but are masked out, and each row counts its own real tokens for rotary positions.

Shapes: ``b`` batch, ``h_kv`` key/value heads, ``n`` tokens in a chunk, ``d`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _checks
from attnkit._tracing import traced
from attnkit.masks import alibi_bias, window_mask
from attnkit.mods import MaskMod, ScoreMod, at_positions
from attnkit.positions import token_positions
from attnkit.rules.nonfinite import nonfinite_rows


class KVCache(nn.Module):
    """Keys and values of past tokens for one attention layer, preallocated.

    Args:
        batch_size: rows decoded together.
        num_kv_heads: key/value heads of the layer (fewer than its query heads under GQA).
        max_len: the most tokens the cache will see (prompt and generated).
        head_dim: width of one head.
        dtype: of the buffers; keys and values given to [`update`][attnkit.cache.KVCache.update] must match it.
        device: of the buffers; likewise.
        window: keep only what a layer with ``window=W`` needs: ``W - 1 + max_chunk`` slots instead
            of ``max_len``.
        max_chunk: the longest chunk one [`update`][attnkit.cache.KVCache.update] takes; defaults to ``window`` for a windowed
            cache and to ``max_len`` otherwise.

    The buffers are not persistent: they move with ``.to()`` but stay out of ``state_dict()``. Keys
    and values are stored detached: the cache is for inference. A causal layer's step calls
    [`step`][attnkit.cache.KVCache.step], eager or compiled (a compiled step then compiles once).

    Example:
        >>> cache = KVCache(1, 4, max_len=128, head_dim=64)
        >>> k, v = cache.update(torch.randn(1, 4, 10, 64), torch.randn(1, 4, 10, 64))  # prefill
        >>> k, v = cache.update(torch.randn(1, 4, 1, 64), torch.randn(1, 4, 1, 64))  # one token
        >>> k.shape, cache.position
        (torch.Size([1, 4, 11, 64]), 11)
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window: int | None = None,
        max_chunk: int | None = None,
    ) -> None:
        super().__init__()
        for value, name in (
            (batch_size, "batch_size"),
            (num_kv_heads, "num_kv_heads"),
            (max_len, "max_len"),
            (head_dim, "head_dim"),
        ):
            _checks.check_positive_int(value, name)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        if window is not None:
            _checks.check_positive_int(window, "window")
        if max_chunk is None:
            max_chunk = max_len if window is None else window
        _checks.check_positive_int(max_chunk, "max_chunk")
        capacity = max_len if window is None else min(max_len, window - 1 + max_chunk)
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.max_len, self.window, self.max_chunk = max_len, window, min(max_chunk, max_len)
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.register_buffer("keys", torch.zeros(shape, dtype=dtype, device=device), False)
        self.register_buffer("values", torch.zeros(shape, dtype=dtype, device=device), False)
        # Padding (ragged batches): `real` is False where a held key is padding, True everywhere
        # else; `padding_seen` counts each row's padding tokens. Both are written only once a chunk
        # comes with a key mask, so that unpadded decoding pays nothing for them.
        real = torch.ones(batch_size, capacity, dtype=torch.bool, device=device)
        self.register_buffer("real", real, False)
        padding_seen = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.register_buffer("padding_seen", padding_seen, False)
        # Tokens seen, as a tensor: under torch.compile the counters cannot be Python ints (each new
        # value would compile anew), so a compiled step reads and advances this one instead.
        self.register_buffer("filled", torch.zeros((), dtype=torch.long, device=device), False)
        # Which held keys hold a NaN or an infinity (nonfinite_keys), filled in when asked for.
        nonfinite = torch.zeros(batch_size, num_kv_heads, capacity, dtype=torch.bool, device=device)
        self.register_buffer("nonfinite", nonfinite, False)
        self.padded = False
        self.reset()

    def reset(self) -> None:
        """Forget every token (the buffers are kept, not zeroed)."""
        self._size = 0  # keys held, in slots [0, size) of the buffers
        self._position = 0  # tokens seen: the position of the next token
        self.filled.zero_()
        self._ints_behind = False  # compiled steps advanced `filled` but not the ints
        self._checked = 0  # slots [0, checked) have their row in `nonfinite`
        self._returned = (0, 0)  # the slots of the keys the last update or get returned
        if self.padded:
            self.real.fill_(True)
            self.padding_seen.zero_()
        self.padded = False  # some key since the last reset was padding

    @property
    def size(self) -> int:
        """Keys held, in slots ``[0, size)`` of the buffers."""
        if self.__dict__["_ints_behind"]:
            self._catch_up()
        return self.__dict__["_size"]

    @property
    def position(self) -> int:
        """Tokens seen: the position of the next token (where rotary embeddings continue)."""
        if self.__dict__["_ints_behind"]:
            self._catch_up()
        return self.__dict__["_position"]

    def _catch_up(self) -> None:
        """The ints after compiled steps, which advanced only ``filled``."""
        seen = int(self.filled)
        self.__dict__.update(_size=seen, _position=seen, _ints_behind=False)

    @property
    def capacity(self) -> int:
        """Slots in the buffers."""
        return self.keys.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def row_positions(self) -> Tensor:
        """``(b,)`` each row's real tokens seen: where its rotary positions continue."""
        return self.position - self.padding_seen

    @property
    def key_mask(self) -> Tensor | None:
        """``(b, size)`` True for a real token, or None when no held key is padding."""
        return self.real[:, : self.size] if self.padded else None

    def get(self) -> tuple[Tensor, Tensor]:
        """Every held key and value, ``(b, h_kv, size, d)`` views in position order."""
        self._returned = (0, self.size)
        return self.keys[:, :, : self.size], self.values[:, :, : self.size]

    def nonfinite_keys(self) -> Tensor:
        """``(b, h_kv, s)`` True where a key that the last [`update`][attnkit.cache.KVCache.update]
        or [`get`][attnkit.cache.KVCache.get] returned holds a NaN or an infinity: what
        [`attention`][attnkit.functional.attention]'s ``nonfinite_keys`` takes, so that a decoding
        step on a GPU does not read the whole cache again to find them. A view of a buffer, valid
        until the next update. Each key is looked at once, at the first call after it arrived (a
        pass over the new keys only), and again after the cache is cast or moved (``.half()`` may
        make a large key infinite)."""
        keys, nonfinite = self._buffers["keys"], self._buffers["nonfinite"]
        start, end = self.__dict__["_returned"]
        checked = self.__dict__["_checked"]
        if checked < end:
            nonfinite[:, :, checked:end] = nonfinite_rows(keys[:, :, checked:end])
            self.__dict__["_checked"] = end
        return nonfinite[:, :, start:end]

    def _apply(self, fn, recurse=True):
        """``nn.Module``'s way to cast or move the buffers (``.to()``, ``.half()``, ``.cuda()``):
        the keys may change (float32 to float16 makes 1e5 infinite), so their record is made anew."""
        self.__dict__["_checked"] = 0
        return super()._apply(fn, recurse)

    def next_slots(self, n: int) -> Tensor:
        """``(n,)`` the buffer slots of the next ``n`` tokens, from the tensor ``filled`` (for a
        compiled step; a cache without window keeps token ``i`` in slot ``i``)."""
        return self._buffers["filled"] + torch.arange(n, device=self.keys.device)

    def next_positions(self, n: int, key_mask: Tensor | None = None) -> Tensor:
        """Positions of the next ``n`` tokens, for rotary embeddings: ``(n,)`` when every row is
        unpadded, else ``(b, n)`` counting each row's real tokens only (padding gets position 0)."""
        if traced():  # from tensors: the ints would compile anew each step
            return token_positions(n, key_mask, self.filled - self.padding_seen)
        if not self.padded and key_mask is None:
            return torch.arange(self.position, self.position + n, device=self.keys.device)
        return token_positions(n, key_mask, self.row_positions, self.keys.device)

    def update(
        self, k: Tensor, v: Tensor, *, key_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Append a chunk and return the keys and values a query of that chunk may need.

        Args:
            k: ``(b, h_kv, n, d)`` keys of the next ``n >= 1`` tokens.
            v: ``(b, h_kv, n, d)`` their values.
            key_mask: ``(b, n)`` bool, False for padding (left padding of a ragged prompt).

        Returns:
            ``(k_all, v_all)``, ``(b, h_kv, s, d)`` in position order, the last ``n`` being the new
            chunk: every held key, or for a windowed cache the last ``window - 1 + n``. They are
            views of the buffers, valid until the next update.

        Raises:
            TypeError: ``k``/``v`` not tensors, or not of the cache's dtype.
            ValueError: a shape that does not match the cache, a chunk longer than ``max_chunk``,
                or more tokens than ``max_len``.
        """
        # self.keys without the failed attribute lookup before nn.Module.__getattr__ (Python 3.11)
        keys, values = self._buffers["keys"], self._buffers["values"]
        n = self._check_chunk(k, v, key_mask, keys)
        size = self.size
        if size + n > keys.shape[2]:  # only a windowed cache: move the kept keys to the front
            kept = min(self.window - 1, size)
            keys[:, :, :kept] = keys[:, :, size - kept : size].clone()
            values[:, :, :kept] = values[:, :, size - kept : size].clone()
            if self.padded:
                self.real[:, :kept] = self.real[:, size - kept : size].clone()
            checked = self.__dict__["_checked"]  # the record of the kept keys moves with them
            if checked >= size:
                self.nonfinite[:, :, :kept] = self.nonfinite[:, :, size - kept : size].clone()
            self.__dict__["_checked"] = kept if checked >= size else 0
            size = kept
        end = size + n
        # slots from `size` on are written now (a record made of them past the held keys, after
        # a compiled step returned the whole buffers, is of their old content)
        self.__dict__["_checked"] = min(self.__dict__["_checked"], size)
        keys[:, :, size:end] = k.detach()
        values[:, :, size:end] = v.detach()
        if key_mask is not None and not self.padded:
            self.padded = not bool(key_mask.all())
        if self.padded:
            self.real[:, size:end] = True if key_mask is None else key_mask
            if key_mask is not None:
                self.padding_seen += n - key_mask.sum(dim=1)
        # Plain ints: straight into the instance dict, past nn.Module.__setattr__'s search of its
        # parameters, buffers and submodules (3.5 us of a 36 us update).
        position = self.__dict__["_position"] + n
        self.__dict__.update(_size=end, _position=position)
        self._buffers["filled"].fill_(position)
        start = 0 if self.window is None else max(0, end - (self.window - 1 + n))
        self.__dict__["_returned"] = (start, end)
        return keys[:, :, start:end], values[:, :, start:end]

    def update_static(
        self, k: Tensor, v: Tensor, *, key_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """[`update`][attnkit.cache.KVCache.update] for a step under ``torch.compile``, where no Python int may change from one
        token to the next (each value would compile anew): the chunk goes to the slots that the
        tensor ``filled`` points at, and the whole buffers come back, with the mask of the slots
        that hold a real key. The step then sees ``capacity`` keys, the empty ones masked, so its
        shapes never change: it compiles once.

        Returns:
            ``(keys, values, real)``: ``(b, h_kv, capacity, d)`` buffers and ``(b, capacity)`` bool,
            True where a slot holds a real (filled, unpadded) key.

        Raises:
            ValueError: a windowed cache (its buffers shift, which a static shape cannot).
        """
        if self.window is not None:
            raise ValueError(
                "a windowed KVCache cannot decode under torch.compile (its buffers shift as tokens "
                "arrive); build the cache with window=None"
            )
        keys, values = self._buffers["keys"], self._buffers["values"]
        n = self._check_chunk_shape(k, v, key_mask, keys)
        filled = self._buffers["filled"]
        # The room check of update(), on the tensor (a RuntimeError, raised when the step runs)
        torch._assert_async(
            filled + n <= self.max_len,
            f"KVCache: a chunk of {n} tokens does not fit in max_len ({self.max_len}); call "
            "reset() or build a larger cache",
        )
        slots = filled + torch.arange(n, device=keys.device)  # (n,)
        keys.index_copy_(2, slots, k.detach())
        values.index_copy_(2, slots, v.detach())
        real = self._buffers["real"]
        if key_mask is not None:
            real.index_copy_(1, slots, key_mask)
            self.padding_seen += n - key_mask.sum(dim=1)
            self.padded = True
        filled.add_(n)
        self._ints_behind = True  # written, never read here: no recompile
        # the whole buffers were returned, and slots written that the record does not know of
        self._returned, self._checked = (0, keys.shape[2]), 0
        held = torch.arange(self.capacity, device=keys.device) < filled  # (capacity,)
        return keys, values, real & held

    def step(
        self,
        k: Tensor,
        v: Tensor,
        *,
        key_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        window: tuple[int, int] | None = None,
        alibi_slopes: Tensor | None = None,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        context_length: int | None = None,
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """A causal layer's step: its chunk's keys and values join the cache, and back come the
        keys and values its queries attend to, with the keywords of
        [`attention`][attnkit.functional.attention] that go with them (``causal``, ``key_mask``,
        ``attn_mask``, ``window``, ``alibi_slopes``, the mods at the tokens' positions in the
        sequence, and off the CPU ``nonfinite_keys``). The arguments are the layer's.

        One path for eager and compiled steps; what is read back differs, and why:

        - eager: views of the keys held (a windowed cache: those the window reaches), so that no
          backend computes over empty slots (a prompt's prefill would otherwise cost
          ``max_len / prompt`` times more);
        - under ``torch.compile``, where no Python int may change from one token to the next
          (each value would compile anew): the whole buffers ([`update_static`][attnkit.cache.KVCache.update_static])
          and the mask, bool or with ALiBi float ``(b, h or 1, t, capacity)``, of the slots each
          query may see, from the tensor position ``filled``: a step compiles once (a cache
          without window; no ``attn_mask``, ``score_mod`` or ``mask_mod``).

        Raises:
            ValueError: more tokens than ``context_length``; under ``torch.compile``, an
                ``attn_mask``, ``score_mod`` or ``mask_mod``.
        """
        t = k.shape[2]
        if not traced():
            _checks.check_context_length(self.position + t, context_length, "cache + x")
            keys, values = self.update(k, v, key_mask=key_mask)
            held = self.key_mask
            mods = at_positions(
                {"score_mod": score_mod, "mask_mod": mask_mod},
                self.position - t,
                self.position - keys.shape[2],
            )
            options = {
                "causal": True,
                "key_mask": None if held is None else held[:, -keys.shape[2] :],
                "attn_mask": attn_mask,
                "window": window,
                "alibi_slopes": alibi_slopes,
                **mods,
            }
            if not keys.is_cpu:  # where SDPA would read the whole cache to find them
                options["nonfinite_keys"] = self.nonfinite_keys()
            return keys, values, options
        for given, name in (
            (attn_mask, "attn_mask"),
            (score_mod, "score_mod"),
            (mask_mod, "mask_mod"),
        ):
            if given is not None:
                raise ValueError(
                    f"{name} cannot be used with a KVCache under torch.compile: a compiled step "
                    "attends over the cache's whole buffer, whose length is not the keys held"
                )
        slots = self.next_slots(t)  # where this chunk goes: the queries' positions
        if context_length is not None:  # check_context_length, on the tensor
            torch._assert_async(
                slots[-1] < context_length,
                f"cache + x is longer than context_length ({context_length})",
            )
        keys, values, real = self.update_static(k, v, key_mask=key_mask)
        capacity = keys.shape[2]
        window = (-1, 0) if window is None else window  # a cached layer is causal
        allowed = window_mask(t, capacity, window, device=keys.device, query_slots=slots)
        attn_mask = allowed & real[:, None, None, :]  # (t, C) & (b, 1, 1, C) -> (b, 1, t, C)
        if alibi_slopes is not None:
            bias = alibi_bias(alibi_slopes, t, capacity, query_slots=slots)  # (h, t, C)
            attn_mask = bias.to(k.dtype).masked_fill(~attn_mask, float("-inf"))
        off = {"causal": False, "key_mask": None, "window": None, "alibi_slopes": None}
        return keys, values, {**off, "attn_mask": attn_mask}

    def _check_chunk(self, k: Tensor, v: Tensor, key_mask: Tensor | None, keys: Tensor) -> int:
        """The chunk's length ``n``, once ``k``, ``v`` and ``key_mask`` fit the cache and its room."""
        n = self._check_chunk_shape(k, v, key_mask, keys)
        if n > self.max_chunk:
            raise ValueError(
                f"a chunk of {n} tokens is longer than max_chunk ({self.max_chunk}); split it or "
                "build the cache with a larger max_chunk"
            )
        if self.position + n > self.max_len:
            raise ValueError(
                f"the cache is full: {self.position} tokens seen + {n} new > max_len "
                f"({self.max_len}); call reset() or build a larger cache"
            )
        return n

    def _check_chunk_shape(
        self, k: Tensor, v: Tensor, key_mask: Tensor | None, keys: Tensor
    ) -> int:
        """The chunk's length ``n``, once ``k``, ``v`` and ``key_mask`` fit the cache's buffers."""
        fits = (
            isinstance(k, Tensor)
            and isinstance(v, Tensor)
            and k.shape == v.shape
            and k.dim() == 4
            and k.shape[:2] == keys.shape[:2]
            and k.shape[3] == keys.shape[3]
            and k.dtype == v.dtype == keys.dtype
            and k.device == v.device == keys.device
        )
        if not fits:  # find what does not, and say so
            for x, name in ((k, "k"), (v, "v")):
                _checks.check_tensor(x, name)
                if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (
                    self.batch_size,
                    self.num_kv_heads,
                    self.head_dim,
                ):
                    raise ValueError(
                        f"{name} must be (batch_size={self.batch_size}, num_kv_heads="
                        f"{self.num_kv_heads}, n, head_dim={self.head_dim}), got shape "
                        f"{tuple(x.shape)}"
                    )
                if x.dtype != keys.dtype:
                    advice = (
                        f"build the cache with dtype={x.dtype}"
                        if x.is_floating_point()
                        else "keys and values have a floating-point dtype"
                    )
                    raise TypeError(
                        f"{name} has dtype {x.dtype} but the cache holds {keys.dtype}; {advice}"
                    )
                if x.device != keys.device:
                    raise ValueError(f"{name} is on {x.device} but the cache is on {keys.device}")
            raise ValueError(
                f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        n = k.shape[2]
        if n < 1:
            raise ValueError("k and v must hold at least one token, got 0")
        if key_mask is not None:
            _checks.check_key_mask(key_mask, self.batch_size, n)
        return n

    def extra_repr(self) -> str:
        return (
            f"batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
            f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"window={self.window}, capacity={self.capacity}, position={self.position}"
        )
