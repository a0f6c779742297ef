"""attnkit's attention modules: thin layers of projections and reshapes around one call to
[`attnkit.functional.attention`][attnkit.functional.attention] (or, for the linear-attention layer
``GatedDeltaNet``, to [`attnkit.gated_delta_rule`][attnkit.linear.functional.gated_delta_rule]);
``MultiHeadLatentAttention`` keeps a compressed latent instead of keys and values."""

from attnkit.modules.cross import AdditiveAttention, CrossAttention
from attnkit.modules.deltanet import GatedDeltaNet
from attnkit.modules.latent import MultiHeadLatentAttention
from attnkit.modules.multihead import MultiHeadAttention
from attnkit.modules.single import CausalAttention, MultiHeadAttentionWrapper, SelfAttention

__all__ = [
    "AdditiveAttention",
    "CausalAttention",
    "CrossAttention",
    "GatedDeltaNet",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "SelfAttention",
]
