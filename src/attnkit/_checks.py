"""Input validation shared by every layer.

Every public entry point checks its arguments here, so that bad input raises a ``ValueError`` or
``TypeError`` that names the argument and the values it got, instead of a bare ``assert`` (removed by
``python -O``) or a shape error from deep inside torch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _shape(x: Tensor) -> str:
    return str(tuple(x.shape))


def check_tensor(x: object, name: str) -> Tensor:
    """Return ``x`` if it is a tensor, else raise a TypeError naming it."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_floating(x: Tensor, name: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")


def check_rank(x: Tensor, name: str, ranks: tuple[int, ...], layout: str) -> None:
    """Raise unless ``x.dim()`` is one of ``ranks``; ``layout`` names the expected axes."""
    if x.dim() not in ranks:
        raise ValueError(f"{name} must be {layout}, got shape {_shape(x)} ({x.dim()} dims)")


def check_probability(p: float, name: str = "dropout") -> float:
    """Dropout probabilities live in [0, 1): p = 1 would zero every weight."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return float(p)


def check_module_dtype(dtype: object) -> None:
    """A module's ``dtype=``: None (torch's default) or a floating-point dtype, as its weights need."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")


def check_positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_divisible(numerator: int, num_name: str, denominator: int, den_name: str) -> None:
    if numerator % denominator:
        raise ValueError(
            f"{num_name} ({numerator}) must be divisible by {den_name} ({denominator})"
        )


