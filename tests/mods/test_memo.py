"""A mod is inspected once while its state stays the same, and again when the state changes: the
kept answer is never stale."""

from __future__ import annotations

import types

import torch

from attnkit import KVCache, MultiHeadAttention, attention
from attnkit.mods import inspection, memo


def counting(monkeypatch) -> list[str]:
    """The inspections that run, by name."""
    ran = []
    traced_adds, captured = inspection._traced_adds, inspection._captured
    monkeypatch.setattr(inspection, "_traced_adds", lambda m: ran.append("adds") or traced_adds(m))
    monkeypatch.setattr(inspection, "_captured", lambda *a: ran.append("tensors") or captured(*a))
    return ran


def test_calls_with_one_mod_inspect_it_once(monkeypatch):
    ran = counting(monkeypatch)
    bias = torch.randn(2, 64, 64, requires_grad=True)

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    q = torch.randn(1, 2, 64, 16)
    for _ in range(3):
        attention(q, q, q, score_mod=rel).sum().backward()
    assert ran == ["tensors", "adds"]
    assert bias.grad is not None


def test_a_changed_closure_string_or_tensor_is_inspected_again(monkeypatch):
    ran = counting(monkeypatch)
    q = torch.randn(1, 2, 8, 4)
    table = torch.randn(8, 8)
    op = "add"

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx, kv_idx] if op == "add" else score * 2

    def check():
        expected = attention(q, q, q, score_mod=mod, backend="reference")
        torch.testing.assert_close(attention(q, q, q, score_mod=mod, backend="tiled"), expected)

    check()
    assert inspection.adds_to_score(mod)
    op = "scale"  # the closure's string: no longer an addition
    check()
    assert not inspection.adds_to_score(mod)
    op, table = "add", torch.randn(8, 8, requires_grad=True)
    leaf = q.clone().requires_grad_()
    attention(leaf, leaf, leaf, score_mod=mod).sum().backward()
    assert table.grad is not None  # the new tensor's gradient, found anew
    assert ran.count("adds") == 3


def test_a_cached_steps_shifted_mod_is_asked_as_the_mod_it_wraps(monkeypatch):
    ran = counting(monkeypatch)
    module = MultiHeadAttention(16, 16, 32, 0.0, 2).eval()
    slope = torch.tensor(-0.1)

    def distance(score, b, h, q_idx, kv_idx):
        return score + slope * (q_idx - kv_idx)

    cache = KVCache(1, 2, 32, module.head_dim)
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        full = module(x, score_mod=distance)
        module(x[:, :3], cache=cache, score_mod=distance)
        steps = [module(x[:, i : i + 1], cache=cache, score_mod=distance) for i in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 3:])
    assert ran.count("adds") == 1


def test_the_state_reads_what_a_module_or_partial_holds():
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = 1.0
            self.table = torch.nn.Parameter(torch.zeros(4))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score + self.scale * self.table[kv_idx]

    bias = Bias()
    before = memo.state_of(bias.forward)
    bias.scale = 2.0
    assert memo.state_of(bias.forward) != before
    bias.scale = 1.0
    assert memo.state_of(bias.forward) == before
    bias.table = torch.nn.Parameter(torch.zeros(4))  # another tensor
    assert memo.state_of(bias.forward) != before
    with torch.no_grad():
        bias.table.add_(1)  # its values: not part of the state
    assert memo.state_of(bias.forward) == memo.state_of(bias.forward)


CONFIG = types.ModuleType("config")  # a module a mod reads a setting from, as `config.op`
CONFIG.op = "add"


def test_a_setting_read_from_a_module_is_part_of_the_state(monkeypatch):
    ran = counting(monkeypatch)
    q = torch.randn(1, 2, 8, 4)

    def mod(score, b, h, q_idx, kv_idx):
        return score + 0.5 * (q_idx - kv_idx) if CONFIG.op == "add" else score * 2

    for op, adds in (("add", True), ("scale", False), ("add", True)):
        monkeypatch.setattr(CONFIG, "op", op)
        want = attention(q, q, q, score_mod=mod, backend="reference")
        torch.testing.assert_close(attention(q, q, q, score_mod=mod, backend="tiled"), want)
        assert inspection.adds_to_score(mod) is adds
    assert ran.count("adds") == 3


def test_each_layers_bound_mod_is_kept_apart(monkeypatch):
    ran = counting(monkeypatch)

    class Bias(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def mod(self, score, b, h, q_idx, kv_idx):
            return score + self.scale * (q_idx - kv_idx)

    layers = [Bias(0.1), Bias(0.2)]
    q = torch.randn(1, 2, 8, 4)
    for _ in range(3):
        for layer in layers:
            attention(q, q, q, score_mod=layer.mod)
    assert ran.count("adds") == 2  # once a layer, not once a call
