"""Whether this thread's call is being traced by ``torch.compile`` or ``torch.export``, where
attnkit keeps to what the tracer can follow (no C++ kernels, no reads of tensors into Python)."""

from __future__ import annotations

import torch
from torch._guards import TracingContext


def traced() -> bool:
    """Whether the calling thread is being traced: under dynamo (which takes this as True), or in
    the rest of a compile or export in this thread (AOTAutograd, ``make_fx``).

    Not ``torch.compiler.is_compiling()`` alone: torch holds that flag True for the whole process
    while any thread compiles, so another thread's eager call would take the traced path (its
    mods uncompiled, its kernels and checks skipped) and round apart from the same call made later.
    """
    if torch.compiler.is_dynamo_compiling():
        return True
    return torch.compiler.is_compiling() and TracingContext.try_get() is not None
