"""Checkpoints of a parallel step: each rank writes its own shards with
torch.distributed.checkpoint (DCP), keyed by the model's parameter FQNs, so that a checkpoint
saved under one plan loads under any other plan of the same model (another mesh, ZeRO-3's
sharded storage, pipeline stages, another number of ranks): DCP reads each rank's shards of
each tensor from whichever files hold them.

What a checkpoint holds: the parameters and persistent buffers (this rank's shards; a pipeline
rank has only its stage's), the optimizer's state and settings (torch's
``get_optimizer_state_dict`` flattened per FQN, ``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``,
as torchtitan saves pipelines), and ``progress.json``: the steps taken, the number of ranks
that saved it, rank 0's random states and the caller's ``extra`` (a data loader's position),
written by rank 0.

A checkpoint directory holds one directory per checkpoint::

    DIR/step-00000003/         DCP's shard files, its .metadata, progress.json, manifest.json
    DIR/.step-00000006.tmp/    a save in progress, or one a crash cut short: never read

A save writes into the temporary directory (progress.json first, then the shards; DCP's
coordinator writes .metadata last, once every rank has reported its writes); rank 0 then
writes the manifest (each file's size and checksum, `autoplan.execute.manifest`), verifies
the checkpoint and renames it into place, and only then removes the checkpoints that ``keep``
no longer keeps: a crash at any moment leaves the checkpoints before it as they were. A load
verifies the newest checkpoint against its manifest; a damaged one is reported (a warning
naming the file) and the newest intact one before it is loaded instead.
Every rank reads and writes the same directory: on several nodes it must be on a shared file
system (as DCP's own file writer assumes).

DCP writes each rank's shard as one block of the logical tensor, and refuses a strided split
(a fused projection's "S(d)xk": torch 2.13 sees overlapping chunks). Such a tensor is saved
redistributed to the plain split of the same dim, and loaded so, then redistributed back
(`_unstrided`, `_restrided`): the checkpoint holds the logical tensor, as under any plan.
So does a fused projection of unequal pieces, which the executor holds interleaved
(`autoplan.execute.placements`): saved and loaded in the model's order, then interleaved.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from autoplan.errors import AutoplanError, CheckpointError
from autoplan.execute.manifest import PROGRESS, damage, write_manifest
from autoplan.execute.placements import Layout, interleaved, logical
from autoplan.torch_private import StridedShard

log = logging.getLogger(__name__)

_NAME = re.compile(r"step-(\d{8})")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# settings of how an optimizer computes, not of what: the new step's own are kept (a
# checkpoint of fused AdamW loads into foreach AdamW)
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


@dataclass(frozen=True)
class Restored:
    """Where training stood when a checkpoint was saved."""

    step: int  # train steps taken
    extra: Any  # what the caller saved with it (JSON), e.g. a data loader's position
    path: Path  # the checkpoint loaded
    world_size: int | None  # the ranks that saved it (None: saved before this was kept)


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def latest(directory: str | Path) -> Path | None:
    """The newest intact checkpoint in ``directory`` (or ``directory`` itself if it is one),
    verified (`autoplan.execute.manifest.damage`); a damaged newer one is skipped with a
    warning naming what is wrong. None if there is no checkpoint; an error if there are some
    but every one is damaged (or ``directory`` is a damaged checkpoint)."""
    directory = Path(directory)
    if (directory / ".metadata").is_file():
        reason = damage(directory)
        if reason is not None:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {reason}; load an earlier checkpoint"
            )
        return directory
    if not directory.is_dir():
        return None
    found = sorted(
        (p for p in directory.iterdir() if _NAME.fullmatch(p.name) and (p / ".metadata").is_file()),
        key=lambda p: p.name,
        reverse=True,
    )
    damaged: list[str] = []
    for path in found:
        reason = damage(path)
        if reason is None:
            return path
        log.warning(
            "checkpoint %s is damaged (%s): it is skipped and left as it is; the newest intact "
            "checkpoint before it is used",
            path,
            reason,
        )
        damaged.append(f"{path.name}: {reason}")
    if damaged:
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged ({'; '.join(damaged)}); remove them "
            "to start from the beginning, or restore an intact copy"
        )
    return None


def check_writable(directory: str | Path) -> None:
    """Make ``directory`` if need be and write a file there (on rank 0, under a process
    group): a folder that cannot take checkpoints is found before any step trains, not at the
    first save."""
    folder = Path(directory)

    def probe() -> None:
        file = folder / f".autoplan-probe-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            file.write_bytes(b"")
            file.unlink()
        except OSError as e:
            raise CheckpointError(
                f"checkpoint folder {folder} cannot be written ({type(e).__name__}: "
                f"{e.strerror or e}); give another --checkpoint-dir, or make it writable"
            ) from None

    if dist.is_initialized():
        _rank0_then_all(probe)  # a shared folder: rank 0 tries it for all
    else:
        probe()


def _on_every_rank(check: Callable[[], None]) -> None:
    """``check()`` on every rank; an error on any rank is raised on every rank (the others
    would wait for it in the next collective)."""
    try:
        check()
        error = None
    except AutoplanError as e:
        error = str(e)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, first = failed[0]
        raise CheckpointError(first if len(failed) == len(errors) else f"{first} (on rank {rank})")


def _rank0_then_all(action: Callable[[], Any]) -> Any:
    """``action()`` on rank 0; every rank gets its result or the same error (never a hang)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", action())
        except AutoplanError as e:
            box[0] = ("error", f"{e}")
        except OSError as e:
            box[0] = ("error", f"checkpoint: {type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(value)
    return value


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers by FQN (a tied parameter once); a pipeline rank's
    other stages' are meta tensors (`_local` leaves them out)."""
    persistent = set(model.state_dict())
    named = [*model.named_parameters(), *model.named_buffers()]
    return {k: v.detach() for k, v in named if k in persistent}


def _local(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors this rank holds (not another pipeline stage's)."""
    return {k: v for k, v in state.items() if not v.is_meta}


def _strided(value: Any) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, StridedShard) for p in value.placements)


def _layout(key: str, layouts: Mapping[str, Layout]) -> Layout:
    """The interleaved layout of a model state's ``key`` (an FQN) or an optimizer state's
    (``state.<fqn>.exp_avg``: placed as its parameter); () for a tensor held in order."""
    if key.startswith("state."):
        key = key.removeprefix("state.").rpartition(".")[0]
    return layouts.get(key, ())


def _unstrided(state: Mapping[str, Any], layouts: Mapping[str, Layout]) -> dict[str, Any]:
    """``state`` with each DTensor split strided redistributed to plain splits of its dims,
    and each held interleaved (``layouts``, a fused projection of unequal pieces) put in the
    model's order (a new tensor; the others as they are)."""
    found = {}
    for key, value in state.items():
        if _strided(value):
            plain = [Shard(p.dim) if isinstance(p, StridedShard) else p for p in value.placements]
            value = value.redistribute(value.device_mesh, plain)
        elif layout := _layout(key, layouts):
            value = logical(value, layout)
        found[key] = value
    return found


def _restrided(
    loaded: Mapping[str, Any], like: Mapping[str, Any], layouts: Mapping[str, Layout]
) -> dict[str, Any]:
    """``loaded`` (`_unstrided` of ``like``, loaded into) with each tensor split strided in
    ``like`` placed so again, and each held interleaved so again."""
    found = {}
    for key, value in loaded.items():
        if _strided(like[key]):
            value = value.redistribute(value.device_mesh, like[key].placements)
        elif layout := _layout(key, layouts):
            value = interleaved(value, layout)
        found[key] = value
    return found


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().numpy().tobytes()
        state["cuda"] = base64.b64encode(cuda).decode()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


def save(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    *,
    keep: int | None = None,
    extra: Any = None,
    layouts: Mapping[str, Layout] | None = None,
) -> Path:
    """Save on every rank into ``directory/step-<step>``, then keep the newest ``keep``
    checkpoints (all if None). Returns the checkpoint's path. ``layouts``: the parameters held
    interleaved (`autoplan.execute.placements.held_layouts`), saved in the model's order."""
    layouts = layouts or {}
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep={keep}: keep at least 1 checkpoint (or None for all)")
    final = checkpoint_path(directory, step)
    tmp = final.with_name(f".{final.name}.tmp")

    def start() -> None:
        try:
            progress = json.dumps(
                {
                    "step": step,
                    "world_size": dist.get_world_size(),
                    "rng": _rng_state(),
                    "extra": extra,
                }
            )
        except TypeError as e:
            raise CheckpointError(f"extra={extra!r} is not JSON: {e}") from None
        if tmp.exists():  # a save at the same step that a crash cut short
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        (tmp / PROGRESS).write_text(progress)

    _rank0_then_all(start)
    state: dict[str, Any] = {"model": _unstrided(_local(_model_state(model)), layouts)}
    # before the first step there is nothing to save (nor to init); None: this rank's
    # pipeline stages hold no parameter
    if optimizer is not None and optimizer.state:
        optim = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        state["optim"] = _unstrided(optim, layouts)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    except dcp.CheckpointException as e:  # a BaseException: a user's `except Exception` misses it
        raise CheckpointError(
            f"saving checkpoint {final} failed ({_failures(e)}); the checkpoints before it are "
            "as they were"
        ) from None

    def commit() -> None:
        write_manifest(tmp)
        # every file DCP's metadata reads is there at its length (the bytes were just hashed)
        reason = damage(tmp, checksums=False)
        if reason is not None:
            raise CheckpointError(
                f"checkpoint {final} failed its check after writing: {reason}; the "
                "checkpoints before it are as they were, and none was removed"
            )
        old = final.with_name(f".{final.name}.old")
        if final.exists():  # saved again at this step: the new one replaces it
            final.rename(old)
        tmp.rename(final)
        _sync_directory(final.parent)
        # only now, the new checkpoint in place and verified, is anything removed
        if old.exists():
            shutil.rmtree(old)
        # saves that crashes cut short (their steps' own saves would replace them)
        for stale in final.parent.glob(".step-*.tmp"):
            shutil.rmtree(stale)
        if keep is not None:
            done = sorted(p for p in final.parent.iterdir() if _NAME.fullmatch(p.name))
            for old_one in done[:-keep]:
                shutil.rmtree(old_one)

    _rank0_then_all(commit)
    log.info("saved checkpoint %s", final)
    return final


def _sync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    missing_ok: bool = False,
    layouts: Mapping[str, Layout] | None = None,
) -> Restored | None:
    """Load the newest checkpoint in ``directory`` (or the checkpoint ``directory``) into
    ``model``'s parameters and buffers in place and into ``optimizer`` (if any), on every
    rank, and set every rank's random state to rank 0's at the save. Without a checkpoint:
    None if ``missing_ok``, else an error."""
    layouts = layouts or {}
    found = _rank0_then_all(lambda: str(latest(directory) or ""))
    if not found:
        if missing_ok:
            return None
        raise CheckpointError(
            f"no checkpoint in {directory}: it is none, and holds no complete step-NNNNNNNN "
            "checkpoint"
        )
    path = Path(found)
    reader = dcp.FileSystemReader(path)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as e:  # damaged after rank 0 verified it: a truncated pickle, say
        raise CheckpointError(
            f"checkpoint {path} is damaged: {path / '.metadata'} cannot be read "
            f"({type(e).__name__}: {e}); remove {path} to resume from the checkpoint before it"
        ) from None
    whole = _model_state(model)
    held = _local(whole)
    state: dict[str, Any] = {"model": _unstrided(held, layouts)}
    template: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    if optimizer is not None and any(k.startswith("optim.") for k in saved):
        template = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        optim = {k: v for k, v in template.items() if k.rpartition(".")[2] not in _IMPLEMENTATION}
        state["optim"] = _unstrided(optim, layouts)
    # every stage's shapes are checked on every rank (a pipeline rank has meta tensors of the
    # others')
    wanted = {f"model.{k}": v for k, v in whole.items()}
    wanted |= {f"optim.{k}": v for k, v in state.get("optim", {}).items()}
    _on_every_rank(lambda: _check(path, wanted, saved))
    progress = _progress(path)
    try:
        dcp.load(state, storage_reader=reader)
    except dcp.CheckpointException as e:
        raise CheckpointError(f"loading checkpoint {path} failed ({_failures(e)})") from None
    with torch.no_grad():  # the parameters loaded in place, those split strided here
        for key, value in _restrided(state["model"], held, layouts).items():
            if _strided(value) or key in layouts:
                held[key].copy_(value)
    if optimizer is not None and template:
        loaded = _restrided(state["optim"], optim, layouts)
        set_optimizer_state_dict(model, optimizer, {**template, **loaded}, options=_FLAT)
    _set_rng_state(progress["rng"])
    log.info("loaded checkpoint %s (step %d)", path, progress["step"])
    return Restored(progress["step"], progress["extra"], path, progress.get("world_size"))


