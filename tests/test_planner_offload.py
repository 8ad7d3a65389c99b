"""``lzo-plan --fsdp --offload-weights`` (issue 47 item 3): FSDP2's ``CPUOffloadPolicy`` keeps
each rank's fp32 shards on the host, where they are the engine's master. Every figure here is
derived from the terms by hand: per trained element of a rank's shard the host holds 4 (the
weights = the master) + the rule's state (AdamW 8 / 4 / 2 + 8/256 with fp32 / bf16 / int8
moments) + the gradient the kernel reads (the compute dtype's ``h`` in pinned blocks of 1 GiB:
40 slices of a 25 MiB bucket's 26,214,400 bytes, so ``2 * 2**30 / (40 * 26214400)`` = 2.048 B in
bf16; none wasted with 32 MiB buckets) + FSDP2's fp32 gradient of one unit (``4 U / N``,
``U`` = 1/32 of the model by default); the device holds FSDP2's two units in flight
(``2 h U``) and the engine's three gradient buckets, no weights."""

from __future__ import annotations

import json

import pytest

from lightning_zero_offload.planner import main, plan

GiB = 2**30
RING = 3 * 25 * 2**20  # the engine's three 25 MiB gradient buckets, bf16
INT8 = 2 + 2 * 4 / 256  # AdamW's two int8 moments and their fp32 scales per 256 elements
ADAM = {"fp32": 8, "bf16": 4, "int8": INT8}
STAGED = 2 * GiB / (40 * 25 * 2**20)  # bf16 staging per element: 40 bucket slices a 1 GiB block
UNIT = 4 / 32  # FSDP2's fp32 gradient of a unit of 1/32 of the model, per element
MEGATRAIN = dict(fsdp=True, offload_weights=True, device_memory="139GiB",
                 host_memory="1500GB", host_reserve=0, measure=False)
ARGV = ["--params", "120e9", "--fsdp", "--offload-weights", "--device-memory", "139GiB",
        "--host-memory", "1500GB", "--host-reserve", "0", "--no-measure"]


