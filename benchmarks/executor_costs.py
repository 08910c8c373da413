"""What the executor's choices cost on one CPU core, in one process (a one-rank gloo group, so
DTensor runs its full dispatch with nothing to communicate):

- a parameter as a DTensor on the autograd path (``to_local`` in forward, its backward and a
  DTensor AccumulateGrad) against a plain tensor: why parameters that only local ops read are
  plain local leaves (execute/gradients.py);
- AdamW over a small GPT's parameters: torch's default loop over plain tensors (what DDP
  runs unless told otherwise), foreach over plain tensors and over DTensors (autoplan's
  default for SGD), fused over DTensors (its default for Adam and AdamW), and how far each
  ends from the default loop after 3 steps.

    python benchmarks/executor_costs.py

Writes benchmarks/results/executor_costs.json and .md.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autoplan.workload import load_workload  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.steps import median_seconds  # noqa: E402

REPEATS, STEPS, WARMUP = 30, 3, 3
GPT = {"size": "small", "num_layers": 4, "batch_size": 8, "seq_len": 128}


def _median_ms(fn: Callable[[], object]) -> float:
    return 1000 * median_seconds(fn, WARMUP, REPEATS)


def _parameter_path(mesh: DeviceMesh, count: int) -> dict[str, float]:
    """Forward and backward through ``count`` tiny parameters: compute is negligible, so the
    time is the autograd path of the parameters themselves."""
    plain = [torch.nn.Parameter(torch.randn(64)) for _ in range(count)]
    dtensors = [
        torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])) for p in plain
    ]
    x = torch.randn(64)

    def run(params: list[torch.nn.Parameter], as_dtensor: bool) -> None:
        for p in params:
            p.grad = None
        h = x
        for p in params:
            local = p.to_local(grad_placements=[Partial()]) if as_dtensor else p
            h = h * local
        h.sum().backward()

    return {
        "plain_ms": _median_ms(lambda: run(plain, False)),
        "dtensor_ms": _median_ms(lambda: run(dtensors, True)),  # type: ignore[arg-type]
    }


def _adamw(mesh: DeviceMesh) -> list[dict[str, Any]]:
    shapes = [p.shape for p in load_workload(ROOT / "examples/gpt.py", **GPT).model.parameters()]
    torch.manual_seed(0)
    start = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]

    def params(as_dtensor: bool) -> list[torch.Tensor]:
        found = []
        for value, grad in zip(start, grads, strict=True):
            if as_dtensor:
                p = torch.nn.Parameter(distribute_tensor(value.clone(), mesh, [Replicate()]))
                p.grad = distribute_tensor(grad, mesh, [Replicate()])
            else:
                p = torch.nn.Parameter(value.clone())
                p.grad = grad.clone()
            found.append(p)
        return found

    def whole(p: torch.Tensor) -> torch.Tensor:
        return p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()

    reference = params(False)
    default = torch.optim.AdamW(reference, lr=1e-3, foreach=False)
    for _ in range(STEPS):
        default.step()
    rows = []
    variants = [
        ("loop over plain tensors (torch's default on CPU)", False, {"foreach": False}),
        ("foreach over plain tensors", False, {"foreach": True}),
        ("foreach over DTensors", True, {"foreach": True}),
        ("fused over DTensors (autoplan's default)", True, {"fused": True}),
    ]
    for name, as_dtensor, options in variants:
        ps = params(as_dtensor)
        opt = torch.optim.AdamW(ps, lr=1e-3, **options)
        for _ in range(STEPS):
            opt.step()
        diff = max(
            (whole(p) - r.detach()).abs().max().item() for p, r in zip(ps, reference, strict=True)
        )
        rows.append(
            {
                "adamw": name,
                "parameters": len(ps),
                "step_ms": round(_median_ms(opt.step), 2),
                "max_param_diff_after_3_steps": f"{diff:.2e}",
            }
        )
    return rows


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    count = sum(1 for _ in load_workload(ROOT / "examples/gpt.py", **GPT).model.parameters())
    path = _parameter_path(mesh, count)
    per_param = (path["dtensor_ms"] - path["plain_ms"]) / count
    print(f"parameter path, {count} parameters: {path}, {per_param:.3f} ms a parameter")
    rows = _adamw(mesh)
    for row in rows:
        print(row)
    meta = {
        "command": "python benchmarks/executor_costs.py",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, one thread",
        "torch": torch.__version__,
        "timing": f"median of {REPEATS} runs after {WARMUP} warm-up",
        "parameter_path": f"{count} parameters of 64 floats, forward and backward: plain "
        f"{path['plain_ms']:.2f} ms, DTensor {path['dtensor_ms']:.2f} ms, "
        f"{per_param:.3f} ms a parameter",
        "adamw": f"GPT {GPT} parameters, lr 1e-3, the same gradients each step; "
        "max_param_diff_after_3_steps: against torch's default loop over plain tensors",
    }
    columns = ["adamw", "parameters", "step_ms", "max_param_diff_after_3_steps"]
    write_results("executor_costs", "Executor costs on one CPU core", meta, rows, columns)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
