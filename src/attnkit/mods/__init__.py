"""User-written score and mask functions, as torch's FlexAttention defines them.

- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: changes a score (after ``scale``, ``softcap``
  and ALiBi); returning ``-inf`` masks the key.
- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where query ``q_idx`` may see key ``kv_idx``.

torch evaluates them one score at a time under ``vmap``. attnkit evaluates them once per block, on
index tensors that broadcast against the block: ``b`` ``(B, 1, 1, 1)``, ``h`` ``(1, H, 1, 1)``,
``q_idx`` ``(1, 1, bq, 1)`` and ``kv_idx`` ``(1, 1, 1, bk)``, all int64. A function written with
elementwise tensor operations and indexing (``bias[h, q_idx - kv_idx]``,
``doc[q_idx] == doc[kv_idx]``, ``torch.where``) gives the same values either way, in one pass over
the block. A function that broadcasting does not fit (one that raises on the block's shapes, or
returns anything but a 4-D tensor that broadcasts to the block, as a reduction over a dim would) is
evaluated under nested ``torch.vmap`` instead, one score at a time as torch does, more slowly.

Errors name the function and the block: a function that raises, a ``mask_mod`` whose result is not
bool, a ``score_mod`` that changes the block's shape or dtype.

The package: [`evaluate`][attnkit.mods.evaluate] (a mod over a block, and the errors that name
it), [`inspection`][attnkit.mods.inspection] (what a mod does: adds to the score, reads tensors
that need gradients) and [`compiling`][attnkit.mods.compiling] (``torch.compile`` for the blocks of
long calls).
"""

from attnkit.mods.compiling import COMPILE_FROM, compile_block, compiled_or_eager, name_of
from attnkit.mods.evaluate import (
    Block,
    MaskMod,
    ScoreMod,
    at_positions,
    bias,
    bias_grads,
    mask,
    score,
)
from attnkit.mods.inspection import adds_to_score, captured_tensors, tensors_to_train

__all__ = [
    "COMPILE_FROM",
    "Block",
    "MaskMod",
    "ScoreMod",
    "adds_to_score",
    "at_positions",
    "bias",
    "bias_grads",
    "captured_tensors",
    "compile_block",
    "compiled_or_eager",
    "mask",
    "name_of",
    "score",
    "tensors_to_train",
]
