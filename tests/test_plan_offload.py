"""The planner with partial offload (issue 28): ``offload_fraction`` and
``device_memory_headroom``. The figures are derived here from bytes per element: a host-resident
element costs the fp32 master (4), the moments (8 fp32, 2 + 8/256 int8), the fp32 gradient (4)
when accumulating and the half staging (2, in power-of-two pinned blocks: at most 3% more); a
device-resident one costs the device 4 + 8 + the compute dtype's gradient (+ 4 accumulating)
and the host nothing; the device always holds the half weights and three gradient buckets
(with several ranks, three reduce-scatter outputs of a bucket's shard too)."""

from __future__ import annotations

import json
import math

import pytest

from lightning_zero_offload.planner import main, plan

GiB = 2**30
BUCKET = 25 * 2**20 // 2  # elements of a 25 MB bucket in bf16
N = 40 * BUCKET  # 40 whole buckets: fractions in steps of 1/40
BUCKETS_BYTES = 3 * 25 * 2**20  # the three gradient buckets on the device
H200 = dict(precision="bf16-mixed", device_memory="141GiB", host_memory="128GiB", measure=False)
USABLE = 128 * GiB - int(0.1 * 128 * GiB)  # the default 10% host reserve


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
def test_bytes_at_fraction_are_the_per_element_sums(fraction, accumulate, world_size):
    p = plan(N, offload_fraction=fraction, accumulate=accumulate, world_size=world_size,
             measure=False)
    shard = N // world_size
    host_elems = int(shard * fraction)
    dev_elems = shard - host_elems
    assert p.offload_fraction == fraction
    grad32 = 4 if accumulate else 0
    assert p.device_optimizer_bytes == (12 + 2 + grad32) * dev_elems
    shards = BUCKETS_BYTES // world_size if world_size > 1 else 0
    assert p.device_bytes == 2 * N + BUCKETS_BYTES + shards + (12 + 2 + grad32) * dev_elems
    host = p.host_breakdown
    assert host.get("master", 0) == 4 * host_elems
    assert host.get("moments", 0) == 8 * host_elems
    assert host.get("grad_fp32", 0) == grad32 * host_elems
    assert 2 * host_elems <= host.get("staging", 0) <= 1.03 * 2 * host_elems
    assert set(host) <= {"master", "moments", "grad_fp32", "staging"}
    assert p.host_bytes_per_rank == sum(host.values())


