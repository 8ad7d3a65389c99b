"""Precision plugins that hand backward, clipping and the optimizer step to the engine.

Lightning gives any strategy it does not know a ``MixedPrecision`` plugin (autocast plus a
``GradScaler`` over device gradients). Under offload those gradients never stay on the device
and the fp32 master weights live in the engine, so the strategies turn the Trainer's or Fabric's
``precision`` into one of these plugins, which drive the engine: half-precision weights on the
device, the engine's loss scaler, the engine's global-norm clipping.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_zero_offload.core.config import PRECISIONS
from lightning_zero_offload.core.rules.rules import supported
from lightning_zero_offload.lightning.common import check_clip_algorithm

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_zero_offload import ZeroOffload

SUPPORTED = tuple(PRECISIONS)  # "32-true", "bf16-mixed", "16-mixed"

_HINTS = {
    "bf16-true": "use 'bf16-mixed': offload keeps bf16 weights on the device and fp32 masters "
    "on the host, which is what 'bf16-true' would throw away",
    "16-true": "use '16-mixed' (fp16 weights on the device, fp32 masters on the host)",
    "64-true": "the CPU optimizer kernel updates fp32 master weights; use '32-true'",
}


_Plugin = TypeVar("_Plugin", bound="_EngineDriver")


def as_engine_plugin(plugin: FabricPrecision | Precision | None, cls: type[_Plugin]
                     ) -> _Plugin | None:
    """The plugin Lightning or Fabric picked, as the offload plugin ``cls`` of its precision
    (``None``, nothing chosen yet, stays ``None``); an unsupported precision raises."""
    if isinstance(plugin, cls):
        return plugin
    name = precision_name(plugin)
    return None if name is None else cls(name)


def precision_name(plugin: FabricPrecision | Precision | None) -> str | None:
    """The offload precision a Lightning or Fabric precision plugin stands for.

    ``None`` stays ``None`` (nothing chosen yet). Raises a ValueError naming the supported
    precisions for anything the engine cannot run (64-true, *-true half, transformer-engine,
    bitsandbytes, custom plugins).
    """
    if plugin is None:
        return None
    if isinstance(plugin, _EngineDriver):
        return plugin.precision
    name = getattr(plugin, "precision", None)
    if type(plugin) in (Precision, FabricPrecision):
        return "32-true"
    if type(plugin) in (MixedPrecision, FabricMixedPrecision):
        return name  # autocast + GradScaler are replaced by the engine's dtype and loss scaler
    hint = _HINTS.get(str(name), "")
    raise ValueError(
        f"ZeroOffloadStrategy does not support precision {name!r} ({type(plugin).__name__}); "
        f"choose one of {', '.join(map(repr, SUPPORTED))}" + (f". Hint: {hint}" if hint else "")
    )


class _EngineDriver:
    """What the Trainer and Fabric plugins share: the engine, input casting and autocast."""

    precision: str

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"ZeroOffload precision {precision!r} is not supported; "
                f"choose one of {', '.join(map(repr, SUPPORTED))}"
            )
        self.precision = precision
        self.engine: ZeroOffload | None = None
        self._norm_known = False  # clipping already measured this step's 2-norm
        self.grad_norm: Tensor | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def skips_nonfinite_steps(self) -> bool:
        """fp16's loss scaler skips a step whose gradients overflowed: not an error there."""
        return self.precision == "16-mixed"

    def _engine(self) -> ZeroOffload:
        if self.engine is None:
            raise RuntimeError(
                "ZeroOffload precision: no engine is set up yet; backward and optimizer steps "
                f"need the model and its optimizer ({supported()}) set up by the zero_offload "
                "strategy"
            )
        return self.engine

    def convert_input(self, data: Any) -> Any:
        """Floating-point batch tensors in the weights' dtype (a no-op in fp32)."""
        if self.compute_dtype == torch.float32:
            return data
        return apply_to_collection(
            data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype
        )

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast for the mixed precisions.

        The weights already are half precision; autocast keeps the ops it lists as fp32-sensitive
        (softmax, losses, norms) in fp32, as under Lightning's own mixed precision.
        """
        if self.precision == "32-true":
            yield
            return
        device = self.engine.device.type if self.engine is not None else _default_device_type()
        with torch.autocast(device, dtype=self.compute_dtype, cache_enabled=False):
            yield

    def _backward(self, tensor: Tensor, args: tuple, kwargs: dict) -> None:
        if args or kwargs:
            raise ValueError(
                "ZeroOffload: backward arguments are not supported (the engine runs "
                f"loss.backward() itself); got args={args}, kwargs={sorted(kwargs)}"
            )
        self._engine().backward(tensor)

    def _step(self, optimizer: Optimizable) -> Tensor | None:
        """The optimizer facade's step (so torch's step hooks run); returns the pre-clip global
        gradient norm, or None when no backward ran (the engine then skips the step, as AdamW
        skips parameters without gradients)."""
        engine = self._engine()
        if not self._norm_known:  # a max_norm of inf clips nothing; it only measures
            engine.clip_grad_norm_(math.inf)
        self._norm_known = False
        optimizer.step()
        norm = engine.last_grad_norm
        return None if norm is None else torch.tensor(norm)

    def _clip(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        norm = self._engine().clip_grad_norm_(max_norm, norm_type)
        self._norm_known = self._norm_known or norm_type == 2.0
        return norm

    def _teardown(self) -> None:
        self.engine = None
        self._norm_known = False  # grad_norm stays: the last step's norm, read after fit()


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class ZeroOffloadPrecision(_EngineDriver, Precision):
    """Trainer precision plugin for ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"``.

    The strategy attaches its engine to ``engine``; the plugin then runs backward through it
    (with the loss scaler for fp16), clips by the global norm over ranks, and steps it after
    the closure. ``grad_norm`` is the last pre-clip global gradient norm, for logging.
    """

    @override
    def convert_input(self, data: Any) -> Any:
        return _EngineDriver.convert_input(self, data)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with _EngineDriver.forward_context(self):
            yield

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if is_overridden("backward", model):
            raise RuntimeError(
                f"{type(model).__name__} overrides LightningModule.backward, but under "
                "ZeroOffloadStrategy the engine runs backward (it streams gradients to the "
                "host); remove the override"
            )
        self._backward(tensor, args, kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if kwargs:
            raise ValueError(f"ZeroOffload: optimizer.step() takes no arguments: {sorted(kwargs)}")
        closure_result = closure()
        self._after_closure(model, optimizer)  # hooks and Trainer(gradient_clip_val=...) clipping
        norm = self._step(optimizer)
        if norm is not None:
            self.grad_norm = norm
        return closure_result

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        check_clip_algorithm(gradient_clip_algorithm)
        self._clip(float(clip_val))

    @override
    def teardown(self) -> None:
        self._teardown()


class ZeroOffloadFabricPrecision(_EngineDriver, FabricPrecision):
    """Fabric precision plugin: ``fabric.backward`` and ``optimizer.step()`` go to the engine."""

    @override
    def convert_input(self, data: Any) -> Any:
        return _EngineDriver.convert_input(self, data)

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        return _EngineDriver.forward_context(self)

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        self._backward(tensor, args, kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        closure = kwargs.pop("closure", None)
        if kwargs:
            raise ValueError(f"ZeroOffload: optimizer.step() takes no arguments: {sorted(kwargs)}")
        result = closure() if closure is not None else None
        self.grad_norm = self._step(optimizer)
        return result

    @override
    def teardown(self) -> None:
        self._teardown()
