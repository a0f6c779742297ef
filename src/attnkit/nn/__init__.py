"""Drop-ins for PyTorch's own attention: the same names, signatures and results, on attnkit.

- [`attnkit.nn.MultiheadAttention`][attnkit.nn.multihead.MultiheadAttention] for
  ``torch.nn.MultiheadAttention`` (the same parameters: a ``state_dict`` loads both ways);
- [`attnkit.nn.swap`][attnkit.nn.swap.swap]: every ``torch.nn.MultiheadAttention`` of a model
  (``nn.Transformer`` and its layers too) made attnkit's, in place;
- [`attnkit.nn.functional.scaled_dot_product_attention`][attnkit.nn.functional.scaled_dot_product_attention]
  for ``torch.nn.functional.scaled_dot_product_attention``: a model that calls SDPA switches with
  one import line.
"""

from attnkit.nn import functional
from attnkit.nn.multihead import MultiheadAttention
from attnkit.nn.swap import swap

__all__ = ["MultiheadAttention", "functional", "swap"]
