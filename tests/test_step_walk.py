"""The walk of one step through the engine's modules stays short (``benchmarks/step_walk.py``):
each bucket more costs at most 4 calls from one core module into another, and once
``GradStreamer.finish`` has handed the gradients over, the step never calls the streamer back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

WALK = Path(__file__).resolve().parents[1] / "benchmarks" / "step_walk.py"
MAX_CROSSINGS_PER_BUCKET = 4  # the kernel's shard, its rule, the gradient's source, its hand-back


def _step_walk():
    spec = importlib.util.spec_from_file_location("step_walk", WALK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("delayed", [False, True], ids=["sync", "delayed"])
def test_each_extra_bucket_costs_few_crossings_and_none_after_finish(delayed: bool) -> None:
    walk = _step_walk().walk(delayed)
    per_bucket = walk["per_extra_bucket"]
    assert per_bucket["crossings"] <= MAX_CROSSINGS_PER_BUCKET, walk
    assert per_bucket["re_entries"] == 0, walk
    assert walk["after_finish"] == 0 and per_bucket["after_finish"] == 0, walk
