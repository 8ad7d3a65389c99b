"""What importing the package costs and gives: every import the README shows works; ``import
lightning_zero_offload``, the planner and the non-Lightning adapters load neither Lightning nor
the test harness (emulated device, race detector); the ``"zero_offload"`` strategy is still
registered with Lightning in either import order."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
HARNESS = ("lightning_zero_offload.testing",)


def _readme_imports() -> list[tuple[str, str]]:
    """``(module, name)`` for each ``from lightning_zero_offload... import ...`` in the README's
    python blocks, and for each ``lightning_zero_offload.X`` its prose names as a path."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        for module, names in re.findall(
                r"^\s*from\s+(lightning_zero_offload[\w.]*)\s+import\s+([^#\n]+)", block, re.M):
            found += [(module, n.strip()) for n in names.strip("() ").split(",") if n.strip()]
    # LightningCLI's class_path and the like: `lightning_zero_offload.Name`
    found += [("lightning_zero_offload", n) for n in
              re.findall(r"\blightning_zero_offload\.([A-Z]\w+)\b", text)]
    return sorted(set(found))


def test_the_readme_shows_the_imports_this_test_checks() -> None:
    names = {n for _, n in _readme_imports()}
    assert {"ZeroOffloadPlugin", "ZeroOffloadTrainer", "ZeroOffloadSFTConfig",
            "ZeroOffloadStrategy"} <= names


@pytest.mark.parametrize(("module", "name"), _readme_imports())
def test_every_import_the_readme_shows_works(module: str, name: str) -> None:
    if name == "ZeroOffloadSFTConfig":
        pytest.importorskip("trl")
    import lightning_zero_offload

    mod = importlib.import_module(module)
    # the same copy of the package (a development install can map a missing module elsewhere)
    assert Path(mod.__file__ or "").is_relative_to(Path(lightning_zero_offload.__file__).parent)
    assert getattr(mod, name) is not None


@pytest.mark.parametrize("name", ["ZeroOffloadStrategy", "ZeroOffloadFabricStrategy",
                                  "ZeroOffload", "ZeroOffloadConfig", "CPUAdam", "plan"])
def test_the_names_the_readme_uses_unqualified_are_top_level(name: str) -> None:
    """The TP section uses ZeroOffloadFabricStrategy and ZeroOffload without naming a module."""
    import lightning_zero_offload

    assert name in dir(lightning_zero_offload)
    assert getattr(lightning_zero_offload, name).__name__ == name


def _loaded_after(code: str) -> list[str]:
    """The modules of Lightning and the test harness in sys.modules after ``code``, in a fresh
    process."""
    probe = (f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if "
             f"m.split('.')[0] in {LIGHTNING!r} or m.startswith({HARNESS!r})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def _plan_help() -> str:
    """``lzo-plan --help`` through its console-script entry point."""
    entry = re.search(r'^lzo-plan\s*=\s*"([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(),
                      re.M)
    assert entry, "pyproject.toml names no lzo-plan entry point"
    module, func = entry.groups()
    return (f"import sys, contextlib, io\nsys.argv = ['lzo-plan', '--help']\n"
            f"from {module} import {func}\n"
            f"with contextlib.redirect_stdout(io.StringIO()) as help_text:\n"
            f"    try:\n        {func}()\n    except SystemExit as e:\n"
            f"        assert e.code in (0, None), e.code\n"
            f"assert 'usage' in help_text.getvalue()")


@pytest.mark.parametrize("code", [
    "import lightning_zero_offload",
    "import lightning_zero_offload.planner",
    "from lightning_zero_offload import ZeroOffload, plan",
    "PLAN_HELP",
])
def test_the_package_and_planner_load_neither_lightning_nor_the_test_harness(code: str) -> None:
    assert _loaded_after(_plan_help() if code == "PLAN_HELP" else code) == []


@pytest.mark.parametrize("module", ["accelerate", "transformers"])
def test_the_accelerate_and_transformers_adapters_do_not_load_lightning(module: str) -> None:
    pytest.importorskip(module)
    assert _loaded_after(f"import lightning_zero_offload.{module}") == []


_TRAINER = """
from lightning.pytorch import Trainer
from lightning.fabric import Fabric
from lightning_zero_offload import ZeroOffloadFabricStrategy, ZeroOffloadStrategy
kw = dict(accelerator="cpu", devices=1)
trainer = Trainer(strategy="zero_offload", logger=False, enable_checkpointing=False, **kw)
assert type(trainer.strategy) is ZeroOffloadStrategy, type(trainer.strategy)
fabric = Fabric(strategy="zero_offload", **kw)
assert type(fabric.strategy) is ZeroOffloadFabricStrategy, type(fabric.strategy)
"""


_LOOKUP_FIRST = ("lightning_zero_offload\nimport importlib.util\n"
                 "importlib.util.find_spec('lightning')")


@pytest.mark.parametrize("first", ["lightning_zero_offload", "lightning.pytorch", "lightning",
                                   _LOOKUP_FIRST])
def test_zero_offload_is_registered_with_lightning_in_either_import_order(first: str) -> None:
    """Also when something asks whether Lightning is installed (``find_spec``, as
    ``lightning_utilities.module_available`` does) before importing it."""
    pytest.importorskip("lightning")
    second = "lightning_zero_offload" if first != "lightning_zero_offload" else "lightning"
    code = f"import {first}\nimport {second}\n{_TRAINER}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr


def test_the_seed_variable_loads_the_emulated_device_in_a_fresh_process() -> None:
    """Nothing imports the test harness up front; the device factory loads it when asked."""
    code = ("import os, sys, torch\nimport lightning_zero_offload as zo\n"
            "assert 'lightning_zero_offload.testing' not in sys.modules\n"
            "m = torch.nn.Linear(8, 8)\n"
            "e = zo.ZeroOffload(m, torch.optim.AdamW(m.parameters()), precision='32-true')\n"
            "print(type(e._dev).__module__, type(e._dev).__name__)\ne.teardown()")
    env = {**os.environ, "LZO_EMULATED_DEVICE_SEED": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lightning_zero_offload.testing.emulated_device",
                                  "EmulatedDevice"]
