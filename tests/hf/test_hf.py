"""attnkit inside Hugging Face models (attn_implementation="attnkit") against transformers' own
eager attention on the same tiny random models and inputs: logits, returned weights, every
parameter's gradient, greedy generation with the model's cache, and packed sequences."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit.hf  # noqa: E402
from helpers.devices import CUDA  # noqa: E402

NAME = attnkit.hf.register()
SMALL = {"vocab_size": 64, "num_hidden_layers": 2}
DECODER = {
    **SMALL,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
FAMILIES = {  # name: (config class, model class, config options)
    "llama": ("LlamaConfig", "LlamaForCausalLM", DECODER),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DECODER),
    "mistral, sliding window": ("MistralConfig", "MistralForCausalLM", {**DECODER, "sliding_window": 4}),
    "gemma2, softcap, sliding window": (
        "Gemma2Config", "Gemma2ForCausalLM",
        {**DECODER, "head_dim": 8, "sliding_window": 4, "attn_logit_softcapping": 5.0},
    ),
    "gpt-oss, sinks, sliding window": (
        "GptOssConfig", "GptOssForCausalLM",
        {**DECODER, "head_dim": 8, "sliding_window": 4, "num_local_experts": 2,
         "num_experts_per_tok": 1, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {**SMALL, "n_embd": 32, "n_head": 4, "n_layer": 2}),
    "bert": (
        "BertConfig", "BertModel",
        {**SMALL, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4},
    ),
    "modernbert, sliding window": (
        "ModernBertConfig", "ModernBertModel",
        {**SMALL, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "local_attention": 4, "global_attn_every_n_layers": 2, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2},
    ),
}  # fmt: skip
CAUSAL = [name for name in FAMILIES if name.split(",")[0] not in ("bert", "modernbert")]
PACKS = [name for name in CAUSAL if name.split(",")[0] not in ("gpt2", "gpt-oss")]


def model_of(name: str, device="cpu") -> torch.nn.Module:
    config_class, model_class, options = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**options)
    for dropout in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                    "hidden_dropout_prob", "attention_probs_dropout_prob"):  # fmt: skip
        if hasattr(config, dropout):
            setattr(config, dropout, 0.0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # learned sinks away from their initial value
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
    return model.to(device)


def padded_batch(device="cpu"):
    ids = torch.randint(1, 64, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return ids.to(device), mask.to(device)


def run(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    return model(**inputs)


def output_of(result):
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_weights_and_gradients_match_eager_on_a_padded_batch(name, device):
    model = model_of(name, device)
    ids, mask = padded_batch(device)
    real = mask.bool()
    found = {}
    for implementation in ("eager", NAME):
        model.zero_grad()
        result = run(
            model, implementation, input_ids=ids, attention_mask=mask, output_attentions=True
        )
        out = output_of(result)
        (out[real] * torch.linspace(-1, 1, out.shape[-1], device=device)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        found[implementation] = out.detach(), result.attentions, grads
    (out, weights, grads), (out_e, weights_e, grads_e) = found[NAME], found["eager"]
    torch.testing.assert_close(out[real], out_e[real])
    assert len(weights) == len(weights_e) == 2
    for w, w_e in zip(weights, weights_e):
        # rows of real queries (a padding query's row is empty here, uniform in eager)
        torch.testing.assert_close(w.detach()[0], w_e.detach()[0])
        torch.testing.assert_close(w.detach()[1][:, 4:], w_e.detach()[1][:, 4:])
    assert grads.keys() == grads_e.keys() and grads
    truth = {}  # eager's gradients in float64, where needed
    for n in grads:
        try:
            torch.testing.assert_close(grads[n], grads_e[n], msg=lambda m, n=n: f"{n}: {m}")
        except AssertionError:  # two float32 sums in other orders: the float64 truth decides
            # (float32's tolerances from it, as for attnkit's own tests, or eager's error x2)
            if name.startswith("gpt-oss"):  # its experts' grouped products take no float64
                raise
            truth = truth or eager_gradients_in_float64(name, device, ids, mask)
            error, eager_error = (
                (g.double() - truth[n]).abs().max() for g in (grads[n], grads_e[n])
            )
            close = torch.allclose(grads[n].double(), truth[n], rtol=1.3e-6, atol=1e-5)
            assert close or error <= 2 * eager_error, (
                f"{n}: {error:.3g} from float64, eager's {eager_error:.3g}"
            )


def eager_gradients_in_float64(name, device, ids, mask) -> dict:
    """Eager's gradients in float64, a sequence at a time without its padding at the positions
    the padded batch gives it (in float64 a padded row would be NaN: its mask's minimum plus a
    negative score overflows)."""
    model = model_of(name, device).double()
    model.set_attn_implementation("eager")
    for row, real in enumerate(mask.bool()):
        positions = torch.arange(ids.shape[1], device=device)[real][None]
        out = output_of(model(input_ids=ids[row, real][None], position_ids=positions))
        weights = torch.linspace(-1, 1, out.shape[-1], device=device, dtype=torch.float64)
        (out * weights).sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_generation_with_the_models_cache_matches_eager(name, device):
    model = model_of(name, device)
    ids, mask = padded_batch(device)
    generated = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        generated[implementation] = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert torch.equal(generated[NAME], generated["eager"])


@pytest.mark.parametrize("name", PACKS)
@pytest.mark.parametrize(
    ("use_cache", "device"),
    [
        pytest.param(False, torch.device("cpu"), id="False-cpu"),
        pytest.param(True, torch.device("cpu"), id="True-cpu"),
        pytest.param(False, torch.device("cuda"), id="False-cuda", marks=CUDA.marks),
    ],
)
def test_a_packed_row_equals_its_sequences_run_alone(name, use_cache, device):
    model = model_of(name, device)
    model.set_attn_implementation(NAME)
    lengths = (5, 3, 6)
    ids = torch.randint(1, 64, (1, sum(lengths))).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    packed = model(input_ids=ids, position_ids=positions, use_cache=use_cache).logits
    alone, start = [], 0
    for n in lengths:
        alone.append(model(input_ids=ids[:, start : start + n]).logits)
        start += n
    torch.testing.assert_close(packed, torch.cat(alone, 1))


def test_packed_sequences_from_flash_attentions_cu_seq_lens(device):
    model = model_of("llama", device)
    model.set_attn_implementation(NAME)
    lengths = (4, 7)
    ids = torch.randint(1, 64, (1, 11)).to(device)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    packed = model(
        input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=7, max_length_k=7, use_cache=True,
    ).logits  # fmt: skip
    alone = torch.cat([model(input_ids=ids[:, :4]).logits, model(input_ids=ids[:, 4:]).logits], 1)
    torch.testing.assert_close(packed, alone)


@pytest.mark.parametrize(
    ("dropout", "t"), [(0.0, 4096), (0.1, 3072)], ids=["eval", "training with dropout"]
)
def test_a_padded_long_batch_builds_no_dense_mask(dropout, t):
    """No tensor of t x s elements (a (b, 1, t, s) bool mask is b times that) is made on the way:
    every operation's output is watched, and the attention runs in the tiled kernel (whose dropout
    draws its mask block by block)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attention_dropout=dropout,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train(dropout > 0)
    model.set_attn_implementation(NAME)
    ids = torch.randint(0, 128, (2, t))
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, :100] = 0

    def largest_tensor(implementation):
        largest = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for x in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(x, torch.Tensor):
                        largest.append((x.numel(), str(func)))
                return out

        model.set_attn_implementation(implementation)
        with torch.no_grad(), Watch():
            logits = model(input_ids=ids, attention_mask=mask).logits
        assert logits.shape == (2, t, 128)
        return max(largest)

    numel, func = largest_tensor(NAME)
    assert numel < t * t // 8, f"{func} made a tensor of {numel} elements"
    assert largest_tensor("sdpa")[0] >= 2 * t * t  # transformers' sdpa: the (b, 1, t, s) mask


