"""Will it fit? Device and host bytes of a ZeRO-Offload run, before building anything.

``plan(7e9, precision="bf16-mixed", device_memory="24GiB", host_memory="128GiB")`` (or the
``lzo-plan`` command) counts what the engine allocates for a model of that many parameters, says
whether it fits, the largest model that would, and predicts the CPU step's time from a 0.2 s
measurement of the fused AdamW kernel on this host. When it does not fit it names the memory
that is short and the changes that fit (``advice``), each re-planned here. Modules: ``inputs``
(reading and checking the arguments), ``model`` (a model folder's count and shape, the activation
estimate), ``figures`` (``plan``: the fit), ``largest`` (the largest model that fits, and which
memory bounds it), ``counts`` (a rank's bytes, the ranks' cut of the model), ``split`` (which
buckets' state stays on the device), ``advice`` (what to change), ``report`` (the text), ``cli``
(``lzo-plan``).

``P`` = trained parameters, ``F`` = frozen ones, ``W`` = data-parallel
ranks, ``S = P / W`` = this rank's shard, ``h`` = bytes per element of the compute dtype (2 for
``bf16-mixed``/``16-mixed``, 4 for ``32-true``):

host, per rank
    exactly what the engine budgets (``core.buckets.host.plan_counts`` and
    ``core.buckets.host.budget``, the functions ``ZeroOffload`` itself sizes with), over buckets of
    ``bucket_size_mb``: fp32 master weights ``4 S`` and the rule's state (``optimizer``;
    ``Rule.host_bytes``: Adam's two moments, Lion's one, each fp32 ``4 S``, bf16 ``2 S`` or int8
    ``S`` plus an fp32 scale per 256 elements, by ``moment_dtype``); the
    fp32 gradient ``4 S`` (as ``plan_counts`` counts it for a run that accumulates,
    ``accumulate``, or not; ``host_bytes_accumulating`` is the accumulating figure); on a GPU the
    gradient staging ``h S`` and, in half precision, the kernel's weight output ``h S``, packed
    into power-of-two pinned blocks (CUDA's pinned allocator rounds every block up to a power of
    two; the fp32 master, pinned in ``32-true``, is rounded whole); with delayed update a second
    fp32 gradient and staging; the exact copies of frozen parameters ``4 F`` in half precision.
    With the CPU as compute device the "device" is the host: add the flat weights ``h P`` (twice
    with delayed update), the frozen ones in the compute dtype ``h F`` and one bucket buffer
    (two with several ranks).
device (CUDA)
    the weights ``h (P + F)`` (every rank holds all of them), a second copy ``h P`` with delayed
    update, three gradient buckets of ``bucket_size_mb`` (one filling while at most two are
    reduced and copied out: ``core.limits.MAX_IN_FLIGHT``) and with several ranks three
    reduce-scatter outputs of ``bucket_size_mb / world_size`` (the engine's own count,
    ``core.buckets.device_budget``) and, when ``batch_size``/
    ``seq_len`` and a model config are given, an activation estimate (batch ``b``, sequence
    ``s``, hidden size ``H``, ``a`` heads, ``L`` layers, vocabulary ``V``) for a decoder-only
    transformer without recomputation (Korthikanti et al. 2022, 16-bit:
    ``s b H (34 + 5 a s / H)`` bytes per layer, plus the logits ``s b V (h + 4)``). The
    ``5 a s / H`` term is eager attention's ``a s^2`` scores, softmax and dropout per layer
    (``attention="eager"``, the default); ``attention="memory-efficient"`` (SDPA/flash kernels)
    drops it. With ``activation_checkpointing`` each of the ``L`` layers keeps only its input
    and one layer at a time is recomputed in full:
    ``L s b H h + s b H (34 + 5 a s / H) + s b V (h + 4)``. Not counted: the CUDA context
    (~0.5 GiB), allocator fragmentation, torch's workspace.

partial offload (``offload_fraction``, ``split``)
    the last buckets in reduction order (the model's first layers) keep their state on the
    device, whole: the split nearest to ``offload_fraction`` (or the one with more on the host
    where the nearer one's engine bytes do not fit the device), ``S_d`` of this rank's trained
    elements: the device adds ``(4 + 8 + h) S_d`` (fp32 master and moments, a gradient in the
    compute dtype; ``+ 4 S_d`` accumulating), the host counts the rest of the buckets only.
    ``"auto"`` resolves to the largest fraction whose host part fits the host and whose device
    part fits ``1 - device_memory_headroom`` of the device (1.0 when the host holds it all;
    explicit fractions are checked against the whole device); the largest model takes, with
    ``"auto"``, any fraction.

tensor parallelism and FSDP2 (``tensor_parallel_size``, ``fsdp``; ``counts``)
    ``world_size`` = ``D`` data-parallel x ``T`` tensor-parallel ranks (``T`` divides it). Every
    figure above is one rank's, for the part of the model a rank holds: ``P / T`` (and ``F / T``)
    with ``W = D``, so the device holds ``h (P + F) / T`` and the host ``P / (D T)`` of the state.
    With ``fsdp`` the model is ``fully_shard``-ed over the data-parallel ranks and the engine
    steps each rank's local shards (its partition is FSDP2's, a world of one): the figures are
    those of ``P / (D T)`` (and ``F / (D T)``) with ``W = 1``, so the device holds the sharded
    weights ``h (P + F) / (D T)``, the host the same state per rank as without FSDP2, and the
    device adds FSDP2's all-gather buffers, two units in flight (the one that runs and the
    prefetched one) of ``U / T`` each, ``2 h U / T``: ``U`` = ``fsdp_unit_params``, by default
    one layer (``(P + F) / L`` of a model config), else ``(P + F) / 32``. Not counted: the root
    unit's own parameters, which FSDP2 keeps unsharded from forward to backward, and a unit's
    unsharded gradients before their reduce-scatter. The largest model keeps ``U``'s share.

host-resident weights (``offload_weights``, with ``fsdp`` on a GPU; ``counts.host_resident``)
    FSDP2's ``CPUOffloadPolicy`` keeps each rank's fp32 shards on the host, and they are the
    engine's master, stepped in place: the device holds no weights, only the two units in
    flight ``2 h U / T``, the engine's three gradient buckets and the activations; the host per
    rank ``4 S`` (the shards = the master), the rule's state, the gradient in the compute dtype
    ``h S`` (pinned blocks; ``+ 4 S`` accumulating), FSDP2's frozen shards ``4 F / (D T)`` and
    its fp32 gradient of one unit ``4 U / (D T)``. All of the state is on the host (offload
    fraction 1; no delayed update). The largest model then is bounded by host memory, unless
    the units in flight outgrow the device; the report says which (``largest``).

host memory
    ``host_memory`` less ``host_reserve`` (default 10% of it) kept for the OS, Python and data
    loaders: "fits" and the largest model compare the per-node host bytes with what is left.

Parameter alignment pads every parameter to 16 elements (not counted: under 0.1% for real
models) and every bucket to ``16 W`` (counted). The largest model that fits keeps the batch, the
sequence and so the activation estimate; when activations alone leave no room it says so.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_zero_offload.planner.cli import main
    from lightning_zero_offload.planner.figures import Plan, plan
    from lightning_zero_offload.planner.inputs import PlanArgumentError, parse_bytes
    from lightning_zero_offload.planner.model import model_info

# name -> its module, imported on first use: ``lzo-plan --help`` (this package's ``cli``) then
# never imports torch, which ``figures`` does
_LAZY = {"Plan": "figures", "plan": "figures", "parse_bytes": "inputs", "model_info": "model",
         "main": "cli", "PlanArgumentError": "inputs"}

__all__ = ["Plan", "plan", "parse_bytes", "model_info", "main", "PlanArgumentError"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
