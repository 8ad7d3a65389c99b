"""CPUAdam as a drop-in for torch.optim.AdamW: train the same small MLP with each and compare.

    python examples/cpu_adam_demo.py [--steps 200]

Both runs start from the same weights and see the same batches; the losses should agree to float
rounding and the final weights differ by ~1e-7 or less. Set LZO_KERNEL=reference to run the
pure-torch reference instead of the C++ kernel.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from lightning_zero_offload import CPUAdam, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 1))
    reference = copy.deepcopy(model)
    ours = CPUAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    theirs = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.01)
    sched_ours = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=args.steps)
    sched_theirs = torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=args.steps)

    # A smooth target the MLP can learn: y = sin(x . w) + noise.
    data_gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, generator=data_gen) / 32**0.5
    print(f"kernel: {ops.backend()} ({ops.get_isa()})")
    print(f"{'step':>5} {'loss CPUAdam':>14} {'loss AdamW':>14}")
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 32, generator=data_gen)
        y = torch.sin(x @ w).unsqueeze(1) + 0.05 * torch.randn(64, 1, generator=data_gen)
        losses = []
        for net, opt, sched in ((model, ours, sched_ours), (reference, theirs, sched_theirs)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        if step == 1 or step % max(1, args.steps // 10) == 0:
            print(f"{step:>5} {losses[0]:>14.6f} {losses[1]:>14.6f}")
    diff = max((a - b).abs().max().item()
               for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    print(f"max |CPUAdam - AdamW| over all weights after {args.steps} steps: {diff:.3e}")


if __name__ == "__main__":
    main()
