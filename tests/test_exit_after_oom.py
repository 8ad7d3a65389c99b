"""After an out-of-memory error of the device part on one of two ranks (inside backward on the
emulated device with a capacity, or injected into "auto"'s move), a script that caught the error
exits with its own status on both ranks: nothing the engine or its emulated device started is
left to end during the interpreter's exit (a side stream's thread that did aborted the process:
"terminate called without an active exception", status 134)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import free_port

pytestmark = pytest.mark.slow

SCRIPT = r"""
import sys, torch
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from _helpers import tiny_engine, train
from _tiny_gpt import batches
from lightning_zero_offload import testing

mode = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
fraction = 0.5 if mode == "backward" else "auto"
with testing.emulated_async_device(seed=1 + rank, memory_bytes=1 << 30) as made:
    engine = tiny_engine(precision="bf16-mixed", offload_fraction=fraction,
                         collective_timeout_s=30)
emu = made[0]
if mode == "backward" and rank == 1:  # the fp32 sum of the second micro-batch does not fit
    emu.memory_bytes = emu.live_bytes + 100
if mode == "move" and rank == 1:
    real = emu.zeros

    def zeros(numel, dtype, role):
        if role.startswith("device-resident"):
            raise torch.OutOfMemoryError("emulated: out of memory")
        return real(numel, dtype, role)
    emu.zeros = zeros
try:
    train(engine, batches(3), micro=2)
    print("trained", flush=True)
except Exception as e:
    print("caught", type(e).__name__, flush=True)
sys.exit(3)
"""


def _two_ranks(tmp_path: Path, mode: str) -> list[tuple[int, str]]:
    script = tmp_path / "oom.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return [(p.wait(timeout=120), p.stdout.read()) for p in procs]  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["backward", "move"])
def test_a_script_that_caught_a_device_oom_exits_with_its_own_status(tmp_path, mode):
    for _ in range(4):  # the abort came at about half of the runs inside backward
        got = _two_ranks(tmp_path, mode)
        for rank, (status, out) in enumerate(got):
            assert status == 3, f"rank {rank} exited with {status}:\n{out[-3000:]}"
        if mode == "backward":
            assert "caught OutOfMemoryError" in got[1][1] and "caught" in got[0][1]
        else:
            assert all("trained" in out for _, out in got)