def _progress(path: Path) -> dict[str, Any]:
    """The checkpoint's progress.json (the steps taken, the random states, ``extra``)."""
    file = path / PROGRESS
    try:
        progress = json.loads(file.read_text())
        if not all(key in progress for key in ("step", "rng", "extra")):
            raise ValueError("it lacks step, rng or extra")
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {file} cannot be read ({type(e).__name__}: {e}); "
            f"remove {path} to resume from the checkpoint before it"
        ) from None
    return dict(progress)


def _failures(e: dcp.CheckpointException) -> str:
    """Each failed rank's error, in a line."""
    return "; ".join(
        f"rank {rank}: {type(error).__name__}: {error}"
        for rank, (error, _) in sorted(e.failures.items())
    )


def _check(path: Path, wanted: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """The checkpoint is one of ours, with every entry of ``wanted`` at its shape and no
    parameter or buffer that ``wanted`` lacks."""
    if not (path / PROGRESS).is_file():
        raise CheckpointError(
            f"{path} has no {PROGRESS}: it is a DCP checkpoint, but not one autoplan saved"
        )
    unknown = sorted(k for k in saved if k.startswith("model.") and k not in wanted)
    if unknown:
        names = ", ".join(k.partition(".")[2] for k in unknown[:3])
        raise CheckpointError(
            f"checkpoint {path} has {len(unknown)} parameter(s) or buffer(s) the model lacks "
            f"({names}{', ...' if len(unknown) > 3 else ''}): it was saved for another model"
        )
    for key, value in wanted.items():
        if key not in saved:
            what = "optimizer state" if key.startswith("optim.") else "parameter or buffer"
            raise CheckpointError(
                f"checkpoint {path} has no {what} {key.partition('.')[2]!r}: it was saved for "
                "another model (or optimizer)"
            )
        if isinstance(value, torch.Tensor):
            shape = tuple(getattr(saved[key], "size", ()))
            if shape != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint {path} has {key.partition('.')[2]!r} of shape {shape}, the "
                    f"model {tuple(value.shape)}: it was saved for another model"
                )


def export(path: str | Path, state: Mapping[str, torch.Tensor]) -> None:
    """Rank 0 writes ``state`` (whole tensors, on every rank) as one ``torch.save`` file,
    atomically."""
    path = Path(path)

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({k: v.cpu() for k, v in state.items()}, tmp)
        tmp.replace(path)

    _rank0_then_all(write)
    log.info("exported the model's state to %s", path)
