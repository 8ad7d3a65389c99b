"""Saves that fail, and saves the script never waits for, as a user's script meets them: in a
process of its own (one, or two under torchrun) whose exit is the interpreter's real one. The
process exits with the script's own status (never an abort), a failure names the user's path,
the previous checkpoint stays as it was, nothing else is left in the folder, and a save nobody
waited for is published (equal to a blocking save of that step) or reported by name."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _dist import torchrun

SCRIPT = Path(__file__).with_name("_save_scenarios.py")
OWN_STATUS = "7"  # what the script exits with: an abort (134) or a crash is anything else


def _run(*args: str, world: int = 1, timeout: float = 300) -> tuple[list[dict], str]:
    """The script on ``world`` processes: what each rank saw, and the output (asserting each
    process exited with the script's own status)."""
    results = Path(tempfile.mkdtemp(prefix="lzo-results-"))
    if world == 1:
        env = {**os.environ, "EXIT_STATUS": OWN_STATUS, "OMP_NUM_THREADS": "1",
               "RESULTS": str(results)}
        run = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                             text=True, timeout=timeout, cwd=SCRIPT.parent)
        assert run.returncode == int(OWN_STATUS), run.stdout + run.stderr
    else:  # torchrun's status is 0 only if every rank's is
        run = torchrun(SCRIPT, *args, timeout=timeout, EXIT_STATUS="0", RESULTS=str(results))
        assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout + run.stderr
    found = sorted(results.iterdir())
    assert len(found) == world, out
    seen = [json.loads(p.read_text()) for p in found]
    shutil.rmtree(results)
    return seen, out


