"""The linear-attention layers of Hugging Face models on attnkit: the Gated DeltaNet layers of
Qwen3-Next and Qwen3.5 run [`gated_delta_rule`][attnkit.linear.functional.gated_delta_rule].

transformers calls two module-level functions of each such model's modeling file,
``torch_chunk_gated_delta_rule`` (a prompt, training) and ``torch_recurrent_gated_delta_rule`` (a
decoding step), wherever flash-linear-attention is not installed (a CPU: its kernels need a GPU).
transformers' own way to swap them (its kernels hub) downloads them, so
[`use_gated_delta_rule`][attnkit.hf.linear.use_gated_delta_rule] replaces both in the modeling
modules instead, in one place, as Liger-Kernel replaces a model's functions, and returns the undo.
attnkit's takes the same arguments and also runs packed sequences (``cu_seqlens``), which
transformers refuses there without flash-linear-attention; the short convolution before it
(``causal_conv1d_fn``) is replaced too, so that no packed sequence reads another's inputs.

Example:
    >>> from attnkit.hf.linear import use_gated_delta_rule
    >>> undo = use_gated_delta_rule()  # before or after the model is made: looked up per call
    >>> undo()  # transformers' own functions again
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.linear import gated_delta_rule

MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
"""The transformers models (``transformers.models.<name>``) whose Gated DeltaNet layers it runs."""

FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn")
"""The functions of their modeling modules it replaces: the delta rule's two, and the short
convolution before it, which transformers' reference runs across the boundaries of packed
sequences."""


def transformers_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    **ignored: object,
) -> tuple[Tensor, Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` on
    attnkit: the same arguments (``chunk_size`` and the other keywords transformers passes on are
    attnkit's to choose, and ignored) and the same results."""
    return gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )


def transformers_causal_conv1d(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    cu_seq_lens_q: Tensor | None = None,
    **ignored: object,
) -> Tensor:
    """transformers' ``causal_conv1d_fn`` (a depthwise causal convolution over ``(b, c, t)``,
    ``weight`` ``(c, w)``), each packed sequence from zeros: no sequence reads another's inputs."""
    width = weight.shape[-1]
    x = hidden_states.to(weight.dtype)
    bounds = [0, x.shape[-1]] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    if bounds[-1] != x.shape[-1]:  # a cache's state before the inputs: packing is not for caches
        raise ValueError(
            f"packed sequences (cu_seq_lens_q ending at {bounds[-1]}) over {x.shape[-1]} inputs of "
            "the convolution: run packed sequences with use_cache=False"
        )
    parts = [
        F.conv1d(F.pad(x[..., start:end], (width - 1, 0)), weight[:, None], bias, groups=x.shape[1])
        for start, end in itertools.pairwise(bounds)
    ]
    out = torch.cat(parts, dim=-1)
    if activation is not None:
        out = _ACTIVATIONS[activation](out)
    return out.to(hidden_states.dtype)


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}
"""The activations the models name for their convolution."""


_REPLACEMENTS = {
    "torch_chunk_gated_delta_rule": transformers_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": transformers_gated_delta_rule,
    "causal_conv1d_fn": transformers_causal_conv1d,
}


def use_gated_delta_rule(models: tuple[str, ...] = MODELS) -> Callable[[], None]:
    """Run the Gated DeltaNet layers of ``models`` on attnkit, in every model of theirs made before
    or after (transformers looks the functions up at each call). Returns the undo, which puts
    transformers' functions back.

    Raises:
        ValueError: a model that transformers does not have here, or whose modeling module has no
            such function.
    """
    replaced: list[tuple[object, str, object]] = []
    for model in models:
        try:
            module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        except ModuleNotFoundError:
            raise ValueError(f"transformers has no model {model!r} here") from None
        for name in FUNCTIONS:
            if not hasattr(module, name):
                raise ValueError(f"transformers.models.{model} has no {name} to replace")
            replaced.append((module, name, getattr(module, name)))
    for module, name, _ in replaced:
        setattr(module, name, _REPLACEMENTS[name])

    def undo() -> None:
        for module, name, original in replaced:
            setattr(module, name, original)

    return undo
