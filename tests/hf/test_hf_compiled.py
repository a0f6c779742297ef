"""attnkit.hf under ``torch.compile(fullgraph=True)``, against transformers' eager attention on
the same weights: models with sliding-window layers compile whole, and generation with a static
cache compiles its decoding step once."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit.hf  # noqa: E402

NAME = attnkit.hf.register()
DECODER = {
    "vocab_size": 64,
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def model_of(config_class: str, model_class: str, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**DECODER, **options)
    return getattr(transformers, model_class)(config).eval()


LOCAL = {  # models with layers that see part of the keys: (config, model, options, padded)
    "mistral, sliding window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}, False),
    "mistral, sliding window, padded": (
        "MistralConfig", "MistralForCausalLM", {"sliding_window": 5}, True
    ),
    "gemma2, sliding window and softcap, padded": (
        "Gemma2Config", "Gemma2ForCausalLM",
        {"head_dim": 8, "sliding_window": 4, "attn_logit_softcapping": 5.0}, True,
    ),
    "gemma3, sliding layers, padded": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"head_dim": 8, "sliding_window": 4,
         "layer_types": ["sliding_attention", "full_attention"]}, True,
    ),
    "qwen3, sliding layers, padded": (
        "Qwen3Config", "Qwen3ForCausalLM",
        {"head_dim": 8, "sliding_window": 4, "use_sliding_window": True,
         "layer_types": ["sliding_attention", "full_attention"]}, True,
    ),
    "llama4, chunked, padded": (
        "Llama4TextConfig", "Llama4ForCausalLM",
        {"head_dim": 8, "attention_chunk_size": 4, "num_local_experts": 2,
         "num_experts_per_tok": 1, "intermediate_size_mlp": 48,
         "layer_types": ["chunked_attention", "full_attention"], "no_rope_layers": [1, 0]},
        True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", LOCAL)
def test_models_with_local_layers_compile_whole_and_match_eager(name, device):
    """transformers builds a sliding window's or a chunk's mask function inside the compiled
    region, where dynamo cannot read a closure's cells: attnkit evaluates it instead."""
    config_class, model_class, options, padded = LOCAL[name]
    torch._dynamo.reset()
    model = model_of(config_class, model_class, **options).to(device)
    ids = torch.randint(1, 64, (2, 12), device=device)
    mask = torch.ones(2, 12, dtype=torch.long, device=device)
    if padded:
        mask[1, :3] = 0
    real = mask.bool()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    model.set_attn_implementation(NAME)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], expected[real])


class _Recompiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += "Recompiling" in record.getMessage()


GENERATORS = {  # the families whose compiled generation recompiled at every step
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
}


@pytest.mark.parametrize("family", GENERATORS)
def test_generation_with_a_static_cache_never_recompiles_and_matches_eager(family, device):
    """As transformers' own test_generate_compile_model_forward_fullgraph: two generations of
    padded batches of the same shape, the forward compiled with dynamic=False; the mask that
    generate builds outside the compiled forward holds nothing that changes with the step."""
    from transformers.generation import CompileConfig

    torch._dynamo.reset()
    model = model_of(*GENERATORS[family]).to(device)
    ids = torch.randint(1, 64, (4, 9), device=device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :3] = 0
    config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles on a GPU only, unless told
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    model.set_attn_implementation("eager")
    expected = [model.generate(ids[i : i + 2], attention_mask=mask[i : i + 2], **options)
                for i in (0, 2)]  # fmt: skip
    model.set_attn_implementation(NAME)
    recompiles = _Recompiles()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(recompiles)
    try:
        got = [model.generate(ids[i : i + 2], attention_mask=mask[i : i + 2],
                              cache_implementation="static", compile_config=config, **options)
               for i in (0, 2)]  # fmt: skip
    finally:
        logger.removeHandler(recompiles)
        torch._logging.set_logs()
    assert hasattr(model, "_compiled_call")  # generate did compile the forward
    assert recompiles.count == 0
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
