"""attnkit.kv_memory: each preset's cache against a count by hand, every kind of layer, a
config.json's fields as Hugging Face writes them, the plain-MHA baseline, and bad configs named."""

from __future__ import annotations

import pytest

from attnkit.kv_memory import PRESETS, CacheMemory, LayerCache, as_mha, from_config

BF16 = 2
MiB = 2**20

# per preset: bytes per token (the first tokens) and bytes at 32768 tokens, counted by hand
BY_HAND = {
    "gpt2": (12 * 2 * 12 * 64 * BF16, 12 * 2 * 12 * 64 * BF16 * 32768),
    "llama-3-8b": (32 * 2 * 8 * 128 * BF16, 32 * 2 * 8 * 128 * BF16 * 32768),
    # every layer slides over 4096 tokens
    "mistral-7b": (32 * 2 * 8 * 128 * BF16, 32 * 2 * 8 * 128 * BF16 * 4096),
    # 20 layers of their own (16 sliding over 512, 4 full), the last 15 share theirs
    "gemma-3n-e4b": (
        20 * 2 * 2 * 256 * BF16,
        16 * 2 * 2 * 256 * BF16 * 512 + 4 * 2 * 2 * 256 * BF16 * 32768,
    ),
    # one latent of 512 and a RoPE key of 64 a token and layer
    "deepseek-v3": (61 * (512 + 64) * BF16, 61 * (512 + 64) * BF16 * 32768),
    # 12 softmax layers (2 heads of 256), 36 linear: a float32 state of 32 heads of 128 x 128
    # and 3 of the convolution's inputs of 2 x 16 x 128 + 32 x 128 channels
    "qwen3-next-80b-a3b": (
        12 * 2 * 2 * 256 * BF16,
        12 * 2 * 2 * 256 * BF16 * 32768 + 36 * (32 * 128 * 128 * 4 + 8192 * 3 * BF16),
    ),
}


def test_every_preset_is_counted_by_hand():
    assert BY_HAND.keys() == PRESETS.keys()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_matches_the_hand_count(name):
    cache = from_config(PRESETS[name], name=name)
    per_token, at_32k = BY_HAND[name]
    assert cache.name == name
    assert cache.per_token() == per_token
    assert cache.bytes_at(32768) == at_32k
    assert cache.bytes_at(32768, batch=3) == 3 * at_32k


def test_the_kinds_of_layer_are_told_apart():
    assert from_config(PRESETS["gemma-3n-e4b"]).count("shared") == 15
    qwen = from_config(PRESETS["qwen3-next-80b-a3b"])
    assert (qwen.count("full"), qwen.count("linear")) == (12, 36)
    assert qwen.bytes_at(1) - qwen.bytes_at(0) == qwen.per_token()  # the state does not grow
    assert from_config(PRESETS["deepseek-v3"]).count("latent") == 61


def test_a_window_keeps_its_last_tokens_only():
    layer = LayerCache("sliding", per_token=10, window=4, fixed=3)
    assert [layer.bytes_at(t) for t in (0, 2, 4, 9)] == [3, 23, 43, 43]
    assert CacheMemory("two", (layer, layer)).bytes_at(9, batch=2) == 4 * 43


def test_a_config_json_as_hugging_face_writes_it():
    config = {  # a multimodal config: the text model's fields are read
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 512,
            "layer_types": ["linear_attention", "full_attention"] * 2,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
        },
    }
    cache = from_config(config, dtype="fp16", state_dtype="bf16")
    assert cache.name == "qwen3_5_text"
    assert cache.per_token() == 2 * 2 * 2 * 64 * 2  # head_dim 512 / 8
    state = 4 * 16 * 32 * 2 + (2 * 2 * 16 + 4 * 32) * 3 * 2
    assert cache.bytes_at(100) == 100 * cache.per_token() + 2 * state


def test_plain_mha_is_the_same_model_with_every_head_kept():
    mha = from_config(as_mha(PRESETS["llama-3-8b"]))
    assert mha.per_token() == 32 * 2 * 32 * 128 * BF16
    latent = from_config(as_mha(PRESETS["deepseek-v3"]))  # decompressed: keys 192, values 128
    assert latent.per_token() == 61 * 128 * (192 + 128) * BF16
    hybrid = from_config(as_mha(PRESETS["qwen3-next-80b-a3b"]))
    assert hybrid.count("full") == 48 and hybrid.per_token() == 48 * 2 * 16 * 256 * BF16


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        ({"num_attention_heads": 4}, {}, "no num_hidden_layers or n_layer"),
        ({"num_hidden_layers": 2, "num_attention_heads": 0}, {}, "at least 1, got 0"),
        ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 8}, {}, "head_dim"),
        ({"num_hidden_layers": 2, "num_attention_heads": 2}, {}, "no head_dim or hidden_size"),
        (
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "head_dim": 4,
                "layer_types": ["full_attention"],
            },
            {},
            "1 entries for 2 layers",
        ),
        (
            {
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "head_dim": 4,
                "layer_types": ["mamba"],
            },
            {},
            "unknown layer type 'mamba'",
        ),
        (
            {"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 4},
            {"dtype": "x"},
            "dtype",
        ),
    ],
)
def test_bad_configs_are_named(config, options, message):
    with pytest.raises(ValueError, match=message):
        from_config(config, **options)
