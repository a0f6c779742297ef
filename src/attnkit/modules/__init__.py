"""attnkit's attention modules: thin layers of projections and reshapes around one call to
[`attnkit.functional.attention`][attnkit.functional.attention]."""

from attnkit.modules.cross import AdditiveAttention, CrossAttention
from attnkit.modules.multihead import MultiHeadAttention
from attnkit.modules.single import CausalAttention, MultiHeadAttentionWrapper, SelfAttention

__all__ = [
    "AdditiveAttention",
    "CausalAttention",
    "CrossAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention",
]
