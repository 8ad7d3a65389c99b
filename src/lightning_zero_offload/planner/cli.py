"""The ``lzo-plan`` command: ``plan``'s arguments as options, its report as text or JSON. A bad
value exits 2 with ``lzo-plan: error:`` naming the option (or the file) and what is expected.
The parser imports nothing heavy (``--help`` and a bad option answer without torch); ``plan``
is imported once the options parsed."""

from __future__ import annotations

import argparse
import json

from lightning_zero_offload.planner.inputs import (
    AUTO,
    DEFAULT_HEADROOM,
    DEFAULT_HOST_RESERVE,
    ELEM,
    MOMENT_DTYPES,
    PlanArgumentError,
)
from lightning_zero_offload.planner.model import ATTENTION


def _option(text: str) -> tuple[str, object]:
    """``NAME=VALUE``: the value as a number or a bool where it reads as one."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, float(value)
    except ValueError:
        return name, value


def _number_or_text(value: str) -> float | str:
    """A number where the text reads as one; ``plan`` refuses the rest, naming the option."""
    try:
        return float(value)
    except ValueError:
        return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lzo-plan", description="Will a ZeRO-Offload run fit? "
                                "Device and host bytes, the largest model that fits, and the "
                                "CPU step time predicted from this host's kernel speed.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count: 7e9, 7B, 350M")
    src.add_argument("--model", help="local HF model folder or its config.json")
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(ELEM),
                   help="the Lightning precision: the compute dtype of the device's weights and "
                   "gradients (default: %(default)s)")
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks in all, data-parallel x --tensor-parallel-size: each keeps 1/N "
                   "of the host state (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks that split each layer (parallelize_module): a rank's device "
                   "holds 1/N of the weights; it must divide --world-size (default: "
                   "%(default)s)")
    p.add_argument("--fsdp", action="store_true",
                   help="the model is fully_shard-ed (FSDP2): a rank's device holds 1/N of the "
                   "weights over the data-parallel ranks, and FSDP2's all-gather buffers of "
                   "two units (the one that runs and the prefetched one)")
    p.add_argument("--fsdp-unit-params",
                   help="with --fsdp, parameters of the largest fully_shard unit, e.g. 1.2B "
                   "(default: one layer of --model, params / num_hidden_layers, else params / "
                   "32); the largest model holds its share of the model")
    p.add_argument("--offload-weights", action="store_true",
                   help="with --fsdp: fully_shard with CPUOffloadPolicy, so each rank's sharded "
                   "fp32 weights live on the host as the engine's master (stepped in place); the "
                   "device holds FSDP2's units in flight, the gradient buckets and the "
                   "activations; all of the optimizer state on the host")
    p.add_argument("--ranks-per-node", type=int, help="ranks sharing one machine's host memory "
                   "(default: --world-size, one machine)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="compute device (cpu: everything is host memory)")
    p.add_argument("--device-memory", help="per device, e.g. 24GiB; without it whether the "
                   "device fits is unknown ('fits' is null in --json)")
    p.add_argument("--host-memory", help="per machine, e.g. 128GiB; without it whether the host "
                   "fits is unknown ('fits' is null in --json)")
    p.add_argument("--host-reserve", default=DEFAULT_HOST_RESERVE,
                   help="of --host-memory, kept for the OS, Python and data loaders: a "
                   "percentage or a size, e.g. 8GiB (default: %(default)s); 'fits' and the "
                   "largest model use the rest")
    p.add_argument("--batch-size", type=int, help="per device, for the activation estimate")
    p.add_argument("--seq-len", type=int, help="for the activation estimate")
    p.add_argument("--attention", default="eager", choices=ATTENTION,
                   help="what the activation estimate assumes: eager keeps the batch x heads x "
                   "seq^2 attention scores; memory-efficient (SDPA/flash kernels) keeps none "
                   "(default: %(default)s)")
    p.add_argument("--bucket-size-mb", type=float, default=25.0,
                   help="gradient bucket size in MiB of the compute dtype; the device keeps "
                   "whole buckets' optimizer state (ZeroOffloadConfig.bucket_size_mb; default: "
                   "%(default)s)")
    p.add_argument("--delayed-update", action=argparse.BooleanOptionalAction, default=False,
                   help="delayed parameter update: a second device copy of the weights and a "
                   "second host gradient (ZeroOffloadConfig.delayed_update; default: off)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="the model recomputes each layer in backward (keeps only layer inputs)")
    p.add_argument("--accumulate", action="store_true",
                   help="the run accumulates gradients (accumulate_grad_batches > 1)")
    p.add_argument("--moment-dtype", default="fp32", choices=list(MOMENT_DTYPES),
                   help="how the host keeps the optimizer's moments (default: %(default)s; "
                   "ZeroOffloadConfig.moment_dtype)")
    p.add_argument("--optimizer", default="adamw",
                   help="the update rule whose state the host keeps, by its key in the engine's "
                   "registry (default: %(default)s; another is refused naming every key)")
    p.add_argument("--optimizer-option", action="append", default=[], type=_option,
                   metavar="NAME=VALUE", help="an option of the optimizer's constructor that "
                   "shapes its state (e.g. momentum=0.9); repeat for several")
    p.add_argument("--offload-fraction", default=AUTO, type=_number_or_text,
                   help="share of the optimizer state on the host, the rest (whole buckets, the "
                   "first layers) on the device: a number in [0, 1] or auto, the largest share "
                   "the host holds with the device within its headroom (default: %(default)s; "
                   "ZeroOffloadConfig.offload_fraction)")
    p.add_argument("--device-memory-headroom", default=DEFAULT_HEADROOM, type=_number_or_text,
                   help="share of the device's memory auto leaves free (default: %(default)s)")
    p.add_argument("--frozen-params", default="0",
                   help="of the parameters, those that do not train, e.g. a LoRA base model's "
                   "(default: %(default)s)")
    p.add_argument("--no-measure", action="store_true", help="skip the 0.2 s kernel timing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``lzo-plan`` command."""
    p = _parser()
    a = p.parse_args(argv)
    from lightning_zero_offload.planner.figures import plan  # torch: only once parsed

    try:
        result = plan(a.params, model=a.model, precision=a.precision, world_size=a.world_size,
                      ranks_per_node=a.ranks_per_node, device=a.device,
                      device_memory=a.device_memory, host_memory=a.host_memory,
                      host_reserve=a.host_reserve, batch_size=a.batch_size, seq_len=a.seq_len,
                      bucket_size_mb=a.bucket_size_mb, delayed_update=a.delayed_update,
                      frozen_params=a.frozen_params, measure=not a.no_measure,
                      moment_dtype=a.moment_dtype, attention=a.attention,
                      activation_checkpointing=a.activation_checkpointing,
                      accumulate=a.accumulate, offload_fraction=a.offload_fraction,
                      device_memory_headroom=a.device_memory_headroom, optimizer=a.optimizer,
                      optimizer_options=dict(a.optimizer_option),
                      tensor_parallel_size=a.tensor_parallel_size, fsdp=a.fsdp,
                      fsdp_unit_params=a.fsdp_unit_params,
                      offload_weights=a.offload_weights)
    except PlanArgumentError as e:
        p.error(f"argument {e.option}: {e.problem}")
    except (ValueError, OSError, ImportError) as e:
        p.error(str(e))
    print(json.dumps(result.to_dict()) if a.json else result)
    return 0
