"""The protocol every backend follows, and the route inside one.

The registry ([`attnkit.backends`][attnkit.backends]) asks each [`Backend`][attnkit.backends.base.Backend]
whether it can run a checked [`Call`][attnkit.call.Call], and whether it is faster there than the
one before it; the backend that wins runs it and returns an
[`AttentionOutput`][attnkit.call.AttentionOutput].
"""

from __future__ import annotations

from typing import Any, NamedTuple

from attnkit.call import AttentionOutput, Call


class Route(NamedTuple):
    """The code inside a backend that runs a call, as
    [`attnkit.functional.which_backend`][attnkit.functional.which_backend] names it.

    Attributes:
        path: ``"native"`` (a C++ kernel), ``"loop"`` (tiled's PyTorch loop), ``"torch"`` (torch's
            own kernel) or ``"float64"`` (the reference).
        products: the dtype of the block products (with bf16 in tiled's C++ kernel, also how:
            ``"bf16-avx512_bf16"``), or None where torch or inductor chooses.
    """

    path: str
    products: str | None = None


class Backend:
    """A way to compute attention, as the registry sees it: a name, the options it computes
    exactly, and four questions. A backend module defines one subclass and one instance of it."""

    name: str = ""
    supports: frozenset[str] = frozenset()
    looks_at_values: bool = False
    """Whether it keeps the NaN rule by a look at the values of q and k
    ([`inputs_finite`][attnkit.rules.nonfinite.inputs_finite]), where its kernel would not: the
    registry makes that look once, before it runs, and hands the answer in ``Call.finite``."""
    reads_padding: bool = True
    """Whether its computation reads the values of padded keys (``key_mask`` False), so that the
    registry zeroes them before it runs (a weight of 0 times a NaN there is still NaN); False for
    a kernel that skips them."""

    def refuses(self, call: Call) -> str | None:
        """Why it cannot run ``call`` (device, dtype, sizes, gradients, a transform, tracing, a
        kernel that cannot be had), or None. Never builds or loads anything."""
        return None

    def plan(self, call: Call) -> Any:
        """What its ``run`` needs to know of ``call`` beyond the call itself (its route, sizes),
        worked out once while it is chosen and handed to ``faster_than``, ``path`` and ``run``;
        None for a backend that needs nothing. Never builds or loads anything."""
        return None

    def may_be_faster(self, call: Call) -> bool:
        """A quick look before ``faster_than``, on every call ``auto`` gives another backend:
        False where no speed rule of this one can apply (then its plan is not worked out)."""
        return True

    def faster_than(self, other: Backend, call: Call, plan: Any = None) -> str | None:
        """Why it runs ``call`` faster than ``other``, which ``auto`` would take before it (None if
        it does not): its own speed rule, beside its kernel."""
        return None

    def path(self, call: Call, plan: Any = None) -> Route:
        """The code inside it that would run ``call``."""
        raise NotImplementedError

    def run(self, call: Call, plan: Any = None) -> AttentionOutput:
        """Compute ``call``, with its ``plan`` (worked out again if not given)."""
        raise NotImplementedError

    def memory(self, call: Call) -> tuple[int, str]:
        """The bytes it would hold for ``call`` at once besides the inputs, at least, and what
        they are (checked against the machine's memory before it runs): by default, the results."""
        return result_bytes(call), "the results"

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"


def result_bytes(call: Call) -> int:
    """The bytes of the results ``call`` returns: the output, the lse, and the weights if asked."""
    b, h, t, _ = call.q.shape
    size = call.q.element_size()
    total = b * h * t * (call.v.shape[-1] * size + 4)
    if call.return_weights:
        total += b * h * t * call.k.shape[2] * size
    return total
