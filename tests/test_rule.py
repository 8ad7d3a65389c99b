"""The Adam rule (core.rules.adam): its two implementations agree with each other and with torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lightning_zero_offload.core.rules.adam import Adam, Hyper
from lightning_zero_offload.core.rules.rules import RULES, rule_for, rule_named
from lightning_zero_offload.ops import MOMENT_DTYPES

SRC = Path(__file__).resolve().parents[1] / "src" / "lightning_zero_offload"


def _case(n: int, grad_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(3)]
    return master, grads


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_device_update_equals_the_host_kernel(decoupled: bool, grad_dtype: torch.dtype) -> None:
    """Three steps with a gradient scale, weight decay and bias correction: the device rule
    (torch's fused ops) and the host kernel stay within fp32 rounding of each other."""
    n = 4099  # not a multiple of any SIMD width
    master, grads = _case(n, grad_dtype)
    hp = Hyper(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, decoupled=decoupled)
    host_p, dev_p = master.clone(), master.clone()
    host_m = Adam().zeros(n, "fp32")
    m, v = torch.zeros(n), torch.zeros(n)
    for step, grad in enumerate(grads, start=1):
        kept = grad.clone()
        Adam().host_update(host_p, grad, host_m, hp, step=step, grad_scale=0.37, out=None,
                           threads=1, seed=0)
        Adam().device_update(dev_p, grad, (m, v), hp, step=step, grad_scale=0.37)
        assert torch.equal(grad, kept), "the device rule must not change the gradient"
    torch.testing.assert_close(dev_p, host_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, host_m.exp_avg, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(v, host_m.exp_avg_sq, rtol=1e-6, atol=1e-10)
    assert not torch.equal(dev_p, master)


def test_device_update_equals_torch_adamw() -> None:
    """grad_scale multiplies the gradient: the same as torch's AdamW on the scaled gradient."""
    n = 1000
    master, grads = _case(n, torch.float32, seed=1)
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([p], lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    hp = Adam(decoupled=True).hyper(opt.param_groups[0])
    ours, m, v = master.clone(), torch.zeros(n), torch.zeros(n)
    for step, grad in enumerate(grads, start=1):
        p.grad = grad * 0.5
        opt.step()
        Adam().device_update(ours, grad, (m, v), hp, step=step, grad_scale=0.5)
    torch.testing.assert_close(ours, p.detach(), rtol=1e-6, atol=1e-7)


def test_hyper_reads_a_group_and_adam_may_ask_for_decoupled_decay() -> None:
    group = {"lr": 1, "betas": [0.5, 0.6], "eps": 0, "weight_decay": 2,
             "decoupled_weight_decay": True}
    assert Adam(decoupled=False).hyper(group) == Hyper(1.0, (0.5, 0.6), 0.0, 2.0, True)
    assert Adam(False).hyper({**group, "decoupled_weight_decay": False}).decoupled is False


def test_check_hparams_names_the_group_and_changes_nothing() -> None:
    good = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    Adam().check_hparams([good])
    with pytest.raises(ValueError, match=r"param group 1 has lr=-1\.0"):
        Adam().check_hparams([good, {**good, "lr": -1}])
    with pytest.raises(ValueError, match="param group 0 now uses amsgrad=True"):
        Adam().check_hparams([{**good, "amsgrad": True}])


def test_the_state_names_are_torchs() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    opt.step()
    assert set(opt.state_dict()["state"][0]) == {"step", *Adam().names}
    assert Adam().host_bytes(256, "fp32") == 8 * 256


def _engine_and_planner_rules():
    """(rule of a user's optimizer, the planner's rule from its name and options) pairs."""
    p = torch.nn.Parameter(torch.zeros(3))
    pairs = [(torch.optim.AdamW([p]), "adamw", {}),
             (torch.optim.Adam([p]), "adamw", {"decoupled_weight_decay": False})]
    try:
        import lion_pytorch
    except ImportError:
        lion_pytorch = None
    if lion_pytorch is not None:
        pairs += [(lion_pytorch.Lion([p]), "lion", {}),
                  (lion_pytorch.Lion([p], lr=1e-2, decoupled_weight_decay=True), "lion",
                   {"lr": 1e-2, "decoupled_weight_decay": True})]
    return [(rule_for(opt), rule_named(key, **options)) for opt, key, options in pairs]


def test_the_planners_rule_is_the_engines() -> None:
    """No option of Adam or Lion changes their state's shape, so the rule the planner makes
    from an optimizer's name and options (no optimizer built) and the engine's rule of that
    optimizer are the same: same options, state, bytes on host and device, zeros."""
    pairs = _engine_and_planner_rules()
    assert {type(engine) for engine, _ in pairs} <= set(RULES)
    for engine, planner in pairs:
        assert type(planner) is type(engine) and vars(planner) == vars(engine)
        assert planner.state == engine.state and planner.names == tuple(engine.state)
        assert planner.device_bytes() == engine.device_bytes() == 4 * len(engine.names)
        for md in MOMENT_DTYPES:
            assert planner.host_bytes(1000, md) == engine.host_bytes(1000, md)
            zeros = planner.zeros(1000, md)
            assert zeros.nbytes == engine.host_bytes(1000, md) and zeros.names == engine.names


def test_the_planners_rule_checks_its_options_as_the_engines() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="amsgrad=True") as engine:
        rule_for(torch.optim.AdamW([p], amsgrad=True))
    with pytest.raises(ValueError, match="amsgrad=True") as planner:
        rule_named("adamw", amsgrad=True)
    assert str(planner.value) == str(engine.value)
    with pytest.raises(ValueError, match="unknown update rule 'sgd9'"):
        rule_named("sgd9")


def _package_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("lightning_zero_offload")}


def test_config_imports_nothing_from_the_runtime() -> None:
    """The options object is a leaf: no engine module (delayed, scaler, ...) behind it."""
    assert {m for m in _package_imports(SRC / "core" / "config.py")
            if m.startswith("lightning_zero_offload.core")} == set()
