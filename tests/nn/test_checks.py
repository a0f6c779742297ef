"""attnkit.nn.checks: the drop-in refuses what torch's nn.MultiheadAttention refuses, in torch's
words, with errors that are both attnkit's ValueError and torch's class."""

from __future__ import annotations

import pytest
import torch

from attnkit.nn import MultiheadAttention
from attnkit.nn.checks import MaskError, ShapeError

E, H, N, L, S = 8, 4, 3, 5, 7
X = torch.randn(N, L, E)
KV = torch.randn(N, S, E)

CASES = {  # name: (module options, call arguments, torch's class, the words of both)
    "embedding of another size": (
        {}, (torch.randn(N, L, E - 1),) * 3, AssertionError,
        "was expecting embedding dimension of 8, but got 7",
    ),
    "unbatched query, batched keys": (
        {}, (torch.randn(L, E), KV, KV), AssertionError,
        r"For unbatched \(2-D\) `query`, expected `key` and `value` to be 2-D but found 3-D and 3-D",
    ),
    "a 4-D query": (
        {}, (X[None], KV[None], KV[None]), AssertionError,
        "query should be unbatched 2D or batched 3D tensor but received 4-D query tensor",
    ),
    "keys and values that do not pair": (
        {}, (X, KV, KV[:, :-1]), AssertionError, "key shape .* does not match value shape",
    ),
    "a 3-D mask of (N, L, S)": (
        {"attn_mask": torch.zeros(N, L, S, dtype=torch.bool)}, (X, KV, KV), RuntimeError,
        r"The shape of the 3D attn_mask is torch.Size\(\[3, 5, 7\]\), but should be \(12, 5, 7\)",
    ),
    "a 2-D mask of another length": (
        {"attn_mask": torch.zeros(L, S + 1, dtype=torch.bool)}, (X, KV, KV), RuntimeError,
        r"The shape of the 2D attn_mask is torch.Size\(\[5, 8\]\), but should be \(5, 7\)",
    ),
    "a 1-D padding mask": (
        {"key_padding_mask": torch.zeros(S, dtype=torch.bool)}, (X, KV, KV), AssertionError,
        "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead",
    ),
    "a padding mask of another length": (
        {"key_padding_mask": torch.zeros(N, S + 1, dtype=torch.bool)}, (X, KV, KV), AssertionError,
        r"Expected key_padded_mask.shape\[1\] to be 7, but got 8",
    ),
    "a padding mask of another batch": (
        {"key_padding_mask": torch.zeros(N + 1, S, dtype=torch.bool)}, (X, KV, KV), AssertionError,
        r"Expected key_padded_mask.shape\[0\] to be 3, but got 4",
    ),
    "is_causal without a mask": (
        {"is_causal": True}, (X, X, X), RuntimeError,
        "Need attn_mask if specifying the is_causal hint",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_refused_as_torch_refuses_it_in_its_words(case):
    options, args, torchs, words = CASES[case]
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(torchs, match=words):
        theirs(*args, **options)
    with pytest.raises(torchs, match=words) as raised:
        ours(*args, **options)
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value, ShapeError if torchs is AssertionError else MaskError)


def test_a_mask_of_another_kind_is_named():
    ours = MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(TypeError, match="only bool and floating types of key_padding_mask"):
        ours(X, KV, KV, key_padding_mask=torch.zeros(N, S, dtype=torch.long))


def test_inputs_of_another_dtype_than_the_weights_are_refused_as_torchs():
    """A bias of another dtype is taken in the inputs' (torch's layer takes it); inputs of another
    dtype than the weights are not, by either."""
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = MultiheadAttention(E, H, batch_first=True)
    x = X.double()
    for module in (theirs, ours):
        with pytest.raises(RuntimeError, match="dtype"):
            module(x, x, x)
