"""The device check's verdict: which of its jobs failed or came back without figures, and a
one-screen summary of the figures, ready to paste into ``benchmarks/RESULTS.md``.

``benchmarks/device_check.sh`` calls it last with its ``$OUT`` and the steps whose command exited
non-zero; it reads ``pytest_cuda.xml``, ``cpu_adam_moments.json``, ``partial_offload_gpu.json``,
``fsdp2_gpu.json`` and ``gpu_e2e.json`` and exits 1 naming every failed job (a missing or empty
file is a failure too), else 0.

    python benchmarks/device_summary.py --out benchmarks/out [--rehearse] [--failed "step (rc=1)"]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
MOMENTS = ("fp32", "bf16", "int8")


def tests_verdict(xml: Path, rehearse: bool) -> tuple[str, list[str]]:
    """(summary line, failures) from pytest's JUnit XML: tests were collected, some ran (in the
    rehearsal, those the CPU can run), none failed or failed to collect."""
    if not xml.is_file():
        return "CUDA tests: no report", [f"CUDA tests: no {xml.name} (pytest did not finish?)"]
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "CUDA tests: unreadable report", [f"CUDA tests: {xml.name} has no testsuite"]
    n, failed, errors, skipped = (int(suite.get(k, 0))
                                  for k in ("tests", "failures", "errors", "skipped"))
    ran = n - skipped - failed - errors
    line = f"CUDA tests: {ran} passed, {failed} failed, {errors} errors, {skipped} skipped"
    out = []
    if failed or errors:
        names = [f"{c.get('classname', '')}.{c.get('name', '')}" for c in suite.iter("testcase")
                 if c.find("failure") is not None or c.find("error") is not None]
        out.append(f"CUDA tests: {failed} failed, {errors} errors: {', '.join(names[:8])}")
    if n == 0:
        out.append("CUDA tests: none collected")
    elif not rehearse and ran == 0:
        out.append("CUDA tests: none ran on the GPU machine (see pytest's -ra skip reasons)")
    elif rehearse and ran == 0:
        out.append("CUDA tests: none ran in the rehearsal")
    return line, out


def moments_verdict(path: Path) -> tuple[list[str], list[str]]:
    """(summary lines, failures) from ``cpu_adam.py --parts d``: every format's step time per
    thread count."""
    if not path.is_file():
        return [], [f"compact moments: no {path.name}"]
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("part") == "d"]
    lines, out = [], []
    for t in sorted({r["threads"] for r in rows if "threads" in r}):
        by = {r["peer"]: r for r in rows if r.get("threads") == t}
        missing = [m for m in MOMENTS if "median_ms" not in by.get(m, {})]
        if missing:
            out.append(f"compact moments, {t} threads: no figures for {missing}")
            continue
        n = by["fp32"]["params"] / 1e6
        lines.append(f"- compact moments, {n:.0f}M params, {t} threads: " + ", ".join(
            f"{m} {by[m]['median_ms']:.2f} ms ({by[m]['x_fp32_time']:.2f}x)" for m in MOMENTS))
    if not lines and not out:
        out.append(f"compact moments: {path.name} holds no part-d rows")
    return lines, out


def partial_verdict(path: Path, md: Path) -> tuple[str, list[str]]:
    """(partial_offload_gpu.md, failures) from ``partial_offload_gpu.py``'s own list."""
    if not path.is_file():
        return "", [f"partial offload: no {path.name}"]
    results = json.loads(path.read_text())
    out = results.get("failures", ["stopped before the end (its time limit?)"])
    return (md.read_text() if md.is_file() else ""), [f"partial offload {f}" for f in out]


def fsdp2_verdict(path: Path, md: Path) -> tuple[str, list[str]]:
    """(fsdp2_gpu.md, failures) from ``fsdp2_gpu.py``'s own list."""
    if not path.is_file():
        return "", [f"fsdp2: no {path.name}"]
    out = json.loads(path.read_text()).get("failures", ["stopped before the end"])
    return (md.read_text() if md.is_file() else ""), [f"fsdp2 {f}" for f in out]


def gpu_e2e_verdict(path: Path, md: Path) -> tuple[str, list[str]]:
    """(gpu_e2e.md, failures) from ``gpu_e2e.py``'s own list, or recomputed from what it saved
    when it was stopped before the end."""
    if not path.is_file():
        return "", [f"gpu_e2e: no {path.name}"]
    results = json.loads(path.read_text())
    if "failures" in results:
        out = list(results["failures"])
    else:
        from gpu_e2e import failures

        out = ["gpu_e2e: stopped before the end (its time limit?)", *failures(results)]
    return (md.read_text() if md.is_file() else ""), [f"gpu_e2e {f}" for f in out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rehearse", action="store_true")
    p.add_argument("--failed", nargs="*", default=[], help="steps whose command failed")
    p.add_argument("--wall-s", type=float)
    a = p.parse_args(argv)
    tests_line, failed = tests_verdict(a.out / "pytest_cuda.xml", a.rehearse)
    moment_lines, f2 = moments_verdict(a.out / "cpu_adam_moments.json")
    partial_md, f4 = partial_verdict(a.out / "partial_offload_gpu.json",
                                     a.out / "partial_offload_gpu.md")
    fsdp2_md, f5 = fsdp2_verdict(a.out / "fsdp2_gpu.json", a.out / "fsdp2_gpu.md")
    e2e_md, f3 = gpu_e2e_verdict(a.out / "gpu_e2e.json", a.out / "gpu_e2e.md")
    failed = [f"step {s}" for s in a.failed] + failed + f2 + f4 + f5 + f3
    kind = "rehearsal on the CPU (emulated device, tiny sizes)" if a.rehearse else "GPU"
    wall = f", {a.wall_s:.0f} s" if a.wall_s is not None else ""
    print(f"\n## Device check summary ({kind}{wall}) - paste into benchmarks/RESULTS.md\n")
    print(f"- {tests_line}")
    print("\n".join(moment_lines))
    print()
    print(partial_md.rstrip())
    print()
    print(fsdp2_md.rstrip())
    print()
    print(e2e_md.rstrip())
    print()
    if failed:
        print(f"DEVICE CHECK FAILED: {len(failed)} job(s)")
        for f in failed:
            print(f"  FAILED {f}")
        return 1
    print("DEVICE CHECK OK: every job came back with its figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
