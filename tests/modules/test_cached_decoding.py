"""Decoding with a KVCache equals the full forward: prefill in chunks, token by token, ragged batches,
cross-attention over a cached memory; and the modules' cache errors."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import CrossAttention, KVCache, MultiHeadAttention, RotaryEmbedding
from helpers.devices import CUDA
from helpers.zoo import H

D_IN, D_OUT, T = 24, 32, 13
CONFIGS = {
    "mha": {"num_heads": 4},
    "gqa": {"num_heads": 4, "num_kv_heads": 2},
    "mqa": {"num_heads": 4, "num_kv_heads": 1},
    "rope": {"num_heads": 4, "num_kv_heads": 2, "rope": True},
    "alibi": {"num_heads": 4, "alibi": True},
    "window": {"num_heads": 4, "window": 5},
    "rope+window, head_dim 40": {"num_heads": 2, "rope": True, "window": 4, "d_out": 80},
}
SCHEDULES = {
    "token by token": [1] * T,
    "prompt then tokens": [7] + [1] * 6,
    "mixed chunks": [3, 1, 4, 1, 2, 2],
}


def make(config, device="cpu", **extra):
    config = dict(config) | extra
    d_out = config.pop("d_out", D_OUT)
    # Dropout is set but eval mode turns it off: decoding is inference.
    module = MultiHeadAttention(D_IN, d_out, 64, 0.4, causal=True, qkv_bias=True, **config)
    return module.eval().to(device)


def cache_for(module, batch_size=2, cache_window=False, max_chunk=None):
    """A cache for ``module``, on its device."""
    window = module.window[0] + 1 if cache_window and module.window is not None else None
    return KVCache(
        batch_size,
        module.num_kv_heads,
        64,
        module.head_dim,
        window=window,
        max_chunk=max_chunk,
        device=module.W_query.weight.device,
    )


def decode(module, x, schedule, cache, key_mask=None):
    outs, start = [], 0
    for n in schedule:
        chunk_mask = None if key_mask is None else key_mask[:, start : start + n]
        outs.append(module(x[:, start : start + n], cache=cache, key_mask=chunk_mask))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize(
    ("schedule", "device"),
    [
        *(
            pytest.param(schedule, torch.device("cpu"), id=f"{name}-cpu")
            for name, schedule in SCHEDULES.items()
        ),
        pytest.param(
            SCHEDULES["mixed chunks"],
            torch.device("cuda"),
            id="mixed chunks-cuda",
            marks=CUDA.marks,
        ),
    ],
)
@pytest.mark.parametrize("cache_window", [False, True], ids=["full cache", "window cache"])
def test_decoding_equals_the_full_forward(config, schedule, device, cache_window):
    module = make(config, device)
    x = torch.randn(2, T, D_IN, device=device)
    with torch.no_grad():
        full = module(x)
        cache = cache_for(module, cache_window=cache_window, max_chunk=max(schedule))
        decoded = decode(module, x, schedule, cache)
    torch.testing.assert_close(decoded, full, atol=1e-5, rtol=1e-5)
    assert cache.position == T


def test_weights_with_a_cache_are_the_rows_of_the_full_weights(device):
    module = make(CONFIGS["gqa"], device)
    x = torch.randn(1, 6, D_IN, device=device)
    with torch.no_grad():
        _, full = module(x, need_weights=True)
        cache = cache_for(module, batch_size=1)
        module(x[:, :4], cache=cache)
        _, step = module(x[:, 4:5], cache=cache, need_weights=True)
    torch.testing.assert_close(step[:, 0], full[:, 4, :5])


@pytest.mark.parametrize(
    "config", ["gqa", "rope", "alibi", "window", "rope+window, head_dim 40"], ids=str
)
def test_a_ragged_batch_decodes_like_each_prompt_alone(config, device):
    module = make(CONFIGS[config], device)
    lengths, new = [7, 4, 1], 5
    width = max(lengths)
    prompts = [torch.randn(1, n, D_IN, device=device) for n in lengths]
    tokens = torch.randn(len(lengths), new, D_IN, device=device)
    x = torch.zeros(len(lengths), width, D_IN, device=device)
    key_mask = torch.zeros(len(lengths), width, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):  # left padding
        x[row, width - prompt.shape[1] :] = prompt[0]
        key_mask[row, width - prompt.shape[1] :] = True
    with torch.no_grad():
        cache = cache_for(module, batch_size=len(lengths))
        batched = [module(x, cache=cache, key_mask=key_mask)[:, -1]]
        batched += [module(tokens[:, i : i + 1], cache=cache)[:, 0] for i in range(new)]
        # The same ragged prompts without a cache: positions come from the key mask too.
        no_cache = module(
            torch.cat([x, tokens], dim=1),
            key_mask=torch.cat(
                [key_mask, torch.ones(len(lengths), new, dtype=torch.bool, device=device)], dim=1
            ),
        )
        for row, prompt in enumerate(prompts):
            alone = cache_for(module, batch_size=1)
            expected = [module(prompt, cache=alone)[:, -1]]
            expected += [
                module(tokens[row : row + 1, i : i + 1], cache=alone)[:, 0] for i in range(new)
            ]
            for got, want in zip(batched, expected):
                torch.testing.assert_close(got[row], want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                no_cache[row, width - 1 :], torch.cat(expected), atol=1e-5, rtol=1e-5
            )


def test_leading_padding_queries_give_zeros_not_nan(device):
    module = make(CONFIGS["rope"], device)
    key_mask = torch.tensor([[False, False, True]], device=device)
    with torch.no_grad():
        x = torch.randn(1, 3, D_IN, device=device)
        out = module(x, cache=cache_for(module, 1), key_mask=key_mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], module.out_proj.bias)  # zero context -> the bias alone


def test_bf16_cache_decodes_close_to_fp32(device):
    module = make(CONFIGS["gqa"], device)
    x = torch.randn(1, 9, D_IN, device=device)
    with torch.no_grad():
        full = module(x)
        module16 = make(CONFIGS["gqa"], device).to(torch.bfloat16)
        module16.load_state_dict(module.state_dict())
        cache = KVCache(1, 2, 16, module.head_dim, dtype=torch.bfloat16, device=device)
        decoded = decode(module16, x.bfloat16(), [4, 1, 1, 1, 1, 1], cache)
    torch.testing.assert_close(decoded.float(), full, atol=5e-2, rtol=5e-2)


def test_cross_attention_computes_the_memory_once_and_reuses_it(device):
    cross = CrossAttention(D_IN, 20, D_OUT, 4, dropout=0.5).eval().to(device)
    x, memory = torch.randn(2, 6, D_IN, device=device), torch.randn(2, 9, 20, device=device)
    key_mask = torch.rand(2, 9, device=device) > 0.3
    key_mask[:, 0] = True
    full = cross(x, memory, key_mask=key_mask)
    cache = KVCache(2, 4, 9, cross.head_dim, device=device)
    with torch.no_grad():
        steps = [cross(x[:, :2], memory, cache=cache, key_mask=key_mask)]
        steps += [cross(x[:, i : i + 1], cache=cache) for i in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    assert cache.size == 9  # the memory's keys, once
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"memory is required \(the first call with an emp"):
            cross(x, cache=KVCache(2, 4, 9, cross.head_dim, device=device))
        with pytest.raises(ValueError, match="cache without window"):
            cross(x, memory, cache=KVCache(2, 4, 9, cross.head_dim, window=3, device=device))


@pytest.mark.parametrize(
    "module_kwargs,cache_args,error,message",
    [
        (
            {},
            (3, 4, 64, 8),
            ValueError,
            r"\(batch_size, num_kv_heads, head_dim\) = \(3, 4, 8\), but this call needs \(2, 4, 8\)",
        ),
        ({"num_kv_heads": 2}, (2, 4, 64, 8), ValueError, r"this call needs \(2, 2, 8\)"),
        ({}, (2, 4, 64, 16), ValueError, r"\(2, 4, 16\), but this call needs \(2, 4, 8\)"),
        ({"causal": False}, (2, 4, 64, 8), ValueError, "needs a causal module"),
        ({"window": 6}, (2, 4, 64, 8, 5), ValueError, "window of 5 .* needs window=6"),
        ({}, (2, 4, 64, 8, 5), ValueError, "window of 5 .* needs every position"),
        ({}, (2, 4, 8, 8), ValueError, r"cache \+ x has 10 tokens, longer than context_length"),
    ],
)
def test_module_cache_errors(module_kwargs, cache_args, error, message):
    module = MultiHeadAttention(D_IN, D_OUT, 8, 0.0, 4, **module_kwargs)
    window = cache_args[4] if len(cache_args) > 4 else None
    cache = KVCache(*cache_args[:4], window=window)
    with pytest.raises(error, match=message), torch.no_grad():
        module(torch.randn(2, 6, D_IN), cache=cache)
        module(torch.randn(2, 4, D_IN), cache=cache)


def test_module_cache_type_and_dtype_errors():
    module = MultiHeadAttention(D_IN, D_OUT, None, 0.0, 4)
    with pytest.raises(TypeError, match=r"cache must be an attnkit\.KVCache, got dict"):
        module(torch.randn(1, 2, D_IN), cache={})
    cache = KVCache(1, 4, 8, 8, dtype=torch.bfloat16)
    with (
        pytest.raises(TypeError, match=r"dtype torch\.float32 but the cache holds torch\.bfloat16"),
        torch.no_grad(),
    ):
        module(torch.randn(1, 2, D_IN), cache=cache)


def test_rope_option_errors():
    with pytest.raises(ValueError, match="rope has head_dim 16 but this module's heads are 8"):
        MultiHeadAttention(D_IN, D_OUT, None, 0.0, 4, rope=RotaryEmbedding(16))
    with pytest.raises(TypeError, match="rope must be a bool or a RotaryEmbedding, got str"):
        MultiHeadAttention(D_IN, D_OUT, None, 0.0, 4, rope="yes")
    module = MultiHeadAttention(D_IN, D_OUT, None, 0.0, 4, rope=RotaryEmbedding(8, max_len=4))
    with pytest.raises(ValueError, match=r"position 4 is beyond the rotary table \(max_len=4\)"):
        module(torch.randn(1, 5, D_IN))


def test_the_module_decodes_with_a_relative_bias_as_its_full_forward(device):
    mha = attnkit.MultiHeadAttention(32, 32, 64, 0.0, H, num_kv_heads=2, rope=True)
    mha = mha.eval().to(device)
    table = torch.randn(H, 2 * 64 - 1, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 63]

    def local(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 9

    x = torch.randn(2, 20, 32, device=device)
    with torch.no_grad():
        full = mha(x, score_mod=score_mod, mask_mod=local)
        cache = attnkit.KVCache(2, 2, max_len=64, head_dim=8, device=device)
        steps = [mha(x[:, :7], cache=cache, score_mod=score_mod, mask_mod=local)]
        steps += [
            mha(x[:, i : i + 1], cache=cache, score_mod=score_mod, mask_mod=local)
            for i in range(7, 20)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


@pytest.mark.parametrize("config", ["gqa", "mqa"])
def test_a_non_finite_token_reaches_the_decoded_rows_that_see_it(config, device):
    """A token whose key holds an infinity: every later row is NaN, the rows before it are not,
    each row as the last row of the full forward of its prefix (on a GPU the cache's record of
    its keys' rows decides, on a CPU the decode kernel's look). Not the whole full forward: torch's
    SDPA lets a NaN value reach the rows that the causal mask hides it from, as attnkit's rule
    allows outside its own kernels."""
    module = make(CONFIGS[config], device)
    x = torch.randn(2, T, D_IN, device=device)
    x[0, 3, :] = torch.inf
    with torch.no_grad():
        decoded = decode(module, x, SCHEDULES["mixed chunks"], cache_for(module, max_chunk=4))
        last_rows = torch.stack([module(x[:, : i + 1])[:, -1] for i in range(T)], dim=1)
    torch.testing.assert_close(decoded, last_rows, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert decoded[0, 3:].isnan().all() and torch.isfinite(decoded[0, :3]).all()
    assert torch.isfinite(decoded[1]).all()
