"""What ``attnkit bench`` measures: one [`Case`][attnkit.bench.peers.Case] per (implementation, shape, dtype, options),
and [`prepare`][attnkit.bench.peers.prepare], which allocates a case's inputs and returns the call to time.

Kernel cases take ``q, k, v`` ``(b, h, n, d)``; module cases take ``x`` ``(b, n, e)`` with
``e = h * d`` and include the projections. The peers are what a PyTorch user would otherwise run:
the naive materialised formula, torch SDPA (its default CPU kernel and its math kernel),
``torch.nn.MultiheadAttention`` and FlexAttention compiled (forward only on a CPU: it has no CPU
backward). A case runs on the CPU or, with ``device="cuda"``, on the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit
from attnkit.backends import BackendChoice
from attnkit.bench import flex_cases
from attnkit.functional import attention, which_backend

KERNEL_IMPLS = (
    "naive",
    "torch-sdpa",
    "torch-sdpa-math",
    "flex-compiled",
    "attnkit-auto",
    "attnkit-tiled",
    "attnkit-reference",
    "attnkit-builtin",
)
MODULE_IMPLS = ("torch-mha", "torch-proj+sdpa", "attnkit-mha")
# score modifiers ("plain" has none), then user-written functions (bench/flex_cases.py)
VARIANTS = ("plain", "alibi", "softcap", "window", "sinks", *flex_cases.FLEX_VARIANTS)
WINDOW = 256  # the sliding window of the "window" variant
SOFTCAP = 30.0


@dataclass(frozen=True)
class Case:
    """One measurement. ``mode`` is "fwd" or "fwd+bwd"; ``group`` "kernel" or "module"."""

    impl: str
    n: int
    dtype: str
    causal: bool
    mode: str
    variant: str = "plain"
    group: str = "kernel"
    b: int = 1
    h: int = 12
    d: int = 64
    device: str = "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def flops(self) -> float:
        """Forward ``4 b h t s d`` (halved for causal), backward 2.5x that (flash-attn's count);
        a window counts only the keys it keeps."""
        keys = min(self.n, WINDOW) if self.variant == "window" else self.n
        forward = 4.0 * self.b * self.h * self.n * keys * self.d
        if self.causal and self.variant != "window":
            forward /= 2
        return forward * (3.5 if self.mode == "fwd+bwd" else 1.0)

    @property
    def label(self) -> str:
        extra = "" if self.variant == "plain" else f" {self.variant}"
        return f"{self.impl}{extra}"

    def key(self) -> tuple:
        """What a row of the report compares across implementations."""
        return (self.group, self.variant, self.n, self.dtype, self.causal, self.mode)

    def to_json(self) -> dict:
        return asdict(self)


def supported(case: Case) -> str | None:
    """Why a case cannot run at all (reported, not dropped), or None."""
    if case.impl == "flex-compiled" and case.mode == "fwd+bwd" and case.device == "cpu":
        return "n/a: FlexAttention has no backward on CPU"
    if case.variant == "sinks" and case.impl not in ("torch-sdpa", "attnkit-auto"):
        return "n/a: measured against plain SDPA (torch has no sinks)"
    if case.variant in flex_cases.FLEX_VARIANTS or case.impl == "attnkit-builtin":
        return flex_cases.supported(case.impl, case.variant)
    if (
        case.impl in ("torch-sdpa", "torch-sdpa-math", "flex-compiled")
        and case.variant == "softcap"
    ):
        return "n/a: no soft-capping"
    return None


def _score_options(case: Case) -> dict:
    if case.variant == "alibi":
        return {"alibi_slopes": attnkit.alibi_slopes(case.h).to(case.device)}
    if case.variant == "sinks":
        return {"sinks": torch.linspace(-1.0, 1.0, case.h, device=case.device)}
    if case.variant == "softcap":
        return {"softcap": SOFTCAP}
    if case.variant == "window":
        return {"window": (WINDOW - 1, 0) if case.causal else (WINDOW // 2, (WINDOW - 1) // 2)}
    return {}


def _naive(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
    """The materialised formula a user writes by hand, in the inputs' dtype."""
    n = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if case.variant == "softcap":
        scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
    position = torch.arange(n, device=q.device)
    distance = position[:, None] - position
    if case.variant == "alibi":
        slopes = attnkit.alibi_slopes(case.h).to(q)[:, None, None]
        scores = scores - slopes * distance.abs().to(q.dtype)
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if case.causal:
        allowed &= distance >= 0
    if case.variant == "window":
        left, right = _score_options(case)["window"]
        allowed &= (distance <= left) & (distance >= -right)
    if case.causal or case.variant == "window":
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _sdpa_call(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
    options = _score_options(case)
    if not options or case.variant == "sinks":  # torch has no sinks: plain SDPA, the baseline
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    # what a user of SDPA does for ALiBi or a window: a dense float mask
    n = q.shape[-2]
    bias = torch.zeros(case.h, n, n, dtype=q.dtype, device=q.device)
    if "alibi_slopes" in options:
        bias = attnkit.masks.alibi_bias(options["alibi_slopes"].to(q.dtype), n, n)
    positions = options.get("window", (-1, 0) if case.causal else (-1, -1))
    allowed = attnkit.window_mask(n, n, positions).to(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~allowed, -math.inf))


def _flex(case: Case) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)  # CPU flex needs static shapes
    block_mask = score_mod = None
    left, right = _score_options(case).get("window", (-1, 0) if case.causal else (-1, -1))
    if left >= 0 or right >= 0:

        def mask_mod(b, h, q_idx, kv_idx):
            distance = q_idx - kv_idx
            keep = (distance <= left) if left >= 0 else (distance == distance)
            return keep & (distance >= -right) if right >= 0 else keep

        block_mask = create_block_mask(mask_mod, None, None, case.n, case.n, device=case.device)
    if case.variant == "alibi":
        slopes = attnkit.alibi_slopes(case.h).to(case.device)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, score_mod=score_mod)


