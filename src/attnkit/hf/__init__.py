"""attnkit inside Hugging Face transformers models: ``attn_implementation="attnkit"``.

[`register`][attnkit.hf.register] adds an attention function and a mask builder to transformers'
``AttentionInterface`` and ``AttentionMaskInterface``. Every model that calls attention through
that interface (Llama, Qwen, Mistral, Gemma, GPT-OSS, Phi, OLMo, SmolLM, GPT-2, BERT, ModernBERT,
...) then runs it on [`attention`][attnkit.functional.attention]: its C++ kernels with soft-capping,
sliding windows and learned sinks, with a backward in O(N) memory, and no dense mask outside
``torch.compile``.

Example:
    >>> import attnkit.hf
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> name = attnkit.hf.register()
    >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(config)
    >>> model.set_attn_implementation(name)
    >>> model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 64])

Importing this module registers the name ``"attnkit"`` already, so that
``from_pretrained(..., attn_implementation="attnkit")`` works after ``import attnkit.hf`` alone.
Models that do not call transformers' attention interface (Falcon, and others whose class says
``_supports_attention_backend = False``) never reach it: [`use`][attnkit.hf.use] warns of them.

transformers is an optional extra (``pip install 'attnkit[hf]'``); ``import attnkit`` does not
import it, this module does.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

try:
    import transformers  # noqa: F401  (the optional extra: say how to install it)
except ModuleNotFoundError as missing:
    if missing.name != "transformers":  # transformers is there, one of its own imports is not
        raise
    raise ModuleNotFoundError(
        "attnkit.hf needs Hugging Face transformers: pip install 'attnkit[hf]'", name=missing.name
    ) from None

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from attnkit._tracing import traced
from attnkit.functional import attention
from attnkit.hf.masks import HFMask, mask_builder
from attnkit.masks import selection_mask
from attnkit.varlen import document_mask


def register(name: str = "attnkit") -> str:
    """Register attnkit in transformers under ``name`` (again: the same); returns ``name``, for
    ``from_pretrained(..., attn_implementation=name)``, ``from_config`` or
    ``model.set_attn_implementation(name)``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    AttentionInterface.register(name, attention_function)
    AttentionMaskInterface.register(name, mask_builder)
    return name


def supports(model: nn.Module | type) -> bool:
    """Whether ``model`` (a transformers model or its class) calls attention through
    transformers' ``AttentionInterface``, the only way attnkit reaches it: whether the modeling
    code of its class (or of a class it derives from) holds the interface's table. Those that do
    not (Falcon, BLOOM, MPT, GPT-Neo, say) keep their own attention whatever
    ``attn_implementation`` says."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cls = model if isinstance(model, type) else type(model)
    for klass in cls.__mro__:
        name = klass.__module__
        if name.startswith("transformers.") and not name.startswith("transformers.models."):
            continue  # PreTrainedModel's own module holds the table for every model
        module = sys.modules.get(name)
        if module is not None and any(v is ALL_ATTENTION_FUNCTIONS for v in vars(module).values()):
            return True
    return False


def use(model: nn.Module, name: str = "attnkit") -> nn.Module:
    """``model`` set to run its attention on attnkit (registered as ``name``), returned; a
    ``UserWarning`` where its class does not call transformers' attention interface and keeps
    its own attention (nothing changes then)."""
    if not supports(model):
        warnings.warn(
            f"{type(model).__name__} does not call transformers' AttentionInterface, so its "
            "attention stays its own (not attnkit's); see attnkit's Hugging Face guide for the "
            "families that do",
            UserWarning,
            stacklevel=2,
        )
        return model
    model.set_attn_implementation(register(name))
    return model


def attention_function(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: HFMask | Tensor | BlockMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface on attnkit: ``query`` ``(b, h, t, d)``, ``key`` and
    ``value`` ``(b, h_kv, s, d)`` (grouped heads are not repeated) -> ``(out (b, t, h, d)
    contiguous, weights (b, h, t, s) or None)``.

    The mask is what [`mask_builder`][attnkit.hf.masks.mask_builder] kept (or a 4-D mask or
    ``BlockMask`` of the user's, honoured as given; a float mask's minimum of its dtype counts as
    masked). Without one, ``is_causal`` (else ``module.is_causal``) and ``sliding_window`` (HF's:
    the query and the ``w - 1`` keys before it) say which keys a query sees. Packed sequences
    come from ``cu_seq_lens_q``/``cu_seq_lens_k``, or else from ``position_ids`` that restart,
    when the mask says nothing of them. ``s_aux`` are learned sinks; ``softcap``, ``scaling``
    and ``dropout`` as named. Weights are returned, exact and differentiable, where
    ``output_attentions`` asks for them (after dropout, as eager's); the output is then their
    product with the values, as eager's, so that a gradient reaches them from the output.
    """
    options: dict[str, Any] = {"scale": scaling, "softcap": softcap, "sinks": s_aux}
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    width = key.shape[2]  # the weights' columns, as eager returns them
    if isinstance(attention_mask, HFMask):
        keys, masks = attention_mask.options(key.shape[2], query.device)
        key, value = key[:, :, :keys], value[:, :, :keys]
    else:
        masks = _given(attention_mask, is_causal, sliding_window)
    masks = _packed(masks, query, key, kwargs)
    if kwargs.get("indices") is not None:  # the keys a query's indexer chose (DeepSeek-V3.2)
        masks = _with_selection(masks, kwargs["indices"], key.shape[2], dropout)
    if position_bias is not None:  # an additive bias of the model's (T5-like)
        masks["attn_mask"] = _sum(masks.get("attn_mask"), position_bias.to(query.dtype))
    weights = _wants_weights(module, kwargs)
    result = attention(  # the weights after dropout, as eager returns them
        query,
        key,
        value,
        **masks,
        **options,
        dropout_p=dropout,
        return_weights=weights and "dropped",
    )
    out, attn_weights = result if weights else (result, None)
    if attn_weights is not None:  # the output made from them, as eager's: a gradient reaches them
        out = _from_weights(attn_weights, value)
    if attn_weights is not None and attn_weights.shape[-1] < width:  # a static cache's empty slots
        attn_weights = torch.nn.functional.pad(attn_weights, (0, width - attn_weights.shape[-1]))
    return out.transpose(1, 2).contiguous(), attn_weights


