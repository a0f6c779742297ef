"""Watch attention learn: train the book's small GPT on a CPU in minutes and record how its heads
specialise (``attnkit learn``).

- [`learn`][attnkit.learn.train.learn]: the run, as a function;
- [`attnkit.learn.tasks`][attnkit.learn.tasks]: English characters, or the copy task on which
  induction heads form;
- [`attnkit.learn.roles`][attnkit.learn.roles]: the scores of a head's roles (previous token,
  first token, self, induction);
- [`attnkit.learn.record`][attnkit.learn.record]: what a run records, ``heads.json``;
- [`attnkit.learn.outputs`][attnkit.learn.outputs], [`pictures`][attnkit.learn.pictures] and
  [`page`][attnkit.learn.page]: the files, the PNGs (the 'plots' extra) and the HTML page.
"""

from attnkit.learn.outputs import write_outputs
from attnkit.learn.record import LearnResult
from attnkit.learn.roles import (
    first_token_score,
    induction_score,
    previous_token_score,
    role_scores,
    self_score,
)
from attnkit.learn.settings import Settings
from attnkit.learn.train import learn

__all__ = [
    "LearnResult",
    "Settings",
    "first_token_score",
    "induction_score",
    "learn",
    "previous_token_score",
    "role_scores",
    "self_score",
    "write_outputs",
]