def _kernel_fn(case: Case) -> tuple[Callable[[Tensor, Tensor, Tensor], Tensor], list[Tensor]]:
    """The call that runs ``case`` on q, k, v, and the tensors besides them that it trains."""
    if case.variant in flex_cases.FLEX_VARIANTS:
        grad = case.mode == "fwd+bwd"
        return flex_cases.kernel_fn(case.impl, case.variant, case.n, case.h, grad, case.device)
    return _modifier_fn(case), []


def _modifier_fn(case: Case) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    options = _score_options(case)
    if case.impl == "naive":
        return lambda q, k, v: _naive(q, k, v, case)
    if case.impl == "torch-sdpa":
        return lambda q, k, v: _sdpa_call(q, k, v, case)
    if case.impl == "torch-sdpa-math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def math_sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return _sdpa_call(q, k, v, case)

        return math_sdpa
    if case.impl == "flex-compiled":
        return _flex(case)
    backend = case.impl.removeprefix("attnkit-")
    return lambda q, k, v: attention(q, k, v, causal=case.causal, backend=backend, **options)


def _module_fn(case: Case) -> tuple[Callable[[Tensor], Tensor], torch.nn.Module]:
    e, dtype = case.h * case.d, case.torch_dtype
    torch_mha = torch.nn.MultiheadAttention(
        e, case.h, batch_first=True, dtype=dtype, device=case.device
    ).eval()
    if case.impl == "torch-mha":
        mask = None
        if case.causal:
            mask = torch.nn.Transformer.generate_square_subsequent_mask(case.n, device=case.device)

        def run(x):
            return torch_mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=case.causal)[0]

        return run, torch_mha
    if case.impl == "torch-proj+sdpa":  # the projections and SDPA written out by hand

        def proj_sdpa(x):
            b, n, _ = x.shape
            qkv = F.linear(x, torch_mha.in_proj_weight, torch_mha.in_proj_bias)
            q, k, v = qkv.view(b, n, 3, case.h, case.d).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
            return torch_mha.out_proj(out.transpose(1, 2).reshape(b, n, e))

        return proj_sdpa, torch_mha
    ours = attnkit.MultiHeadAttention.from_torch(torch_mha).eval()
    ours.causal = case.causal
    return ours, ours


def path_of(choice: BackendChoice) -> str:
    """A [`attnkit.backends.BackendChoice`][attnkit.backends.BackendChoice] as a table shows it: ``"tiled native
    bf16-avx512_bf16"``, ``"decode native float32"``, ``"sdpa torch"``."""
    products = choice.products if choice.products != choice.path else None
    return " ".join(filter(None, (choice.backend, choice.path, products)))


def runs(case: Case) -> str | None:
    """For an attnkit kernel case, the backend, path and block products that run it, as
    [`attnkit.functional.which_backend`][attnkit.functional.which_backend] reports them (e.g. ``"tiled native float32"``); else
    None."""
    if case.group == "module" or not case.impl.startswith("attnkit-"):
        return None
    grad = case.mode == "fwd+bwd"
    shape = (case.b, case.h, case.n, case.d)
    q, k, v = (
        torch.empty(shape, dtype=case.torch_dtype, device=case.device, requires_grad=grad)
        for _ in range(3)
    )
    backend = case.impl.removeprefix("attnkit-")
    options = {"causal": case.causal, **_score_options(case)}
    if case.variant in flex_cases.FLEX_VARIANTS:
        mods = flex_cases.build(case.variant, case.n, case.h, grad, case.device)
        options = flex_cases.attention_options(mods, case.n, case.device)
    if case.impl == "attnkit-builtin":
        slopes = attnkit.alibi_slopes(case.h).to(case.device)
        backend, options = "auto", {"causal": True, "alibi_slopes": slopes}
    with torch.set_grad_enabled(grad):
        choice = which_backend(q, k, v, backend=backend, **options)
    return path_of(choice)


def prepare(case: Case) -> Callable[[], object]:
    """Allocate the inputs of ``case`` and return a call that runs it once (untimed set-up); on a
    GPU the call waits for the GPU's work to end, so that a clock around it times that work."""
    factory = {"dtype": case.torch_dtype, "device": case.device}
    grad = case.mode == "fwd+bwd"
    if case.group == "module":
        fn, module = _module_fn(case)
        x = torch.randn(case.b, case.n, case.h * case.d, **factory, requires_grad=grad)
        inputs = [x, *module.parameters()] if grad else []
        args = (x,)
    else:
        fn, trained = _kernel_fn(case)
        args = tuple(
            torch.randn(case.b, case.h, case.n, case.d, **factory, requires_grad=grad)
            for _ in range(3)
        )
        inputs = [*args, *trained]
    wait = torch.cuda.synchronize if case.device.startswith("cuda") else lambda: None

    if not grad:

        def forward() -> object:
            with torch.inference_mode():
                out = fn(*args)
            wait()
            return out

        return forward

    def forward_backward() -> object:
        for x in inputs:
            x.grad = None
        out = fn(*args)
        out.backward(torch.ones_like(out))
        wait()
        return out

    return forward_backward
