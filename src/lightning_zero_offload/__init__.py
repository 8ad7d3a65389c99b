"""ZeRO-Offload for PyTorch Lightning, Accelerate and the transformers Trainer.

Importing this package registers ``"zero_offload"`` with Lightning's strategy registries when
Lightning is installed, so ``Trainer(strategy="zero_offload")`` works after ``import
lightning_zero_offload``.
"""

from lightning_zero_offload import ops
from lightning_zero_offload.core import ZeroOffload, ZeroOffloadConfig
from lightning_zero_offload.cpu_adam import CPUAdam
from lightning_zero_offload.planner import plan

__version__ = "0.1.0.dev0"

__all__ = ["ops", "__version__", "CPUAdam", "ZeroOffload", "ZeroOffloadConfig", "plan"]

# Lightning adapter: importing the package registers strategy="zero_offload" (Trainer and Fabric).
import importlib.util as _importlib_util  # noqa: E402

# Registers the emulated device with the device factory, so LZO_EMULATED_DEVICE_SEED=N (read when
# an engine is made) runs every CPU engine of the process on it; without the variable, or a
# testing.emulated_async_device() block, engines keep the plain CPU device.
from lightning_zero_offload import testing as _testing  # noqa: E402, F401

if _importlib_util.find_spec("lightning") is not None:
    from lightning_zero_offload.lightning import ZeroOffloadStrategy  # noqa: E402
    from lightning_zero_offload.lightning import register as _register_lightning  # noqa: E402

    _register_lightning()
    __all__ += ["ZeroOffloadStrategy"]
