"""The pictures of a run: each head's title says which sequences its scores were read on."""

from __future__ import annotations

import re

import pytest

from attnkit.learn import learn, previous_token_score
from attnkit.learn.roles import SCORES

pytest.importorskip("matplotlib")

TINY = {"steps": 4, "layers": 2, "heads": 2, "dim": 16, "context": 16}


@pytest.mark.parametrize("task", ["copy", "text"])
def test_each_title_gives_the_probes_score_and_the_drawn_sequences(task, tmp_path):
    from attnkit.learn.pictures import heads_figure

    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 40)
    result = learn(task, text=text if task == "text" else None, **TINY, progress=False)
    fig = heads_figure(result)
    weights = result.weights[-1]  # (L, h, t, t)
    scores = {role: s[-1] for role, s in result.scores.items()}  # (L, h) each
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 4
    assert "held-out probes, and on this sequence" in fig.get_suptitle()
    for k, title in enumerate(titles):
        layer, head = divmod(k, 2)
        assert title.startswith(f"layer {layer + 1} head {head + 1}\n")
        role, on_probes, *here = re.fullmatch(
            r"layer \d head \d\n([a-z-]+) (\d\.\d\d) on the probes(?:, (\d\.\d\d) here)?", title
        ).groups()
        role = role.replace("-", "_")
        assert float(on_probes) == pytest.approx(scores[role][layer, head].item(), abs=5e-3)
        if role == "induction" and task == "text":  # the drawn text is not written twice
            assert here == [None]
        else:
            drawn = SCORES[role](weights[layer, head]).item()
            assert float(here[0]) == pytest.approx(drawn, abs=5e-3)


def test_the_drawn_score_is_the_score_of_the_map_drawn():
    """The two numbers differ: the probes are other sequences than the one drawn."""
    from attnkit.learn.pictures import drawn_score

    result = learn("copy", **TINY, progress=False)
    weights = result.weights[-1, 0, 0]
    assert drawn_score(result, "previous_token", weights) == previous_token_score(weights).item()
    assert drawn_score(result, "induction", weights) is not None  # 8 tokens written twice
