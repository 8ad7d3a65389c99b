"""Scripts for ``test_checkpoint_exit.py``: saves that fail or that the script never waits for,
run as a user's script runs (one process, or two under torchrun), so the interpreter's exit is
the real one. Each rank writes what it saw to ``RESULTS/rank-N.json``; exits with ``EXIT_STATUS``.

``python _save_scenarios.py fault KIND FOLDER``: a checkpoint saved at step 2, then with the
fault on, each of a blocking and an asynchronous save, file and folder, over it: each must
raise an ``OSError`` naming the user's path, leave that checkpoint as it was and nothing else
behind; with the fault off one more save works and loads. KIND: ``enospc`` (FOLDER is a small
tmpfs: a file fills it), ``efbig`` (``RLIMIT_FSIZE``), ``readonly-mount`` (FOLDER is a tmpfs,
remounted read-only), ``readonly-chmod`` (not root: the folder's write bits). Under two ranks
only the rank that writes fails (rank 1 for a folder, rank 0 for a file).

``python _save_scenarios.py unwaited FILE_OR_DIR FOLDER [--blocking] [--destroy] [--at-exit]``: a
checkpoint saved at step 2, then one at step 3 with ``blocking=False`` (``--blocking``: a blocking
one, the reference) as the script's last call; ``--destroy`` destroys the process group after it;
``--at-exit``: that save is made by an exit hook.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist
from _helpers import tiny_engine, train
from _tiny_gpt import batches

RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def digest(path: Path) -> str:
    """The bytes of a checkpoint file, or of every file of a folder, as one hash."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


class Fault:
    def __init__(self, kind: str, folder: Path) -> None:
        self.kind, self.folder = kind, folder
        self.filler = folder / "filler"

    def on(self) -> None:
        if self.kind == "enospc":
            with open(self.filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
        elif self.kind == "efbig":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        elif self.kind == "readonly-mount":
            subprocess.run(["mount", "-o", "remount,ro", str(self.folder)], check=True)
        else:
            self.folder.chmod(0o555)

    def off(self) -> None:
        if self.kind == "enospc":
            self.filler.unlink()
        elif self.kind == "efbig":
            resource.setrlimit(resource.RLIMIT_FSIZE,
                               (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        elif self.kind == "readonly-mount":
            subprocess.run(["mount", "-o", "remount,rw", str(self.folder)], check=True)
        else:
            self.folder.chmod(0o755)


def faults(kind: str, folder: Path) -> dict:
    engine = tiny_engine(precision="32-true")
    train(engine, batches(2))
    fault, out = Fault(kind, folder), {}
    for sharded in (False, True):
        path = folder / ("dir" if sharded else "file")
        engine.save_checkpoint(path, sharded=sharded)
        before = digest(path)
        writes = (RANK == 1) if sharded and WORLD > 1 else RANK == 0
        for blocking in (True, False):
            case = f"{'dir' if sharded else 'file'}-{'blocking' if blocking else 'async'}"
            if writes:
                fault.on()
            error = None
            try:
                save = engine.save_checkpoint(path, sharded=sharded, blocking=blocking)
                if save is not None:
                    save.wait()
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            finally:
                if writes:
                    fault.off()
            if WORLD > 1:
                dist.barrier()  # every rank's files are settled before rank 0 looks
            out[case] = {"error": error, "intact": digest(path) == before,
                         "left": sorted(p.name for p in folder.iterdir())}
        train(engine, batches(1, seed=5))
        engine.save_checkpoint(path, sharded=sharded)  # the fault is off: this one works
        engine.load_checkpoint(path)
        out[f"{'dir' if sharded else 'file'}-after"] = digest(path) != before
    return out


def unwaited(kind: str, folder: Path, blocking: bool, destroy: bool, at_exit: bool) -> dict:
    engine = tiny_engine(precision="32-true")
    path = folder / "ck"
    train(engine, batches(2))
    engine.save_checkpoint(path, sharded=kind == "dir")
    before = digest(path)
    train(engine, batches(1, seed=5))
    save = lambda: engine.save_checkpoint(path, sharded=kind == "dir", blocking=blocking)  # noqa: E731
    if at_exit:  # started by an exit hook: the interpreter is already past waiting for threads
        atexit.register(save)
    else:
        save()  # not waited for
    if destroy:
        dist.destroy_process_group()
    return {"before": before}


def main(argv: list[str]) -> None:
    if WORLD > 1:
        dist.init_process_group("gloo")
    if argv[0] == "fault":
        result = faults(argv[1], Path(argv[2]))
    else:
        result = unwaited(argv[1], Path(argv[2]), "--blocking" in argv, "--destroy" in argv,
                          "--at-exit" in argv)
    Path(os.environ["RESULTS"], f"rank-{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(int(os.environ.get("EXIT_STATUS", "0")))
