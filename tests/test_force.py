"""attnkit.force: each path forced whatever the CPU, as which_backend reports it; forced
paths nest; an unknown path is refused."""

from __future__ import annotations

import pytest
import torch

from attnkit import force
from attnkit.functional import which_backend
from attnkit.kernels import cpu as _cpu
from helpers.devices import expected_products


def qkv(dtype=torch.float32):
    return torch.randn(1, 2, 9, 8, dtype=dtype), *torch.randn(2, 1, 2, 11, 8, dtype=dtype)


# the path, and what each question of the module answers inside it
ANSWERS = {
    "tiled:loop": {"loop_only": True, "half_products": False, "portable_pairs": False},
    "tiled:half": {"loop_only": False, "half_products": True, "portable_pairs": False},
    "tiled:portable": {"loop_only": False, "half_products": True, "portable_pairs": True},
    "tiled:half-loop": {"loop_only": True, "half_products": True, "portable_pairs": False},
    "chunked:torch": {"loop_only": False, "half_products": False, "torch_chunks": True},
    "sparse:gather": {"loop_only": False, "torch_chunks": False, "gather_only": True},
}


def test_every_path_is_listed_and_nothing_is_forced_outside():
    assert set(force.PATHS) == set(ANSWERS)
    assert force.current() is None
    assert not (force.loop_only() or force.half_products() or force.portable_pairs())
    assert not (force.torch_chunks() or force.gather_only())


@pytest.mark.parametrize("path", force.PATHS)
def test_inside_a_forced_path_the_module_answers_for_it(path):
    with force.forced(path):
        assert force.current() == path
        answers = {name: getattr(force, name)() for name in ANSWERS[path]}
    assert answers == ANSWERS[path]
    assert force.current() is None


@pytest.mark.parametrize("path", force.PATHS)
def test_which_backend_reports_the_forced_path_for_bf16_inputs(path):
    """bf16 inputs: the loop's bf16 products, or the C++ kernel's (AVX512-BF16 or portable)."""
    q, k, v = qkv(torch.bfloat16)
    with force.forced(path):
        choice = which_backend(q, k, v, backend="tiled")
    assert choice.backend == "tiled"
    if path == "tiled:loop":  # bf16 products where the CPU multiplies bf16 fast, else float32
        fast = _cpu.fast_half_products(torch.bfloat16)
        assert (choice.path, choice.products) == ("loop", "bfloat16" if fast else "float32")
    else:
        assert (choice.path, choice.products) == expected_products(path)


@pytest.mark.parametrize("path", force.PATHS)
def test_float32_inputs_keep_float32_products_on_every_path(path):
    q, k, v = qkv()
    with force.forced(path):
        choice = which_backend(q, k, v, backend="tiled")
    loop = path in ("tiled:loop", "tiled:half-loop")
    assert (choice.path, choice.products) == ("loop" if loop else "native", "float32")


def test_outside_any_forced_path_float32_runs_the_kernel():
    q, k, v = qkv()
    assert which_backend(q, k, v, backend="tiled").path == "native"  # it builds on every test CPU


def test_forced_paths_nest_the_innermost_winning_and_unwind_on_errors():
    q, k, v = qkv(torch.bfloat16)
    with force.forced("tiled:loop"):
        with force.forced("tiled:portable"):
            assert force.current() == "tiled:portable"
            assert which_backend(q, k, v, backend="tiled").products == "bf16-portable"
        assert force.current() == "tiled:loop"
        assert which_backend(q, k, v, backend="tiled").path == "loop"
        with pytest.raises(RuntimeError, match="inside"), force.forced("tiled:half"):
            raise RuntimeError("inside")
        assert force.current() == "tiled:loop"
    assert force.current() is None


@pytest.mark.parametrize("path", ["tiled", "loop", "tiled:native", "TILED:LOOP", ""])
def test_an_unknown_path_is_refused_naming_the_known_ones(path):
    message = rf"unknown path {path!r}; choose one of 'tiled:loop', "
    with pytest.raises(ValueError, match=message), force.forced(path):
        pass
    assert force.current() is None


def test_block_and_piece_sizes_nest_and_refuse_what_is_not_a_size():
    from attnkit.distributed.plan import KEY_PIECE, QUERY_PIECE, piece_sizes
    from attnkit.functional import checked_call
    from attnkit.tiled.plans import route_of

    q = torch.randn(1, 2, 8, 4)
    with force.blocks(3, 5):
        assert route_of(checked_call(q, q, q))[3:5] == (3, 5)
        with force.blocks(16, 32, tile_bytes=64):
            assert route_of(checked_call(q, q, q))[3:] == (16, 32, 64)
        assert route_of(checked_call(q, q, q))[3:5] == (3, 5)
    assert piece_sizes() == (KEY_PIECE, QUERY_PIECE)
    with force.pieces(4):
        assert piece_sizes() == (4, QUERY_PIECE)
    for bad in (0, -1, 2.5, True):
        with (
            pytest.raises(ValueError, match="block_q must be a positive int"),
            force.blocks(bad, 8),
        ):
            pass
        with pytest.raises(ValueError, match="key_piece must be a positive int"), force.pieces(bad):
            pass
        with pytest.raises(ValueError, match="min_keys must be a positive int"), force.splits(bad):
            pass
    assert force.split_size() is None
    with force.splits(16):
        with force.splits(4):
            assert force.split_size() == 4
        assert force.split_size() == 16
    assert force.split_size() is None
