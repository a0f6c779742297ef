"""KVCache on its own: position order, windows, ragged rows, memory, and every error."""

from __future__ import annotations

import pytest
import torch

from attnkit import KVCache
from helpers.devices import CUDA


def chunks(b, h, n, d, start, dtype=torch.float32, device="cpu"):
    """Keys whose every entry is its absolute position, so order is visible; values the negation."""
    k = torch.arange(start, start + n, dtype=dtype, device=device)
    k = k.view(1, 1, n, 1).expand(b, h, n, d).clone()
    return k, -k


def positions_of(k):
    return k[0, 0, :, 0].tolist()


def test_update_returns_every_key_in_position_order_and_counts_tokens(device):
    cache = KVCache(2, 3, max_len=20, head_dim=4, device=device)
    seen = 0
    for n in (5, 1, 3, 1, 1):
        k_all, v_all = cache.update(*chunks(2, 3, n, 4, seen, device=device))
        seen += n
        assert positions_of(k_all) == list(range(seen))
        assert torch.equal(v_all, -k_all)
        assert (cache.size, cache.position) == (seen, seen)
    assert cache.key_mask is None
    cache.reset()
    assert (cache.size, cache.position) == (0, 0)
    k_all, _ = cache.update(*chunks(2, 3, 2, 4, 0, device=device))
    assert positions_of(k_all) == [0, 1]


@pytest.mark.parametrize("window,max_chunk", [(4, 1), (4, 3), (5, 5), (1, 2)])
def test_windowed_cache_returns_the_last_window_minus_one_plus_the_chunk(window, max_chunk, device):
    cache = KVCache(
        1, 2, max_len=100, head_dim=3, window=window, max_chunk=max_chunk, device=device
    )
    assert cache.capacity == window - 1 + max_chunk
    seen = 0
    for n in [max_chunk, 1, max_chunk, 1, 1, max_chunk, 1, 1, 1, max_chunk, 1]:
        k_all, v_all = cache.update(*chunks(1, 2, n, 3, seen, device=device))
        seen += n
        first = max(0, seen - n - (window - 1))
        assert positions_of(k_all) == list(range(first, seen))
        assert torch.equal(v_all, -k_all)
        assert cache.position == seen and cache.size <= cache.capacity


def test_memory_gqa_is_a_third_and_a_window_is_its_share_of_max_len():
    def nbytes(cache):
        return cache.keys.nbytes + cache.values.nbytes

    full = KVCache(1, 12, 8192, 64)
    assert nbytes(KVCache(1, 4, 8192, 64)) * 3 == nbytes(full)
    windowed = KVCache(1, 12, 8192, 64, window=1024, max_chunk=256)
    assert nbytes(windowed) * 8192 == nbytes(full) * (1024 - 1 + 256)
    assert nbytes(KVCache(1, 12, 8192, 64, dtype=torch.bfloat16)) * 2 == nbytes(full)


def test_buffers_are_preallocated_non_persistent_and_move_with_the_module(device):
    cache = KVCache(1, 2, 16, 4, dtype=torch.bfloat16, device=device)
    assert cache.state_dict() == {}
    before = cache.keys.data_ptr()
    k_all, _ = cache.update(*chunks(1, 2, 3, 4, 0, torch.bfloat16, device))
    assert cache.keys.data_ptr() == before and k_all.data_ptr() == before  # a view, no copy
    assert cache.to(torch.float32).dtype == torch.float32


def test_stored_keys_are_detached(device):
    cache = KVCache(1, 1, 4, 2, device=device)
    k = torch.randn(1, 1, 2, 2, requires_grad=True, device=device)
    k_all, _ = cache.update(k, k.detach())
    assert not k_all.requires_grad


