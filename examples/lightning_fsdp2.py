"""FSDP2 x ZeRO-Offload with the Lightning Trainer: the Llama of examples/lightning_tp.py whose
``configure_model`` calls ``fully_shard`` per block and at the root over
``self.device_mesh["data_parallel"]`` (and, with --tensor-parallel-size > 1, first applies the
tensor-parallel plan over ``"tensor_parallel"``), exactly as under Lightning's
``ModelParallelStrategy``: ``--strategy model_parallel`` runs the same module under that one.
Under ``ZeroOffloadStrategy(data_parallel_size=..., tensor_parallel_size=...)`` FSDP2 shards the
weights (in the run's half precision under bf16-mixed) and the engine keeps each rank's shards'
fp32 master and optimizer state on the host, stepping them there.

With --offload-weights each ``fully_shard`` call also passes FSDP2's ``CPUOffloadPolicy``
(pinned only with CUDA): the fp32 shards live on the host and are the master, the engine steps
them in place under the next forward, and the GPU holds only the units in flight. Under
``ModelParallelStrategy`` FSDP2 does the same with torch's AdamW stepping after backward.

On the CPU (2 processes, FSDP2 over both):
    python examples/lightning_fsdp2.py --devices 2 --accelerator cpu [--offload-weights]
On 8 GPUs: ``--devices 8 --precision bf16-mixed`` (or ``--tensor-parallel-size 2``: 4 x 2).

Refused at setup, naming what to change (ZeroOffloadStrategy):
  - FSDP1: a module wrapped in ``FullyShardedDataParallel`` (Lightning's ``FSDPStrategy`` is
    another strategy altogether); use ``fully_shard``.
  - HSDP (``fully_shard`` over a mesh with a replicated dimension), ``fully_shard`` over the
    "tensor_parallel" dimension, a ``shard_placement_fn`` other than dim 0, parameters that no
    ``fully_shard`` call manages (shard the root too).
  - With ``CPUOffloadPolicy``: bf16 shards (the host shards stay fp32; under bf16-mixed FSDP2
    computes in bf16 by a ``MixedPrecisionPolicy``, as this recipe passes), ``delayed_update``,
    an ``offload_fraction`` below 1.
  - A ``MixedPrecisionPolicy`` whose ``param_dtype`` disagrees with ``--precision`` (first step).
  - ``--precision`` bf16-true, 16-true or 64-true (use bf16-mixed / 16-mixed / 32-true);
    ``gradient_clip_algorithm="value"``; more than one optimizer.
Differs from ``ModelParallelStrategy``: with both sizes "auto" the run is data parallel without a
mesh (``self.device_mesh`` is None); give ``data_parallel_size`` (this recipe always does). And
clipping by the global norm works over FSDP2 x tensor parallelism here; there, torch's
``clip_grad_norm_`` fails over the two meshes, so ``--strategy model_parallel`` with
``--tensor-parallel-size`` > 1 runs unclipped.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_tp import Bytes, Llama  # examples/ is sys.path[0] when run as a script
from torch.utils.data import DataLoader

from lightning_zero_offload import ZeroOffloadStrategy


class ShardedLlama(Llama):
    def __init__(self, offload_weights: bool = False, half: torch.dtype | None = None) -> None:
        super().__init__()
        self.offload_weights, self.half = offload_weights, half

    def configure_model(self) -> None:
        """Tensor parallelism (when asked), then FSDP2 per block and at the root (with the
        weights on the host when asked)."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )

        mesh = self.device_mesh  # the strategy's 2-D mesh
        if isinstance(self, FSDPModule) or mesh is None:  # runs again for validate/test
            return
        if mesh["tensor_parallel"].size() > 1:
            super().configure_model()
        kw: dict = {"mesh": mesh["data_parallel"]}
        if self.offload_weights:  # pinning needs CUDA
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            # the host shards stay fp32 (the master): FSDP2 casts each unit it gathers
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.half,
                                                   reduce_dtype=torch.float32)
        for layer in self.layers:
            fully_shard(layer, **kw)
        fully_shard(self, **kw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=2, help="processes (default: %(default)s)")
    ap.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks that split each layer; --devices / this many shard it with "
                    "FSDP2 (default: %(default)s)")
    ap.add_argument("--strategy", choices=("zero_offload", "model_parallel"),
                    default="zero_offload", help="ours, or Lightning's ModelParallelStrategy")
    ap.add_argument("--precision", default="32-true", help="e.g. bf16-mixed (default: 32-true)")
    ap.add_argument("--max-steps", type=int, default=20, help="optimizer steps (default: 20)")
    ap.add_argument("--accumulate", type=int, default=2,
                    help="micro-batches per optimizer step (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=4,
                    help="per data-parallel replica and micro-batch (default: %(default)s)")
    ap.add_argument("--offload-weights", action="store_true",
                    help="fully_shard with CPUOffloadPolicy: the weights live on the host")
    args = ap.parse_args(argv)
    if min(args.devices, args.tensor_parallel_size, args.max_steps, args.accumulate,
           args.batch_size) < 1 or args.devices % args.tensor_parallel_size:
        ap.error("sizes must be >= 1 and --tensor-parallel-size must divide --devices")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)  # the same initial weights on every rank: fully_shard cuts them
    replicas = args.devices // args.tensor_parallel_size
    sizes = {"data_parallel_size": replicas, "tensor_parallel_size": args.tensor_parallel_size}
    ours = args.strategy == "zero_offload"
    # offload: on a GPU the engine sees where the shards live, on the CPU it is told
    strategy = (ZeroOffloadStrategy(**sizes, offload_weights=args.offload_weights or None)
                if ours else ModelParallelStrategy(**sizes))
    data = Bytes(samples=args.max_steps * args.accumulate * args.batch_size * replicas)
    # ModelParallelStrategy clips with torch's clip_grad_norm_, which fails over two meshes
    # (FSDP2 x tensor parallelism: "All operands in aten.stack.default must have the same mesh")
    clip = None if not ours and args.tensor_parallel_size > 1 else 1.0
    trainer = Trainer(strategy=strategy, devices=args.devices, accelerator=args.accelerator,
                      precision=args.precision, max_steps=args.max_steps, max_epochs=1,
                      accumulate_grad_batches=args.accumulate, gradient_clip_val=clip,
                      logger=False, enable_checkpointing=False, log_every_n_steps=5)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    half = {"bf16": torch.bfloat16, "16": torch.float16}.get(args.precision.split("-")[0])
    trainer.fit(ShardedLlama(args.offload_weights, half), loader)
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
