"""Fault injection: damaged and crafted checkpoints, killed saves, bad paths.

Each case asserts the exact outcome: the error (type and message) or the state equal to before.
Killed saves run in a child process that pauses at a chosen point and is sent SIGKILL there.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from _helpers import Payload, buffer_engine, dead_pid, same_state, snapshot, train_buffer_net

from lightning_zero_offload.core import CheckpointError
from lightning_zero_offload.core.checkpoint import files

TESTS = Path(__file__).parent


def flip_tensor_byte(path: Path) -> None:
    """Flip one byte in the middle of the largest tensor payload of a torch zip archive."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:
                                                    info.header_offset + 30])
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path):
    """An engine trained 2 steps and saved both ways, then trained on (state differs)."""
    engine = buffer_engine()
    train_buffer_net(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_checkpoint(tmp_path / "full.pt", sharded=False)
    state = snapshot(engine)
    train_buffer_net(engine, 1, seed=1)
    return engine, state, tmp_path


# -- damaged and crafted files ------------------------------------------------------------------
@pytest.mark.parametrize("which", ["ckpt/shard-00000-of-00001.pt", "full.pt"])
def test_flipped_byte_in_tensor_data_is_refused_and_nothing_changes(saved, which):
    engine, _, tmp = saved
    path = tmp / which
    flip_tensor_byte(path)
    torch.load(path, weights_only=True)  # torch itself does not notice
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=rf"{path.name}.*is damaged.*Use another checkpoint"):
        engine.load_checkpoint(path.parent if which.startswith("ckpt/") else path)
    assert same_state(before, snapshot(engine))


def test_truncated_file_is_refused(saved):
    engine, _, tmp = saved
    path = tmp / "full.pt"
    path.write_bytes(path.read_bytes()[:1000])
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match="full.pt.*corrupt or truncated.*another checkpoint"):
        engine.load_checkpoint(path)
    assert same_state(before, snapshot(engine))


def test_file_without_checksum_is_refused(saved):
    engine, _, tmp = saved
    obj = torch.load(tmp / "full.pt", weights_only=True)
    del obj[files.CHECKSUM_KEY]
    torch.save(obj, tmp / "full.pt")
    with pytest.raises(CheckpointError, match="has no checksum"):
        engine.load_checkpoint(tmp / "full.pt")


def test_crafted_pickle_in_a_shard_does_not_run(saved):
    engine, _, tmp = saved
    marker = tmp / "ran"
    shard = tmp / "ckpt" / "shard-00000-of-00001.pt"
    obj = torch.load(shard, weights_only=True)
    torch.save({**obj, "x": Payload(marker)}, shard)
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match="could run code.*add_safe_globals"):
        engine.load_checkpoint(tmp / "ckpt")
    assert not marker.exists()
    assert same_state(before, snapshot(engine))


# -- validation before anything changes ----------------------------------------------------------
@pytest.mark.parametrize("net_kw, message", [
    ({"extra": 5}, r"'extra' has shape \(4,\) in the checkpoint, the module has \(5,\)"),
    ({"d": 6}, r"has shape .* in the checkpoint, the module has .*different model"),
])
def test_load_into_a_different_model_changes_nothing(saved, net_kw, message):
    _, _, tmp = saved
    other = buffer_engine(seed=3, **net_kw)
    train_buffer_net(other, 1, seed=2)  # running statistics moved off their defaults
    before = snapshot(other)
    for path in (tmp / "ckpt", tmp / "full.pt"):
        with pytest.raises(CheckpointError, match=message if path.is_dir() else "shape"):
            other.load_checkpoint(path)
        assert same_state(before, snapshot(other))


def test_missing_shard_file_is_reported(saved):
    engine, _, tmp = saved
    (tmp / "ckpt" / "shard-00000-of-00001.pt").unlink()
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=r"lacks shard files \['shard-00000-of-00001.pt'\]"):
        engine.load_checkpoint(tmp / "ckpt")
    assert same_state(before, snapshot(engine))


def test_folder_of_an_unfinished_save_is_not_a_checkpoint(saved):
    engine, _, tmp = saved
    (tmp / "ckpt" / files.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="zero_offload.json cannot be read.*did not finish"):
        engine.load_checkpoint(tmp / "ckpt")