def check_same_dtype_device(tensors: dict[str, Tensor]) -> None:
    """All named tensors must share one dtype and one device."""
    (first_name, first), *rest = tensors.items()
    for name, x in rest:
        if x.dtype != first.dtype:
            raise TypeError(
                f"{first_name} and {name} must have the same dtype, "
                f"got {first_name}: {first.dtype} and {name}: {x.dtype}"
            )
        if x.device != first.device:
            raise ValueError(
                f"{first_name} and {name} must be on the same device, "
                f"got {first_name}: {first.device} and {name}: {x.device}"
            )


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Check the ``(b, h, t, d)`` / ``(b, h_kv, s, d)`` layout of the functional entry point."""
    # Inputs that fit pass in one expression (this runs on every decoding step); others go
    # through the checks below, which name what does not fit.
    if (
        isinstance(q, Tensor)
        and isinstance(k, Tensor)
        and isinstance(v, Tensor)
        and q.dim() == k.dim() == v.dim() == 4
        and q.is_floating_point()
        and q.dtype == k.dtype == v.dtype
        and q.device == k.device == v.device
    ):
        (b, h, _, d), (bk, h_kv, s, dk), (bv, h_v, sv, _) = q.shape, k.shape, v.shape
        if (
            b == bk == bv
            and 0 < d == dk
            and s == sv
            and 0 < h_kv == h_v
            and h > 0
            and h % h_kv == 0
        ):
            return
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name)
        check_rank(x, name, (4,), "(batch, heads, length, head_dim)")
        check_floating(x, name)
    check_same_dtype_device({"q": q, "k": k, "v": v})
    (b, h, _, d), (bk, h_kv, s, dk), (bv, h_v, sv, _) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ValueError(
            f"q, k and v must have the same batch size, got {b}, {bk} and {bv} "
            f"(shapes {_shape(q)}, {_shape(k)}, {_shape(v)})"
        )
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got q: {d} and k: {dk}")
    if d == 0:
        raise ValueError(f"q and k must have a head_dim of at least 1, got shape {_shape(q)}")
    if s != sv:
        raise ValueError(
            f"k and v must have the same length, got k: {s} and v: {sv} "
            f"(shapes {_shape(k)} and {_shape(v)})"
        )
    if h_v != h_kv:
        raise ValueError(f"k and v must have the same number of heads, got {h_kv} and {h_v}")
    if h == 0:
        raise ValueError(f"q must have at least one head, got shape {_shape(q)}")
    if h_kv == 0:
        raise ValueError(
            f"k and v must have at least one head, got shapes {_shape(k)}, {_shape(v)}"
        )
    if h % h_kv:
        raise ValueError(
            f"the query heads ({h}) must be a multiple of the key/value heads ({h_kv})"
        )


def check_flag(value: object, name: str) -> bool:
    """A switch such as ``causal``: a bool, not anything truthy (``causal="no"`` would be True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_same_device(x: Tensor, name: str, device: torch.device, of: str = "q") -> None:
    """``x`` is on ``device``, the device of the tensor named ``of``."""
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {of} is on {device}")


def check_key_mask(key_mask: Tensor, b: int, s: int, device: torch.device | None = None) -> None:
    """``key_mask`` is ``(b, s)`` bool, True for a real token (a key that may be attended), on
    ``device`` when one is given."""
    check_tensor(key_mask, "key_mask")
    if key_mask.dtype != torch.bool:
        raise TypeError(
            f"key_mask must be a bool tensor (True = real token), got dtype {key_mask.dtype}"
        )
    if tuple(key_mask.shape) != (b, s):
        raise ValueError(
            f"key_mask must have shape (batch, key_length) = {(b, s)}, got {_shape(key_mask)}"
        )
    if device is not None:
        check_same_device(key_mask, "key_mask", device)


def check_indices(
    indices: object, b: int, h_kv: int, t: int, s: int, device: torch.device, *, look: bool = True
) -> Tensor:
    """``indices`` of top-k sparse attention: integer (int32 or int64), ``(b, t, n)`` (shared by
    every head) or ``(b, h_kv, t, n)``, on ``device``, each -1 (an unused slot) or a key in
    ``0..s-1`` (their values read only where ``look``). Returned as ``(b, 1 or h_kv, t, n)``."""
    check_tensor(indices, "indices")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got dtype {indices.dtype}")
    if indices.dim() == 3:
        indices = indices.unsqueeze(1)
    shapes = (
        f"(batch, query_length, n) = ({b}, {t}, n) or "
        f"(batch, kv_heads, query_length, n) = ({b}, {h_kv}, {t}, n)"
    )
    if indices.dim() != 4 or indices.shape[0] != b or indices.shape[1] not in (1, h_kv):
        raise ValueError(f"indices must have shape {shapes}, got {_shape(indices)}")
    if indices.shape[2] != t:
        raise ValueError(f"indices must have shape {shapes}, got {_shape(indices)}")
    check_same_device(indices, "indices", device)
    if look and indices.numel():
        low, high = (int(x) for x in torch.aminmax(indices))
        if low < -1 or high >= s:
            raise ValueError(
                f"indices must be -1 (an unused slot) or a key in 0..{s - 1}, got values from "
                f"{low} to {high}"
            )
    return indices


def check_nonfinite_keys(nonfinite_keys: Tensor, shape: tuple[int, ...], device) -> None:
    """``nonfinite_keys`` is bool of ``shape`` = ``(b, h_kv, s)``, on ``device``, the keys'."""
    check_tensor(nonfinite_keys, "nonfinite_keys")
    if nonfinite_keys.dtype != torch.bool:
        raise TypeError(f"nonfinite_keys must be a bool tensor, got dtype {nonfinite_keys.dtype}")
    if tuple(nonfinite_keys.shape) != shape:
        raise ValueError(
            f"nonfinite_keys must have shape (batch, kv_heads, key_length) = {shape}, got "
            f"{_shape(nonfinite_keys)}"
        )
    check_same_device(nonfinite_keys, "nonfinite_keys", device, of="k")


def check_attn_mask(
    attn_mask: Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    """``attn_mask`` is bool (True = may attend) or a float of the query's dtype, added to scores,
    must broadcast to ``shape`` = ``(b, h, t, s)`` and be on the query's ``device``."""
    check_tensor(attn_mask, "attn_mask")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != dtype:
        raise TypeError(
            f"attn_mask must be bool (True = may attend) or the query's dtype {dtype} "
            f"(added to the scores), got {attn_mask.dtype}"
        )
    ok = attn_mask.dim() <= len(shape) and all(
        m in (1, n) for m, n in zip(reversed(attn_mask.shape), reversed(shape))
    )
    if not ok:
        raise ValueError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to "
            f"(batch, heads, query_length, key_length) = {shape}"
        )
    check_same_device(attn_mask, "attn_mask", device)


def check_features(x: Tensor, name: str, expected: int, expected_name: str) -> None:
    """The last dim of a ``(..., e)`` input must match the layer's input width."""
    if x.shape[-1] != expected:
        raise ValueError(
            f"{name} has {x.shape[-1]} features in its last dim, but {expected_name} is {expected} "
            f"(shape {_shape(x)})"
        )


def check_matches_parameters(x: Tensor, name: str, weight: Tensor) -> None:
    """A module input must match its parameters' device, and dtype unless autocast casts both."""
    if x.device != weight.device:
        raise ValueError(
            f"{name} is on {x.device} but the module's parameters are on {weight.device}"
        )
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{name} has dtype {x.dtype} but the module's parameters are {weight.dtype}; "
            f"convert one of them (e.g. module.to({x.dtype}))"
        )


