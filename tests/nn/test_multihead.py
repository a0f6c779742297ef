"""attnkit.nn.MultiheadAttention against torch.nn.MultiheadAttention, same weights and inputs:
outputs, returned weights and every gradient, for the options and masks torch takes."""

from __future__ import annotations

import pytest
import torch

from attnkit.nn import MultiheadAttention

E, H, N, L, S = 16, 4, 3, 5, 7


def pair(device="cpu", **options):
    """torch's module and attnkit's, with the same weights (loaded strictly)."""
    theirs = torch.nn.MultiheadAttention(E, H, device=device, **options)
    with torch.no_grad():  # bias_k/bias_v and the biases away from their initial values
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = MultiheadAttention(E, H, device=device, **options)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def inputs(batch_first, device, kdim=E, vdim=E, batched=True):
    def seq(n, e):
        if not batched:
            return torch.randn(n, e, device=device)
        return (
            torch.randn(N, n, e, device=device)
            if batch_first
            else torch.randn(n, N, e, device=device)
        )

    return seq(L, E), seq(S, kdim), seq(S, vdim)


def compare(ours, theirs, args, **kwargs):
    results = []
    for module in (ours, theirs):
        module.zero_grad()
        leaves = [x.detach().clone().requires_grad_() for x in args]
        out, weights = module(*leaves, **kwargs)
        loss = (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum()
        if weights is not None:
            loss = (
                loss
                + (weights * torch.linspace(0, 1, weights.numel()).view_as(weights).to(out)).sum()
            )
        loss.backward()
        grads = [x.grad for x in leaves] + [p.grad for p in module.parameters()]
        results.append((out, weights, grads))
    (out, weights, grads), (want, want_weights, want_grads) = results
    torch.testing.assert_close(out, want)
    if want_weights is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, want_weights)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


OPTIONS = {
    "defaults": {},
    "batch_first": {"batch_first": True},
    "no bias": {"bias": False},
    "add_bias_kv": {"add_bias_kv": True},
    "add_zero_attn": {"add_zero_attn": True},
    "both and batch_first": {"add_bias_kv": True, "add_zero_attn": True, "batch_first": True},
    "kdim and vdim": {"kdim": 6, "vdim": 10},
}


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("name", OPTIONS)
def test_outputs_weights_and_gradients_equal_torchs(name, need_weights, average, device):
    options = OPTIONS[name]
    ours, theirs = pair(device, **options)
    args = inputs(
        options.get("batch_first", False), device, options.get("kdim", E), options.get("vdim", E)
    )
    compare(ours, theirs, args, need_weights=need_weights, average_attn_weights=average)


def bool_mask(*shape, device):
    mask = torch.rand(*shape, device=device) > 0.6  # True: may not look
    mask[..., 0] = False
    return mask


MASKS = {
    "bool attn_mask (L, S)": lambda d: {"attn_mask": bool_mask(L, S, device=d)},
    "float attn_mask (N*H, L, S)": lambda d: {"attn_mask": torch.randn(N * H, L, S, device=d)},
    "bool key_padding_mask": lambda d: {"key_padding_mask": bool_mask(N, S, device=d)},
    "float key_padding_mask": lambda d: {"key_padding_mask": torch.randn(N, S, device=d)},
    "bool both": lambda d: {
        "attn_mask": bool_mask(N * H, L, S, device=d),
        "key_padding_mask": bool_mask(N, S, device=d),
    },
    "float attn_mask, bool padding": lambda d: {
        "attn_mask": torch.randn(L, S, device=d),
        "key_padding_mask": bool_mask(N, S, device=d),
    },
    "bool attn_mask, float padding": lambda d: {
        "attn_mask": bool_mask(L, S, device=d),
        "key_padding_mask": torch.randn(N, S, device=d),
    },
}


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("options", ["defaults", "add_bias_kv", "both and batch_first"])
@pytest.mark.parametrize("masks", MASKS)
def test_masks_in_torchs_polarity(masks, options, need_weights, device):
    ours, theirs = pair(device, **OPTIONS[options])
    args = inputs(OPTIONS[options].get("batch_first", False), device)
    compare(ours, theirs, args, need_weights=need_weights, **MASKS[masks](device))