# -- targets the library must not replace ---------------------------------------------------------
def test_save_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    engine = buffer_engine()
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')\n")
    with pytest.raises(CheckpointError, match="project.*not written by lightning_zero_offload "
                                              r"\(e.g. 'train.py'\).*new or empty folder"):
        engine.save_checkpoint(project)
    assert [p.name for p in project.iterdir()] == ["train.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no temporary left


def test_save_never_touches_a_sibling_dot_old_folder(tmp_path):
    engine = buffer_engine()
    (tmp_path / "project.old").mkdir()
    (tmp_path / "project.old" / "notes.txt").write_text("keep")
    for seed in range(2):  # the second save replaces the first
        train_buffer_net(engine, 1, seed=seed)
        engine.save_checkpoint(tmp_path / "project")
    assert (tmp_path / "project.old" / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "project.old"]
    engine.load_checkpoint(tmp_path / "project")


def test_save_refuses_our_folder_with_a_file_added(saved):
    engine, _, tmp = saved
    (tmp / "ckpt" / "eval.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"also holds files .*\['eval.json'\].*delete them"):
        engine.save_checkpoint(tmp / "ckpt")
    assert (tmp / "ckpt" / "eval.json").exists()


@pytest.mark.parametrize("path", [".", "", "sub/..", ".."])
def test_save_to_a_path_without_a_name_is_refused(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    engine = buffer_engine()
    for sharded in (True, False):
        with pytest.raises(CheckpointError, match="has no file or folder name"):
            engine.save_checkpoint(path, sharded=sharded)
    assert list(tmp_path.iterdir()) == []


def test_file_and_folder_targets_of_the_wrong_kind(saved):
    engine, _, tmp = saved
    with pytest.raises(CheckpointError, match="full.pt' is a file; a sharded checkpoint"):
        engine.save_checkpoint(tmp / "full.pt")
    with pytest.raises(CheckpointError, match="ckpt' is a folder; a single-file checkpoint"):
        engine.save_checkpoint(tmp / "ckpt", sharded=False)
    assert sorted(p.name for p in tmp.iterdir()) == ["ckpt", "full.pt"]


def test_save_after_teardown_is_a_clear_error_and_leaves_nothing(tmp_path):
    engine = buffer_engine()
    engine.teardown()
    for sharded in (True, False):
        with pytest.raises(RuntimeError, match="torn down .* create a new engine"):
            engine.save_checkpoint(tmp_path / "c", sharded=sharded)
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_the_previous_checkpoint_and_leaves_nothing(saved, monkeypatch):
    engine, state, tmp = saved

    def disk_full(obj, path):
        path.write_bytes(b"PK\x03\x04")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.stream, "write", disk_full)
    for path, sharded in ((tmp / "ckpt", True), (tmp / "full.pt", False)):
        with pytest.raises(OSError, match="No space left"):
            engine.save_checkpoint(path, sharded=sharded)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp.iterdir()) == ["ckpt", "full.pt"]
    for path in (tmp / "ckpt", tmp / "full.pt"):
        fresh = buffer_engine(seed=5)
        fresh.load_checkpoint(path)
        assert same_state(state, snapshot(fresh))


# -- leftovers of killed saves ------------------------------------------------------------------
def test_leftovers_of_dead_processes_are_removed_and_others_kept(saved):
    engine, _, tmp = saved
    dead = dead_pid()
    stale = [tmp / f".full.pt.tmp-{dead}",  # the old naming: .NAME.tmp-PID
             tmp / f".full.pt.tmp-{dead}-0badcafe-{os.uname().nodename}"]
    for p in stale:
        p.write_bytes(b"x" * 1000)
    (tmp / f".ckpt.tmp-{dead}-0badcafe-{os.uname().nodename}").mkdir()
    (tmp / f".ckpt.old-{dead}-0badcafe-{os.uname().nodename}").mkdir()
    kept = [tmp / ".full.pt.tmp-1",  # pid 1 is alive
            tmp / f".full.pt.tmp-{dead}-0badcafe-another-host",  # may still be writing
            tmp / ".full.pt.tmp-notes", tmp / "full.pt.tmp"]  # not our naming
    for p in kept:
        p.write_text("keep")
    engine.save_checkpoint(tmp / "full.pt", sharded=False)
    engine.save_checkpoint(tmp / "ckpt")
    assert sorted(p.name for p in tmp.iterdir()) == sorted(
        ["ckpt", "full.pt", *(p.name for p in kept)])


_CHILD = r"""
import os, sys, time
sys.path.insert(0, {tests!r})
import torch
import _helpers as h
from lightning_zero_offload.core.checkpoint import files

path, point, flag = sys.argv[1], sys.argv[2], sys.argv[3]
sharded = point != "file"
engine = h.buffer_engine()
h.train_buffer_net(engine)
engine.save_checkpoint(path, sharded=sharded)
torch.save(h.snapshot(engine), flag + ".expected")
h.train_buffer_net(engine, 1, seed=1)

def pause():
    open(flag, "w").close()
    time.sleep(600)

real_write, real_rename = files.stream.write, os.rename
def write(obj, path):
    if point == "file":  # half of the file written
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04" + b"\0" * 4096)
        pause()
    real_write(obj, path)
    if point == "shard":  # the shard written, not yet renamed
        pause()
def rename(src, dst):
    if point == "rename":  # the old folder moved aside, the new one not yet in place
        pause()
    real_rename(src, dst)
files.stream.write, files.os.rename = write, rename
engine.save_checkpoint(path, sharded=sharded)
"""


def _kill_during_save(tmp: Path, name: str, point: str) -> dict:
    """Run the child, SIGKILL it at ``point``; return the state of the checkpoint saved before."""
    flag = tmp / "paused"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(tests=str(TESTS)),
                              str(tmp / name), point, str(flag)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert child.poll() is None, "the child exited before reaching the pause point"
            assert time.monotonic() < deadline, "the child never reached the pause point"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    expected = torch.load(str(flag) + ".expected", weights_only=True)
    flag.unlink()
    Path(str(flag) + ".expected").unlink()
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("point, name", [("shard", "ckpt"), ("file", "full.pt")])
def test_kill_while_writing_keeps_the_previous_checkpoint(tmp_path, point, name):
    expected = _kill_during_save(tmp_path, name, point)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != name)
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{name}.tmp-")
    engine = buffer_engine(seed=5)
    engine.load_checkpoint(tmp_path / name)
    assert same_state(expected, snapshot(engine))
    engine.save_checkpoint(tmp_path / name, sharded=point == "shard")  # cleans the leftover
    assert [p.name for p in tmp_path.iterdir()] == [name]


