"""Forcing a path inside a backend, whatever the CPU: to compare paths, and for the tests, which
check every path on any machine.

``auto`` and a named backend choose the path themselves (see
[`attnkit.functional.which_backend`][attnkit.functional.which_backend]); inside ``forced(path)``,
that choice is overridden:

| path | what runs |
|---|---|
| ``"tiled:loop"`` | the tiled backend's PyTorch loop, never its C++ kernel |
| ``"tiled:half"`` | half-precision block products, as on a CPU with AVX512-BF16 or AMX: bf16 ones in the C++ kernel, with AVX512-BF16 where its build has it, else by the kernel's portable version of the same sums (slow, exact) |
| ``"tiled:portable"`` | bf16 block products in the C++ kernel, always by its portable version |
| ``"tiled:half-loop"`` | half-precision block products, in the PyTorch loop |
| ``"chunked:torch"`` | the gated delta rule's chunked form in PyTorch, never its C++ kernel |
| ``"sparse:gather"`` | top-k sparse attention's PyTorch form, never its C++ kernel |

Inside ``blind()``, the calls never look at the data from Python, as on a GPU: the CPU runs the
GPU's form of attnkit's rule for non-finite values. Inside ``blocks(block_q, block_k)``, the tiled
backend walks blocks of those sizes (the tests take small ones, so that short calls cross many
blocks); inside ``pieces(key_piece, query_piece)``, ring attention cuts its chunks into pieces of
those sizes; inside ``splits(min_keys)``, the decode kernel's threads take splits of the keys as
short as ``min_keys``.

Example:
    >>> import torch
    >>> from attnkit.force import forced
    >>> from attnkit.functional import which_backend
    >>> q = torch.randn(1, 2, 64, 32)
    >>> with forced("tiled:loop"):
    ...     which_backend(q, q, q, backend="tiled").path
    'loop'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

PATHS = (
    "tiled:loop",
    "tiled:half",
    "tiled:portable",
    "tiled:half-loop",
    "chunked:torch",
    "sparse:gather",
)
"""The paths that can be forced."""

_FORCED: list[str] = []  # the innermost forced path last


@contextlib.contextmanager
def forced(path: str) -> Iterator[None]:
    """Run the calls inside with ``path`` forced (one of [`PATHS`][attnkit.force.PATHS]).

    Raises:
        ValueError: an unknown path.
    """
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; choose one of {', '.join(map(repr, PATHS))}")
    _FORCED.append(path)
    try:
        yield
    finally:
        _FORCED.pop()


def current() -> str | None:
    """The path forced now, or None."""
    return _FORCED[-1] if _FORCED else None


def loop_only() -> bool:
    """Whether the tiled backend must run its PyTorch loop."""
    return current() in ("tiled:loop", "tiled:half-loop")


def torch_chunks() -> bool:
    """Whether the gated delta rule's chunked backend must run its PyTorch form."""
    return current() == "chunked:torch"


def gather_only() -> bool:
    """Whether the sparse backend must run its PyTorch form."""
    return current() == "sparse:gather"


def half_products() -> bool:
    """Whether half-precision block products are forced (whatever the CPU has)."""
    return current() in ("tiled:half", "tiled:half-loop", "tiled:portable")


def portable_pairs() -> bool:
    """Whether the C++ kernel must multiply bf16 blocks by its portable sums."""
    return current() == "tiled:portable"


_BLIND: list[bool] = []


@contextlib.contextmanager
def blind() -> Iterator[None]:
    """Run the calls inside as on a GPU, where a look at the data from Python would cost a
    synchronisation: attnkit's rule for non-finite values runs as tensor operations only, never
    branching on values (see
    [`can_branch_on_data`][attnkit.rules.nonfinite.can_branch_on_data])."""
    _BLIND.append(True)
    try:
        yield
    finally:
        _BLIND.pop()


def is_blind() -> bool:
    """Whether the calls run inside [`blind`][attnkit.force.blind]."""
    return bool(_BLIND)


_BLOCKS: list[tuple[int, int, int | None]] = []


@contextlib.contextmanager
def blocks(block_q: int, block_k: int, tile_bytes: int | None = None) -> Iterator[None]:
    """Run the calls inside with the tiled backend's blocks of ``block_q`` queries and ``block_k``
    keys, and (if given) tiles of a ``score_mod``'s bias of at most ``tile_bytes``; the plan of
    each call carries them ([`attnkit.tiled.plans.route_of`][attnkit.tiled.plans.route_of]).

    Raises:
        ValueError: a size that is not a positive int.
    """
    _check_sizes(block_q=block_q, block_k=block_k, tile_bytes=tile_bytes)
    _BLOCKS.append((block_q, block_k, tile_bytes))
    try:
        yield
    finally:
        _BLOCKS.pop()


def block_sizes() -> tuple[int, int, int | None] | None:
    """The sizes [`blocks`][attnkit.force.blocks] set now, or None."""
    return _BLOCKS[-1] if _BLOCKS else None


_PIECES: list[tuple[int | None, int | None]] = []


@contextlib.contextmanager
def pieces(key_piece: int | None = None, query_piece: int | None = None) -> Iterator[None]:
    """Run the calls inside with ring attention's chunks cut into pieces of about ``key_piece``
    keys and ``query_piece`` queries (None: the default, `attnkit.distributed.KEY_PIECE` and
    `QUERY_PIECE`).

    Raises:
        ValueError: a size that is not a positive int.
    """
    _check_sizes(key_piece=key_piece, query_piece=query_piece)
    _PIECES.append((key_piece, query_piece))
    try:
        yield
    finally:
        _PIECES.pop()


def piece_sizes() -> tuple[int | None, int | None]:
    """The sizes [`pieces`][attnkit.force.pieces] set now (None where not set)."""
    return _PIECES[-1] if _PIECES else (None, None)


_SPLITS: list[int] = []


@contextlib.contextmanager
def splits(min_keys: int) -> Iterator[None]:
    """Run the calls inside with the decode kernel splitting the keys among its threads into
    splits of at least ``min_keys`` keys (the default:
    [`MIN_KEYS_PER_SPLIT`][attnkit.backends.decode.MIN_KEYS_PER_SPLIT]); the tests take short
    ones, so that short caches are split.

    Raises:
        ValueError: a size that is not a positive int.
    """
    _check_sizes(min_keys=min_keys)
    _SPLITS.append(min_keys)
    try:
        yield
    finally:
        _SPLITS.pop()


def split_size() -> int | None:
    """The size [`splits`][attnkit.force.splits] set now, or None."""
    return _SPLITS[-1] if _SPLITS else None


def _check_sizes(**sizes: object) -> None:
    """Each size given (not None) is a positive int."""
    for name, value in sizes.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