def test_a_users_4d_float_mask_that_uses_the_dtypes_minimum_is_honoured(device):
    model = model_of("llama", device)
    ids = torch.randint(1, 64, (1, 6)).to(device)
    allowed = torch.ones(6, 6, dtype=torch.bool, device=device).tril()
    allowed[:, 0] = False
    allowed[0, 0] = True
    minimum = torch.finfo(torch.float32).min
    float_mask = torch.zeros(1, 1, 6, 6, device=device).masked_fill(~allowed, minimum)
    out = output_of(run(model, NAME, input_ids=ids, attention_mask=float_mask))
    out_e = output_of(run(model, "eager", input_ids=ids, attention_mask=float_mask))
    torch.testing.assert_close(out, out_e)


def test_register_is_idempotent_and_checks_the_name():
    assert attnkit.hf.register() == NAME == attnkit.hf.register("attnkit")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        attnkit.hf.register("")


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_greedy_generation_with_a_preallocated_cache_matches_eager(cache, device):
    name = "mistral, sliding window"
    model = model_of(name, device)
    ids, mask = padded_batch(device)
    generated = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        generated[implementation] = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
            cache_implementation=cache,
        )  # fmt: skip
    assert torch.equal(generated[NAME], generated["eager"])


def test_weights_under_a_static_cache_span_its_buffer_as_eagers():
    """attnkit cuts a static cache's empty slots off the keys; the weights it returns still have
    the buffer's width, zeros there, as eager's."""
    model = model_of("llama")
    ids = torch.randint(1, 64, (1, 5))
    found = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        found[implementation] = model(ids, past_key_values=cache, output_attentions=True).attentions
    for w, w_e in zip(found[NAME], found["eager"]):
        assert w.shape == w_e.shape == (1, 4, 5, 16)
        torch.testing.assert_close(w, w_e)