@pytest.mark.slow
def test_kill_between_the_two_renames_falls_back_to_the_previous_folder(tmp_path):
    expected = _kill_during_save(tmp_path, "ckpt", "rename")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "ckpt" not in names and any(n.startswith(".ckpt.old-") for n in names)
    engine = buffer_engine(seed=5)
    with pytest.warns(UserWarning, match=r"'.*ckpt' is missing: a save was killed.*\.ckpt\.old-"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert same_state(expected, snapshot(engine))
    train_buffer_net(engine, 1, seed=4)
    engine.save_checkpoint(tmp_path / "ckpt")  # a new save cleans both leftovers
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    state = snapshot(engine)
    fresh = buffer_engine(seed=6)
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert same_state(state, snapshot(fresh))


_SAVER = r"""
import os, sys, time
sys.path.insert(0, {tests!r})
import _helpers as h
engine = h.buffer_engine()
open(sys.argv[3] + str(os.getpid()), "w").close()
while not os.path.exists(sys.argv[3] + "go"):  # start saving at the same time as the other
    time.sleep(0.01)
for i in range(10):
    h.train_buffer_net(engine, 1, seed=i)
    engine.save_checkpoint(sys.argv[1], sharded=True)
    engine.save_checkpoint(sys.argv[2], sharded=False)
"""


@pytest.mark.slow
def test_two_processes_saving_to_one_path(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    sync = tmp_path / "sync"
    sync.mkdir()
    args = [sys.executable, "-c", _SAVER.format(tests=str(TESTS)),
            str(tmp_path / "ckpt"), str(tmp_path / "full.pt"), str(sync) + "/"]
    procs = [subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(sync.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    (sync / "go").touch()
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "full.pt", "sync"]
    for path in (tmp_path / "ckpt", tmp_path / "full.pt"):
        buffer_engine(seed=5).load_checkpoint(path)


def _outcome(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _two_rank_save(rank: int, world: int, tmp: str) -> list:
    engine = buffer_engine()
    train_buffer_net(engine)
    refused = _outcome(lambda: engine.save_checkpoint(Path(tmp) / "foreign"))
    engine.save_checkpoint(Path(tmp) / "ckpt")
    return [refused]


def _two_rank_load(rank: int, world: int, tmp: str) -> list:
    engine = buffer_engine(seed=3)
    train_buffer_net(engine, 1, seed=rank)
    before = snapshot(engine)
    error = _outcome(lambda: engine.load_checkpoint(Path(tmp) / "ckpt"))
    return [error, same_state(before, snapshot(engine))]


@pytest.mark.slow
def test_two_ranks_fail_together_and_change_nothing(tmp_path):
    from _dist import run_ranks

    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.csv").write_text("1,2\n")
    saves = run_ranks(_two_rank_save, 2, str(tmp_path), timeout=120)
    assert saves[0][0][0] == saves[1][0][0] == "CheckpointError"
    assert "not written by lightning_zero_offload" in saves[0][0][1]
    assert "rank 0 could not start the checkpoint" in saves[1][0][1]
    assert [p.name for p in (tmp_path / "foreign").iterdir()] == ["data.csv"]
    flip_tensor_byte(tmp_path / "ckpt" / "shard-00001-of-00002.pt")  # only rank 1's shard
    (error0, same0), (error1, same1) = run_ranks(_two_rank_load, 2, str(tmp_path), timeout=120)
    assert error1[0] == "CheckpointError" and "shard-00001-of-00002.pt' is damaged" in error1[1]
    assert error0 == ("CheckpointError", "checkpoint: rank(s) [1] failed (see their error); "
                                         "nothing was changed on this rank")
    assert same0 and same1
