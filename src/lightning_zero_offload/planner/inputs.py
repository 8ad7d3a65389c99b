"""The planner's inputs read and checked: sizes, counts, numbers. Every refusal names the
argument (``lzo-plan`` shows it with the option's name) and what is expected."""

from __future__ import annotations

import math
import re
from typing import Any

MAX_PARAMS = 10**12  # the planner counts bucket by bucket: beyond a trillion it takes minutes
# The settings' names and defaults, here (no torch) so that ``lzo-plan --help`` imports nothing
# heavy: bytes per element of each precision's compute dtype, the moment dtypes, the defaults
# (the update rules' keys are the registry's, ``core.rules.rules.RULES``, checked when planning).
ELEM = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}
MOMENT_DTYPES = ("fp32", "bf16", "int8")
DEFAULT_HOST_RESERVE = "10%"
AUTO = "auto"
DEFAULT_HEADROOM = 0.2
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class PlanArgumentError(ValueError):
    """A bad value of ``plan``'s argument ``argument``: ``plan: ARGUMENT: PROBLEM``."""

    def __init__(self, argument: str, problem: str) -> None:
        self.argument, self.problem = argument, problem
        super().__init__(f"plan: {argument}: {problem}")

    @property
    def option(self) -> str:
        """The ``lzo-plan`` option of the argument."""
        return "--" + self.argument.replace("_", "-")


class PlanArgumentTypeError(PlanArgumentError, TypeError):
    """An argument of the wrong type (a list for a count, a string for a flag)."""


def _number(value: Any, argument: str, units: dict[str, float], what: str,
            example: str) -> float:
    """A finite number >= 0 from ``value``: a number, or a string with one of ``units``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PlanArgumentTypeError(argument, f"got {type(value).__name__} {value!r}; give "
                                    f"{what} as a number or a string such as {example}")
    if isinstance(value, str):
        m = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in units:
            raise PlanArgumentError(argument, f"cannot read {value!r} as {what}: use e.g. "
                                    f"{example}")
        number = float(m.group(1)) * units[m.group(2).lower()]
    else:
        number = float(value)
    if not math.isfinite(number) or number < 0:
        raise PlanArgumentError(argument, f"{value!r} is not {what} (a finite number >= 0): "
                                f"use e.g. {example}")
    return number


def parse_bytes(value: int | float | str, argument: str = "size") -> int:
    """``24GiB``, ``24 GB``, ``2.5e10`` or a number of bytes."""
    return int(_number(value, argument, _UNITS, "a size", "24GiB, 80GB or 2.5e10"))


def parse_count(value: int | float | str, argument: str = "params") -> int:
    """``7e9``, ``7B``, ``350M`` or an int: a parameter count, at most ``MAX_PARAMS``."""
    n = _number(value, argument, _COUNT_UNITS, "a parameter count", "7e9, 7B or 350M")
    if n > MAX_PARAMS:
        raise PlanArgumentError(argument, f"{value!r} is more than the planner counts (at most "
                                f"{MAX_PARAMS:.0e} parameters)")
    return int(n)


def memory(value: int | float | str | None, argument: str) -> int | None:
    """A memory size > 0, or None."""
    if value is None:
        return None
    n = parse_bytes(value, argument)
    if n < 1:
        raise PlanArgumentError(argument, f"{value!r} is no memory: give the size, e.g. 24GiB")
    return n


def reserve(value: int | float | str, host_memory: int | None) -> int:
    """Bytes of ``host_memory`` kept for the OS, Python and data loaders: ``"10%"`` of it or a
    size (``"8GiB"``); 0 without a host memory."""
    argument = "host_reserve"
    if isinstance(value, str) and value.strip().endswith("%"):
        share = _number(value.strip()[:-1], argument, {"": 1}, "a percentage", "10%")
        if share >= 100:
            raise PlanArgumentError(argument, f"{value!r} keeps all host memory: give a "
                                    "percentage below 100%, e.g. 10%, or a size, e.g. 8GiB")
        n = int((host_memory or 0) * share / 100)
    else:
        n = parse_bytes(value, argument)
    if host_memory is not None and n >= host_memory:
        raise PlanArgumentError(argument, f"{value!r} is not less than the host memory "
                                f"({host_memory} bytes): give a smaller reserve, e.g. 10%")
    return n if host_memory is not None else 0


def positive_int(value: Any, argument: str) -> None:
    """Refuse anything but an int >= 1 (None passes)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanArgumentTypeError(argument, f"got {type(value).__name__} {value!r}; give an "
                                    "int >= 1")
    if value < 1:
        raise PlanArgumentError(argument, f"{value!r} is not an int >= 1")


def positive_number(value: Any, argument: str) -> float:
    """A finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanArgumentTypeError(argument, f"got {type(value).__name__} {value!r}; give a "
                                    "number > 0")
    if not (math.isfinite(value) and value > 0):
        raise PlanArgumentError(argument, f"{value!r} is not a finite number > 0")
    return float(value)


def fraction(value: Any, argument: str, auto: str | None = None,
             below_one: bool = False) -> Any:
    """A number in [0, 1] (``[0, 1)`` with ``below_one``), or the string ``auto`` where given."""
    if auto is not None and value == auto:
        return auto
    want = ("a number in [0, 1)" if below_one else "a number in [0, 1]") + (
        f" or {auto!r}" if auto is not None else "")
    if isinstance(value, str):  # the right type for "auto": a bad value, not a bad type
        raise PlanArgumentError(argument, f"cannot read {value!r}: give {want}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanArgumentTypeError(argument, f"got {type(value).__name__} {value!r}; give "
                                    f"{want}")
    if not (0.0 <= value < 1.0 if below_one else 0.0 <= value <= 1.0):
        raise PlanArgumentError(argument, f"{value!r} is not {want}")
    return float(value)


def choice(value: Any, argument: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise PlanArgumentError(argument, f"{value!r} is not supported; use one of "
                                f"{', '.join(map(repr, choices))}")
    return value


def flag(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise PlanArgumentTypeError(argument, f"got {type(value).__name__} {value!r}; give "
                                    "True or False")
    return value