def test_returned_weights_take_the_outputs_gradient_as_eagers(device):
    """transformers' test_retain_grad_hidden_states_attentions: the weights a model returns are
    those its output was made from."""
    model = model_of("gemma2, softcap, sliding window", device)
    ids = padded_batch(device)[0]
    grads = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        result = model(ids, output_attentions=True)
        result.attentions[0].retain_grad()
        result.logits.flatten()[0].backward()
        grads[implementation] = result.attentions[0].grad
    assert grads[NAME] is not None
    torch.testing.assert_close(grads[NAME], grads["eager"])


def python_with(code: str, *, hide_transformers: bool = False) -> subprocess.CompletedProcess:
    """``code`` run by a fresh Python (nothing registered yet), optionally one where
    transformers cannot be imported."""
    if hide_transformers:
        code = "import sys; sys.modules['transformers'] = None\n" + code
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_importing_attnkit_hf_registers_its_name():
    ran = python_with(
        "import attnkit.hf, transformers\n"
        "config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, "
        "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)\n"
        "model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation='attnkit')\n"
        "print(model.config._attn_implementation)"
    )
    assert ran.returncode == 0 and ran.stdout.strip() == "attnkit", ran.stderr


def test_importing_attnkit_hf_without_transformers_says_what_to_install():
    ran = python_with("import attnkit.hf", hide_transformers=True)
    assert ran.returncode == 1
    assert (
        "ModuleNotFoundError: attnkit.hf needs Hugging Face transformers: pip install 'attnkit[hf]'"
        in ran.stderr
    )


def test_use_warns_of_a_model_that_does_not_call_the_attention_interface():
    falcon = transformers.FalconForCausalLM(
        transformers.FalconConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
        )
    )
    assert not attnkit.hf.supports(falcon) and not attnkit.hf.supports(transformers.BloomModel)
    assert attnkit.hf.supports(transformers.WhisperModel)  # its own flag says no; its code calls it
    with pytest.warns(
        UserWarning, match="FalconForCausalLM does not call transformers' AttentionInterface"
    ):
        assert attnkit.hf.use(falcon) is falcon
    llama = model_of("llama")
    assert attnkit.hf.supports(type(llama))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attnkit.hf.use(llama)
    assert llama.config._attn_implementation == NAME


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_stay_within_twice_eagers_error(dtype, device):
    model = model_of("mistral, sliding window", device)
    ids = padded_batch(device)[0]  # unpadded: eager in float64 overflows min + score to -inf, NaN
    exact = output_of(run(model.double(), "eager", input_ids=ids))
    model = model.to(dtype)
    errors = {}
    for implementation in ("eager", NAME):
        out = output_of(run(model, implementation, input_ids=ids))
        errors[implementation] = (out.double() - exact).abs().max().item()
    assert errors[NAME] <= 2 * errors["eager"] + 1e-6, errors


