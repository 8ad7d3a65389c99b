"""Draw a timeline PNG of recorded step profiles: one lane per activity, a few steps.

Input: JSON written by ``ProfileRecorder.dump`` / ``engine.profile`` (``{"records": [...]}``); one
panel per file, so a plain and a delayed-update run can be compared on one figure::

    python benchmarks/timeline.py out/plain.json out/delayed.json --labels plain delayed -o t.png
    python benchmarks/timeline.py --demo -o t.png   # tiny CPU run with the engine, then draw
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LANES = {  # span name -> (lane, colour)
    "fwd_bwd": ("main: fwd/bwd", "tab:blue"),
    "grad_wait": ("main: fwd/bwd", "tab:gray"),
    "stall": ("main: fwd/bwd", "tab:red"),
    "grad_transfer": ("grad transfer", "tab:orange"),
    "cpu_step": ("CPU step", "tab:green"),
    "weight_copy": ("weight copy", "tab:purple"),
}
LANE_ORDER = ["main: fwd/bwd", "grad transfer", "CPU step", "weight copy"]


def load(path: str | Path, steps: int) -> list[dict]:
    """The last ``steps`` records of a profile JSON file."""
    data = json.loads(Path(path).read_text())
    records = data["records"] if isinstance(data, dict) else data
    if not records:
        raise SystemExit(f"{path}: no profile records (did the run close any step?)")
    return records[-steps:]


def draw(panels: list[tuple[str, list[dict]]], out: str | Path) -> Path:
    """One panel per (label, records); spans are shifted so each panel starts at 0 s."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.2 * len(panels) + 0.6), squeeze=False)
    for ax, (label, records) in zip(axes[:, 0], panels, strict=True):
        spans = [(n, s, e, r["step"]) for r in records for n, s, e in r["spans"]]
        t0 = min(s for _, s, _, _ in spans)
        for name, start, end, step in spans:
            lane, colour = LANES[name]
            y = len(LANE_ORDER) - 1 - LANE_ORDER.index(lane)
            ax.broken_barh([(start - t0, max(end - start, 1e-5))], (y - 0.4, 0.8), color=colour)
            if name in ("fwd_bwd", "cpu_step") and end - start > 0:
                ax.text((start + end) / 2 - t0, y, str(step), ha="center", va="center",
                        fontsize=7, color="white")
        ax.set_yticks(range(len(LANE_ORDER)), LANE_ORDER[::-1])
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in LANES.values()]
    fig.legend(handles, list(LANES), loc="upper center", ncol=len(LANES), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def demo(workdir: Path, steps: int) -> list[tuple[str, Path]]:
    """A tiny GPT on the CPU, plain and with delayed update; returns the profile files."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _gpt import build_gpt, random_batch

    import lightning_zero_offload as zo

    torch.set_num_threads(1)  # a small shared machine: no oversubscription
    files = []
    for label, delayed in (("plain", False), ("delayed update", True)):
        model = build_gpt("tiny", vocab_size=512, seq_len=64)
        x, y = random_batch(model.cfg, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = zo.ZeroOffload(model, opt, precision="32-true", delayed_update=delayed,
                                delayed_update_warmup=1, cpu_threads=1)
        for _ in range(steps + 2):
            engine.backward(engine.module(x, y))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        path = workdir / f"{'delayed' if delayed else 'plain'}.json"
        path.write_text(json.dumps({"records": [r.to_dict() for r in engine.profile]}))
        engine.teardown()
        files.append((label, path))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("inputs", nargs="*", help="profile JSON files (one panel each)")
    p.add_argument("--labels", nargs="*", help="panel titles (default: file names)")
    p.add_argument("--steps", type=int, default=4, help="last N steps of each file (default 4)")
    p.add_argument("--demo", action="store_true", help="record a tiny CPU engine run and draw it")
    p.add_argument("-o", "--out", default="benchmarks/out/timeline.png")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.demo:
            files = demo(Path(tmp), args.steps)
        elif args.inputs:
            labels = args.labels or [Path(f).stem for f in args.inputs]
            if len(labels) != len(args.inputs):
                p.error(f"{len(args.inputs)} inputs but {len(labels)} labels")
            files = list(zip(labels, args.inputs, strict=True))
        else:
            p.error("give profile JSON files or --demo")
        out = draw([(label, load(f, args.steps)) for label, f in files], args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
