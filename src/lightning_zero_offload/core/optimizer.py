"""The ``torch.optim.Optimizer`` facade that frameworks and LR schedulers talk to."""

from __future__ import annotations

import functools
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from lightning_zero_offload.core.engine import ZeroOffload


class OffloadOptimizer(torch.optim.Optimizer):
    """Shares the user's ``param_groups`` (the same dicts), so schedulers and per-group changes
    to ``lr``/``weight_decay``/``betas`` reach the engine's next step. ``step``/``zero_grad``/
    ``state_dict`` go to the engine; ``state`` stays empty because the state lives on the host
    shards (use ``engine.full_state_dict()`` for torch's format).

    An instance's class is a subclass named after the wrapped optimizer's (``AdamW``/``Adam``),
    since frameworks name things by ``optimizer.__class__.__name__`` (``LearningRateMonitor``
    logs ``lr-AdamW`` as it does without offload); it is not a ``torch.optim.AdamW``.

    Step hooks: those registered here are kept on the user's optimizer (called with this one),
    so that one :meth:`hooked` call runs them, the user's optimizer's own and torch's global
    ones once per engine step, whether the step came through here or ``engine.step()``."""

    def __new__(cls, engine: ZeroOffload, inner: torch.optim.Optimizer) -> OffloadOptimizer:
        # Optimizer defines no __new__: object's, called with the named subclass
        return object.__new__(_named(type(inner).__name__) if cls is OffloadOptimizer else cls)

    def __init__(self, engine: ZeroOffload, inner: torch.optim.Optimizer) -> None:
        # Optimizer.__init__ would copy the groups; set up what it sets, sharing the groups.
        self.engine = engine
        self.inner = inner
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        # No _patch_step_function(): the engine's step runs the hooks (hooked), once.
        self.state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        self.param_groups = inner.param_groups
        self._warned_capturable_if_run_uncaptured = True

    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step()
        return loss

    def hooked(self, update: Callable[[], None]) -> None:
        """``update()`` between the step hooks: torch's global ones and the user's optimizer's
        (this one's included), each called with the optimizer it was registered on."""
        run_step_hooks(self.inner, update)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        return self.inner.register_step_pre_hook(lambda _inner, a, kw: hook(self, a, kw))

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        return self.inner.register_step_post_hook(lambda _inner, a, kw: hook(self, a, kw))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.engine.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError(
            "ZeroOffload: parameters cannot be added after setup; add all param groups to the "
            "optimizer before creating ZeroOffload"
        )


@functools.cache
def _named(name: str) -> type[OffloadOptimizer]:
    """One ``OffloadOptimizer`` subclass per wrapped optimizer class name."""
    return type(name, (OffloadOptimizer,), {"__module__": __name__, "__qualname__": name})


def run_step_hooks(optimizer: torch.optim.Optimizer, update: Callable[[], None]) -> None:
    """``update()`` between ``optimizer``'s step pre and post hooks and torch's global ones, as
    ``optimizer.step()`` runs them: the engine updates the weights in place of the user's
    optimizer, whose hooks (an EMA, a float8 scale precompute) must still see each step.

    ``Optimizer.profile_hook_step`` is torch's public wrapper that runs them around a step
    function; the hooks see ``(optimizer,)`` as the step's arguments (a pre hook's changed
    arguments are not used: the engine's step takes none)."""
    torch.optim.Optimizer.profile_hook_step(lambda _optimizer: update())(optimizer)


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch's LR schedulers that ``optimizer`` has stepped.

    A scheduler warns when ``scheduler.step()`` comes before any ``optimizer.step()``; it learns
    of a step from a private flag that its wrapper around ``optimizer.step`` sets. Where the
    engine steps on an optimizer's behalf (the user's idle optimizer, the facade) that wrapper
    never runs, so the flag is set here, the one place that touches it.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]