def test_autocast_stays_within_twice_eagers_error(device):
    model = model_of("llama", device)
    ids = padded_batch(device)[0]  # unpadded: eager in float64 overflows min + score to -inf, NaN
    exact = output_of(run(model.double(), "eager", input_ids=ids))
    model = model.float()
    errors = {}
    for implementation in ("eager", NAME):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = output_of(run(model, implementation, input_ids=ids))
        errors[implementation] = (out.double() - exact).abs().max().item()
    assert 0 < errors[NAME] <= 2 * errors["eager"] + 1e-6, errors


def test_weights_returned_in_training_are_after_dropout_as_eagers(device):
    from types import SimpleNamespace

    module = SimpleNamespace(is_causal=True, training=True)
    q, k, v = (torch.randn(1, h, 6, 8, device=device) for h in (4, 2, 2))
    out, weights = attnkit.hf.attention_function(
        module, q, k, v, None, dropout=0.5, scaling=0.3, output_attentions=True
    )
    assert out.shape == (1, 6, 4, 8) and out.is_contiguous()
    assert (weights == 0).any() and weights.max() > 1  # dropped, the rest scaled by 2
    torch.testing.assert_close(out.transpose(1, 2), weights @ v.repeat_interleave(2, dim=1))


def test_a_models_position_bias_is_added_to_the_scores_with_the_mask(device):
    from types import SimpleNamespace

    module = SimpleNamespace(is_causal=True, training=False)
    q, k, v = (torch.randn(2, h, 5, 8, device=device) for h in (4, 2, 2))
    bias = torch.randn(1, 4, 5, 5, device=device)
    out, _ = attnkit.hf.attention_function(module, q, k, v, None, scaling=1.0, position_bias=bias)
    causal = torch.ones(5, 5, dtype=torch.bool, device=device).tril()
    expected = attnkit.attention(
        q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")), scale=1.0, backend="reference"
    )
    torch.testing.assert_close(out, expected.transpose(1, 2))


SEQ2SEQ = {
    "bart": (
        "BartConfig", "BartForConditionalGeneration",
        {**SMALL, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
         "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 48,
         "decoder_ffn_dim": 48, "max_position_embeddings": 64, "dropout": 0.0,
         "attention_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "decoder_start_token_id": 2},
    ),
    "t5, position bias": (
        "T5Config", "T5ForConditionalGeneration",
        {"vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 1,
         "num_decoder_layers": 1, "num_heads": 4, "dropout_rate": 0.0, "pad_token_id": 0,
         "eos_token_id": 1, "decoder_start_token_id": 0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoder_models_with_a_shorter_decoder_match_eager(name, device):
    config_class, model_class, options = SEQ2SEQ[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**options))
    model = model.eval().to(device)
    ids, mask = padded_batch(device)  # 11 encoder tokens, one row left-padded
    decoder_ids = torch.randint(3, 64, (2, 4)).to(device)
    found = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        generated = model.generate(
            ids, attention_mask=mask, max_new_tokens=5, do_sample=False, min_new_tokens=5
        )
        found[implementation] = logits, generated
    torch.testing.assert_close(found[NAME][0], found["eager"][0])
    assert torch.equal(found[NAME][1], found["eager"][1])


def test_an_attention_mask_of_another_kind_is_refused_naming_it():
    from types import SimpleNamespace

    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(
        TypeError, match=r"attention_mask must be a tensor, a BlockMask or .* got list"
    ):
        attnkit.hf.attention_function(SimpleNamespace(is_causal=True), q, q, q, [[1, 1, 1]])