def _json(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_the_terms_are_exact_where_the_staging_packs_whole_blocks():
    """2^35 trained elements, 32 MiB buckets (2^25-byte slices, 32 to a 1 GiB block): every term
    is exact, on the host and the device."""
    n = 2**35
    for moments, state in (("int8", 2 * n + 2 * 4 * n // 256), ("fp32", 8 * n)):
        p = plan(n, moment_dtype=moments, bucket_size_mb=32, **MEGATRAIN)
        assert p.host_breakdown == {"master": 4 * n, "moments": state, "staging": 2 * n,
                                    "FSDP2 unit gradient": 4 * n // 32}
        assert p.device_breakdown == {"gradient buckets (3)": 3 * 32 * 2**20,
                                      "FSDP2 all-gather (2 units)": 2 * 2 * n // 32}
        assert p.host_bytes_per_rank == 4 * n + state + 2 * n + 4 * n // 32
        assert (p.device_weight_bytes, p.device_engine_bytes) == (0, 3 * 32 * 2**20)
        assert p.offload_fraction == 1.0 and p.offload_weights
        # --accumulate: the engine's fp32 sum beside its bf16 staging
        assert p.host_bytes_accumulating == p.host_bytes_per_rank + 4 * n
    # 32-true: a 4-byte gradient staged, 4-byte units in flight, the master never re-pinned
    p = plan(n, precision="32-true", bucket_size_mb=32, **MEGATRAIN)
    assert p.host_breakdown == {"master": 4 * n, "moments": 8 * n, "staging": 4 * n,
                                "FSDP2 unit gradient": 4 * n // 32}
    assert p.device_breakdown["FSDP2 all-gather (2 units)"] == 2 * 4 * n // 32


@pytest.mark.parametrize("moments,largest", [("fp32", 105.8e9), ("bf16", 147.4e9),
                                             ("int8", 182.8e9)])
def test_megatrain_box_fits_120b_and_the_host_bounds_the_largest(moments, largest):
    """One 139 GiB GPU, 1.5 TB of host memory, no reserve: the host bounds the largest model at
    1.5e12 / (4 + state + 2.048 + 0.125) bytes per parameter; the device, holding no weights,
    would take (139 GiB - ring) / (2 units x 2 B / 32) alone, past the planner's 10^12."""
    p = plan(120e9, moment_dtype=moments, **MEGATRAIN)
    per = 4 + ADAM[moments] + STAGED + UNIT
    assert p.max_params_that_fit == pytest.approx(1.5e12 / per, rel=2e-3)
    assert p.max_params_that_fit == pytest.approx(largest, rel=1e-3)
    assert p.max_params_bound == "host"
    assert p.max_params_device_alone == 10**12  # as far as the planner counts
    assert (139 * GiB - RING) / (2 * 2 / 32) > 10**12
    assert p.device_bytes == 2 * 2 * 120 * 10**9 // 32 + RING
    n = 120 * 10**9
    b = p.host_breakdown
    assert (b["master"], b["FSDP2 unit gradient"]) == (4 * n, 4 * n // 32)
    assert b["moments"] == pytest.approx(ADAM[moments] * n)
    assert 2 * n <= b["staging"] <= STAGED * n + GiB
    assert p.fits is (moments != "fp32")  # 14.2 B x 120e9 > 1.5e12


def test_the_issue_floor_8_03_is_reached_without_the_unit_gradient_and_the_block_waste():
    """The issue's 187B is 1.5e12 / 8.03: with a tiny unit (no FSDP2 unit gradient) and 32 MiB
    buckets (no pinned block waste) the count gives it; the default's 182.8B differs by exactly
    those two terms."""
    p = plan(120e9, moment_dtype="int8", bucket_size_mb=32, fsdp_unit_params=1, **MEGATRAIN)
    assert p.max_params_that_fit == pytest.approx(1.5e12 / (4 + INT8 + 2), rel=1e-3)
    assert p.max_params_that_fit == pytest.approx(186.8e9, rel=1e-3)


@pytest.mark.parametrize("reserve,largest", [("0", 16.75e9), ("10%", 15.08e9)])
def test_one_24gib_gpu_with_128gib_of_host(reserve, largest):
    """The issue's 17.1B is 128 GiB / 8.03; ours is 128 GiB (less the reserve) / 8.204 with
    int8 moments; the device alone would take (24 GiB - ring) x 32 / 4."""
    p = plan(7e9, fsdp=True, offload_weights=True, device_memory="24GiB", host_memory="128GiB",
             host_reserve=reserve, moment_dtype="int8", measure=False)
    usable = 128 * GiB * (1 if reserve == "0" else 0.9)
    assert p.max_params_that_fit == pytest.approx(usable / (4 + INT8 + STAGED + UNIT), rel=2e-3)
    assert p.max_params_that_fit == pytest.approx(largest, rel=1e-3)
    assert p.max_params_bound == "host"
    assert p.max_params_device_alone == pytest.approx((24 * GiB - RING) * 32 / 4, rel=1e-3)


def test_the_device_bounds_where_its_units_in_flight_outgrow_it():
    """8 GiB of device and 2 TB of host: two units of 1/32 of the model in bf16 fill the device
    at (8 GiB - ring) x 8 parameters; the report says the device bounds it and what it holds."""
    p = plan(70e9, fsdp=True, offload_weights=True, device_memory="8GiB", host_memory="2TB",
             measure=False)
    assert p.device_fits is False and p.host_fits
    assert p.max_params_that_fit == pytest.approx((8 * GiB - RING) * 32 / 4, rel=1e-3)
    assert p.max_params_bound == "device" and p.max_params_device_alone is None
    text = str(p)
    assert "bounded by device memory: the device holds FSDP2's 2 units in flight" in text, text
    assert "--offload-fraction" not in text.split("changes that fit:")[1], text


def test_ranks_tensor_parallel_and_frozen_weights_cut_every_term():
    """8 ranks, tensor parallel 2, 60B of 70B frozen: a rank keeps 1/8 of the trained and of
    the frozen weights on the host (fp32), FSDP2's unit gradient 1/8 of a unit, and its device
    gathers 1/2 of each unit."""
    n, frozen = 70 * 10**9, 60 * 10**9
    p = plan(n, world_size=8, tensor_parallel_size=2, frozen_params=frozen, fsdp=True,
             offload_weights=True, bucket_size_mb=32, measure=False)
    trained, unit = -(-(n - frozen) // 8), -(-n // 32)
    b = p.host_breakdown
    assert (b["master"], b["FSDP2 frozen shards"]) == (4 * trained, 4 * (frozen // 8))
    assert b["FSDP2 unit gradient"] == 4 * -(-unit // 8)
    assert p.fsdp_all_gather_bytes == 2 * 2 * -(-unit // 2)
    assert p.device_weight_bytes == 0


def test_the_report_and_json_say_where_the_weights_are_and_what_bounds_the_largest(capsys):
    out = _json([*ARGV, "--moment-dtype", "int8", "--json"], capsys)
    assert out["offload_weights"] is True and out["fits"] is True
    assert out["max_params_bound"] == "host" and out["max_params_device_alone"] == 10**12
    assert out["device_weight_bytes"] == 0 and out["offload_fraction"] == 1.0
    assert set(out["host_breakdown"]) == {"master", "moments", "staging", "FSDP2 unit gradient"}
    assert set(out["device_breakdown"]) == {"gradient buckets (3)", "FSDP2 all-gather (2 units)"}
    assert main([*ARGV, "--moment-dtype", "int8"]) == 0
    text = capsys.readouterr().out
    per = 4 + INT8 + STAGED + UNIT
    for line in ("by owner: the model's weights none (FSDP2's shards are on the host",
                 f"per trained parameter of the rank's shard: {per:.2f} bytes (the weights = "
                 f"the fp32 master 4.00, the optimizer state {INT8:.2f}, the gradient "
                 f"{STAGED:.2f}, FSDP2's unit gradient {UNIT:.2f})",
                 "offload fraction: 1.000 (--offload-weights",
                 "largest model that fits: 182.8", "  bounded by host memory; the device holds "
                 "no weights", "alone it would hold 1000.00B or more",
                 "CPUOffloadPolicy's pin_memory=True"):
        assert line in text, text


@pytest.mark.parametrize("extra,option,words", [
    ([], "--offload-weights", "needs --fsdp"),
    (["--fsdp", "--offload-fraction", "0.5"], "--offload-fraction", "use 1.0 or auto"),
    (["--fsdp", "--offload-fraction", "0"], "--offload-fraction", "use 1.0 or auto"),
    (["--fsdp", "--delayed-update"], "--delayed-update", "drop --delayed-update"),
    (["--fsdp", "--device", "cpu"], "--offload-weights", "plans a GPU run")])
def test_what_has_no_meaning_with_offload_weights_is_refused(extra, option, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--params", "7e9", "--offload-weights", *extra, "--no-measure"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {option}: " in err and words in err, err
    assert "Traceback" not in err


def test_plan_refuses_too_and_takes_auto_or_1():
    with pytest.raises(ValueError, match=r"plan: offload_weights: needs --fsdp"):
        plan(7e9, offload_weights=True, measure=False)
    with pytest.raises(TypeError, match=r"plan: offload_weights: got str"):
        plan(7e9, fsdp=True, offload_weights="yes", measure=False)
    for fraction in ("auto", 1.0):
        p = plan(7e9, fsdp=True, offload_weights=True, offload_fraction=fraction,
                 measure=False)
        assert p.offload_fraction == 1.0 and p.device_weight_bytes == 0
    # the host short (fp32 moments): still all of the state on the host, no split tried
    short = plan(120e9, moment_dtype="fp32", **MEGATRAIN)
    assert short.host_fits is False and short.offload_fraction == 1.0
    assert short.auto_tried is None and short.offload_fraction_setting == 1.0
