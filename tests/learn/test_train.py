"""The training loop on tiny settings: what it records, its schedule, and its determinism."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from attnkit.learn import Settings, learn
from attnkit.learn.train import learning_rate, snapshot_steps

TINY = {"steps": 6, "layers": 2, "heads": 2, "dim": 16, "context": 16}


@pytest.fixture(scope="module")
def copy_run():
    return learn("copy", **TINY, seed=3, progress=False)


def test_a_run_records_a_snapshot_at_step_0_and_at_the_end(copy_run):
    result = copy_run
    assert result.snapshot_steps[0] == 0 and result.snapshot_steps[-1] == 6
    assert result.snapshot_steps == sorted(set(result.snapshot_steps))
    s = len(result.snapshot_steps)
    for role, scores in result.scores.items():
        assert scores.shape == (s, 2, 2), role
        assert ((scores >= 0) & (scores <= 1)).all(), role
    assert result.weights.shape == (s, 2, 2, 16, 16)
    torch.testing.assert_close(result.weights.sum(-1), torch.ones(s, 2, 2, 16))
    assert result.steps[-1] == 6 and len(result.loss) == len(result.steps)
    assert result.score_steps == [0, *result.steps]  # the scores at each step of the curve
    assert result.scores_by_step["induction"].shape == (len(result.score_steps), 2, 2)
    assert len(result.loss_repeated) == len(result.loss_others) == len(result.steps)
    assert all(v > 0 for v in result.loss + result.held_out_loss)
    assert result.tokens_per_second > 0


def test_heads_json_holds_the_issues_schema(copy_run):
    data = copy_run.heads_json()
    assert {"task", "steps", "loss", "snapshot_steps", "heads"} <= set(data)
    assert data["task"] == "copy"
    assert [(h["layer"], h["head"]) for h in data["heads"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for head in data["heads"]:
        roles = {"previous_token", "first_token", "self", "induction"}
        assert set(head) == {"layer", "head", "scores_by_step", *roles}
        for role in ("previous_token", "first_token", "self", "induction"):
            assert len(head[role]) == len(data["snapshot_steps"])
            assert all(0 <= v <= 1 for v in head[role])
    # the copy task's loss on each part, and the held-out loss at each snapshot
    assert len(data["loss_repeated"]) == len(data["loss_others"]) == len(data["steps"])
    assert len(data["held_out_loss"]) == len(data["snapshot_steps"])
    json.dumps(data)  # plain JSON


def test_the_same_seed_gives_the_same_heads_json_and_another_seed_does_not(copy_run):
    again = learn("copy", **TINY, seed=3, progress=False)
    other = learn("copy", **TINY, seed=4, progress=False)
    assert json.dumps(again.heads_json()) == json.dumps(copy_run.heads_json())
    assert json.dumps(other.heads_json()) != json.dumps(copy_run.heads_json())


def test_the_text_task_learns_from_a_file_of_its_own(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat. " * 40)
    result = learn("text", text=path, **TINY, progress=False)
    assert result.task == "text" and result.loss_repeated is None
    assert "loss_repeated" not in result.heads_json()
    assert result.unigram_entropy is not None and result.unigram_entropy > 0
    assert any("loss" in line for line in result.summary())


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    settings = Settings.for_task("copy", steps=1000)
    lrs = [learning_rate(step, settings) for step in range(1000)]
    assert lrs[0] == pytest.approx(settings.lr / settings.warmup)
    assert max(lrs) == pytest.approx(settings.lr)
    assert lrs[settings.warmup] == pytest.approx(settings.lr)
    assert lrs[-1] == pytest.approx(settings.lr / 10, rel=1e-3)
    after = lrs[settings.warmup :]
    assert all(a >= b for a, b in itertools.pairwise(after))


def test_snapshot_steps_start_at_0_and_end_at_the_last_step():
    assert snapshot_steps(100, 4) == [0, 25, 50, 75, 100]
    assert snapshot_steps(3, 25) == [0, 1, 2, 3]  # never more snapshots than steps


def test_a_run_loads_no_cpp_kernel(monkeypatch):
    """A first build of a kernel takes half a minute or more of a 2-core machine: the snapshots'
    short probes must not ask for one (the decode kernel's products of 16 rows or fewer, the
    tiled kernel's weights)."""
    from attnkit.kernels import loader as _native

    loaded = []
    for name, kernel in _native.KERNELS.items():
        monkeypatch.setattr(kernel, "load", lambda name=name: loaded.append(name))
    learn("copy", **{**TINY, "context": 8}, progress=False)  # the drawn sequence: 8 rows
    assert loaded == []


def test_the_drawn_weights_are_those_of_the_drawn_tokens_alone(copy_run):
    """The drawn sequence is read with the probes, at full length: a causal model's weights
    among its first tokens are those it gives these tokens alone."""
    from attnkit.learn.tasks import make_task
    from attnkit.models import GPTModel

    task = make_task("copy", None, 16, seed=3)
    model = GPTModel(task.vocab_size, 16, 16, 2, 2, feed_forward=False).eval()
    n = len(task.labels)
    with torch.no_grad():
        _, whole = model(task.shown, need_weights=True)
        _, alone = model(task.shown[:, :n], need_weights=True)
    torch.testing.assert_close(whole[:, 0, :, :n, :n], alone[:, 0])
    assert copy_run.weights.shape[-1] == n
