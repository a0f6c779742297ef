"""attnkit.nn.swap on torch's Transformer modules: the same results and gradients as the model
before, in training and in eval (where torch's encoder takes its fused path), and compiled."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import attnkit.nn
from attnkit.nn import MultiheadAttention, swap

E, H, N, L = 16, 4, 3, 6


@contextlib.contextmanager
def unfused():
    """torch's own modules without their fused path: the reference for every position."""
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def models(device):
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True),
        num_layers=2,
    )
    decoder = nn.TransformerDecoder(
        nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True),
        num_layers=2,
    )
    transformer = nn.Transformer(
        E,
        H,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=32,
        dropout=0.0,
        batch_first=True,
    )
    return {"encoder": encoder, "decoder": decoder, "transformer": transformer}


def run(name, model, x, memory, padding, causal):
    mask = nn.Transformer.generate_square_subsequent_mask(L, device=x.device)
    if name == "encoder":
        return model(
            x, mask=mask if causal else None, src_key_padding_mask=padding, is_causal=causal
        )
    if name == "decoder":
        return model(
            x,
            memory,
            tgt_mask=mask if causal else None,
            tgt_is_causal=causal,
            memory_key_padding_mask=padding,
        )
    return model(
        x,
        memory,
        tgt_mask=mask if causal else None,
        tgt_is_causal=causal,
        src_key_padding_mask=padding,
        memory_key_padding_mask=padding,
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", ["encoder", "decoder", "transformer"])
def test_swapped_models_compute_what_they_computed(name, training, causal, device):
    theirs = models(device)[name].to(device).train(training)
    ours = swap(copy.deepcopy(theirs))
    swapped = [m for m in ours.modules() if isinstance(m, nn.MultiheadAttention)]
    assert swapped and all(type(m) is MultiheadAttention for m in swapped)
    assert all(type(m.out_proj) is type(nn.MultiheadAttention(E, H).out_proj) for m in swapped)
    x, memory = torch.randn(N, L, E, device=device), torch.randn(N, L, E, device=device)
    padding = torch.zeros(N, L, dtype=torch.bool, device=device)
    padding[1, 4:] = True
    results = []
    for model in (ours, theirs):
        with unfused() if model is theirs else contextlib.nullcontext():
            out = run(name, model, x, memory, padding, causal)
            (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        results.append((out, [p.grad for p in model.parameters()]))
    (out, grads), (want, want_grads) = results
    real = ~padding if name == "encoder" else torch.ones_like(padding)
    torch.testing.assert_close(out[real], want[real])
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_in_eval_attnkit_runs_where_torch_would_take_its_fused_path(monkeypatch):
    encoder = models("cpu")["encoder"].eval()
    swap(encoder)
    calls = []
    original = attnkit.nn.multihead.attention
    monkeypatch.setattr(
        attnkit.nn.multihead, "attention", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    with torch.no_grad():
        encoder(torch.randn(N, L, E))
    assert len(calls) == 2  # one per layer
    assert torch.backends.mha.get_fastpath_enabled()  # as it was


def test_swap_keeps_parameters_device_dtype_and_mode_and_takes_a_module_alone():
    model = nn.Sequential(nn.Linear(E, E), nn.MultiheadAttention(E, H, dtype=torch.float64))
    model.eval()
    params = list(model.parameters())
    assert swap(model) is model
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert type(model[1]) is MultiheadAttention and not model[1].training
    assert model[1].in_proj_weight.dtype == torch.float64
    alone = swap(nn.MultiheadAttention(E, H))
    assert type(alone) is MultiheadAttention
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got int"):
        swap(3)


def test_a_swapped_encoder_compiles():
    encoder = swap(models("cpu")["encoder"])
    x = torch.randn(N, L, E)
    want = encoder(x)
    compiled = torch.compile(encoder, dynamic=False)
    torch.testing.assert_close(compiled(x), want)


def test_swap_changes_a_module_alone_in_place_and_warns_of_subclasses():
    alone = nn.MultiheadAttention(E, H)
    assert swap(alone) is alone and type(alone) is MultiheadAttention

    class Mine(nn.MultiheadAttention):
        pass

    model = nn.Sequential(Mine(E, H), nn.MultiheadAttention(E, H))
    with pytest.warns(
        UserWarning, match="swap left .*Mine, a subclass of torch.nn.MultiheadAttention"
    ):
        swap(model)
    assert type(model[0]) is Mine and type(model[1]) is MultiheadAttention
