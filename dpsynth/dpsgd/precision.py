"""Mixed precision for DP-SGD: the forward and backward in bf16/fp16, the privacy arithmetic in fp32.

``precision`` (the ``precision`` key of every DP-SGD config section) is one of :data:`PRECISIONS`:

* ``"fp32"``: everything in the parameters' dtype (the default);
* ``"bf16"``: the per-example forward runs under autocast to bfloat16 (CPU and CUDA; Kalamkar et al.,
  "A Study of BFLOAT16 for Deep Learning Training", arXiv:1905.12322): its matrix products and
  convolutions, and the backward through them, run in bf16, softmax, normalisation and losses in fp32;
* ``"fp16"``: the same with float16, CUDA only, with a *static* loss scale :data:`FP16_LOSS_SCALE`
  (Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv:1710.03740, §3.2) so that small
  output gradients do not underflow.

Autocast is applied by :class:`Autocast`, a torch function mode with ``torch.autocast``'s rule for the
ops it lists, not by ``torch.autocast`` itself: the engine's forward runs under ``torch.func.vmap``, and
there ``torch.autocast`` leaves convolutions and linear layers in fp32 on the CPU (torch 2.13: their
batching rules dispatch below the autocast key; pytorch/functorch#305, pytorch/pytorch#105442), so a bf16
run would silently have been an fp32 run, or failed on a bf16 input meeting an fp32 bias. A function
mode sees every call at the Python API, batched or not.

What stays in fp32 (docs/privacy.md, "Mixed precision keeps the clip bound"): a tapped layer's input and
output gradient are upcast to the parameters' dtype (and unscaled) as soon as the backward hands them
over (:meth:`Precision.for_sum`), and a fallback parameter's per-example gradient arrives in its own
dtype; so every per-example norm, clip factor, clipped sum and the noise are computed by exactly the fp32
code of the default path (the ghost-norm Grams stay float64). The clip bound is therefore as exact as
in fp32: the norm is taken of the very tensor that is summed.

TF32 is off inside the private step (:func:`no_tf32`, entered by
:func:`~dpsynth.dpsgd.per_example.clipped_grad_sum`, which forms every DP-SGD step's clipped sum). A ghost
layer takes its clip factor from float64 Gram matrices, and a convolution may take it from its instantiated
per-example gradient, but its clipped contribution is then summed by a separate GEMM or weight-gradient
convolution of ``A`` and the clip-weighted ``G``. Clipping is exact only if that sum is as accurate as the
norm: on CUDA, cuDNN convolutions (and cuBLAS matrix products where a user enabled it) run fp32 in TF32
by default, whose 10-bit mantissa lets a record whose gradient rows nearly cancel (terms of size ``s``
summing to something far smaller) add more than C by about ``2^-11 s`` relative to its norm. In full fp32
that error is about ``2^-24 s``, inside the 1e-5 to which the clip bound is tested
(``tests/dpsgd/test_tap_safety.py``).

Why the loss scale is static: a dynamic scaler (``torch.amp.GradScaler``) lowers its scale after an
overflow, and which step overflows depends on the private records; the scale would carry private
information from one step into the next outside the released updates, which the composition argument
does not cover. A fixed scale is public. An example whose scaled gradient overflows is non-finite and
contributes zero, like any NaN/Inf gradient (:mod:`dpsynth.dpsgd.per_example`), so the sensitivity
stays C.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from dpsynth.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
PrecisionName = Literal["fp32", "bf16", "fp16"]

#: The fp16 loss scale, a power of two so scaling and unscaling are exact. 2^12 lifts an output
#: gradient of 1e-8 (fp16 flushes below 6e-8) into fp16's normal range while leaving headroom to
#: 65504 / 4096 = 16 for the largest one (torch's GradScaler starts at 2^16 and backs off on overflow;
#: a static scale cannot back off, hence a more modest one).
FP16_LOSS_SCALE = 2.0**12

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: Ops run in the low precision: torch.autocast's lower-precision list for the matrix products and
#: convolutions (the cost of a forward), as the Python API calls them.
LOW_PRECISION_OPS = frozenset(
    {
        torch.conv1d,
        torch.conv2d,
        torch.conv3d,
        torch.conv_transpose1d,
        torch.conv_transpose2d,
        torch.conv_transpose3d,
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
        F.scaled_dot_product_attention,
    }
)
#: Ops run in fp32 whatever their inputs: torch.autocast's fp32 list for the reductions that lose
#: accuracy in 8 mantissa bits (softmax, normalisation statistics, losses).
FP32_OPS = frozenset(
    {
        torch.softmax,
        torch.Tensor.softmax,
        F.softmax,
        torch.log_softmax,
        torch.Tensor.log_softmax,
        F.log_softmax,
        F.group_norm,
        F.layer_norm,
        F.cross_entropy,
        F.nll_loss,
        F.mse_loss,
        F.binary_cross_entropy_with_logits,
    }
)


class Autocast(TorchFunctionMode):
    """``torch.autocast``'s casting rule for :data:`LOW_PRECISION_OPS` (floating inputs to ``dtype``) and
    :data:`FP32_OPS` (floating inputs to fp32), applied wherever the call is made, under ``vmap`` too. The
    casts are ordinary differentiable ``Tensor.to``: the backward runs each op in the forward's dtype and
    hands gradients back in the dtype of the tensors that went in (fp32 parameters get fp32 gradients)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LOW_PRECISION_OPS:
            args, kwargs = _cast((args, kwargs), self.dtype)
        elif func in FP32_OPS:
            args, kwargs = _cast((args, kwargs), torch.float32)
        return func(*args, **kwargs)


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    def cast(value: Any) -> Any:
        # Metadata through the dtype attribute, not Tensor.is_floating_point(): the tap plan counts the torch
        # calls a parameter enters (dpsynth.dpsgd.taps._ParameterUses), and the cast must add only its .to.
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point and value.dtype != dtype:
            return value.to(dtype)
        return value

    return _pytree.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Precision:
    """One of :data:`PRECISIONS`; ``autocast(device)`` wraps the forward, ``for_sum`` takes gradients back."""

    name: str = "fp32"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.name!r}; choose one of {', '.join(PRECISIONS)}")

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype; None for fp32 (no autocast)."""
        return _DTYPES.get(self.name)

    @property
    def loss_scale(self) -> float:
        """The factor the summed loss is multiplied by before the backward (1 but for fp16)."""
        return FP16_LOSS_SCALE if self.name == "fp16" else 1.0

    def check_device(self, device: torch.device, what: str = "precision") -> None:
        """ConfigError for fp16 off CUDA: CPU kernels in float16 are slow and partly missing, and the
        loss scaling is tuned for GPUs; bf16 runs on both."""
        if self.name == "fp16" and device.type != "cuda":
            raise ConfigError(f"{what}=fp16 needs a CUDA device (got {device.type}); use bf16 or fp32")

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """:class:`Autocast` for the forward (whose dtypes the backward replays); a no-op context for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        self.check_device(device)
        return Autocast(self.dtype)

    def for_sum(self, tensor: torch.Tensor, dtype: torch.dtype, *, gradient: bool) -> torch.Tensor:
        """``tensor`` in ``dtype`` (the parameters'), a gradient divided by the loss scale: the per-example
        gradients, their norms and the clipped sum are then formed in ``dtype``, whatever the forward used.
        Integer tensors (an Embedding's indices) pass unchanged."""
        if not tensor.is_floating_point():
            return tensor
        tensor = tensor.to(dtype)
        if gradient and self.loss_scale != 1.0:
            tensor = tensor / self.loss_scale  # a power of two: exact
        return tensor


