"""``CPUAdam``: a drop-in ``torch.optim.AdamW`` / ``Adam`` for CPU fp32 tensors on the fused kernel.

Param groups and state use torch's AdamW format (group keys such as ``decoupled_weight_decay``;
per-parameter ``step`` as a float32 scalar tensor and the two moments by torch's names,
``core.rules.adam.Adam.STATE``), so with the default ``moment_dtype="fp32"`` a state dict moves
between ``CPUAdam`` and ``torch.optim.AdamW`` in both directions.

Compact moments (``moment_dtype="bf16"`` or ``"int8"``, see ``lightning_zero_offload.ops.moments``)
are kept and saved as they are: ``state_dict()`` holds bf16 moments, or uint8 codes plus
a ``<moment>_scales`` tensor each per parameter (small checkpoints, exact resume).
``torch_state_dict()`` gives the ``torch.optim.AdamW`` form (moments dequantized to fp32).
``load_state_dict`` takes either form, from any ``moment_dtype``, and converts the moments to this
optimizer's format (to bf16/int8 by rounding to nearest), so the format can change between save
and resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_zero_offload.core.rules.adam import Adam
from lightning_zero_offload.ops import BLOCK, MOMENT_DTYPES, Moments, fused_adamw_

__all__ = ["CPUAdam"]

_RULE = Adam()
_NAMES = _RULE.names  # torch's, in order


class CPUAdam(torch.optim.Optimizer):
    """AdamW (``decoupled=True``) or Adam with L2 decay (``decoupled=False``) over CPU fp32 tensors.

    Hyperparameters are read from each param group at every step, so LR schedulers work.
    ``num_threads`` (default ``torch.get_num_threads()``) does not change results.
    ``moment_dtype``: ``"fp32"`` (exact AdamW), ``"bf16"`` or ``"int8"`` (compact moments, rounded
    stochastically from ``seed``; see the module docstring for their state dicts).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        num_threads: int | None = None,
        moment_dtype: str = "fp32",
        seed: int = 0,
    ) -> None:
        _check_unsupported({"amsgrad": amsgrad, "maximize": maximize})
        if moment_dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"CPUAdam: moment_dtype={moment_dtype!r} is not supported; choose one of "
                f"{MOMENT_DTYPES}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"CPUAdam: `seed` must be an int >= 0, got {seed!r}")
        if isinstance(lr, torch.Tensor):
            raise TypeError("CPUAdam: `lr` must be a Python float (tensor lr is not supported)")
        if not lr >= 0.0:
            raise ValueError(f"CPUAdam: invalid learning rate {lr!r} (must be >= 0)")
        if not eps >= 0.0:
            raise ValueError(f"CPUAdam: invalid eps {eps!r} (must be >= 0)")
        if not (len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas)):
            raise ValueError(f"CPUAdam: betas must be two floats in [0, 1), got {betas!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"CPUAdam: invalid weight_decay {weight_decay!r} (must be >= 0)")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"CPUAdam: `num_threads` must be an int >= 1, got {num_threads!r}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": decoupled,
        }
        super().__init__(params, defaults)
        self.num_threads = num_threads
        self.moment_dtype = moment_dtype
        self.seed = seed
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Check everything first, so a bad gradient leaves every parameter as it was.
        work = []
        for group in self.param_groups:
            _check_unsupported(group)
            for p in group["params"]:
                if p.grad is not None:
                    _check_param(p)
                    _check_grad(p, p.grad)
                    work.append((group, p))
        offsets = self._offsets()
        for group, p in work:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                mom = _RULE.zeros(p.numel(), self.moment_dtype)
                _put(state, mom, p)
            step = int(state["step"].item()) + 1
            beta1, beta2 = group["betas"]
            fused_adamw_(
                p,
                p.grad.contiguous(),
                step=step,
                lr=float(group["lr"]),
                betas=(float(beta1), float(beta2)),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled=bool(group.get("decoupled_weight_decay", True)),
                num_threads=self.num_threads,
                seed=self.seed,
                offset=offsets[p],
                **_moment_args(state),
            )
            state["step"].fill_(step)
        return loss


    def _offsets(self) -> dict[torch.Tensor, int]:
        # Each parameter's place in one notional flat buffer (block-aligned): the counter of the
        # stochastic rounding, so no two parameters share rounding bits.
        offsets, at = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                offsets[p] = at
                at += -(-p.numel() // BLOCK) * BLOCK
        return offsets

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``CPUAdam`` (any ``moment_dtype``) or ``torch.optim.AdamW`` state dict; the
        moments are converted to this optimizer's ``moment_dtype``."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if _NAMES[0] in state:
                _convert(state, self.moment_dtype)

    def torch_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as ``torch.optim.AdamW`` holds it (fp32 moments shaped like
        their parameters; for ``"fp32"`` the same as ``state_dict()``)."""
        sd = self.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, state in sd["state"].items():
            if _NAMES[0] in state and (_format(state) != "fp32"):
                shape = params[idx].shape
                sd["state"][idx] = {"step": state["step"], **{
                    n: x.view(shape) for n, x in zip(_NAMES, _moments(state).to_fp32(),
                                                     strict=True)}}
        return sd


def _scales(name: str) -> str:
    return f"{name}_scales"


def _format(state: dict[str, Any]) -> str:
    if _scales(_NAMES[0]) in state:
        return "int8"
    return "bf16" if state[_NAMES[0]].dtype == torch.bfloat16 else "fp32"


def _moments(state: dict[str, Any]) -> Moments:
    fmt = _format(state)
    flat = {n: state[n].reshape(-1) for n in _NAMES}
    if fmt == "int8":
        # torch's load_state_dict casts every state tensor to the parameter's dtype: codes come
        # back as exact small floats
        flat = {n: t.to(torch.uint8) for n, t in flat.items()}
        flat.update({_scales(n): state[_scales(n)].float().reshape(-1) for n in _NAMES})
    return _RULE.named(fmt, flat)


def _put(state: dict[str, Any], mom: Moments, p: torch.Tensor) -> None:
    for n in _NAMES:
        state.pop(_scales(n), None)
    for key, t in mom.fields().items():
        state[key] = t if key.endswith("_scales") else t.view(p.shape)


def _convert(state: dict[str, Any], moment_dtype: str) -> None:
    p_like = state[_NAMES[0]]
    mom = _moments(state)
    if mom.moment_dtype != moment_dtype:
        # fp32 may be a bf16 state that torch's loader widened: narrowing it again is exact
        mom = _RULE.from_fp32(mom.to_fp32(), moment_dtype)
    _put(state, mom, p_like)


def _moment_args(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for n in _NAMES for k in (n, _scales(n)) if k in state}


def _check_param(p: torch.Tensor) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"CPUAdam: parameter is on {p.device}; CPUAdam updates CPU tensors only")
    if p.dtype != torch.float32:
        raise ValueError(
            f"CPUAdam: parameter has dtype {p.dtype}; CPUAdam keeps fp32 master weights "
            "(convert the model with `.float()`)"
        )
    if not p.is_contiguous():
        raise ValueError("CPUAdam: parameters must be contiguous")


def _check_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError("CPUAdam does not support sparse gradients")
    if grad.device.type != "cpu":
        raise RuntimeError(f"CPUAdam: gradient is on {grad.device}; it must be on CPU")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"CPUAdam: grad has dtype {grad.dtype}; expected float32, bfloat16 or float16"
        )
    if grad.shape != p.shape:
        raise ValueError(f"CPUAdam: grad has shape {tuple(grad.shape)}, param {tuple(p.shape)}")


def _check_unsupported(group: dict[str, Any]) -> None:
    for key in ("amsgrad", "maximize"):
        if group.get(key, False):
            raise ValueError(f"CPUAdam does not support {key}=True; use torch.optim.AdamW for it")
