"""attnkit: attention mechanisms on PyTorch, from the textbook's first dot product to fused kernels.

The layers, bottom up: input checks (``_checks``) and one mask convention ([`attnkit.masks`][attnkit.masks],
True = may attend, causal aligned bottom-right); backends in a small registry
([`attnkit.backends`][attnkit.backends]); the one entry point [`attnkit.functional.attention`][attnkit.functional.attention]; thin modules
([`attnkit.modules`][attnkit.modules]); the chapter's first steps ([`attnkit.textbook`][attnkit.textbook]); and for decoding, a
preallocated [`KVCache`][attnkit.cache.KVCache] and [`RotaryEmbedding`][attnkit.positions.RotaryEmbedding] positions.
"""

from attnkit import functional
from attnkit.block_mask import create_block_mask
from attnkit.cache import KVCache
from attnkit.flex import flex_attention
from attnkit.functional import attention
from attnkit.latent_cache import LatentCache
from attnkit.linear import gated_delta_rule
from attnkit.masks import alibi_slopes, causal_mask, window_mask
from attnkit.modules import (
    AdditiveAttention,
    CausalAttention,
    CrossAttention,
    GatedDeltaNet,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    MultiHeadLatentAttention,
    SelfAttention,
)
from attnkit.positions import RotaryEmbedding
from attnkit.state_cache import StateCache
from attnkit.textbook import AttentionResult, attend, simple_self_attention
from attnkit.varlen import document_mask, varlen_attention

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "AttentionResult",
    "CausalAttention",
    "CrossAttention",
    "GatedDeltaNet",
    "KVCache",
    "LatentCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "RotaryEmbedding",
    "SelfAttention",
    "StateCache",
    "__version__",
    "alibi_slopes",
    "attend",
    "attention",
    "causal_mask",
    "create_block_mask",
    "document_mask",
    "flex_attention",
    "functional",
    "gated_delta_rule",
    "simple_self_attention",
    "varlen_attention",
    "window_mask",
]