FP32 = Precision("fp32")


def _tf32_precision_settings() -> list[Any]:
    """The objects whose ``fp32_precision`` decides TF32 for cuBLAS matrix products and cuDNN convolutions and
    RNNs (torch >= 2.9); none on an older torch, which has the ``allow_tf32`` flags only."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    owners = [matmul, getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)]
    return owners if all(hasattr(owner, "fp32_precision") for owner in owners) else []


def _tf32_flags() -> tuple[bool, bool] | None:
    """``(matmul.allow_tf32, cudnn.allow_tf32)``; None where torch refuses to read them (torch >= 2.9 when TF32
    was set through both its old flags and its new ``fp32_precision`` strings: the strings are then restored)."""
    try:
        return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    except RuntimeError:
        return None


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """TF32 off for fp32 matrix products and cuDNN convolutions inside the block, the previous settings
    restored after it (also on an error).

    Inside the private step the clipped sum must be as accurate as the norm its clip factor came from (the
    module docstring, "TF32 is off inside the private step"). The settings are process-wide and change
    nothing on the CPU. They are turned off through torch's ``allow_tf32`` flags (every torch this supports
    has them) and restored through the flags, then through the ``fp32_precision`` strings where torch has
    them, so both read back as they were."""
    flags = _tf32_flags()
    precisions = [(owner, owner.fp32_precision) for owner in _tf32_precision_settings()]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        if flags is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
        for owner, value in precisions:
            owner.fp32_precision = value