def test_fraction_takes_whole_buckets_and_32_true_gradients():
    # 1 - 0.61 of 40 buckets is 15.6: 16 stay on the device, 24 of 40 on the host
    p = plan(N, offload_fraction=0.61, measure=False)
    assert p.offload_fraction == pytest.approx(24 / 40)
    assert p.device_optimizer_bytes == 14 * 16 * BUCKET
    # int8 moments are the host's only: the device keeps fp32 moments
    q = plan(N, offload_fraction=0.5, moment_dtype="int8", measure=False)
    assert q.device_optimizer_bytes == 14 * N // 2
    assert q.host_breakdown["moments"] == 2 * (N // 2) + 2 * 4 * math.ceil(N // 2 / 256)
    # in 32-true the device gradient is fp32 (4 bytes) and the buckets hold twice the bytes
    r = plan(N // 2, precision="32-true", offload_fraction=0.0, measure=False)
    assert r.device_optimizer_bytes == (12 + 4) * N // 2
    assert r.host_bytes_per_rank == 0


def test_json_reports_the_resolved_fraction(capsys):
    """"auto" resolves to the largest host share whose host part fits the host and whose device
    part fits 80% of the device: one bucket more on the host would not fit the host."""
    assert main(["--params", "13e9", "--device-memory", "141GiB", "--host-memory", "128GiB",
                 "--no-measure", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offload_fraction_setting"] == "auto" and out["fits"] is True
    f = out["offload_fraction"]
    host_elems = round(f * 13e9)
    assert 0.6 < f < 0.7
    assert out["device_optimizer_bytes"] == 14 * (13_000_000_000 - host_elems)
    assert out["host_bytes_per_node"] <= USABLE
    one_more = plan(13e9, offload_fraction=(host_elems + BUCKET) / 13e9, **H200)
    assert one_more.host_fits is False
    assert out["device_bytes"] <= 0.8 * 141 * GiB
    # the same split asked for explicitly gives the same figures
    again = plan(13e9, offload_fraction=f, **H200)
    assert (again.host_bytes_per_node, again.device_bytes) == (out["host_bytes_per_node"],
                                                               out["device_bytes"])
    # everything fits the host: 1.0, and after the first step auto would move more (the device
    # has room for all of 7B's state within 80%: 16 bytes per parameter, 104.4 GiB)
    small = plan(7e9, **H200)
    assert small.offload_fraction == 1.0 and small.device_optimizer_bytes == 0
    assert small.offload_fraction_after_first_step == 0.0
    assert 16 * 7e9 + BUCKETS_BYTES <= 0.8 * 141 * GiB


def test_short_host_proposes_a_fraction_that_fits(capsys):
    p = plan(13e9, offload_fraction=1.0, **H200)
    assert p.host_fits is False and p.device_fits is True
    fractions = [s for s in p.suggestions if s["change"].startswith("--offload-fraction")]
    assert fractions and p.suggestions[0] is fractions[0]
    f = float(fractions[0]["change"].split()[1])
    again = plan(13e9, offload_fraction=f, **H200)
    assert again.fits and fractions[0]["host_bytes"] == again.host_bytes_per_node
    # the largest such fraction to two decimals: 0.02 more on the host does not fit it
    assert plan(13e9, offload_fraction=f + 0.02, **H200).host_fits is False
    # host: 14.05 bytes per host element (pinned staging rounding), device: 2 per parameter
    # and 14 per device element
    host_elems = (1 - math.floor(USABLE / 14.05 / 13e9 * 100) / 100) * 13e9
    assert f == math.floor(USABLE / 14.05 / 13e9 * 100) / 100
    assert again.device_bytes == pytest.approx(2 * 13e9 + 14 * host_elems + BUCKETS_BYTES,
                                               rel=3e-3)  # whole buckets
    assert main(["--params", "13e9", "--device-memory", "141GiB", "--host-memory", "128GiB",
                 "--offload-fraction", "1", "--no-measure"]) == 0
    assert f"changes that fit:\n  --offload-fraction {f:g}: " in capsys.readouterr().out
    # nothing fits both (24 GiB holds not even the weights with any state): no fraction offered
    none = plan(13e9, offload_fraction=1.0, precision="bf16-mixed", device_memory="24GiB",
                host_memory="128GiB", measure=False)
    assert none.fits is False
    assert not any("--offload-fraction" in s["change"] for s in none.suggestions)


def _largest(moment_bytes: float, headroom: float) -> float:
    """The largest model on the H200 with "auto": the host holds ``x`` elements at ``moment_bytes``
    + 4 master + 2.05 staging each (``x = USABLE / that``), the device the half weights of all
    ``n``, the three buckets and 14 bytes per other element, within ``1 - headroom`` of 141 GiB:
    ``2 n + 14 (n - x) + buckets <= (1 - headroom) D``."""
    x = USABLE / (4 + moment_bytes + 2.05)
    return ((1 - headroom) * 141 * GiB - BUCKETS_BYTES + 14 * x) / 16


@pytest.mark.parametrize("moment_dtype,moment_bytes", [("fp32", 8), ("int8", 2 + 8 / 256)])
def test_largest_model_pools_both_memories(moment_dtype, moment_bytes):
    """Issue 28's targets with the README's H200 (141 GiB, 128 GiB host, default 10% host
    reserve): with the default 20% device headroom fp32 moments reach 15.26B (not 16B) and int8
    20.95B (not 22B); with all state on the host 8.80B and 15.31B."""
    for headroom in (0.2, 0.1):
        p = plan(13e9, moment_dtype=moment_dtype, device_memory_headroom=headroom, **H200)
        assert p.max_params_that_fit == pytest.approx(_largest(moment_bytes, headroom),
                                                      rel=2e-3), headroom
    host_only = plan(13e9, moment_dtype=moment_dtype, offload_fraction=1.0, **H200)
    assert host_only.max_params_that_fit == pytest.approx(
        USABLE / (4 + moment_bytes + 2.05), rel=2e-3)
    # an explicit half: host x = n / 2 elements, device 2 n + 7 n within all 141 GiB
    half = plan(13e9, moment_dtype=moment_dtype, offload_fraction=0.5, **H200)
    assert half.max_params_that_fit == pytest.approx(min(
        2 * USABLE / (4 + moment_bytes + 2.05), (141 * GiB - BUCKETS_BYTES) / 9), rel=2e-3)


def test_cpu_device_refuses_a_fraction_below_one():
    with pytest.raises(ValueError, match="offload_fraction: 0.5 with the CPU"):
        plan(1e9, device="cpu", offload_fraction=0.5, measure=False)
    assert plan(1e9, device="cpu", measure=False).offload_fraction == 1.0


def test_the_device_parts_step_is_counted_apart_from_the_cpu_step(capsys):
    """The CPU step counts the host part only; the device part's step is printed separately:
    its elements per rank and its memory traffic (fp32 master and moments read and written, the
    half gradient read and weights written: 28 bytes in bf16), timed only where CUDA is."""
    import torch

    half = plan(N, offload_fraction=0.5, device_memory="141GiB", measure=False)
    elems = N - int(N * half.offload_fraction)
    assert half.device_step_elements == pytest.approx(elems, abs=1)
    assert half.device_step_bytes == half.device_step_elements * 28
    assert plan(N, offload_fraction=1.0, measure=False).device_step_elements == 0
    zero = plan(N, offload_fraction=0.0, measure=False)
    assert zero.device_step_elements == N and zero.device_step_bytes == 28 * N
    assert main(["--params", str(N), "--offload-fraction", "0.5"]) == 0
    out = capsys.readouterr().out
    cpu = next(x for x in out.splitlines() if x.startswith("predicted CPU step"))
    assert "the host part, 50.0% of the state" in cpu
    line = next(x for x in out.splitlines() if x.startswith("device part's step"))
    assert f"{half.device_step_elements / 1e9:.2f}B elements per rank" in line
    if not torch.cuda.is_available():
        assert "not measured: this machine has no CUDA device" in line


def test_a_fixed_fraction_runs_at_the_nearest_whole_bucket_split_that_fits():
    """Of 40 buckets the splits are 1/40 apart: 0.34 runs at 0.35 (nearer than 0.325, where
    rounding the host share down took it), 0.337 at 0.325 (nearer, one bucket more on the
    device) and, on a device one byte short of that split's bytes, at 0.35, which fits: the
    engine's own choice (``core.buckets.placement.count_for``)."""
    kw = dict(precision="bf16-mixed", host_memory="1TiB", measure=False)
    assert plan(N, offload_fraction=0.34, device_memory="1TiB", **kw).offload_fraction == 0.35
    near = plan(N, offload_fraction=0.337, device_memory="1TiB", **kw)
    assert near.offload_fraction == 0.325
    tight = plan(N, offload_fraction=0.337, device_memory=near.device_bytes - 1, **kw)
    assert tight.offload_fraction == 0.35 and tight.fits
    assert plan(N, offload_fraction=0.325, device_memory=near.device_bytes - 1,
                **kw).fits is False  # a split itself has no other side to give way to