def test_ragged_rows_keep_their_key_mask_and_count_their_own_positions(device):
    cache = KVCache(2, 1, 10, 2, device=device)
    key_mask = torch.tensor([[True, True, True], [False, False, True]], device=device)
    assert cache.next_positions(3, key_mask).tolist() == [[0, 1, 2], [0, 0, 0]]
    cache.update(*chunks(2, 1, 3, 2, 0, device=device), key_mask=key_mask)
    assert cache.next_positions(2).tolist() == [[3, 4], [1, 2]]
    cache.update(*chunks(2, 1, 1, 2, 3, device=device))
    assert cache.key_mask.tolist() == [[True] * 4, [False, False, True, True]]
    assert cache.row_positions.tolist() == [4, 2]


BAD_CHUNKS = [
    (lambda: chunks(3, 2, 1, 4, 0), ValueError, r"batch_size=2, num_kv_heads=2, n, head_dim=4"),
    (lambda: chunks(2, 3, 1, 4, 0), ValueError, r"got shape \(2, 3, 1, 4\)"),
    (lambda: chunks(2, 2, 1, 5, 0), ValueError, r"head_dim=4\), got shape \(2, 2, 1, 5\)"),
    (
        lambda: (torch.zeros(2, 2, 4), torch.zeros(2, 2, 4)),
        ValueError,
        r"got shape \(2, 2, 4\)",
    ),
    (
        lambda: chunks(2, 2, 1, 4, 0, torch.float64),
        TypeError,
        "dtype torch.float64 but the cache",
    ),
    (lambda: (torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 2, 4)), ValueError, "same shape"),
    (  # k fits, v does not: v is named
        lambda: (torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4, dtype=torch.float64)),
        TypeError,
        "v has dtype torch.float64 but the cache holds torch.float32",
    ),
    (
        lambda: (torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4, device="meta")),
        ValueError,
        "v is on meta but the cache is on cpu",
    ),
    (  # not "build the cache with dtype=torch.int32", which the constructor refuses
        lambda: chunks(2, 2, 1, 4, 0, torch.int32),
        TypeError,
        r"dtype torch\.int32 but the cache holds torch\.float32; keys and values have a floating",
    ),
    (lambda: chunks(2, 2, 0, 4, 0), ValueError, "at least one token, got 0"),
    (lambda: chunks(2, 2, 7, 4, 0), ValueError, r"7 tokens is longer than max_chunk \(6\)"),
    (lambda: ("k", torch.zeros(1)), TypeError, "k must be a torch.Tensor, got str"),
]


@pytest.mark.parametrize(
    "make_chunk,error,message,device",
    [
        *(pytest.param(*case, torch.device("cpu")) for case in BAD_CHUNKS),
        pytest.param(  # a chunk on the CPU for a cache on CUDA: named, never moved
            lambda: chunks(2, 2, 1, 4, 0),
            ValueError,
            "k is on cpu but the cache is on cuda",
            torch.device("cuda"),
            id="cpu chunk-cuda cache",
            marks=CUDA.marks,
        ),
    ],
)
def test_bad_chunks_raise_naming_what_is_wrong(make_chunk, error, message, device):
    cache = KVCache(2, 2, max_len=10, head_dim=4, max_chunk=6, device=device)
    with pytest.raises(error, match=message):
        cache.update(*make_chunk())


def test_overflow_raises_and_reset_makes_room(device):
    cache = KVCache(1, 1, max_len=4, head_dim=2, device=device)
    cache.update(*chunks(1, 1, 3, 2, 0, device=device))
    with pytest.raises(ValueError, match=r"full: 3 tokens seen \+ 2 new > max_len \(4\)"):
        cache.update(*chunks(1, 1, 2, 2, 3, device=device))
    cache.reset()
    cache.update(*chunks(1, 1, 4, 2, 0, device=device))


def test_a_windowed_cache_also_stops_at_max_len():
    cache = KVCache(1, 1, max_len=6, head_dim=2, window=2, max_chunk=1)
    for i in range(6):
        cache.update(*chunks(1, 1, 1, 2, i))
    with pytest.raises(ValueError, match="max_len"):
        cache.update(*chunks(1, 1, 1, 2, 6))


