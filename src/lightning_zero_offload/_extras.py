"""A clear ImportError when an adapter's optional dependencies (an extra) are not installed."""

from __future__ import annotations

import importlib


def require_extra(feature: str, extra: str, *modules: str) -> None:
    """Raise ImportError naming ``pip install 'lightning-zero-offload[extra]'`` when one of
    ``modules`` cannot be imported; ``feature`` is what needs them (a module name)."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(
            f"{feature} needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: "
            f"pip install 'lightning-zero-offload[{extra}]'",
            name=missing[0],
        )
