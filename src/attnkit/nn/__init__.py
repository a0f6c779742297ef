"""Drop-ins for PyTorch's own attention: the same names, signatures and results, on attnkit.

- [`attnkit.nn.functional.scaled_dot_product_attention`][attnkit.nn.functional.scaled_dot_product_attention]
  for ``torch.nn.functional.scaled_dot_product_attention``: a model that calls SDPA switches with
  one import line.
"""

from attnkit.nn import functional

__all__ = ["functional"]
