"""How much memory a model's cache takes while it generates: bytes per token and at a context
length, layer by layer, for the attention each layer uses.

A softmax layer keeps a key and a value for every token it sees: ``2 x kv_heads x head_dim``
numbers a token (MHA when ``kv_heads`` is the number of query heads, GQA when fewer, MQA at one).
A sliding-window layer keeps its last ``window`` tokens only. Multi-head latent attention
(DeepSeek-V3) keeps one compressed latent and one RoPE key a token, ``kv_lora_rank +
qk_rope_head_dim`` numbers, for all its heads. A linear-attention layer (the gated delta rule of
Qwen3-Next) keeps a fixed state, ``value_heads x key_dim x value_dim``, and its short convolution's
last inputs, whatever the length. Layers that share another layer's cache (Gemma 3n's last
``num_kv_shared_layers``) keep nothing of their own.

[`from_config`][attnkit.kv_memory.from_config] reads these from a Hugging Face ``config.json``
(as a dict); [`PRESETS`][attnkit.kv_memory.PRESETS] holds a few models' numbers.

Example:
    >>> cache = from_config(PRESETS["llama-3-8b"])
    >>> cache.per_token()  # 32 layers x 2 x 8 heads x 128 x 2 bytes (bf16)
    131072
    >>> cache.bytes_at(8192) / 2**30  # GiB for one sequence of 8192 tokens
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("full", "sliding", "latent", "linear", "shared")
"""The kinds of layer cache: softmax attention over every token (MHA, GQA, MQA), over a sliding
window, multi-head latent attention, linear attention's state, and a cache shared with another
layer."""

BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1}
"""Bytes a number of each dtype name takes."""


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache: ``per_token`` bytes for each token it keeps (all of them, or the last
    ``window``), plus ``fixed`` bytes whatever the length."""

    kind: str
    per_token: int = 0
    window: int | None = None
    fixed: int = 0

    def bytes_at(self, tokens: int) -> int:
        """The bytes this layer holds after ``tokens`` tokens."""
        kept = tokens if self.window is None else min(tokens, self.window)
        return self.per_token * kept + self.fixed


@dataclass(frozen=True)
class CacheMemory:
    """A model's cache, layer by layer, for one sequence."""

    name: str
    layers: tuple[LayerCache, ...]

    def per_token(self) -> int:
        """Bytes each new token adds while every window is still filling (the first tokens)."""
        return sum(layer.per_token for layer in self.layers)

    def bytes_at(self, tokens: int, batch: int = 1) -> int:
        """The bytes the cache holds after ``tokens`` tokens, for ``batch`` sequences."""
        return batch * sum(layer.bytes_at(tokens) for layer in self.layers)

    def count(self, kind: str) -> int:
        """How many layers are of ``kind``."""
        return sum(layer.kind == kind for layer in self.layers)


def from_config(
    config: dict, *, dtype: str = "bf16", state_dtype: str = "fp32", name: str | None = None
) -> CacheMemory:
    """The cache of the model a Hugging Face ``config.json`` describes (the dict it holds; a
    multimodal config's ``text_config`` is read).

    Args:
        config: the config's fields: ``num_hidden_layers`` (or ``n_layer``),
            ``num_attention_heads`` (``n_head``), ``num_key_value_heads``, ``head_dim`` (default
            ``hidden_size / heads``), ``layer_types`` (``full_attention``, ``sliding_attention``,
            ``linear_attention``; or ``sliding_window`` alone: every layer slides), and where they
            apply ``kv_lora_rank`` with ``qk_rope_head_dim`` (latent attention), the
            ``linear_*`` sizes of linear attention, ``num_kv_shared_layers``.
        dtype: the keys', values' and latents' dtype.
        state_dtype: linear attention's state dtype (attnkit keeps it in float32).
        name: what to call the model; default its ``model_type``.

    Raises:
        ValueError: a missing or non-positive size, an unknown layer type or dtype.
    """
    config = config.get("text_config") or config
    size = _bytes_of(dtype, "dtype")
    state_size = _bytes_of(state_dtype, "state_dtype")
    layers = _count(config, "num_hidden_layers", "n_layer")
    heads = _count(config, "num_attention_heads", "n_head")
    hidden = config.get("hidden_size", config.get("n_embd"))

    def keys_and_values() -> int:  # a softmax layer's bytes a token (read where there is one)
        kv_heads = _count(config, "num_key_value_heads", default=heads)
        if config.get("head_dim") is not None:
            head_dim = _count(config, "head_dim")
        elif hidden:
            head_dim = _count({"head_dim": hidden / heads}, "head_dim")  # heads divide the width
        else:
            raise ValueError("the config has no head_dim or hidden_size")
        return 2 * kv_heads * head_dim * size

    types = config.get("layer_types") or _types_of(config, layers)
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    shared = _count(config, "num_kv_shared_layers", default=0, least=0)
    caches = []
    for index, kind in enumerate(types):
        if index >= layers - shared:
            caches.append(LayerCache("shared"))
        elif "kv_lora_rank" in config and kind == "full_attention":
            latent = _count(config, "kv_lora_rank") + _count(config, "qk_rope_head_dim")
            caches.append(LayerCache("latent", latent * size))
        elif kind == "full_attention":
            caches.append(LayerCache("full", keys_and_values()))
        elif kind == "sliding_attention":
            window = _count(config, "sliding_window")
            caches.append(LayerCache("sliding", keys_and_values(), window))
        elif kind == "linear_attention":
            caches.append(LayerCache("linear", fixed=_linear_state(config, size, state_size)))
        else:
            raise ValueError(f"unknown layer type {kind!r} in layer_types")
    return CacheMemory(name or str(config.get("model_type", "model")), tuple(caches))