def test_bad_key_mask_raises():
    cache = KVCache(2, 1, max_len=4, head_dim=2)
    with pytest.raises(TypeError, match="key_mask must be a bool tensor"):
        cache.update(*chunks(2, 1, 2, 2, 0), key_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"key_mask must have shape .* \(2, 2\), got \(2, 3\)"):
        cache.update(*chunks(2, 1, 2, 2, 0), key_mask=torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"max_len": 0}, ValueError, "max_len"),
        ({"window": 0}, ValueError, "window"),
        ({"max_chunk": -1}, ValueError, "max_chunk"),
        ({"dtype": torch.int64}, TypeError, "floating-point torch.dtype, got torch.int64"),
        ({"dtype": "float32"}, TypeError, "floating-point torch.dtype"),
    ],
)
def test_bad_construction_raises(kwargs, error, message):
    args = {"batch_size": 1, "num_kv_heads": 1, "max_len": 8, "head_dim": 2} | kwargs
    with pytest.raises(error, match=message):
        KVCache(**args)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("sometimes", [False, True], ids=["asked each step", "asked sometimes"])
def test_nonfinite_keys_records_the_rows_of_the_keys_each_update_returns(
    window, sometimes, device, monkeypatch
):
    """The record of the keys' non-finite rows follows the keys through updates, the window's
    shifts, get and reset, whether or not it is asked for after each update, and each key is
    looked at once (again only after a reset, or where a shift left the record behind)."""
    from attnkit import cache as cache_module

    looked = []
    rows = cache_module.nonfinite_rows
    monkeypatch.setattr(
        cache_module, "nonfinite_rows", lambda x: looked.append(x.shape[2]) or rows(x)
    )
    cache = KVCache(2, 3, 40, 5, window=window, max_chunk=3, device=device)
    generator = torch.Generator().manual_seed(0)
    arrived = 0
    for step, n in enumerate([3, 1, 2, 3, 1, 1, 3, 2] * 2):
        if step == 8:
            cache.reset()
        k = torch.randn(2, 3, n, 5, generator=generator)
        k[torch.rand(2, 3, n, generator=generator) < 0.2, 1] = [torch.nan, torch.inf][step % 2]
        k_all, _ = cache.update(k.to(device), k.to(device))
        arrived += n
        if sometimes and step % 3 == 2:  # not asked for after this update
            continue
        assert torch.equal(cache.nonfinite_keys(), ~torch.isfinite(k_all).all(dim=-1))
        assert torch.equal(cache.nonfinite_keys(), ~torch.isfinite(k_all).all(dim=-1))
        held, _ = cache.get()
        assert torch.equal(cache.nonfinite_keys(), ~torch.isfinite(held).all(dim=-1))
    if not sometimes or window is None:  # each key once
        assert sum(looked) == arrived
    else:  # and a window's kept keys again where the record was behind when they moved
        assert arrived < sum(looked) < 2 * arrived


def test_nonfinite_keys_looks_again_after_a_cast_or_a_compiled_steps_writes(device):
    cache = KVCache(1, 1, 8, 2, device=device)
    big = torch.full((1, 1, 2, 2), 1e5, device=device)  # finite in float32, not in float16
    cache.update(big, big)
    assert not cache.nonfinite_keys().any()
    cache.half().float()  # 1e5 -> inf -> inf
    cache.get()
    assert cache.nonfinite_keys().all()
    one = torch.ones(1, 1, 1, 2, device=device)
    cache.update_static(one, one)  # the slot filled as a compiled step fills it
    assert cache.nonfinite_keys().shape == (1, 1, 8) and not cache.nonfinite_keys()[0, 0, 2]
    nan = torch.full((1, 1, 1, 2), torch.nan, device=device)
    k_all, _ = cache.update(nan, nan)  # an eager step after it: slot 3, recorded past the keys
    assert torch.equal(
        cache.nonfinite_keys(), torch.tensor([[[True, True, False, True]]], device=device)
    )
    assert k_all.shape[2] == 4
