"""Draw a timeline PNG of recorded step profiles: one lane per activity, a few steps.

Input: JSON written by ``ProfileRecorder.dump`` / ``engine.profile`` (``{"records": [...]}``); one
panel per file, so a plain and a delayed-update run can be compared on one figure. The drawing is
the package's (``python -m lightning_zero_offload.profile_report plot`` draws saved files without
this script); this script adds ``--demo``::

    python benchmarks/timeline.py out/plain.json out/delayed.json --labels plain delayed -o t.png
    python benchmarks/timeline.py --demo -o t.png   # tiny CPU run with the engine, then draw
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lightning_zero_offload.profile_report import draw, load


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