def as_mha(config: dict) -> dict:
    """The same model with every layer keeping full keys and values for all its query heads
    (plain multi-head attention, no window, no latent, no linear layer, no sharing): the
    baseline the variants save against."""
    config = dict(config.get("text_config") or config)
    layers = _count(config, "num_hidden_layers", "n_layer")
    heads = _count(config, "num_attention_heads", "n_head")
    if "kv_lora_rank" in config:  # MLA's heads decompressed: keys of nope + rope, values of v
        key = _count(config, "qk_nope_head_dim") + _count(config, "qk_rope_head_dim")
        config["head_dim"] = (key + _count(config, "v_head_dim")) / 2
    for field in ("kv_lora_rank", "num_kv_shared_layers", "sliding_window"):
        config.pop(field, None)
    config.update(layer_types=["full_attention"] * layers, num_key_value_heads=heads)
    return config


def _linear_state(config: dict, size: int, state_size: int) -> int:
    """A linear-attention layer's fixed bytes: its state, ``value_heads x key_dim x value_dim``,
    and its convolution's last ``kernel - 1`` inputs of every channel (q, k and v)."""
    value_heads = _count(config, "linear_num_value_heads")
    key_heads = _count(config, "linear_num_key_heads")
    key_dim = _count(config, "linear_key_head_dim")
    value_dim = _count(config, "linear_value_head_dim")
    kernel = _count(config, "linear_conv_kernel_dim", default=1)
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return value_heads * key_dim * value_dim * state_size + channels * (kernel - 1) * size


def _types_of(config: dict, layers: int) -> list[str]:
    """The layer types a config implies without ``layer_types``: every layer sliding where it
    names a window it uses, else every layer full."""
    sliding = config.get("sliding_window") and config.get("use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * layers


def _count(config: dict, *names: str, default=..., least: int = 1) -> int:
    """The first of ``names`` the config holds, a whole number of at least ``least``."""
    value = next((config[n] for n in names if config.get(n) is not None), default)
    if value is ...:
        raise ValueError(f"the config has no {' or '.join(names)}")
    if value is None or value != int(value) or value < least:
        raise ValueError(f"{names[0]} must be a whole number of at least {least}, got {value!r}")
    return int(value)


def _bytes_of(dtype: str, name: str) -> int:
    if dtype not in BYTES:
        raise ValueError(f"{name} must be one of {', '.join(BYTES)}, got {dtype!r}")
    return BYTES[dtype]


def _pattern(unit: list[str], layers: int) -> list[str]:
    return (unit * layers)[:layers]


PRESETS: dict[str, dict] = {
    "gpt2": {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768},
    "llama-3-8b": {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "sliding_window": 4096,
    },
    "gemma-3n-e4b": {
        "model_type": "gemma3n_text",
        "num_hidden_layers": 35,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "sliding_window": 512,
        "layer_types": _pattern(["sliding_attention"] * 4 + ["full_attention"], 35),
        "num_kv_shared_layers": 15,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "layer_types": _pattern(["linear_attention"] * 3 + ["full_attention"], 48),
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
}
"""A few models' cache-shaping fields, as their ``config.json`` files (and transformers' config
defaults) give them."""
