"""The update rule recorded in every checkpoint format by its registry key: a shard's ``"rule"``,
the consolidated form's ``optimizer["rule"]`` (built live, from shards at once, or lazily); a
load refuses another rule's state naming both, and reads a form without the key (a plain torch
optimizer's, or one saved before it) by its state's names, as before."""

from __future__ import annotations

import pytest
import torch
from _helpers import tiny_engine, train
from _tiny_gpt import batches

from lightning_zero_offload.core.checkpoint import files, formats, reader
from lightning_zero_offload.core.checkpoint.formats import CheckpointError


@pytest.fixture(scope="module")
def adam():
    engine = tiny_engine(precision="32-true")
    train(engine, batches(2))
    return engine


def test_every_format_records_the_rule(adam, tmp_path) -> None:
    assert adam.state_dict()["rule"] == "adamw"
    assert adam.full_state_dict()["optimizer"]["rule"] == "adamw"
    adam.save_checkpoint(tmp_path / "one.pt", sharded=False)
    assert files.safe_load(tmp_path / "one.pt")["optimizer"]["rule"] == "adamw"
    adam.save_checkpoint(tmp_path / "dir")
    shards = files.read_shard_dir(tmp_path / "dir")
    assert [s["rule"] for s in shards] == ["adamw"]
    assert formats.consolidate(shards)["optimizer"]["rule"] == "adamw"
    assert reader.lazy_full(shards)["optimizer"]["rule"] == "adamw"
    # torch's optimizer takes the form as its own state_dict (the key is ignored there)
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"],
                         "rule": "adamw"})


def _full(engine) -> dict:
    return engine.full_state_dict()


def test_a_recorded_rule_other_than_the_engines_is_refused_naming_both(adam) -> None:
    """Adam's state recorded as Lion's: the names alone would pass, the key refuses."""
    full = _full(adam)
    before = [p.detach().clone() for p in adam.module.parameters()]
    full["optimizer"]["rule"] = "lion"
    with pytest.raises(CheckpointError, match=r"optimizer state is Lion's \(exp_avg\), but this "
                       r"engine's optimizer is Adam/AdamW \(exp_avg, exp_avg_sq\)"):
        adam.load_full_state_dict(full)
    full["optimizer"]["rule"] = "sgd9"
    with pytest.raises(CheckpointError, match="optimizer state's unknown update rule 'sgd9'"):
        adam.load_full_state_dict(full)
    shard = adam.state_dict()
    shard["rule"] = "lion"
    with pytest.raises(CheckpointError, match=r"Lion's \(exp_avg\).*Adam/AdamW"):
        adam.load_state_dict(shard)
    assert all(torch.equal(a, b) for a, b in zip(before, adam.module.parameters(), strict=True))


def test_state_that_is_not_its_recorded_rules_is_refused(adam) -> None:
    full = _full(adam)
    for st in full["optimizer"]["state"].values():
        del st["exp_avg_sq"]  # Lion's names, recorded as Adam's
    with pytest.raises(CheckpointError, match=r"holds \['exp_avg'\], not Adam/AdamW's "
                       r"\['exp_avg', 'exp_avg_sq'\] that it records"):
        adam.load_full_state_dict(full)


def test_a_form_without_the_key_is_read_by_its_names(adam) -> None:
    """A checkpoint saved before the key (or a plain torch optimizer's state) loads as before,
    and another rule's is still refused by its names."""
    full = _full(adam)
    del full["optimizer"]["rule"]
    adam.load_full_state_dict(full)
    for st in full["optimizer"]["state"].values():
        del st["exp_avg_sq"]
    with pytest.raises(CheckpointError, match=r"Lion's \(exp_avg\).*Adam/AdamW"):
        adam.load_full_state_dict(full)
    shard = adam.state_dict()
    del shard["rule"]  # shards before the key were Adam's
    adam.load_state_dict(shard)


def test_lions_forms_record_lion() -> None:
    lion_pytorch = pytest.importorskip("lion_pytorch")
    lion = tiny_engine(optim=lion_pytorch.Lion, lr=1e-3, precision="32-true")
    train(lion, batches(1))
    assert lion.state_dict()["rule"] == "lion"
    assert lion.full_state_dict()["optimizer"]["rule"] == "lion"
