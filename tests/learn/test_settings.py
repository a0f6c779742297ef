"""attnkit.learn.settings: each task's defaults, the settings a run is given in their place, and
the bounds they are checked against (the longest context follows from what a snapshot may hold)."""

from __future__ import annotations

import pytest

from attnkit.learn import Settings
from attnkit.learn.settings import DEFAULTS, MIN_CONTEXT, SNAPSHOT_BYTES, max_context
from attnkit.learn.tasks import PROBES


def test_defaults_differ_by_task_and_given_settings_replace_them():
    assert Settings.for_task("copy") == DEFAULTS["copy"]
    assert not DEFAULTS["copy"].feed_forward and DEFAULTS["text"].feed_forward
    assert Settings.for_task("text", num_heads=2, emb_dim=None).num_heads == 2


@pytest.mark.parametrize(
    "task, given, error, message",
    [
        ("poems", {}, ValueError, "task must be one of text, copy, got 'poems'"),
        ("copy", {"steps": 0}, ValueError, "steps must be >= 1, got 0"),
        ("copy", {"emb_dim": 30, "num_heads": 4}, ValueError, r"dim \(30\) .* heads \(4\)"),
        ("copy", {"num_layers": 1.5}, TypeError, "num_layers must be an int, got float"),
        ("copy", {"context_length": 2.5}, TypeError, "--context must be an int, got float"),
        ("copy", {"context_length": 7}, ValueError, "--context must be >= 8 for --task copy"),
        # the longest context follows the layers and heads: a snapshot's weights stay < 1 GiB
        ("text", {"num_heads": 8, "context_length": 714}, ValueError, "<= 713 with 2 layers"),
    ],
)
def test_bad_settings_are_named(task, given, error, message):
    with pytest.raises(error, match=message):
        Settings.for_task(task, **given)


@pytest.mark.parametrize(("layers", "heads"), [(2, 4), (1, 1), (6, 12)])
def test_the_longest_context_is_the_longest_whose_snapshot_weights_fit(layers, heads):
    def snapshot_bytes(context):  # every head's float32 (t, t) weights on each probe sequence
        return 4 * (2 * PROBES + 1) * layers * heads * context**2

    high = max_context(layers, heads)
    assert snapshot_bytes(high) <= SNAPSHOT_BYTES < snapshot_bytes(high + 1)
    shape = {"num_layers": layers, "num_heads": heads, "emb_dim": 12 * heads}
    assert Settings.for_task("text", **shape, context_length=high).context_length == high
    with pytest.raises(ValueError, match=f"--context must be <= {high} with {layers} layers"):
        Settings.for_task("text", **shape, context_length=high + 1)


def test_every_tasks_default_context_lies_within_its_bounds():
    for task, settings in DEFAULTS.items():
        assert MIN_CONTEXT[task] <= settings.context_length
        assert settings.context_length <= max_context(settings.num_layers, settings.num_heads)
