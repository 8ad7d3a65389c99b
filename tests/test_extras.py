"""Importing an adapter without its extra names the pip command, not a bare ModuleNotFoundError."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from lightning_zero_offload._extras import require_extra

SRC = Path(__file__).resolve().parents[1] / "src" / "lightning_zero_offload"


def test_require_extra_names_the_missing_modules_and_the_extra(monkeypatch):
    require_extra("x", "accelerate", "json", "os")  # present: nothing happens
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    with pytest.raises(ImportError) as info:
        require_extra("lightning_zero_offload.accelerate", "accelerate", "json", "accelerate")
    assert str(info.value) == ("lightning_zero_offload.accelerate needs accelerate, which is not "
                               "installed: pip install 'lightning-zero-offload[accelerate]'")
    assert info.value.name == "accelerate"


@pytest.mark.parametrize("module,blocked", [("accelerate", "accelerate"),
                                            ("transformers", "transformers")])
def test_adapter_import_without_its_extra(module, blocked, monkeypatch):
    if "require_extra" not in (SRC / f"{module}.py").read_text():
        pytest.skip(f"{module}.py does not call require_extra yet (see _extras.py)")
    pytest.importorskip("lightning_zero_offload.transformers")  # everything else imported first
    name = f"lightning_zero_offload.{module}"
    monkeypatch.delitem(sys.modules, name)  # restored after the test
    monkeypatch.setitem(sys.modules, blocked, None)  # import blocked -> ImportError
    with pytest.raises(ImportError, match=rf"pip install 'lightning-zero-offload\[{module}\]'"):
        importlib.import_module(name)
