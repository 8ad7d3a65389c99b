"""Importing an adapter without its extra names the pip command, not a bare ModuleNotFoundError."""

from __future__ import annotations

import importlib
import importlib.util
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
    pytest.importorskip("lightning_zero_offload.transformers")  # everything else imported first
    name = f"lightning_zero_offload.{module}"
    monkeypatch.delitem(sys.modules, name)  # restored after the test
    monkeypatch.setitem(sys.modules, blocked, None)  # import blocked -> ImportError
    with pytest.raises(ImportError, match=rf"pip install 'lightning-zero-offload\[{module}\]'"):
        importlib.import_module(name)


def test_tasks_passes_lzo_torch_options_to_pip_as_separate_arguments(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("tasks", SRC.parents[1] / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    calls = []
    fake = tmp_path / "venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.touch()
    monkeypatch.setattr(tasks, "VENV", tmp_path / "venv")
    monkeypatch.setattr(tasks, "_run", lambda *cmd: calls.append([str(c) for c in cmd]))
    monkeypatch.setattr(tasks, "TORCH", "torch==2.13.0 --index-url https://example.invalid/cpu")
    tasks.ensure_venv()
    torch_call = next(c for c in calls if "torch==2.13.0" in c)
    assert torch_call[-3:] == ["torch==2.13.0", "--index-url", "https://example.invalid/cpu"]
    assert any(c[-2:] == ["-e", ".[all,dev]"] for c in calls)
    monkeypatch.setattr(tasks, "TORCH", "  ")
    with pytest.raises(SystemExit, match="LZO_TORCH is empty"):
        tasks.torch_args()
