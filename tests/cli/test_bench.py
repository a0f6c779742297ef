"""``attnkit bench``'s checks of its arguments, made before any work (its runs: tests/bench/)."""

from __future__ import annotations

import pytest
import torch

from attnkit.cli import main


@pytest.mark.parametrize("timeout", ["0", "-1", "inf"])
def test_bench_refuses_a_timeout_that_is_not_a_positive_number(timeout, capsys):
    assert main(["bench", "--smoke", "--timeout", timeout]) == 2
    assert "--timeout must be a positive number of seconds" in capsys.readouterr().err


def test_bench_checks_its_output_folder_before_any_work(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "folder"
    assert main(["bench", "--smoke", "--out", str(missing)]) == 2
    assert f"{tmp_path / 'no' / 'such'} is not a directory" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["bench", "--smoke", "--out", str(a_file)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_bad_bench_arguments_exit_2(capsys):
    assert main(["bench", "--n", "0"]) == 2
    assert capsys.readouterr().err.strip() == "attnkit: error: --n must be >= 1, got 0"


def test_ring_bench_rejects_lengths_the_ranks_cannot_split(capsys):
    assert main(["bench", "--ring", "--smoke", "--n", "250", "--ranks", "4"]) == 2
    assert "--n 250 must split into 2 x 4 equal chunks" in capsys.readouterr().err


def test_decode_bench_rejects_kv_heads_that_do_not_divide_h(capsys):
    assert main(["bench", "--decode", "--smoke", "--h", "6", "--kv-heads", "4"]) == 2
    assert "--h (6) must be a multiple of every --kv-heads, got 4" in capsys.readouterr().err


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without CUDA"
)
def test_a_gpu_bench_without_a_gpu_says_so(capsys):
    assert main(["bench", "--device", "cuda", "--smoke"]) == 2
    assert capsys.readouterr().err.strip() == (
        "attnkit: error: --device cuda: torch sees no CUDA device here"
    )


def test_a_gpu_bench_runs_the_kernel_and_decoding_cases_only(capsys):
    assert main(["bench", "--device", "cuda", "--ring"]) == 2
    assert "--device cuda runs the kernel cases and --decode; not --ring" in capsys.readouterr().err
