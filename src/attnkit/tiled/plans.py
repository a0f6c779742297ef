"""The tiled backend's plans: the route of a call, worked out once while the backend is chosen
([`TiledRoute`][attnkit.tiled.plans.TiledRoute]: the block products, the C++ kernel or the loop,
the block and tile sizes), and the plan of a block mask, which of its key blocks each block of
queries visits, in blocks of several of the mask's own
([`BlockPlan`][attnkit.tiled.plans.BlockPlan])."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attnkit import force
from attnkit._tracing import traced
from attnkit.block_mask import scores_allowed, tables
from attnkit.call import Call
from attnkit.kernels import cpu, loader
from attnkit.kernels.loader import Kernel

KERNEL = loader.KERNELS["tiled"]

BLOCK_Q = 256
"""Query rows per block."""
BLOCK_K = 512
"""Keys per block: a (12 heads, 256, 512) float32 block of scores is 6 MB, and stays in cache."""
TILE_BYTES = 16 * 2**20
"""The memory a tile of a ``score_mod``'s bias may take (float32, every batch row and head), unless
one block of queries by one block of keys takes more: it stays in the CPU's last-level cache
between being written and being read, and the allocator reuses it from tile to tile."""

_HALF_FORCED = ("tiled:half", "tiled:half-loop", "tiled:portable")


class TiledRoute(NamedTuple):
    """Which code of the tiled backend runs a call and in what sizes: worked out once
    ([`route_of`][attnkit.tiled.plans.route_of]), while the backend is chosen, and carried to the
    kernel.

    Attributes:
        products: the dtype of the block products.
        kernel: the C++ kernel (not yet loaded) that runs the call, or None: the PyTorch loop.
        pairs: how the kernel multiplies bf16 blocks: ``"avx512_bf16"`` or ``"portable"``; None
            for float32 products.
        block_q: query rows per block.
        block_k: keys per block.
        tile_bytes: the most a tile of a ``score_mod``'s bias may take.
    """

    products: torch.dtype
    kernel: Kernel | None
    pairs: str | None = None
    block_q: int = BLOCK_Q
    block_k: int = BLOCK_K
    tile_bytes: int = TILE_BYTES

    @property
    def path(self) -> str:
        return "loop" if self.kernel is None else "native"

    @property
    def products_name(self) -> str:
        """As [`which_backend`][attnkit.functional.which_backend] names them: ``"float32"``,
        ``"bf16-avx512_bf16"``, ``"bf16-portable"``, or the loop's dtype."""
        if self.pairs is not None:  # the C++ kernel's bf16 products
            return f"bf16-{self.pairs}"
        return str(self.products).removeprefix("torch.")


def route_of(call: Call) -> TiledRoute:
    """The route of ``call``: block products in the inputs' dtype (autocast's, where it is on)
    where the device multiplies it fast (a GPU; on a CPU, `attnkit.kernels.cpu.fast_half_products`,
    or as [forced][attnkit.force]), else in float32; the C++ kernel where it takes those products,
    the call's device and its user functions (a ``score_mod`` that
    [adds to the score][attnkit.mods.adds_to_score]; no block mask), else the loop. What is forced
    and whether this is traced are read once, here."""
    q = call.q
    device = q.device
    dtype = (
        torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else q.dtype
    )
    forced = force.current()
    if dtype in (torch.bfloat16, torch.float16) and device.type == "cpu":
        fast = forced in _HALF_FORCED or cpu.fast_half_products(dtype)
        products = dtype if fast else torch.float32
    else:
        products = dtype
    kernel = pairs = None
    if call.block_mask is None and (call.score_mod is None or call.mod_adds):
        kernel, pairs = _kernel_and_pairs(device, products, forced)
    sizes = force.block_sizes()
    if sizes is None:
        return TiledRoute(products, kernel, pairs)
    block_q, block_k, tile_bytes = sizes
    return TiledRoute(products, kernel, pairs, block_q, block_k, tile_bytes or TILE_BYTES)


_NOW = object()  # read what is forced now


def kernel_for(device: torch.device, matmul_dtype: torch.dtype, forced=_NOW) -> Kernel | None:
    """The C++ kernel if it would run a call with these block products, else None (the loop
    runs): float32 products always, bf16 ones where its build multiplies them with AVX512-BF16
    (elsewhere the loop's bf16 matrix products, oneDNN's, are the faster way). Decides without
    building or loading it (`attnkit.kernels.loader.Kernel.usable`); ``forced``: the path
    [forced][attnkit.force] (read now if not given)."""
    return _kernel_and_pairs(device, matmul_dtype, force.current() if forced is _NOW else forced)[0]


