"""The planner's advice (``planner.advice``): the pool's own settings (a fixed offload
fraction, the headroom, the host reserve) are searched before the moment dtype and other
hardware, and every change ``lzo-plan`` prints, fed back as its flags, plans to a fit; when no
split fits, the report says what "auto" tried and which memory is short by how much."""

from __future__ import annotations

import json
import re

import pytest

from lightning_zero_offload.planner import cli, main, plan

BOX = ["--device-memory", "141GiB", "--host-memory", "128GiB", "--no-measure"]
CASES = {  # name -> lzo-plan arguments (the H200 box unless given)
    "16B fp32 moments": ["--params", "16e9"],
    "22B int8 at 0.5": ["--params", "22e9", "--moment-dtype", "int8", "--offload-fraction",
                        "0.5"],
    "13B all host": ["--params", "13e9", "--offload-fraction", "1"],
    "50B": ["--params", "50e9"],
    "16B delayed": ["--params", "16e9", "--delayed-update"],
    "7B on 24 GiB with activations": ["--params", "7e9", "--precision", "bf16-mixed",
                                      "--batch-size", "8", "--seq-len", "4096", "--model",
                                      "{model}", "--device-memory", "24GiB"],
    "3B on a 16 GiB device, 32 GiB host": ["--params", "3e9", "--device-memory", "16GiB",
                                           "--host-memory", "32GiB"],
}


def _report(args: list[str], capsys) -> str:
    assert main(args) == 0
    return capsys.readouterr().out


def _suggestions(out: str) -> list[str]:
    block = out.split("changes that fit:\n", 1)
    if len(block) == 1:
        return []
    return [m.group(1) for m in re.finditer(r"^  (.+?): device [^\n]*per node$", block[1],
                                            re.MULTILINE)]


def _applied(args: list[str], change: str) -> list[str]:
    """``args`` with the printed ``change`` applied, as a user would type it."""
    out = list(args)
    for part in change.split(" + "):  # flags only: a later one wins (--no-delayed-update)
        out += part.split()
    return out


def _args(case: str, tmp_path) -> list[str]:
    model = tmp_path / "config.json"
    model.write_text('{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, '
                     '"num_attention_heads": 32, "vocab_size": 32000, '
                     '"intermediate_size": 11008}')
    args = [a.replace("{model}", str(model)) for a in CASES[case]]
    if "--model" in args:  # the count comes from the config
        i = args.index("--params")
        del args[i:i + 2]
    return [*BOX[:2] * ("--device-memory" not in args), *BOX[2:]] + args


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_printed_change_fits_when_fed_back(case, tmp_path, capsys):
    args = _args(case, tmp_path)
    out = _report(args, capsys)
    assert "fits: NO" in out, out
    changes = _suggestions(out)
    assert changes, out
    for change in changes:
        again = _report(_applied(args, change), capsys)
        assert "fits: yes" in again, (change, again)


def test_the_pool_is_searched_before_other_hardware(tmp_path, capsys):
    out = _report(_args("16B fp32 moments", tmp_path), capsys)
    changes = _suggestions(out)
    pool = [c.split()[0] for c in changes[:3]]
    assert pool == ["--offload-fraction", "--device-memory-headroom", "--host-reserve"], changes
    assert changes.index(next(c for c in changes if c.startswith("--moment-dtype"))) == 3
    # 22B int8 at 0.5 was advised only a 185 GiB device; the fraction that fits comes first
    changes = _suggestions(_report(_args("22B int8 at 0.5", tmp_path), capsys))
    f = float(changes[0].split()[1])
    assert changes[0].startswith("--offload-fraction") and 0.6 < f < 0.75, changes
    assert plan(22e9, moment_dtype="int8", offload_fraction=f, precision="bf16-mixed",
                device_memory="141GiB", host_memory="128GiB", measure=False).fits
    # the largest such fraction: 0.01 more on the host does not fit
    assert not plan(22e9, moment_dtype="int8", offload_fraction=f + 0.01,
                    device_memory="141GiB", host_memory="128GiB", measure=False).fits


