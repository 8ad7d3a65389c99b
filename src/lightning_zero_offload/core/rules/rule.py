"""What an update rule is: the one seam between the engine and the arithmetic of a step.

A rule owns its state's shape and nothing of the engine: the names of its per-parameter state
(:attr:`Rule.state`, as torch's ``state_dict`` spells them, each with its 8-bit code), their bytes
on the host for each ``moment_dtype`` and on the device, their zeros and their fp32 form, which
optimizers it takes and their hyperparameter check, and two implementations of one update with
the same semantics:

- :meth:`Rule.host_update`: a fused C++ kernel (or its pure-torch reference) over flat host
  tensors, the state in any ``moment_dtype``, the new half weights optionally written in the
  same pass;
- :meth:`Rule.device_update`: torch ops over fp32 master and state wherever they live (the
  device; the CPU too, which is how it is tested), equal to the kernel to fp32 rounding.

Both take the gradient as it arrived and a ``grad_scale`` (loss-scale inverse times clip
coefficient) that multiplies it before anything else, and a 1-based ``step``. One instance per
engine, made from the user's optimizer by the registry (``core.rules.rules.rule_for``; the planner's
from an optimizer's name and options, ``core.rules.rules.rule_named``). The state's shape is the
instance's (an optimizer's options may change it); the engine, its checkpoints, budgets and the
planner ask it and never spell a state name or a byte count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_zero_offload.ops import Moments, moment_bytes


def unwrapped(fn: object) -> object:
    """``fn`` without the wrapper torch's ``Optimizer`` puts around a class's ``step`` to run its
    hooks (marked ``hooked``); any other wrapper, a user's ``functools.wraps`` included, stays:
    it may change the step."""
    while getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = getattr(fn, "__wrapped__")  # noqa: B009
    return fn


def qualified(cls: type) -> str:
    """A class as users import it: ``lion_pytorch.foreach.Lion``, not just ``Lion``."""
    return f"{cls.__module__}.{cls.__name__}"


def check_keeps_step(optimizer: torch.optim.Optimizer, base: type, what: str) -> None:
    """The optimizer's class keeps ``base.step``: the fused step runs the rule's update, so
    another ``step`` (or a wrapper around it) would be silently ignored."""
    if unwrapped(type(optimizer).step) is not unwrapped(base.step):
        raise TypeError(
            f"ZeroOffload: {qualified(type(optimizer))} overrides step(), which the fused CPU "
            f"step would not run; use {what} (or a subclass that keeps their step)")


class Rule(ABC):
    """One update rule, configured for one optimizer by :meth:`for_optimizer` (after
    :meth:`accepts`), which checks its options (``TypeError``/``ValueError`` naming what to
    change), or for an optimizer's options alone by :meth:`from_options` (the planner's);
    ``Rule()`` is the rule with its defaults."""

    NAME: ClassVar[str]  # as users know it, in messages: "Adam/AdamW", "Lion"
    KEY: ClassVar[str]  # recorded in checkpoints: "adamw", "lion"
    # The default per-parameter state besides "step": torch's names, and each one's 8-bit code
    # (ops.SIGNED, ops.SQRT). An instance's state is :attr:`state` (names: :attr:`names`).
    STATE: ClassVar[tuple[str, ...]]
    CODES: ClassVar[Mapping[str, str]]
    OPTIMIZERS: ClassVar[str]  # what users pass, for messages: "torch.optim.AdamW or Adam"
    FAMILY: ClassVar[str]  # in the class name of an optimizer of this kind: "adam", "lion"
    EXAMPLE: ClassVar[str]  # the advice to such a user: "torch.optim.AdamW(model.parameters())"
    DEFAULTS: ClassVar[dict]  # one param group's hyperparameters, as the optimizer's defaults

    @classmethod
    @abstractmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> Rule:
        """The rule for ``optimizer`` (one :meth:`accepts`), its options checked."""

    @classmethod
    @abstractmethod
    def accepts(cls, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is one of this rule's (its options are checked by ``cls``)."""

    @classmethod
    def from_options(cls, **options: Any) -> Rule:
        """The rule of an optimizer of this kind made with ``options`` (its constructor's
        keyword arguments), checked as :meth:`for_optimizer` checks them, with no optimizer
        made: what the planner plans. Options that change nothing of the rule (the groups'
        hyperparameters) are ignored; none: ``cls()``, the rule with its defaults."""
        return cls()

    @property
    def options(self) -> dict[str, Any]:
        """The options that shape this rule's state, as :meth:`from_options` takes them:
        recorded in checkpoints beside :attr:`KEY`, so a checkpoint's rule is rebuilt with the
        state it wrote (none: the state is the rule's own whatever the options)."""
        return {}

    # --- the state's shape: names, bytes, zeros and the fp32 form --------------------------

    @property
    def state(self) -> Mapping[str, str]:
        """This rule's per-parameter state: torch's names, each with its 8-bit code (a rule
        whose options change its state overrides this)."""
        return {name: self.CODES[name] for name in self.STATE}

    @property
    def names(self) -> tuple[str, ...]:
        """The state's names, in order."""
        return tuple(self.state)

    def device_bytes(self) -> int:
        """Bytes per element of the state on the device: fp32, whatever ``moment_dtype``."""
        return 4 * len(self.state)

    def host_bytes(self, numel: int, moment_dtype: str) -> int:
        """Exact host bytes of the state of ``numel`` elements (block scales included)."""
        return moment_bytes(numel, moment_dtype, len(self.state))

    def zeros(self, numel: int, moment_dtype: str, *, pin_memory: bool = False) -> Moments:
        """The initial state of ``numel`` elements (:meth:`host_bytes` bytes)."""
        return Moments.zeros(numel, moment_dtype, names=self.state, pin_memory=pin_memory)

    def from_fp32(self, arrays: Sequence[Tensor], moment_dtype: str) -> Moments:
        """fp32 arrays in :attr:`names` order as ``moment_dtype``, rounded to nearest."""
        return Moments.from_fp32(*arrays, moment_dtype, names=self.state)

    def named(self, moment_dtype: str, fields: Mapping[str, Any]) -> Moments:
        """The state from tensors by name, as a checkpoint stores them."""
        return Moments.named(moment_dtype, fields, self.state)

    # --- one step ------------------------------------------------------------------------

    @abstractmethod
    def check_hparams(self, groups: list[dict]) -> None:
        """Every group's hyperparameters, before a step changes anything: a bad value set after
        setup (a scheduler, a user edit) raises with nothing updated, not after some buckets."""

    @abstractmethod
    def hyper(self, group: dict) -> Any:
        """A checked group's hyperparameters for one step, as plain numbers."""

    @abstractmethod
    def host_update(self, master: Tensor, grad: Tensor, state: Moments, hp: Any, *, step: int,
                    grad_scale: float, out: Tensor | None, threads: int, seed: int) -> None:
        """One step over flat host tensors by the fused kernel; ``state`` is the matching
        chunk, ``out`` (bf16/fp16, or None) receives the new weights rounded to nearest even."""

    @abstractmethod
    def device_update(self, master: Tensor, grad: Tensor, state: Sequence[Tensor], hp: Any, *,
                      step: int, grad_scale: float) -> None:
        """The same step over fp32 tensors on one device by torch ops; ``state`` in
        :attr:`names` order; ``grad`` itself is left as it is."""
