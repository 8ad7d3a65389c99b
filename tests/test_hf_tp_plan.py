"""Hugging Face's own tensor parallelism under ZeRO-Offload: ``from_pretrained(path,
tp_plan="auto")`` gives DTensor weights over a 1-D mesh named ``"tp"`` spanning every process, and
the engine takes that mesh (its data-parallel group is then each rank alone). Against the same
``tp_plan`` model stepped by torch's AdamW, on 2 gloo processes: two parameter groups, a frozen
parameter, accumulation 2, clip 1.0, 12 steps."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from _dist import run_ranks  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_zero_offload import ZeroOffload  # noqa: E402

STEPS, ACCUM, LR, MAX_NORM, VOCAB = 12, 2, 1e-2, 1.0, 64
pytestmark = pytest.mark.slow  # multi-process


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A tiny Llama saved as from_pretrained reads it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # the norms' weights away from 1, so their gradients matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


def _load(path: str, plan: dict | None = None) -> torch.nn.Module:
    """``tp_plan="auto"`` (or ``plan`` through ``DistributedConfig``), the final norm frozen."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kw: dict = ({"tp_plan": "auto"} if plan is None
                else {"distributed_config": DistributedConfig(tp_plan=plan)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # tp_plan= is deprecated for the config
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    model.model.norm.weight.requires_grad_(False)
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([
        {"params": [p for p in trained if p.dim() == 2], "weight_decay": 0.1},
        {"params": [p for p in trained if p.dim() != 2], "weight_decay": 0.0, "lr": LR / 2}],
        lr=LR)


def _loss(model: torch.nn.Module, step: int, micro: int) -> torch.Tensor:
    """The same micro-batch on every rank (tensor parallelism: every rank runs the batch)."""
    g = torch.Generator().manual_seed(100 * step + micro)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    return model(input_ids=ids, labels=ids).loss / ACCUM


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def _clip_by_hand(model: torch.nn.Module) -> float:
    """torch's clip_grad_norm_ formula over DTensor and plain gradients together (torch's own
    refuses the mix): the sharded ones whole, the replicated ones once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = sum(float((g.full_tensor() if isinstance(g, DTensor) else g).double().pow(2).sum())
                for g in grads) ** 0.5
    coef = min(1.0, MAX_NORM / (total + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def _reference(path: str) -> dict:
    model = _load(path)
    opt = _optimizer(model)
    norms = []
    for step in range(STEPS):
        for m in range(ACCUM):
            _loss(model, step, m).backward()
        norms.append(_clip_by_hand(model))
        opt.step()
        opt.zero_grad()
    return {"weights": _whole(model), "norms": norms}


def _engine(path: str, mesh: bool) -> dict:
    """The engine over the model as loaded; ``mesh``: also given the 2-D mesh the model's
    tensor-parallel ranks form, as a user who builds one passes it."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _load(path)
    device_mesh = (init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel",
                                                                    "tensor_parallel"))
                   if mesh else None)
    engine = ZeroOffload(model, _optimizer(model), device="cpu", precision="32-true",
                         max_grad_norm=MAX_NORM, bucket_size_mb=0.002, device_mesh=device_mesh)
    assert engine.tp is not None and engine.tp.size == 2 and engine.world_size == 1
    norms = []
    for step in range(STEPS):
        for m in range(ACCUM):
            engine.backward(_loss(model, step, m), sync_gradients=m == ACCUM - 1)
        norms.append(float(engine.step()))  # type: ignore[arg-type]
        engine.zero_grad()
    saved = engine.full_state_dict(optimizer=False)["model"]
    engine.teardown()
    names = [n for n, _ in model.named_parameters()]
    return {"weights": {n: saved[n].float() for n in names}, "norms": norms,
            "live": _whole(model)}


def _all(rank: int, world: int, path: str) -> dict:
    return {"want": _reference(path), "got": _engine(path, False),
            "got_2d": _engine(path, True)}


def _rel(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
    return (num / sum(float(want[k].double().norm() ** 2) for k in want)) ** 0.5


def test_tp_plan_auto_equals_the_same_model_with_torch_adamw(saved: str) -> None:
    start = _whole(_load_plain(saved))
    for r in run_ranks(_all, 2, saved, timeout=400):
        want = r["want"]
        assert _rel(want["weights"], start) > 1e-2  # training moved the weights
        assert max(want["norms"]) > MAX_NORM  # clipping was active
        for got in (r["got"], r["got_2d"]):
            assert _rel(got["weights"], want["weights"]) < 1e-6
            assert _rel(got["live"], want["weights"]) < 1e-6  # teardown: the model holds them
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)


def _load_plain(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _refused(rank: int, world: int, path: str) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    auto = dict(AutoModelForCausalLM.from_pretrained(path).tp_plan)
    out = {}
    for style in ("sequence_parallel", "replicated_with_grad_allreduce"):
        model = _load(path, {**auto, "model.layers.*.input_layernorm": style})
        with pytest.raises(ValueError) as e:
            ZeroOffload(model, torch.optim.AdamW(model.parameters()), device="cpu")
        out[style] = str(e.value)
    return out


def test_styles_the_engine_cannot_run_are_refused_naming_the_layer(saved: str) -> None:
    for r in run_ranks(_refused, 2, saved, timeout=300):
        assert ("style 'sequence_parallel' on 'model.layers.0.input_layernorm' (sequence "
                "parallelism)" in r["sequence_parallel"])
        assert ("style 'replicated_with_grad_allreduce' on 'model.layers.0.input_layernorm'"
                in r["replicated_with_grad_allreduce"])
