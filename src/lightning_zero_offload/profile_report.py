"""Read a recorded offload profile: a short text summary, and a timeline plot.

``engine.profile`` (or the JSON :func:`save` writes, ``{"records": [...]}``) holds per-step
seconds for ``fwd_bwd``, ``grad_wait``, ``cpu_step``, ``weight_copy`` and ``stall`` (see
:class:`~lightning_zero_offload.core.device.profile.StepProfile`) plus the spans for timelines::

    print(format_summary(engine.profile))
    save(engine.profile, "run.json")  # Lightning: trainer.strategy.engine.profile (during fit)
    python -m lightning_zero_offload.profile_report summary run.json
    python -m lightning_zero_offload.profile_report plot run.json [delayed.json ...] -o timeline.png

Plotting needs matplotlib (``pip install 'lightning-zero-offload[plot]'``); nothing else here does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_zero_offload.core.device.profile import FIELDS

__all__ = ["format_summary", "save", "load", "draw", "main"]

_LABELS = {"fwd_bwd": "forward+backward", "grad_wait": "gradient wait", "cpu_step": "CPU step",
           "device_step": "device step (partial offload)", "weight_copy": "weight copy",
           "stall": "stall (CPU step not hidden)"}
# Time the main thread (so the device's queue) spends per step: the CPU step and the weight
# copy show only through ``stall`` when they overlap forward/backward (delayed update).
# The device part of partial offload runs on the main thread too.
_MAIN = ("fwd_bwd", "grad_wait", "device_step", "stall")

LANES = {  # span name -> (lane, colour)
    "fwd_bwd": ("main: fwd/bwd", "tab:blue"),
    "grad_wait": ("main: fwd/bwd", "tab:gray"),
    "stall": ("main: fwd/bwd", "tab:red"),
    "grad_transfer": ("grad transfer", "tab:orange"),
    "device_step": ("main: fwd/bwd", "tab:cyan"),
    "cpu_step": ("CPU step", "tab:green"),
    "weight_copy": ("weight copy", "tab:purple"),
}
LANE_ORDER = ["main: fwd/bwd", "grad transfer", "CPU step", "weight copy"]


def _as_dict(record: Any) -> dict:
    return record if isinstance(record, dict) else record.to_dict()


def format_summary(records: Iterable[Any]) -> str:
    """Where the step time went, as a few lines of text: the median milliseconds per step of
    each activity over ``records`` (``StepProfile`` objects or their dicts), and each
    main-thread activity's share of the main thread's step time (forward+backward, gradient
    wait and stall; the CPU step and weight copy count there only as the stall they cause)."""
    recs = [_as_dict(r) for r in records]
    if not recs:
        return "ZeRO-Offload profile: no steps recorded"
    med = {k: statistics.median(float(r.get(k, 0.0)) for r in recs) for k in FIELDS}
    main = sum(med[k] for k in _MAIN)
    steps = f"steps {recs[0]['step']}-{recs[-1]['step']}" if len(recs) > 1 else \
        f"step {recs[0]['step']}"
    lines = [f"ZeRO-Offload profile, median of {len(recs)} steps ({steps}):"]
    for k in FIELDS:
        share = f"  {100 * med[k] / main:3.0f}% of the step" if k in _MAIN and main > 0 else ""
        lines.append(f"  {_LABELS[k]:<28} {1e3 * med[k]:9.2f} ms{share}")
    hidden = ""
    if med["cpu_step"] > 0:
        hidden = (f"; CPU step hidden behind forward+backward: "
                  f"{100 * max(0.0, 1 - med['stall'] / med['cpu_step']):.0f}%")
    lines.append(f"  main-thread step time {1e3 * main:.2f} ms{hidden}")
    return "\n".join(lines)


def save(records: Iterable[Any], path: str | Path) -> Path:
    """``records`` (``engine.profile``: ``StepProfile`` objects, or their dicts) as the JSON
    file that :func:`load`, ``summary`` and ``plot`` read; returns its path."""
    path = Path(path)
    path.write_text(json.dumps({"records": [_as_dict(r) for r in records]}))
    return path


def load(path: str | Path, steps: int | None = None) -> list[dict]:
    """The records (the last ``steps`` of them) of a profile JSON file."""
    data = json.loads(Path(path).read_text())
    records = data["records"] if isinstance(data, dict) else data
    if not records:
        raise ValueError(f"{path}: no profile records (did the run close any step?)")
    return records[-steps:] if steps else records


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting a profile needs matplotlib: pip install "
                          "'lightning-zero-offload[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(panels: Sequence[tuple[str, list[dict]]], out: str | Path) -> Path:
    """A PNG timeline, one panel per (label, records), one lane per activity; each panel's
    spans are shifted to start at 0 s."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.2 * len(panels) + 0.6), squeeze=False)
    for ax, (label, records) in zip(axes[:, 0], panels, strict=True):
        spans = [(n, s, e, r["step"]) for r in map(_as_dict, records) for n, s, e in r["spans"]]
        t0 = min((s for _, s, _, _ in spans), default=0.0)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_zero_offload.profile_report",
                                description="Summarize or plot saved ZeRO-Offload profiles.")
    sub = p.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="draw a timeline PNG (one panel per file)")
    plot.add_argument("inputs", nargs="+", help="profile JSON files (ProfileRecorder.dump)")
    plot.add_argument("--labels", nargs="+", help="panel titles (default: file names)")
    plot.add_argument("--steps", type=int, default=4, help="last N steps of each file (default 4)")
    plot.add_argument("-o", "--out", default="timeline.png", help="PNG to write")
    summary = sub.add_parser("summary", help="print where the step time went")
    summary.add_argument("input", help="a profile JSON file")
    args = p.parse_args(argv)
    try:
        if args.command == "summary":
            print(format_summary(load(args.input)))
            return 0
        if args.steps < 1:
            p.error(f"--steps must be >= 1, got {args.steps}")
        labels = args.labels or [Path(f).stem for f in args.inputs]
        if len(labels) != len(args.inputs):
            p.error(f"{len(args.inputs)} inputs but {len(labels)} labels")
        panels = [(label, load(f, args.steps)) for label, f in zip(labels, args.inputs,
                                                                    strict=True)]
        print(f"wrote {draw(panels, args.out)}")
    except (OSError, ValueError, KeyError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
