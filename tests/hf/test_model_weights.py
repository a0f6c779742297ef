"""attnkit's MultiHeadAttention, loaded with the weights of Hugging Face's GPT-2 and Llama attention,
reproduces their outputs in prefill and in cached decoding.

The models are tiny, random and built offline. An HF attention module called alone is not causal (the
model builds the mask), so each model runs whole, with its own KV cache, and a hook records what its
attention layer received and returned; attnkit replays the same inputs with a KVCache.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from attnkit import KVCache, MultiHeadAttention, RotaryEmbedding

PROMPT, NEW = 7, 5


def run_and_record(model, layer, ids):
    """Prefill ``PROMPT`` tokens, then decode the rest one by one with the model's own cache; return
    the (input, output) of ``layer`` at every call."""
    calls = []

    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        calls.append((hidden.detach().clone(), output[0].detach().clone()))

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            past = model(ids[:, :PROMPT], use_cache=True).past_key_values
            for i in range(PROMPT, ids.shape[1]):
                past = model(
                    ids[:, i : i + 1], past_key_values=past, use_cache=True
                ).past_key_values
    finally:
        handle.remove()
    return calls


def replay(module, calls, num_kv_heads):
    b = calls[0][0].shape[0]
    cache = KVCache(b, num_kv_heads, PROMPT + NEW, module.head_dim)
    with torch.no_grad():
        prompt_alone = module(calls[0][0])  # no cache: the full causal forward
        torch.testing.assert_close(prompt_alone, calls[0][1], atol=1e-5, rtol=1e-5)
        for hidden, expected in calls:
            torch.testing.assert_close(module(hidden, cache=cache), expected, atol=1e-5, rtol=1e-5)
    assert cache.position == PROMPT + NEW


def test_gpt2_attention_prefill_and_cached_decode():
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.3,  # eval mode turns it off, in both
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2Model(config).eval()
    attn = model.h[1].attn  # the second layer: its input went through the first
    calls = run_and_record(model, attn, torch.randint(0, 50, (2, PROMPT + NEW)))

    e = config.n_embd
    ours = MultiHeadAttention(e, e, config.n_positions, 0.3, 4, qkv_bias=True, causal=True).eval()
    with torch.no_grad():  # GPT-2's Conv1D computes x @ W + b, W (in, out), columns q | k | v
        for i, linear in enumerate((ours.W_query, ours.W_key, ours.W_value)):
            linear.weight.copy_(attn.c_attn.weight[:, i * e : (i + 1) * e].T)
            linear.bias.copy_(attn.c_attn.bias[i * e : (i + 1) * e])
        ours.out_proj.weight.copy_(attn.c_proj.weight.T)
        ours.out_proj.bias.copy_(attn.c_proj.bias)
    replay(ours, calls, num_kv_heads=4)


def test_llama_attention_gqa_rope_prefill_and_cached_decode():
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.LlamaModel(config).eval()
    attn = model.layers[1].self_attn
    calls = run_and_record(model, attn, torch.randint(0, 50, (2, PROMPT + NEW)))

    head_dim = config.hidden_size // config.num_attention_heads
    rope = RotaryEmbedding(head_dim, base=config.rope_parameters["rope_theta"], max_len=64)
    ours = MultiHeadAttention(
        64, 64, 64, 0.0, 4, num_kv_heads=2, rope=rope, out_bias=False, causal=True
    ).eval()
    with torch.no_grad():
        for mine, theirs in (
            (ours.W_query, attn.q_proj),
            (ours.W_key, attn.k_proj),
            (ours.W_value, attn.v_proj),
            (ours.out_proj, attn.o_proj),
        ):
            mine.weight.copy_(theirs.weight)
    replay(ours, calls, num_kv_heads=2)
