"""Dynamic loss scaling for "16-mixed": halve on overflow, double after a run of clean steps."""

from __future__ import annotations

from lightning_zero_offload.core.config import MIN_SCALE

__all__ = ["MIN_SCALE", "DynamicLossScaler"]


class DynamicLossScaler:
    """The policy of ``torch.amp.GradScaler`` (growth 2, backoff 0.5), kept as Python floats
    because the overflow check already lands on the host with the gradient norm."""

    def __init__(self, init_scale: float, growth_interval: int) -> None:
        self.scale = float(init_scale)
        self.growth_interval = int(growth_interval)
        self.growth_factor = 2.0
        self.backoff_factor = 0.5
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.scale * self.backoff_factor < MIN_SCALE:
                raise FloatingPointError(
                    f"ZeroOffload: the fp16 loss scale fell below {MIN_SCALE:g}: the gradients "
                    "are inf/NaN at every scale, so the loss or the data is not finite (check "
                    "them; bf16-mixed has fp32's range and needs no scaling)")
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict) -> None:
        try:
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
            self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"loss scaler state is malformed ({e!r}); expected keys 'scale' and 'good_steps' "
                "as written by ZeroOffload.state_dict()"
            ) from None
