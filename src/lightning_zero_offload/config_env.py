"""``ZeroOffloadConfig`` options from the environment, a JSON/YAML file or adapter keywords.

Frameworks without a plugin registry (Accelerate, the transformers Trainer) switch the engine on
with ``ZERO_OFFLOAD=1`` and take options as ``ZERO_OFFLOAD_<FIELD>`` variables (e.g.
``ZERO_OFFLOAD_BUCKET_SIZE_MB=50``) or a ``.json``/``.yaml`` file named by
``ZERO_OFFLOAD_CONFIG``. Every value is parsed as its field's type here; a misspelt name or a bad
value raises naming the variable or file it came from.
"""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Mapping
from pathlib import Path

from lightning_zero_offload.core.config import ZeroOffloadConfig

ENV_FLAG = "ZERO_OFFLOAD"
ENV_CONFIG = "ZERO_OFFLOAD_CONFIG"
ENV_PREFIX = "ZERO_OFFLOAD_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _parse_bool(source: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{source}={text!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def zero_offload_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ZERO_OFFLOAD`` turns the engine on (unset or empty means off)."""
    env = os.environ if environ is None else environ
    return _parse_bool(ENV_FLAG, env.get(ENV_FLAG, ""))


def field_types() -> dict[str, object]:
    """Each ``ZeroOffloadConfig`` field's type hint, by name."""
    return typing.get_type_hints(ZeroOffloadConfig)


def _coerce(source: str, value: object, hint: object) -> object:
    """``value`` (text from a variable, or a JSON/YAML scalar) as the field's type, or a
    ValueError that names ``source``."""
    args = typing.get_args(hint)
    optional = type(None) in args
    bases = [a for a in args if a is not type(None)] if args else [hint]
    if set(bases) == {float, str}:  # offload_fraction: a number or "auto"
        return _coerce_number_or_word(source, value)
    base = bases[0]
    expected = getattr(base, "__name__", str(base)) + (" or none" if optional else "")
    if typing.get_origin(base) is tuple:  # cpu_affinity: "0,1,2" (or "[0, 1, 2]", a list)
        return _coerce_ints(source, value, optional)
    if base not in (bool, int, float, str):
        raise TypeError(f"no parser for option {source} of type {hint}")
    if isinstance(value, str) and base is not str:
        text = value.strip()
        if optional and text.lower() in ("none", "null"):
            return None
        if base is bool:
            return _parse_bool(source, text)
        try:
            return typing.cast(type, base)(text)
        except ValueError:
            raise ValueError(f"{source}={value!r}: expected {expected}") from None
    if isinstance(value, str) and optional and value.strip().lower() in ("none", "null"):
        return None  # precision=none: take the framework's
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, typing.cast(type, base)) and not (
        base is int and isinstance(value, bool)
    ):
        return value
    raise ValueError(f"{source}={value!r}: expected {expected}")


def _coerce_number_or_word(source: str, value: object) -> float | str:
    """A number, from text when it reads as one; else the word itself, which the config
    checks (``offload_fraction``: ``"auto"``), so one place says what the field accepts."""
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            return text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{source}={value!r}: expected a number or a word such as 'auto'")


def _coerce_ints(source: str, value: object, optional: bool) -> tuple[int, ...] | None:
    """Comma-separated ints from a variable, or a list of ints from a file."""
    text = value.strip() if isinstance(value, str) else None
    if optional and (value is None or (text or "").lower() in ("none", "null")):
        return None
    items = value if text is None else text.strip("[]()").replace(",", " ").split()
    try:
        if not isinstance(items, (list, tuple)) or not items or any(
            isinstance(i, (bool, float)) for i in items
        ):
            raise ValueError
        return tuple(int(i) for i in items)
    except (TypeError, ValueError):
        raise ValueError(
            f"{source}={value!r}: expected comma-separated integers such as 0,1,2"
            + (" (or none)" if optional else "")
        ) from None


def load_config_file(path: str | os.PathLike[str], *, source: str = ENV_CONFIG
                     ) -> dict[str, object]:
    """ZeroOffloadConfig fields from a ``.json`` or ``.yaml``/``.yml`` mapping (checked)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{source}={str(path)!r}: no such file")
    text = file.read_text()
    try:
        if file.suffix == ".json":
            data = json.loads(text)
        elif file.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise ValueError(f"{source}={str(path)!r}: use a .json, .yaml or .yml file")
    except (json.JSONDecodeError, ImportError) as e:
        raise ValueError(f"{source}={str(path)!r} could not be read: {e}") from None
    except Exception as e:  # yaml.YAMLError without importing yaml at module level
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"{source}={str(path)!r} could not be read: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}={str(path)!r} must hold a mapping of ZeroOffloadConfig fields")
    hints = field_types()
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ValueError(f"{source}={str(path)!r}: unknown option(s) {unknown}; "
                         f"ZeroOffloadConfig fields are {sorted(hints)}")
    return {k: _coerce(f"{path}: {k}", v, hints[k]) for k, v in data.items()}


def config_overrides_from_env(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """ZeroOffloadConfig fields set by ``ZERO_OFFLOAD_CONFIG`` and ``ZERO_OFFLOAD_<FIELD>``
    (the variables win over the file). A misspelt variable raises instead of being ignored."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    if env.get(ENV_CONFIG, "").strip():
        values.update(load_config_file(env[ENV_CONFIG].strip()))
    hints = field_types()
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG:
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in hints:
            known = [ENV_CONFIG] + [ENV_PREFIX + n.upper() for n in sorted(hints)]
            raise ValueError(f"{var} is not a ZeroOffload option; the variables are {known}")
        values[name] = _coerce(var, env[var], hints[name])
    return values


def check_option_names(names: object, who: str) -> None:
    """A TypeError listing the fields when ``names`` holds one that is not a config field."""
    known = field_types()
    unknown = sorted(set(typing.cast("typing.Iterable[str]", names)) - set(known))
    if unknown:
        raise TypeError(f"{who}: unknown option(s) {unknown}; ZeroOffloadConfig fields are "
                        f"{sorted(known)}")


def build_config(base: ZeroOffloadConfig | None, values: Mapping[str, object], *, who: str,
                 where: str) -> ZeroOffloadConfig:
    """``base`` (or the defaults) with ``values`` applied; an unknown name or a value the
    config rejects raises naming ``who`` and ``where`` the options came from."""
    if base is not None and not isinstance(base, ZeroOffloadConfig):
        raise TypeError(f"{who}: config must be a ZeroOffloadConfig, got {type(base).__name__}")
    check_option_names(values, who)
    try:
        return (base or ZeroOffloadConfig()).replace(**values)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e} (options from {where})") from None
