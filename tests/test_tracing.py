"""Whether a call is traced: true inside ``torch.compile`` in the thread that compiles, never in
another thread that runs eagerly meanwhile."""

from __future__ import annotations

import threading

import torch

from attnkit._tracing import traced
from attnkit.mods import compile_block


def test_a_call_under_dynamo_is_traced_and_an_eager_one_is_not():
    compiled = torch.compile(lambda x: x * 2 if traced() else x, fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(compiled(x), x * 2)
    assert traced() is False


def test_another_threads_compile_leaves_this_threads_calls_eager():
    """torch holds ``is_compiling()`` True process-wide while any thread compiles: a call made
    meanwhile in another thread is not traced, and still compiles the mods of its blocks."""
    inside, release = threading.Event(), threading.Event()

    def waiting_backend(graph, example_inputs):  # holds the other thread inside its compile
        inside.set()
        release.wait(60)
        return graph.forward

    other = threading.Thread(
        target=lambda: torch.compile(lambda x: x + 1, backend=waiting_backend)(torch.ones(2))
    )
    other.start()

    def relative(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    try:
        assert inside.wait(60), "the other thread never reached its compile"
        assert torch.compiler.is_compiling()  # torch's flag, seen from this thread too
        here, block_function = traced(), compile_block(relative)
    finally:
        release.set()
        other.join()
    assert here is False
    assert block_function is not relative  # the wrapper that compiles where that pays