@pytest.mark.parametrize("need_weights", [True, False])
def test_unbatched_inputs(need_weights, device):
    ours, theirs = pair(device)
    args = inputs(False, device, batched=False)
    mask = bool_mask(S, device=device)
    compare(ours, theirs, args, need_weights=need_weights, key_padding_mask=mask)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("padding", [False, True])
def test_is_causal_is_a_hint_as_in_torch(need_weights, padding, device):
    """Without weights or padding torch drops the mask for SDPA's top-left causal one; otherwise
    the mask it was given applies (here an unrelated mask, so that the two differ)."""
    ours, theirs = pair(device, batch_first=True)
    x = torch.randn(N, L, E, device=device)
    other = bool_mask(L, L, device=device)
    kwargs = {"attn_mask": other, "is_causal": True, "need_weights": need_weights}
    if padding:
        kwargs["key_padding_mask"] = bool_mask(N, L, device=device)
    compare(ours, theirs, (x, x, x), **kwargs)
    for error in (ValueError, RuntimeError):  # attnkit's kind, and torch's
        with pytest.raises(error, match="Need attn_mask if specifying the is_causal hint"):
            ours(x, x, x, is_causal=True)


def test_dropout_applies_in_training_only_and_weights_are_those_after_it():
    ours, theirs = pair(dropout=0.5, batch_first=True)
    x = torch.randn(N, L, E)
    ours.eval(), theirs.eval()
    compare(ours, theirs, (x, x, x))
    ours.train()
    out, weights = ours(x, x, x, average_attn_weights=False)
    assert bool((weights == 0).any())  # dropped
    kept = weights[weights != 0]
    plain, _ = ours.eval()(x, x, x, average_attn_weights=False)
    assert kept.min() > 0 and not torch.allclose(out, plain)


def test_a_fully_masked_query_gets_zero_not_nan():
    ours, _ = pair(batch_first=True)
    x = torch.randn(1, L, E)
    mask = torch.zeros(L, L, dtype=torch.bool)
    mask[2] = True  # query 2 may look nowhere
    out, weights = ours(x, x, x, attn_mask=mask)
    assert not out.isnan().any() and bool((weights[0, 2] == 0).all())
    torch.testing.assert_close(out[0, 2], ours.out_proj.bias)


def test_state_dicts_load_strictly_both_ways_and_torchs_layers_take_it():
    ours, theirs = pair(add_bias_kv=True, kdim=6, vdim=10)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert isinstance(ours, torch.nn.MultiheadAttention)
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0)
    layer.self_attn = MultiheadAttention(E, H, dropout=0.0)
    layer.self_attn.load_state_dict(torch.nn.MultiheadAttention(E, H).state_dict())
    x = torch.randn(L, N, E)
    assert layer(x).shape == (L, N, E)


@pytest.mark.parametrize("seed", range(12))
def test_random_options_and_masks_equal_torchs_both_ways(seed):
    """Every constructor option and every forward option drawn at random; the state_dict loaded
    into attnkit's from torch's, or into torch's from attnkit's."""
    draw = torch.Generator().manual_seed(seed)

    def coin():
        return bool(torch.randint(0, 2, (), generator=draw))

    separate = coin()
    options = {
        "dropout": 0.3,  # eval: no dropout, but the attribute is there
        "bias": coin(),
        "add_bias_kv": coin(),
        "add_zero_attn": coin(),
        "kdim": 6 if separate else None,
        "vdim": 10 if separate else None,
        "batch_first": coin(),
    }
    if coin():
        ours, theirs = pair(**options)
    else:  # the reverse load
        theirs = torch.nn.MultiheadAttention(E, H, **options)
        ours = MultiheadAttention(E, H, **options)
        theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.eval(), theirs.eval()
    batched = coin()
    args = inputs(
        options["batch_first"], "cpu", 6 if separate else E, 10 if separate else E, batched
    )
    kwargs = {"need_weights": coin(), "average_attn_weights": coin()}
    if coin():
        shape = (L, S) if coin() or not batched else (N * H, L, S)
        kwargs["attn_mask"] = bool_mask(*shape, device="cpu") if coin() else torch.randn(shape)
    if coin():
        shape = (N, S) if batched else (S,)
        kwargs["key_padding_mask"] = (
            bool_mask(*shape, device="cpu") if coin() else torch.randn(shape)
        )
    compare(ours, theirs, args, **kwargs)


