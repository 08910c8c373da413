"""`autoplan.parallelize` in a training loop of your own: a data loader, a learning-rate
schedule (warm-up, then cosine), gradient accumulation, evaluation on held-out batches and a
checkpoint that records the loader's position. Run it on every rank under torchrun:

    torchrun --nproc-per-node 2 examples/own_loop.py
    torchrun --nproc-per-node 4 examples/own_loop.py --steps 20 --accumulate 4

The model is the tiny GPT of examples/gpt.py; the data are random token ids, so the loss falls
only as far as the model memorizes them. docs/python.md explains each part.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import autoplan
from autoplan.workload import load_workload

HERE = Path(__file__).resolve().parent


def batches(tokens: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    """Every rank reads the same batches in the same order (the same seed): the step is given
    the whole batch on every rank, and each rank keeps the part the plan gives it."""
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])  # inputs, next-token targets
    order = torch.Generator().manual_seed(seed)
    # drop_last: the step was traced at one batch shape, and every batch must have it
    return DataLoader(data, batch_size=batch_size, shuffle=True, generator=order, drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=2, help="steps of linear warm-up")
    parser.add_argument("--checkpoint-dir", help="save here at the end (and resume from it)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # the bundled 4-process CPU cluster, cut to the processes started (one node)
    cluster = autoplan.Cluster.load(HERE.parent / "costmodels/cpu-gloo-4.json").stage(world)
    w = load_workload(HERE / "gpt.py", size="tiny", batch_size=args.batch_size)
    seq_len = w.example_inputs[0].shape[1]
    vocab = w.model.head.weight.shape[0]
    tokens = torch.randint(0, vocab, (64, seq_len + 1), generator=torch.Generator().manual_seed(1))
    train, held_out = tokens[:48], tokens[48:]

    step = autoplan.parallelize(
        w.model,
        cluster,
        example_inputs=w.example_inputs,  # the batch's shapes: planned and built now
        loss_fn=w.loss_fn,
        example_target=w.example_target,
        # one stage: a pipelined plan has no step.module to accumulate or evaluate with
        options=autoplan.PlanOptions(optimizer="adamw", pipeline=False),
        train=autoplan.TrainOptions(optimizer_options={"lr": args.lr, "weight_decay": 0.1}),
    )
    module, optimizer = step.module, step.optimizer
    assert module is not None and optimizer is not None

    def lr_factor(n: int) -> float:  # of --lr, at optimizer step n
        if n < args.warmup:
            return (n + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (n - args.warmup) / max(1, args.steps - args.warmup)))

    epoch, seen = 0, 0  # the loader's position: epochs done, batches read of this one
    if args.checkpoint_dir:
        restored = step.load(args.checkpoint_dir, missing_ok=True)  # None: nothing saved yet
        if restored is not None:  # parameters, optimizer state and step count come back
            epoch, seen = restored.extra["epoch"], restored.extra["seen"]

    def evaluate() -> float:
        """The mean loss over the held-out batches: forward only, no gradients."""
        with torch.no_grad():
            losses = [module(x, y).item() for x, y in batches(held_out, args.batch_size, 0)]
        return sum(losses) / len(losses)

    rank0 = dist.get_rank() == 0
    axes = dict(zip(step.plan.mesh.axes, step.plan.mesh.shape, strict=True))
    held = evaluate()  # on every rank: each runs its part of every step's collectives
    if rank0:
        print(f"mesh {axes}; step {step.steps_done}: held-out loss {held:.4f}")
    while step.steps_done < args.steps:
        for i, (x, y) in enumerate(batches(train, args.batch_size, seed=epoch)):
            if i < seen:  # resumed mid-epoch: skip what was trained on
                continue
            seen += 1
            # gradients of several backward passes add up, as in one process; each loss is
            # divided so that their sum is the mean over the batches
            loss = module(x, y) / args.accumulate
            loss.backward()
            if seen % args.accumulate:
                continue
            # the schedule, from the step count (so a resumed run goes on where it was; any
            # torch.optim.lr_scheduler on step.optimizer works too)
            lr = args.lr * lr_factor(step.steps_done)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step.clip_gradients(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step.steps_done += 1  # what step.save names the checkpoint after
            if rank0:
                print(
                    f"step {step.steps_done}: loss {loss.item() * args.accumulate:.4f}  lr {lr:.2e}"
                )
            if step.steps_done == args.steps:
                break
        else:
            epoch, seen = epoch + 1, 0  # the epoch's last batches, if fewer, carry over
    held = evaluate()
    if rank0:
        print(f"step {step.steps_done}: held-out loss {held:.4f}")
    if args.checkpoint_dir:
        path = step.save(args.checkpoint_dir, extra={"epoch": epoch, "seen": seen})
        if rank0:
            print(f"saved {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
