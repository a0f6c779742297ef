"""attnkit.call: the call as data. `Options` holds attention()'s keywords that are not tensors,
with attention()'s defaults; which_backend and checked_call take the same keywords."""

from __future__ import annotations

import inspect

import pytest
import torch

from attnkit.call import TENSOR_KEYWORDS, Call, Options
from attnkit.functional import attention, checked_call, which_backend


def test_options_and_the_tensor_keywords_are_attentions_keywords_with_its_defaults():
    keywords = {
        name: p.default
        for name, p in inspect.signature(attention).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    }
    assert set(Options._fields) | set(TENSOR_KEYWORDS) == set(keywords)
    assert not set(Options._fields) & set(TENSOR_KEYWORDS)
    assert Options()._asdict() == {name: keywords[name] for name in Options._fields}


def test_options_or_keywords_make_the_same_call():
    q = torch.randn(1, 2, 6, 8)
    slopes = torch.rand(2)
    by_options = checked_call(q, q, q, Options(causal=True, softcap=3.0), alibi_slopes=slopes)
    by_keywords = checked_call(q, q, q, causal=True, softcap=3.0, alibi_slopes=slopes)
    assert by_options == by_keywords
    assert by_options.options == {"causal", "softcap", "alibi_slopes"}


def test_an_unknown_keyword_is_named():
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(
        TypeError, match="which_backend\\(\\) got an unexpected keyword argument 'casual'"
    ):
        which_backend(q, q, q, casual=True)
    with pytest.raises(
        TypeError, match="checked_call\\(\\) got an unexpected keyword argument 'x'"
    ):
        checked_call(q, q, q, x=1)
    assert which_backend(q, q, q, softcap=2.0, backend="reference").backend == "reference"


def test_looked_sets_finite_alone():
    q = torch.randn(1, 2, 3, 4)
    call = checked_call(q, q, q, causal=True, return_lse=True)
    assert Call._fields[-2:] == ("finite", "options")  # what looked's tuple relies on
    looked = call.looked(True)
    assert type(looked) is Call and looked.finite is True
    assert looked == call._replace(finite=True)
