"""The planner with FSDP2 (``--fsdp``) and tensor parallelism (``--tensor-parallel-size``), issue
46 item 7. The figures are derived here from bytes per parameter: the device holds the half
weights (``h`` = 2 in bf16-mixed, 4 in 32-true) of the rank's part of the model, 1/TP without
FSDP2 and 1/(DP x TP) with it, FSDP2's all-gather buffers of two units (``2 h U / TP``, ``U`` =
1/32 of the model or one layer of a config) and the engine's three gradient buckets (plus three
reduce-scatter outputs of a bucket's shard where the engine partitions over several ranks, so
never with FSDP2); the host per rank holds 1/(DP x TP) of the state: the fp32 master (4), the
moments (fp32 8, int8 2 + 8/256) and the staging in the compute dtype (``h``, pinned: at most
5% more)."""

from __future__ import annotations

import json
import re
import struct

import pytest

from lightning_zero_offload.planner import main, plan

GiB = 2**30
BUCKET = 25 * 2**20 // 2  # elements of a 25 MB bucket in bf16
RING = 3 * 2 * BUCKET  # the engine's three gradient buckets, bf16
NODE = ["--params", "70e9", "--world-size", "8", "--device-memory", "80GiB", "--host-memory",
        "1TiB", "--host-reserve", "0", "--moment-dtype", "int8", "--no-measure", "--json"]
NODE_KW = dict(world_size=8, device_memory="80GiB", host_memory="1TiB", host_reserve=0,
               moment_dtype="int8", measure=False)
INT8_HOST = 4 + 2 + 2 * 4 / 256  # master, two int8 moments and their fp32 scales
# the pinned staging's power-of-two blocks: under FSDP2 the engine's slices are whole buckets
# (26 MB), 40 to a 1 GiB block, so up to 5% more than the staged bytes
STAGED = 1.05