def test_when_nothing_fits_the_report_says_what_auto_tried(tmp_path, capsys):
    out = _report(_args("16B fp32 moments", tmp_path), capsys)
    assert "(auto: all of the optimizer state on the host)" not in out
    line = next(x for x in out.splitlines() if x.startswith("offload fraction:"))
    m = re.search(r"auto tried (\d\.\d{3}), the fewest device buckets whose host part fits: "
                  r"the device needs ([\d.]+) GiB of the ([\d.]+) GiB it may use .* short by "
                  r"([\d.]+) GiB", line)
    assert m, line
    tried, need, limit, short = (float(x) for x in m.groups())
    assert 0 < tried < 1 and need > limit and short == pytest.approx(need - limit, abs=0.02)
    p = plan(16e9, device_memory="141GiB", host_memory="128GiB", measure=False)
    assert p.auto_tried["offload_fraction"] == pytest.approx(tried, abs=5e-4)
    # at that fraction the host fits and the device is short by what the line says
    at = plan(16e9, offload_fraction=p.auto_tried["offload_fraction"], device_memory="141GiB",
              host_memory="128GiB", measure=False)
    assert at.host_fits and at.device_bytes / 2**30 == pytest.approx(need, abs=0.01)


@pytest.mark.parametrize("params", ["16e9", "22e9"])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_the_h200_box_table_every_change_fits(params, moments, capsys):
    """16B and 22B with each moment dtype on one H200 (141 GiB, 128 GiB host): where it does
    not fit, every change printed fits when planned; one machine is offered before two (22B
    with fp32 or bf16 moments: int8 moments with a pool setting)."""
    args = ["--params", params, "--moment-dtype", moments, *BOX]
    out = _report(args, capsys)
    changes = _suggestions(out)
    assert ("fits: yes" in out) == (not changes), out
    for change in changes:
        assert "fits: yes" in _report(_applied(args, change), capsys), change
    if changes:
        assert not changes[0].startswith("--world-size"), changes


@pytest.mark.parametrize("case", ["22B int8 at 0.5", "16B fp32 moments",
                                  "3B on a 16 GiB device, 32 GiB host"])
def test_a_change_is_flags_to_paste_with_its_reason_and_the_room_it_leaves(case, tmp_path,
                                                                          capsys):
    """In the JSON a change is ``lzo-plan`` flags only (the parser takes them after the
    command's own, nothing else), its ``reason`` says why in words, and
    ``device_headroom_bytes`` is the device memory it leaves free, as the change planned on its
    own says (22B int8: the fraction that fits leaves about 11 GiB, less than the headroom
    "auto" keeps, which its reason says too)."""
    args = _args(case, tmp_path)
    out = json.loads(_report([*args, "--json"], capsys))
    assert out["suggestions"]
    for s in out["suggestions"]:
        applied = _applied(args, s["change"])
        cli._parser().parse_args(applied)  # exits 2 on anything that is not its flags
        assert "(" not in s["change"] and "without" not in s["change"], s
        assert s["reason"] and not s["reason"].startswith("--"), s
        again = json.loads(_report([*applied, "--json"], capsys))
        assert again["fits"] is True
        assert s["device_headroom_bytes"] == again["device_memory"] - again["device_bytes"], s
        warned = any("the engine warns at setup" in n for n in again["notes"])
        assert warned == ("the engine warns at setup" in s["reason"]), (s, again["notes"])
    if case == "22B int8 at 0.5":
        first = out["suggestions"][0]
        assert first["change"].startswith("--offload-fraction ")
        assert 10 * 2**30 < first["device_headroom_bytes"] < 0.2 * 141 * 2**30
        assert "the engine warns at setup" in first["reason"]
    # "without --delayed-update" is a flag too (test_planner lists it for a 9B delayed run)
    assert cli._parser().parse_args([*args, "--delayed-update", "--no-delayed-update"]
                                    ).delayed_update is False