@contextlib.contextmanager
def _tmpfs(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@contextlib.contextmanager
def _fault_folder(kind: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if kind == "enospc":
        with _tmpfs(tmp_path / "disk", "2m") as folder:
            yield kind, folder
    elif kind == "readonly" and os.geteuid() == 0:  # root writes through a folder's mode
        with _tmpfs(tmp_path / "disk", "16m") as folder:
            yield "readonly-mount", folder
    else:
        folder = tmp_path / "disk"
        folder.mkdir()
        yield ("readonly-chmod" if kind == "readonly" else kind), folder


REASON = {"enospc": "No space left on device", "efbig": "File too large",
          "readonly": "Read-only file system"}


@pytest.mark.parametrize("kind", ["enospc", "efbig", "readonly"])
def test_a_failed_write_raises_naming_the_path_and_the_run_goes_on(tmp_path, kind):
    """Item 1 and 4: blocking and asynchronous, file and folder."""
    with _fault_folder(kind, tmp_path) as (script_kind, folder):
        (result,), out = _run("fault", script_kind, str(folder))
    for case in ("file-blocking", "file-async", "dir-blocking", "dir-async"):
        got, path = result[case], folder / case.split("-")[0]
        reason = REASON[kind] if script_kind != "readonly-chmod" else "Permission denied"
        assert got["error"] == (f"OSError: [Errno {_errno(reason)}] cannot save the checkpoint "
                                f"to {str(path)!r}: {reason}"), (case, out)
        assert got["intact"], (case, out)
        assert got["left"] == (["dir", "file"] if case.startswith("dir") else ["file"]), case
    assert result["file-after"] and result["dir-after"], out


def _errno(reason: str) -> int:
    import errno

    return {"No space left on device": errno.ENOSPC, "File too large": errno.EFBIG,
            "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES}[reason]


@pytest.mark.slow
def test_one_ranks_failed_write_raises_on_both_and_neither_aborts(tmp_path):
    """Two gloo ranks under torchrun: the writing rank's write fails (``RLIMIT_FSIZE``)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    results, out = _run("fault", "efbig", str(folder), world=2)
    for case in ("file-blocking", "file-async", "dir-blocking", "dir-async"):
        errors = [r[case]["error"] for r in results]
        writer = 1 if case.startswith("dir") else 0
        assert errors[writer].startswith("OSError: [Errno 27] cannot save the checkpoint to "
                                         f"{str(folder / case.split('-')[0])!r}"), (case, out)
        assert errors[1 - writer] is not None and "failed" in errors[1 - writer], (case, out)
        assert all(r[case]["intact"] for r in results), (case, out)
    assert results[0]["dir-async"]["left"] == ["dir", "file"], out
    assert all(r["file-after"] and r["dir-after"] for r in results), out


def _content(path: Path) -> dict:
    found = sorted(path.iterdir()) if path.is_dir() else [path]
    return {p.name: p.read_text() if p.suffix == ".json" else
            torch.load(p, weights_only=True) for p in found}


def _unwaited(tmp_path: Path, kind: str, world: int, *extra: str) -> None:
    from _helpers import equal_nested

    saved = {}
    for how in ("async", "blocking"):
        folder = tmp_path / how
        folder.mkdir()
        args = ["--blocking"] if how == "blocking" else list(extra)
        results, out = _run("unwaited", kind, str(folder), *args, world=world)
        assert "RuntimeWarning" not in out and "Traceback" not in out, out
        assert sorted(p.name for p in folder.iterdir()) == ["ck"], out
        saved[how] = _content(folder / "ck")
    assert equal_nested(saved["async"], saved["blocking"])


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_save_the_script_never_waits_for_is_published_at_exit(tmp_path, kind):
    """Item 2, one process: the checkpoint is what a blocking save at that step writes."""
    _unwaited(tmp_path, kind, 1)


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_an_asynchronous_save_an_exit_hook_starts_is_written_as_a_blocking_one(tmp_path, kind):
    """No exit hook would settle a save started by one: it is written then and there."""
    _unwaited(tmp_path, kind, 1, "--at-exit")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_save_two_ranks_never_wait_for_is_published_at_exit(tmp_path, kind):
    _unwaited(tmp_path, kind, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_save_whose_group_is_destroyed_first_is_reported_and_removed(tmp_path, kind):
    """Item 2: it cannot be published; a warning names it, the previous checkpoint stays."""
    results, out = _run("unwaited", kind, str(tmp_path), "--destroy", world=2)
    assert f"the asynchronous save of {str(tmp_path / 'ck')!r} was not published at exit " \
           "(the process group was destroyed" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], out
    from _save_scenarios import digest

    assert digest(tmp_path / "ck") == results[0]["before"]


FABRIC = """
import sys, torch
from lightning.fabric import Fabric, seed_everything
from lightning_zero_offload.lightning import ZeroOffloadFabricStrategy
path, then, sharded = sys.argv[1], sys.argv[2], sys.argv[3] == "dir"
fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroOffloadFabricStrategy(
    async_checkpoint=then != "reference", sharded_checkpoint=sharded))
fabric.launch()
seed_everything(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
for _ in range(3):
    fabric.backward(model(torch.ones(4, 8)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
if then == "load":
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 3, state
    print("LOADED", flush=True)
sys.exit(7)
"""


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_fabric_loads_an_asynchronous_save_and_publishes_one_left_at_exit(tmp_path, kind):
    """Item 3: ``fabric.save`` then ``fabric.load`` waits for the save; a script whose last
    call is ``fabric.save`` leaves the checkpoint a blocking save writes."""
    from _helpers import equal_nested

    script = tmp_path / "fabric_save.py"
    script.write_text(FABRIC)
    saved = {}
    for then in ("load", "exit", "reference"):
        path = tmp_path / then / "a.ckpt"
        path.parent.mkdir()
        run = subprocess.run([sys.executable, str(script), str(path), then, kind],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 7, run.stdout + run.stderr
        assert ("LOADED" in run.stdout) == (then == "load"), run.stdout + run.stderr
        assert sorted(p.name for p in path.parent.iterdir()) == ["a.ckpt"]
        saved[then] = _content(path)
    assert equal_nested(saved["exit"], saved["reference"])
    assert equal_nested(saved["load"], saved["reference"])
