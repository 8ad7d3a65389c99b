"""ZeRO-Offload for PyTorch Lightning, Accelerate and the transformers Trainer.

Importing this package registers ``"zero_offload"`` with Lightning's strategy registries when
Lightning is installed, so ``Trainer(strategy="zero_offload")`` works after ``import
lightning_zero_offload``.
"""

from lightning_zero_offload import ops

__version__ = "0.1.0.dev0"

__all__ = ["ops", "__version__"]