_DENSE_ONLY = ("attn_mask", "block_mask", "mask_mod", "score_mod")
"""Masks the sparse backend does not take: with one of them, the selection joins it as a mask."""


def _with_selection(masks: dict[str, Any], indices: Tensor, s: int, dropout: float) -> dict:
    """``masks`` with the keys ``indices`` ``(b, t, n)`` selects for each query: as ``indices``
    (the sparse backend, ``O(t n d)``), those past the keys given unused (a static cache's empty
    slots); as a dense mask where another mask or dropout needs a dense backend."""
    if dropout or any(masks.get(name) is not None for name in _DENSE_ONLY):
        return {
            **masks,
            "attn_mask": _both(masks.get("attn_mask"), selection_mask(indices[:, None], 1, s)),
        }
    return {**masks, "indices": indices.masked_fill(indices >= s, -1)}


def _both(mask: Tensor | None, selected: Tensor) -> Tensor:
    """``mask`` (bool, True = may attend, or float, added) where ``selected`` too."""
    if mask is None:
        return selected
    if mask.dtype == torch.bool:
        return mask & selected
    return mask.masked_fill(~selected, float("-inf"))


def _from_weights(weights: Tensor, value: Tensor) -> Tensor:
    """``weights @ value``, each group of query heads on its key/value head:
    ``(b, h, t, s) x (b, h_kv, s, d) -> (b, h, t, d)``."""
    b, h, t, s = weights.shape
    h_kv = value.shape[1]
    grouped = weights.reshape(b, h_kv, h // h_kv, t, s)  # (b, h_kv, g, t, s)
    return (grouped @ value[:, :, None]).reshape(b, h, t, value.shape[-1])


def _wants_weights(module: nn.Module, kwargs: dict) -> bool:
    """Whether the model returns this layer's weights: ``output_attentions`` passed down, or
    transformers' output recorder collecting attentions (models that do not pass it down)."""
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without the recorder passes output_attentions down
        return False
    collected = _active_collector.get()
    return bool(collected) and any(key.endswith("attentions") for key in collected)


def _given(mask, is_causal: bool, sliding_window: int | None) -> dict[str, Any]:
    """The options for a mask that the model or the user built, or none."""
    if mask is None:
        window = None if sliding_window is None else (sliding_window - 1, 0 if is_causal else -1)
        return {"causal": bool(is_causal), "window": window}
    if isinstance(mask, BlockMask):
        return {"block_mask": mask}
    if not isinstance(mask, Tensor):
        raise TypeError(
            "attention_mask must be a tensor, a BlockMask or what attnkit's mask builder makes, "
            f"got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and mask.is_floating_point():  # the dtype's minimum: masked
        mask = mask.masked_fill(mask == torch.finfo(mask.dtype).min, float("-inf"))
    return {"attn_mask": mask}


def _packed(masks: dict[str, Any], query: Tensor, key: Tensor, kwargs: dict) -> dict[str, Any]:
    """``masks`` with packed sequences, where the mask says nothing of them: from flash
    attention's ``cu_seq_lens_q``/``cu_seq_lens_k``, or from ``position_ids`` that restart, in a
    batch of one row whose queries are its keys (as transformers' flash path reads them)."""
    if query.shape[0] != 1 or {"block_mask", "mask_mod", "attn_mask"} & masks.keys():
        return masks
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    documents = None
    positions = kwargs.get("position_ids")
    restart = positions is not None and query.shape[2] == key.shape[2] > 1 and not traced()
    if cu_q is None and restart and positions.numel() == query.shape[2]:
        positions = positions.reshape(-1)
        documents = torch.cat([positions.new_zeros(1), positions[1:] != positions[:-1] + 1])
        if not bool(documents.any()):  # one sequence (reading it back: not under a trace)
            return masks
        documents = documents.cumsum(0)
    if cu_q is None and documents is None:
        return masks
    masks = dict(masks)
    causal, window = masks.pop("causal", False), masks.pop("window", None)
    masks["block_mask"] = document_mask(
        None if documents is None else documents.to(query.device),
        cu_seqlens=None if cu_q is None else cu_q.to(query.device),
        cu_seqlens_k=None if cu_k is None else cu_k.to(query.device),
        causal=causal,
        window=window,
        device=query.device,
    )
    return masks


def _sum(a: Tensor | None, b: Tensor) -> Tensor:
    if a is None:
        return b
    if a.dtype == torch.bool:
        a = torch.zeros_like(b).masked_fill(~a, float("-inf"))
    return a + b


register()

__all__ = ["HFMask", "attention_function", "mask_builder", "register", "supports", "use"]
