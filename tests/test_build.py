"""Building and loading the kernel: cache key, no-compiler fallback, compile error, prebuilt dir."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_zero_offload import ops
from lightning_zero_offload.ops import _build


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Forget the loaded extension and point the cache at an empty folder (restored after)."""
    monkeypatch.setattr(_build, "_ext", None)
    monkeypatch.setattr(_build, "_warned_no_compiler", False)
    monkeypatch.setenv(_build.ENV_BUILD_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(_build.ENV_KERNEL, raising=False)
    return tmp_path


def _step(out_dtype=torch.bfloat16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    m, v, out = torch.zeros(1000), torch.zeros(1000), torch.empty(1000, dtype=out_dtype)
    ops.fused_adamw_(p, g, m, v, step=1, lr=1e-2, weight_decay=0.1, out=out)
    return [p, m, v, out]


def test_sources_found_and_key_covers_source_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _build.source_dir()
    assert (src / "bindings.cpp").is_file() and (src / "step.h").is_file()
    key = _build.cache_key()
    assert key == _build.cache_key(src)
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    assert _build.cache_key(copy) == key
    (copy / "step.h").write_text((copy / "step.h").read_text() + "\n// changed\n")
    assert _build.cache_key(copy) != key
    monkeypatch.setattr(_build, "cflags", lambda: ["-O1"])
    assert _build.cache_key() != key


def test_no_compiler_warns_once_and_uses_reference(fresh: Path, monkeypatch) -> None:
    monkeypatch.setattr(_build, "find_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler") as record:
        first = _step()
        second = _step()
    assert len([w for w in record if "compiler" in str(w.message)]) == 1
    assert ops.backend() == "reference"
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _build.load() is None  # no second warning


def test_kernel_env_values(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_build.ENV_KERNEL, "fast")
    with pytest.raises(ValueError, match="LZO_KERNEL"):
        _build.load()
    monkeypatch.setenv(_build.ENV_KERNEL, "cpp")
    monkeypatch.setattr(_build, "find_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        _build.load()


def test_failing_compile_raises_clear_error(fresh: Path, capsys) -> None:
    if _build.find_compiler() is None:
        pytest.skip("no C++ compiler here")
    broken = fresh / "broken"
    shutil.copytree(_build.source_dir(), broken)
    (broken / "bindings.cpp").write_text('#error "lzo_broken_source_marker"\n')
    with pytest.raises(RuntimeError) as info:
        _build.build(fresh / "brokenkey", broken)
    message = str(info.value)
    assert "building the C++ CPU optimizer kernel" in message
    assert "lzo_broken_source_marker" in message  # the compiler's own words
    assert "LZO_KERNEL=reference" in message and "g++" in message  # what to do
    # the pause of a real first build (about a minute) is announced once, on stderr
    said = "building the CPU optimizer kernel (first use, about a minute)"
    assert capsys.readouterr().err.count(said) == 1


def test_prebuilt_read_only_dir_loads_without_compiler(fresh: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv(_build.ENV_BUILD_DIR)  # the normal cache: built by now, or built here
    module = _build.load()
    if module is None:
        pytest.skip("the C++ kernel is not in use")
    root = fresh / "prebuilt"
    target = root / _build.cache_key()
    target.mkdir(parents=True)
    shutil.copy2(module.__file__, target / Path(module.__file__).name)
    target.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        # A fresh process with no compiler (CXX points nowhere) loads the read-only prebuilt copy.
        env = dict(os.environ, LZO_BUILD_DIR=str(root), CXX="/nonexistent/c++")
        code = (
            "import warnings; warnings.simplefilter('error'); import torch\n"
            "from lightning_zero_offload import ops\n"
            "from lightning_zero_offload.ops import _build\n"
            "p, g, m, v = torch.ones(100), torch.ones(100), torch.zeros(100), torch.zeros(100)\n"
            "ops.fused_adamw_(p, g, m, v, step=1, lr=0.5)\n"
            "print(_build.load().__file__, ops.backend(), p[0].item())\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "building the CPU optimizer kernel" not in proc.stderr  # loading is not building
        file, backend, value = proc.stdout.split()
        assert Path(file).parent == target and backend == "cpp" and abs(float(value) - 0.5) < 1e-6
        assert _build.main([str(root)]) == 0
        printed = capsys.readouterr().out
        assert str(target) in printed and f"LZO_BUILD_DIR={root}" in printed
    finally:
        target.chmod(stat.S_IRWXU)


def _isa_in_fresh_process(value: str) -> subprocess.CompletedProcess:
    """A new process (the path is chosen when the extension loads) with ``LZO_KERNEL_ISA=value``
    prints the path in use after one step."""
    code = ("import torch\nfrom lightning_zero_offload import ops\n"
            "p, g, m, v = torch.ones(100), torch.ones(100), torch.zeros(100), torch.zeros(100)\n"
            "ops.fused_adamw_(p, g, m, v, step=1, lr=0.5)\nprint(ops.get_isa())\n")
    env = dict(os.environ, **{_build.ENV_ISA: value})
    env.pop(_build.ENV_KERNEL, None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def test_kernel_isa_env_selects_the_path_or_names_those_there_are() -> None:
    paths = ops.available_isas()
    if not paths:
        pytest.skip("the C++ kernel is not in use")
    # the last path is never the default where there are several (best first)
    proc = _isa_in_fresh_process(f" {paths[-1].upper()} ")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [paths[-1]]
    proc = _isa_in_fresh_process("avx1024")
    assert proc.returncode != 0
    assert "LZO_KERNEL_ISA='avx1024'" in proc.stderr, proc.stderr
    assert f"available here (best first): {', '.join(paths)}" in proc.stderr, proc.stderr
