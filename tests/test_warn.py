"""attnkit._warn: a warning attnkit raises points at the user's line, not at attnkit's or torch's."""

from __future__ import annotations

import warnings

import torch

import attnkit
from attnkit import _warn


def test_frames_of_attnkit_torch_and_pythons_machinery_are_inside():
    assert _warn._inside(attnkit.__file__)
    assert _warn._inside(torch.nn.Module.__call__.__code__.co_filename)
    assert _warn._inside("<frozen importlib._bootstrap>")
    assert not _warn._inside(__file__)


def test_the_warning_names_the_callers_line():
    def users_code():
        _warn.warn("slower here", RuntimeWarning)  # the line the user sees

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        users_code()
    (warning,) = caught
    assert warning.category is RuntimeWarning and str(warning.message) == "slower here"
    assert warning.filename == __file__
    assert warning.lineno == users_code.__code__.co_firstlineno + 1
