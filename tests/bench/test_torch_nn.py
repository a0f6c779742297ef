"""attnkit bench --torch-nn: torch's encoder before and after swap, measured in one run."""

from __future__ import annotations

from attnkit.bench.torch_nn import EncoderCase, TorchNNConfig, markdown, run_torch_nn, step_of


def test_each_case_is_measured_and_attnkit_is_compared_with_torch(tmp_path):
    config = TorchNNConfig(
        dtypes=("fp32",), models=("encoder",), dropouts=(0.1,), repeats=1, warmups=0, shrink=32
    )
    record = run_torch_nn(config, stream=open(tmp_path / "progress", "w"))  # noqa: SIM115
    rows = record["rows"]
    assert [r["impl"] for r in rows] == ["torch", "attnkit"]
    assert all(r["median_s"] > 0 and len(r["times"]) == 1 for r in rows)
    assert rows[0]["vs_torch"] == 1.0 and rows[1]["vs_torch"] > 0
    assert all("peak_mib" in r for r in rows), rows
    assert "| encoder | fp32 | 0.1 | attnkit |" in markdown(record)


def test_the_swapped_model_runs_attnkits_module():
    case = EncoderCase(impl="attnkit", d_model=16, heads=2, layers=1, ff=32, seq=8, batch=2)
    model, step = step_of(case)
    assert type(model.layers[0].self_attn).__module__ == "attnkit.nn.multihead"
    step()
    assert model.layers[0].self_attn.in_proj_weight.grad is not None


def test_each_model_trains_one_step_on_each_side():
    """The nanoGPT blocks call the SDPA function of their side; the weights model returns them."""
    for model_name in ("encoder weights", "nanogpt"):
        for impl in ("torch", "attnkit"):
            case = EncoderCase(impl=impl, model=model_name, d_model=16, heads=2, layers=1, ff=32)
            model, step = step_of(EncoderCase(**{**case.__dict__, "seq": 8, "batch": 2}))
            step()
            assert all(p.grad is not None for p in model.parameters())
    blocks, _ = step_of(EncoderCase(impl="attnkit", model="nanogpt", d_model=16, heads=2, ff=32))
    assert blocks[0].sdpa.__module__ == "attnkit.nn.functional"