def _kernel_and_pairs(device, matmul_dtype, forced) -> tuple[Kernel | None, str | None]:
    """`kernel_for`, and `pair_products` of it for bf16 products (None for float32)."""
    if device.type != "cpu" or matmul_dtype not in (torch.float32, torch.bfloat16):
        return None, None
    if forced in ("tiled:loop", "tiled:half-loop") or traced():  # dynamo cannot trace C++
        return None, None
    if not KERNEL.usable()[0]:
        return None, None
    if matmul_dtype == torch.float32:
        return KERNEL, None
    pairs = pair_products(KERNEL, forced)
    return (None, None) if pairs is None else (KERNEL, pairs)


def pair_products(kernel, forced=_NOW) -> str | None:
    """How the kernel (or its loaded module) multiplies bf16 blocks: ``"avx512_bf16"``
    (``vdpbf16ps``) where its build has it, else None (bf16 products then run in the loop);
    ``"portable"``, the same sums in portable code, where a path forces it."""
    forced = force.current() if forced is _NOW else forced
    fast = kernel.has_avx512_bf16()
    if forced == "tiled:portable" or (forced == "tiled:half" and not fast):
        return "portable"
    return "avx512_bf16" if fast else None


def products(kernel, matmul_dtype: torch.dtype) -> str:
    """The block products as [`attnkit.functional.which_backend`][attnkit.functional.which_backend] names them: ``"float32"``,
    ``"bf16-avx512_bf16"`` or ``"bf16-portable"``."""
    return "float32" if matmul_dtype == torch.float32 else f"bf16-{pair_products(kernel)}"


class BlockPlan:
    """A block mask as the tiled kernel walks it, in blocks of ``group`` of the mask's blocks (the
    kernel's blocks are larger than a mask's 128 x 128, so that Python's cost per block is paid
    less often): for each row of blocks, the blocks that some batch and head needs, and for each
    of those the mask to apply, None where all of it is full for every batch and head (then
    ``mask_mod`` is skipped)."""

    def __init__(
        self,
        block_mask: BlockMask,
        batches: int,
        heads: int,
        most: tuple[int, int] = (1, 1),
        *,
        compiled: bool = False,
    ):
        self.block_mask = block_mask
        self.batches, self.heads = batches, heads  # the call's: mask_mod sees them all
        self.compiled = compiled  # mask_mod through mods.compile_block
        self.partial, self.full = tables(block_mask)  # (B, H, nq, nk), the mask's blocks
        listed = (self.partial | self.full).flatten(0, 1).any(dim=0)  # (nq, nk)
        self.group = _largest_group(listed, most)
        bq, bk = block_mask.BLOCK_SIZE
        self.block_size = (bq * self.group[0], bk * self.group[1])
        full = self.full.flatten(0, 1).all(dim=0)
        # blocks past the matrix's end: never listed, and no reason for a block to be masked
        grouped = _any_in_group(listed, self.group)
        self.key_blocks = [row.nonzero().flatten().tolist() for row in grouped]
        self.all_full = _grouped(full, self.group, True).all(-1).all(1).tolist()

    def allowed(self, qb: int, kb: int, rows: range, keys: range) -> Tensor | None:
        """Bool, broadcastable to ``(b, h, len(rows), len(keys))``, for the scores of rows
        ``rows`` (in the kernel's query block ``qb``) and keys ``keys`` (in its key block
        ``kb``), or None if every score there is allowed for every batch and head."""
        if self.all_full[qb][kb]:
            return None
        return scores_allowed(
            self.block_mask,
            self.partial,
            self.full,
            rows,
            keys,
            self.batches,
            self.heads,
            self.compiled,
        )


def _grouped(table: Tensor, group: tuple[int, int], fill: bool) -> Tensor:
    """``(nq, nk)`` -> ``(NQ, gq, NK, gk)``: the mask's blocks by the kernel's blocks of ``group``
    of them, padded with ``fill`` past the matrix's end."""
    gq, gk = group
    nq, nk = table.shape
    padded = torch.nn.functional.pad(table, (0, -nk % gk, 0, -nq % gq), value=fill)
    return padded.view(padded.shape[0] // gq, gq, padded.shape[1] // gk, gk)


def _any_in_group(listed: Tensor, group: tuple[int, int]) -> Tensor:
    """``(NQ, NK)``: the kernel's blocks that hold a listed block of the mask."""
    return _grouped(listed, group, False).any(-1).any(1)


def _largest_group(listed: Tensor, most: tuple[int, int]) -> tuple[int, int]:
    """The largest group, up to ``most``, whose blocks cover at most a quarter more of the scores
    than the mask's listed blocks: a sparse mask (packed documents) keeps small blocks, a dense
    one (causal) gets large ones."""
    needed = int(listed.sum())
    gq, gk = most
    while gq * gk > 1:
        if int(_any_in_group(listed, (gq, gk)).sum()) * gq * gk <= 1.25 * needed:
            return gq, gk
        gq, gk = (gq, gk // 2) if gk >= gq else (gq // 2, gk)
    return 1, 1
