"""Train a small GPT-style causal LM with ``Trainer(strategy="zero_offload")``.

The model is a randomly initialized transformers Llama (nothing is downloaded); the text is the
Python standard library's own source, read as bytes (a byte-level vocabulary of 256, so no
tokenizer either). It runs on whatever device exists: the fp32 master weights and AdamW state
stay in host memory, the device holds the weights in the compute dtype. At the end it prints
tokens/s (over the steps after a warm-up of 3; with fewer steps, over all of them) and the peak
device and host memory.

    .venv/bin/python examples/lightning_gpt.py             # about a minute on a 2-core CPU
    .venv/bin/python examples/lightning_gpt.py --size 300m --precision bf16-mixed --steps 200
    .venv/bin/python examples/lightning_gpt.py --devices 2 # data parallel, gradients partitioned
    .venv/bin/python examples/lightning_gpt.py --no-zero-offload --optimizer torchao-adamw8bit

The last one is a peer for ``benchmarks/moments_convergence.py``: the same model, data and steps
without the engine (plain Lightning), with torchao's ``AdamW8bit`` (``--optimizer adamw`` there
is the stock ``torch.optim.AdamW``, the exact reference).

(``python3 tasks.py train ARGS`` runs it in the ``.venv`` that ``tasks.py`` makes.) At the end it
also prints the offload profile's summary: where the step time went. The job itself (data, model,
callbacks, the fit) is ``lightning_gpt_job.py``, imported once the flags parsed: ``--help`` and a
bad flag answer without importing torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# hidden, layers, heads (intermediate about 8/3 * hidden as in Llama); names give the parameter
# count, which is nearly all in the blocks since the byte vocabulary is only 256
SIZES = {
    "tiny": (128, 2, 4),
    "small": (256, 4, 4),
    "85m": (768, 12, 12),
    "300m": (1024, 24, 16),
    "800m": (2048, 16, 16),
    "3b": (3072, 26, 24),
}


def _at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _fraction(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or auto, got {text!r}"
                                         ) from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] or auto, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    parser.add_argument(
        "--precision",
        choices=["auto", "32-true", "bf16-mixed", "16-mixed"],
        default="auto",
        help="auto: bf16-mixed on a GPU, 32-true on a CPU (most CPUs have no fast bf16)",
    )
    parser.add_argument("--devices", type=_at_least(1), default=1, help="GPUs (or CPU processes)")
    parser.add_argument("--steps", type=_at_least(1), default=60, help="optimizer steps")
    parser.add_argument("--batch-size", type=_at_least(1), default=8, help="per device")
    parser.add_argument("--seq-len", type=_at_least(2), default=128, help="tokens per sample")
    parser.add_argument("--accumulate", type=_at_least(1), default=1,
                        help="accumulate_grad_batches")
    parser.add_argument("--lr", type=_positive_float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--delayed-update", action="store_true", help="delayed parameter update")
    parser.add_argument("--moment-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                        help="how the host keeps the Adam moments (fp32: exact AdamW)")
    parser.add_argument("--offload-fraction", type=_fraction, default="auto",
                        help="share of the optimizer state on the host: a number in [0, 1] or "
                             "auto (what the host cannot hold stays on the device); it runs at "
                             "the nearest split into whole buckets (see --bucket-size-mb)")
    parser.add_argument("--bucket-size-mb", type=_positive_float, default=25.0,
                        help="gradient bucket size in MiB: the device keeps whole buckets' "
                             "optimizer state, so smaller buckets split it closer to "
                             "--offload-fraction")
    parser.add_argument("--no-zero-offload", action="store_true",
                        help="plain Lightning without the engine (a peer for the benchmarks)")
    parser.add_argument("--optimizer", choices=["adamw", "torchao-adamw8bit"], default="adamw",
                        help="torch.optim.AdamW, or torchao's AdamW8bit (needs --no-zero-offload "
                             "and torchao: pip install 'lightning-zero-offload[torchao]')")
    parser.add_argument("--loss-csv", help="write each step's training loss and wall time "
                                           "(seconds, end of the previous step to end of this) "
                                           "to this CSV file")
    args = parser.parse_args(argv)
    if not args.no_zero_offload and args.optimizer != "adamw":
        parser.error(f"argument --optimizer: {args.optimizer} runs without the engine (which "
                     "takes torch.optim.AdamW); add --no-zero-offload")
    if args.no_zero_offload and args.offload_fraction != "auto":
        parser.error("argument --offload-fraction: it places the engine's state; drop "
                     "--no-zero-offload")
    if args.no_zero_offload and args.bucket_size_mb != 25.0:
        parser.error("argument --bucket-size-mb: it sizes the engine's buckets; drop "
                     "--no-zero-offload")
    if args.no_zero_offload and args.moment_dtype != "fp32":
        parser.error(f"argument --moment-dtype: {args.moment_dtype} moments need the engine; "
                     "drop --no-zero-offload")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lightning_gpt_job import run  # the heavy imports, once the flags are known good

    run(args, SIZES[args.size])
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
