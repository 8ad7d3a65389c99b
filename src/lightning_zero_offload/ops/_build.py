"""Build and load the C++ kernel. PLACEHOLDER: the kernel work replaces this module.

``load()`` returns the extension module, or ``None`` when the pure-torch reference is in use.
"""

from __future__ import annotations


def load():  # noqa: ANN201 - replaced by the kernel work
    return None


def main() -> int:
    raise SystemExit("the C++ kernel is not built yet")