@pytest.mark.parametrize("shape", [(0, L, E), (N, 0, E)], ids=["no batch", "no query"])
def test_empty_inputs_give_empty_results_as_torchs(shape, device):
    ours, theirs = pair(device, batch_first=True)
    x, keys = torch.randn(shape, device=device), torch.randn(shape[0], S, E, device=device)
    compare(ours, theirs, (x, keys, keys))


def test_no_keys_give_the_output_projections_bias():
    """torch's layer returns NaN rows with no key to see; attnkit's rule gives those rows 0."""
    ours, _ = pair(batch_first=True)
    out, weights = ours(torch.randn(N, L, E), torch.randn(N, 0, E), torch.randn(N, 0, E))
    assert weights.shape == (N, L, 0)
    torch.testing.assert_close(out, ours.out_proj.bias.expand(N, L, E))


def test_parameters_of_another_dtype_than_the_inputs_are_taken_in_theirs(device):
    ours, theirs = pair(device, dtype=torch.float64, batch_first=True)
    for module in (ours, theirs):
        module.in_proj_bias = torch.nn.Parameter(module.in_proj_bias.detach().half())
    x = torch.randn(N, L, E, dtype=torch.float64, device=device)
    with torch.no_grad():
        out, want = (
            ours(x, x, x, need_weights=False)[0],
            theirs.eval()(x, x, x, need_weights=False)[0],
        )
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("need_weights", [True, False])
def test_compiles_whole_with_parameters_that_need_gradients(need_weights, device):
    ours, theirs = pair(device, batch_first=True)
    x = torch.randn(N, L, E, device=device, requires_grad=True)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    out = compiled(x, x, x, need_weights=need_weights)[0]
    out.sum().backward()
    torch.testing.assert_close(out, theirs(x, x, x, need_weights=need_weights)[0])
    assert ours.in_proj_weight.grad is not None


def test_exports_with_torch_export():
    ours, theirs = pair(batch_first=True)
    x = torch.randn(N, L, E)
    program = torch.export.export(ours.eval(), (x, x, x), {"need_weights": False})
    got = program.module()(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(got, theirs.eval()(x, x, x, need_weights=False)[0])


def test_a_call_too_large_for_the_memory_names_need_weights(monkeypatch):
    import attnkit.backends

    monkeypatch.setattr(attnkit.backends, "memory_of", lambda device: 2**20)
    ours, _ = pair(batch_first=True)
    x = torch.randn(1, 1100, E)
    with pytest.raises(ValueError, match="need_weights=False in a MultiheadAttention's forward"):
        ours(x, x, x)


def test_torchscript_compiles_a_layer_around_it_which_calls_attnkit_back():
    """torch.jit.script of a model holding the drop-in (torch's layers script): the scripted
    model runs attnkit's Python for the attention, with the eager model's results."""
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=32, batch_first=True)
    layer.self_attn.__class__ = MultiheadAttention
    scripted = torch.jit.script(layer.eval())
    x, mask = torch.randn(N, L, E), torch.zeros(L, L, dtype=torch.bool)
    torch.testing.assert_close(scripted(x, src_mask=mask), layer(x, src_mask=mask))
    ours, theirs = pair()
    q, k, v = inputs(False, "cpu")
    torch.testing.assert_close(torch.jit.script(ours)(q, k, v)[0], theirs(q, k, v)[0])