def check_context_length(t: int, context_length: int | None, name: str = "x") -> None:
    if context_length is not None and t > context_length:
        raise ValueError(f"{name} has {t} tokens, longer than context_length ({context_length})")


def check_window(window: object) -> tuple[int, int] | None:
    """``window`` is None or ``(left, right)``: two ints, each >= 0 or -1 for unbounded."""
    if window is None:
        return None
    ok = (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    )
    if not ok:
        raise TypeError(f"window must be a pair of ints (left, right), got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window sizes must be >= 0, or -1 for unbounded, got {tuple(window)}")
    return (left, right)


def check_positive_number(value: object, name: str) -> float:
    """A finite number > 0 (an infinite scale or softcap has no finite scores to give)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_alibi_slopes(slopes: object, num_heads: int, device: torch.device) -> Tensor:
    """ALiBi slopes: one float per query head, on the queries' device."""
    slopes = check_tensor(slopes, "alibi_slopes")
    check_floating(slopes, "alibi_slopes")
    if tuple(slopes.shape) != (num_heads,):
        raise ValueError(
            f"alibi_slopes must have shape (heads,) = ({num_heads},), got {_shape(slopes)}"
        )
    check_same_device(slopes, "alibi_slopes", device)
    return slopes


def check_sinks(sinks: object, num_heads: int, device: torch.device) -> Tensor:
    """Learned sinks: one float logit per query head, on the queries' device."""
    sinks = check_tensor(sinks, "sinks")
    check_floating(sinks, "sinks")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({num_heads},), got {_shape(sinks)}")
    check_same_device(sinks, "sinks", device)
    return sinks


def check_mask_mod(mask_mod, block_mask) -> None:
    """``mask_mod`` a function, and not given with a ``block_mask`` (which holds its own)."""
    if block_mask is not None:
        raise ValueError("give block_mask or mask_mod, not both (a BlockMask holds its mask_mod)")
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function, got {type(mask_mod).__name__}")


def check_block_mask(block_mask, b: int, h: int, t: int, s: int, device):
    """``block_mask``: a torch ``BlockMask`` built for ``(t, s)``, batches 1 or ``b``, heads 1 or
    ``h``, on the queries' device."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a torch BlockMask, got {type(block_mask).__name__}")
    if tuple(block_mask.seq_lengths) != (t, s):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, but the "
            f"call has t={t} queries and s={s} keys"
        )
    bq, bk = block_mask.BLOCK_SIZE
    blocks = tuple(block_mask.kv_num_blocks.shape)
    want = (-(-t // bq),)
    if blocks[-1:] != want or blocks[0] not in (1, b) or blocks[1] not in (1, h):
        raise ValueError(
            f"block_mask's tables have shape {blocks} for BLOCK_SIZE {(bq, bk)}; this call needs "
            f"(1 or {b}, 1 or {h}, {want[0]})"
        )
    if block_mask.kv_num_blocks.device != torch.device(device):
        raise ValueError(
            f"block_mask is on {block_mask.kv_num_blocks.device}, the queries on {device}"
        )
    return block_mask