def _json(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _ceil(a: float, b: int) -> int:
    return -(-int(a) // b)


def test_70b_on_one_node_fits_with_fsdp_only(capsys):
    """8 x 80 GiB, 1 TiB host: without FSDP2 every rank holds all 130 GiB of bf16 weights; with
    it a rank holds 1/8 of them and two units in flight, and the host the same state."""
    plain = _json(NODE, capsys)
    fsdp = _json([*NODE, "--fsdp"], capsys)
    assert plain["fits"] is False and plain["device_fits"] is False
    assert fsdp["fits"] is True and fsdp["device_fits"] and fsdp["host_fits"]
    p = 70 * 10**9
    assert plain["device_weight_bytes"] == 2 * p > 80 * GiB
    assert fsdp["device_weight_bytes"] == 2 * _ceil(p, 8)
    assert fsdp["fsdp_all_gather_bytes"] == 2 * 2 * _ceil(p, 32)
    assert fsdp["device_bytes"] == 2 * _ceil(p, 8) + 2 * 2 * _ceil(p, 32) + RING
    assert fsdp["device_engine_bytes"] == RING and fsdp["fsdp_unit_params"] == _ceil(p, 32)
    assert (fsdp["fsdp"], fsdp["data_parallel_size"], fsdp["tensor_parallel_size"]) == (
        True, 8, 1)
    shard = p / 8
    assert (INT8_HOST + 2) * shard <= fsdp["host_bytes_per_rank"] <= (
        INT8_HOST + STAGED * 2) * shard
    assert fsdp["host_bytes_per_rank"] == pytest.approx(plain["host_bytes_per_rank"], rel=0.03)
    assert fsdp["max_params_that_fit"] > p > plain["max_params_that_fit"]


@pytest.mark.parametrize("precision,h", [("bf16-mixed", 2), ("32-true", 4)])
def test_fsdp_device_bytes_at_8_ranks_are_an_eighth_of_the_weights_and_fixed_buffers(
        precision, h):
    """The device bytes at world size 8 are 1/8 of world size 1's weights term, plus FSDP2's
    two units and the engine's ring, within 1%; the weights in the compute dtype's size."""
    n = 7 * 10**9
    kw = dict(precision=precision, offload_fraction=1.0, measure=False)
    one = plan(n, **kw)
    eight = plan(n, world_size=8, fsdp=True, **kw)
    assert one.device_breakdown["weights"] == h * n
    fixed = 2 * h * _ceil(n, 32) + 3 * h * (25 * 2**20 // h)
    assert eight.device_bytes == pytest.approx(one.device_breakdown["weights"] / 8 + fixed,
                                               rel=0.01)
    assert eight.device_breakdown["weights (FSDP2 shard)"] == h * _ceil(n, 8)
    assert eight.fsdp_all_gather_bytes == 2 * h * _ceil(n, 32)
    # the host keeps 1/8 of the state, as without FSDP2: the master (in 32-true pinned whole,
    # rounded up to a power of two), fp32 moments and the staging in the compute dtype
    shard = n / 8
    master = 1 << int(4 * shard - 1).bit_length() if h == 4 else 4 * shard
    assert (4 + 8 + h) * shard <= eight.host_bytes_per_rank <= master + (8 + STAGED * h) * shard
    assert eight.host_bytes_per_rank == pytest.approx(
        plan(n, world_size=8, **kw).host_bytes_per_rank, rel=0.03)


def test_tensor_parallel_divides_the_weights_and_the_state():
    """Without FSDP2 the device holds 1/TP of the weights and the host 1/(DP x TP) of the state;
    with it both are 1/(DP x TP), and a unit gathers its tensor-parallel part."""
    n = 70 * 10**9
    kw = dict(world_size=8, offload_fraction=1.0, moment_dtype="int8", measure=False)
    dp = plan(n, **kw)
    tp2 = plan(n, tensor_parallel_size=2, **kw)
    assert (tp2.data_parallel_size, tp2.tensor_parallel_size) == (4, 2)
    assert tp2.device_weight_bytes == 2 * n // 2 and dp.device_weight_bytes == 2 * n
    shard = n / 8
    for p in (dp, tp2):
        assert (INT8_HOST + 2) * shard <= p.host_bytes_per_rank <= 1.03 * (INT8_HOST + 2) * shard
    # three reduce-scatter outputs of a bucket's shard over the 4 (8) data-parallel ranks
    assert tp2.device_bytes == 2 * n // 2 + RING + 3 * 2 * (BUCKET // 4)
    both = plan(n, tensor_parallel_size=2, fsdp=True, **kw)
    assert both.device_weight_bytes == 2 * _ceil(n, 8)
    assert both.fsdp_all_gather_bytes == 2 * 2 * _ceil(_ceil(n, 32), 2)
    assert both.host_bytes_per_rank == pytest.approx(tp2.host_bytes_per_rank, rel=0.03)
    # frozen weights are cut the same way (LoRA's base model): 1/TP, 1/(DP x TP) with FSDP2
    lora = dict(kw, frozen_params=60 * 10**9)
    assert plan(n, tensor_parallel_size=2, **lora).device_weight_bytes == 2 * n // 2
    assert plan(n, tensor_parallel_size=2, fsdp=True, **lora).device_weight_bytes == (
        2 * _ceil(10 * 10**9, 8) + 2 * _ceil(60 * 10**9, 8))


def test_a_tensor_parallel_size_that_does_not_divide_the_world_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--params", "7e9", "--world-size", "8", "--tensor-parallel-size", "3",
              "--no-measure"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--tensor-parallel-size" in err, err
    assert re.search(r"\b3\b.*\b8\b", err) and "Traceback" not in err, err
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 .*world size \(6\)"):
        plan(7e9, world_size=6, tensor_parallel_size=4, measure=False)


def test_the_unit_is_a_layer_of_the_model_or_the_given_count(tmp_path, capsys):
    """``--model`` with ``num_hidden_layers``: a unit is one layer's share; ``--fsdp-unit-params``
    sets it; without ``--fsdp`` it is refused."""
    n, layers = 4 * 10**8, 10
    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
         "vocab_size": 100}))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}})
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) +
                                                 header.encode())
    p = plan(model=tmp_path, fsdp=True, world_size=4, measure=False)
    assert p.fsdp_unit_params == n // layers
    assert p.fsdp_all_gather_bytes == 2 * 2 * (n // layers)
    q = plan(n, fsdp=True, world_size=4, fsdp_unit_params="1e8", measure=False)
    assert q.fsdp_all_gather_bytes == 2 * 2 * 10**8
    with pytest.raises(SystemExit):
        main(["--params", "4e8", "--fsdp-unit-params", "1e8", "--no-measure"])
    assert "--fsdp-unit-params" in capsys.readouterr().err


def test_the_report_shows_each_owner_and_the_largest_model_is_consistent(capsys):
    assert main([*NODE[:-1], "--fsdp", "--tensor-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "tensor parallel 2 x data parallel 4, weights sharded by FSDP2" in text
    for line in ("weights (FSDP2 shard)", "FSDP2 all-gather (2 units)", "gradient buckets (3)",
                 "host bytes per rank: ", "by owner: the model's weights"):
        assert line in text, text
    big = plan(70e9, fsdp=True, **NODE_KW).max_params_that_fit
    assert plan(big, fsdp=True, **NODE_KW).fits
    assert not plan(int(big * 1.01), fsdp=True, **NODE_KW).fits


def test_more_ranks_offered_for_a_short_host_keep_the_tensor_parallel_size():
    p = plan(13e9, world_size=2, tensor_parallel_size=2, ranks_per_node=1, host_memory="64GiB",
             device_memory="80GiB", offload_fraction=1.0, measure=False)
    assert p.host_fits is False
    sizes = [int(m.group(1)) for s in p.suggestions
             if (m := re.search(r"--world-size (\d+)", s["change"]))]
    assert sizes and all(w % 2 == 0 and w > 2 for w in sizes), p.suggestions
