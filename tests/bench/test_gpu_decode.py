"""attnkit.bench.gpu_decode: one decoding step on a GPU against its copy bandwidth. The run needs a
GPU (marked ``gpu``); its table is checked from a record of the run's form."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.bench import gpu_decode

RECORD = {
    "config": {"b": 8, "h": 32, "kv_heads": 8, "d": 128, "length": 32768, "repeats": 50,
               "warmups": 5, "device": "cuda"},
    "machine": {"gpu": "a GPU", "driver": "580", "cuda": "13.0", "torch": "2.11"},
    "bytes_read": 2 * 8 * 8 * 32768 * 128 * 2,
    "copy_gbps": 3000.0,
    "runs": "decode kernel",
    "rows": [
        {"impl": "attnkit", "ms": 0.5, "gbps": 2147.5, "pct_copy": 71.6},
        {"impl": "torch-sdpa", "ms": 0.6, "gbps": 1789.6, "pct_copy": 59.7},
    ],
    "date": "2026-11-29",
}  # fmt: skip


def test_the_table_names_the_step_and_each_implementations_share_of_the_copy():
    table = gpu_decode.markdown(RECORD)
    assert "b=8, 32 query heads over 8 cached heads of 128, 32768 bf16 tokens (1024 MiB" in table
    assert "| attnkit (decode kernel) | 0.500 | 2148 | 72 |" in table
    assert "| torch-sdpa | 0.600 | 1790 | 60 |" in table


def test_the_record_is_written_with_its_table(tmp_path):
    written = gpu_decode.write_gpu_decode(RECORD, tmp_path)
    paths = list(written.values())
    assert all(p.exists() for p in paths)
    json_path = next(p for p in paths if p.suffix == ".json")
    assert json.loads(json_path.read_text())["rows"] == RECORD["rows"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_small_run_on_the_gpu_reads_the_cache_once_a_step():
    config = gpu_decode.GPUDecodeConfig(b=1, h=4, kv_heads=2, d=64, length=4096, repeats=3,
                                        warmups=1)  # fmt: skip
    record = gpu_decode.run_gpu_decode(config)
    assert record["bytes_read"] == 2 * 1 * 2 * 4096 * 64 * 2
    assert [row["impl"] for row in record["rows"]] == [
        "attnkit",
        "attnkit, keys read",
        "torch-sdpa",
    ]
    assert all(row["ms"] > 0 and row["pct_copy"] > 0 for row in record["rows"])
