"""Linear attention: the gated delta rule family (Gated DeltaNet, DeltaNet, gated linear attention),
the recurrent layers that today's hybrid models put beside softmax attention. Its entry point is
[`gated_delta_rule`][attnkit.linear.functional.gated_delta_rule]."""

from attnkit.linear.functional import gated_delta_rule, which_gated_delta_rule

__all__ = ["gated_delta_rule", "which_gated_delta_rule"]
