"""The cluster file: reading, validating and writing its JSON (costmodels/README.md lists every
field and its units).

Every problem raises `ClusterFormatError` naming the file, the field path
(``device.peak_flops.float32``) and what was expected (`autoplan.jsonfields`). The readers
return the parts a cluster is made of (`Device`, `Link`, `Measured`) and the constructor's
fields by name (`read_cluster`); `autoplan.cluster.model.Cluster.from_dict` and `Cluster.load`
call them and build the cluster. So this module imports the parts it builds, never the cluster,
and the cluster imports it: one direction, no cycle.

The `measured` field holds profiled curves (`autoplan profile`) beside the analytic constants:

    "measured": {
      "fingerprint": {"device": str, "device_count": int >= 1, "torch": str, "driver": str,
                      "hosts": [str, ...]},                 # required when anything is measured
      "matmul":      {"<dtype>": [[flops, seconds], ...]},
      "elementwise": {"<dtype>": [[bytes_moved, seconds], ...]},
      "activation":  {"<dtype>": [[tensor_bytes, seconds], ...]},   # GELU forward + backward
      "op_overhead": seconds,              # forward + backward of one more op, beyond compute
      "op_overheads": {"<aten op>|view": seconds},   # the same for that op (view: any view op)
      "redistribute_overhead": [[tensor_bytes, seconds], ...],  # DTensor's, beyond its collective
      "sync_overhead": seconds,            # a blocking collective after compute: the skew
      "<kind>":      {"<intra|inter>/<group size>": [[bytes, seconds], ...]}
    }

with <kind> one of autoplan.cluster.measured.COLLECTIVE_KINDS and bytes as
`autoplan.costmodel.timing` defines them for that kind; send_recv curves have group size 2. Every
section is optional and `{}` means nothing is measured. Each curve is a non-empty list of
points with sizes > 0 strictly increasing and seconds >= 0 non-decreasing
(`autoplan.cluster.measured` says why and how they are interpolated). `read_measured` gives the
validated form (`Cluster.curves`). `Cluster.load` warns (`warn_if_profiled_elsewhere`), naming
both fingerprints, when the file's profile was measured on other hardware than this machine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from autoplan.cluster.hardware import BACKENDS, DTYPES, REQUIRED_DTYPES, Device, Link
from autoplan.cluster.measured import (
    COLLECTIVE_KINDS,
    LINK_CLASSES,
    OVERHEADS,
    Curve,
    Fingerprint,
    Measured,
    machine_fingerprint,
)
from autoplan.errors import ClusterFormatError
from autoplan.jsonfields import JsonField

log = logging.getLogger(__name__)

__all__ = [
    "check_num_nodes",
    "read_cluster",
    "read_document",
    "read_measured",
    "warn_if_profiled_elsewhere",
    "write_document",
]

_TOP_FIELDS = (
    "backend",
    "cores_per_node",
    "device",
    "devices_per_node",
    "inter_node",
    "intra_node",
    "measured",
    "name",
    "num_nodes",
    "source",
)
_DEVICE_FIELDS = (
    "allocator_margin",
    "compute_efficiency",
    "kind",
    "memory_bandwidth",
    "memory_bytes",
    "memory_efficiency",
    "peak_flops",
)
_LINK_FIELDS = ("bandwidth", "latency")
_BY_DTYPE = ("activation", "elementwise", "matmul")
_MEASURED_FIELDS = (
    *_BY_DTYPE,
    "fingerprint",
    *OVERHEADS,
    "op_overheads",
    "redistribute_overhead",
    *COLLECTIVE_KINDS,
)
_FINGERPRINT_FIELDS = ("device", "device_count", "driver", "hosts", "torch")
_HELP = "see costmodels/README.md for the fields of a cluster file"


# -------------------------------------------------------------------- the file


def read_document(path: str | Path) -> Any:
    """The parsed JSON of the cluster file at `path`."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClusterFormatError(
            f"cluster file {where!r} does not exist; pass the path of a cluster JSON file "
            f"(see costmodels/README.md for the bundled ones and their fields)"
        ) from None
    except OSError as exc:
        raise ClusterFormatError(f"cluster file {where!r} cannot be read: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterFormatError(
            f"{where}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None


def write_document(path: str | Path, data: dict[str, Any]) -> None:
    """Write `data` (`Cluster.to_dict`) with sorted keys, indent 2 and a trailing newline."""
    text = json.dumps(data, sort_keys=True, indent=2) + "\n"
    Path(path).write_text(text, encoding="utf-8")


def read_cluster(data: Any, where: str) -> dict[str, Any]:
    """Validate `data` (a parsed cluster file; `where` names it in errors) field by field into
    `Cluster`'s keyword arguments."""
    top = _field(data, where).only(_TOP_FIELDS)
    device = _device(top["device"])
    backend = top["backend"].one_of(BACKENDS)
    measured = top["measured"]
    read_measured(measured.value, where)  # checked here so that errors name the file
    cores = top.get("cores_per_node")
    return dict(
        name=top["name"].text(non_empty=True),
        device=device,
        num_nodes=top["num_nodes"].integer(minimum=1),
        devices_per_node=top["devices_per_node"].integer(minimum=1),
        intra_node=_link(top["intra_node"]),
        inter_node=_link(top["inter_node"]),
        backend=backend,
        source=top["source"].text(non_empty=True),
        measured=measured.value,
        cores_per_node=None if cores is None else cores.integer(minimum=1),
    )


def check_num_nodes(value: Any, where: str) -> int:
    """`value` as a node count (an integer >= 1); `where` names who gave it."""
    return _field(value, where, "num_nodes").integer(minimum=1)


def _field(value: Any, where: str, path: str = "") -> JsonField:
    return JsonField(value, where, ClusterFormatError, path, hint=_HELP)


def _device(f: JsonField) -> Device:
    f.only(_DEVICE_FIELDS)
    flops = f["peak_flops"].require(REQUIRED_DTYPES).only(DTYPES)
    return Device(
        kind=f["kind"].text(non_empty=True),
        memory_bytes=f["memory_bytes"].integer(minimum=1),
        peak_flops={str(dtype): peak.positive() for dtype, peak in flops.items()},
        memory_bandwidth=f["memory_bandwidth"].positive(),
        compute_efficiency=f["compute_efficiency"].fraction(),
        memory_efficiency=f["memory_efficiency"].fraction(),
        allocator_margin=_margin(f.get("allocator_margin")),
    )


def _margin(f: JsonField | None) -> float:
    """`device.allocator_margin`: a number in [0, 1); absent, 0."""
    if f is None:
        return 0.0
    value = f.number()
    if not 0.0 <= value < 1.0:
        raise f.fail("a number in [0, 1) (the share of the allocator's memory no tensor holds)")
    return value


def _link(f: JsonField) -> Link:
    f.only(_LINK_FIELDS)
    return Link(bandwidth=f["bandwidth"].positive(), latency=f["latency"].seconds())


# -------------------------------------------------------------------- the measured section


def read_measured(value: Any, where: str) -> Measured:
    """The `measured` section `value`, validated (`where` names its file or cluster)."""
    f = _field(value, where, "measured").only(_MEASURED_FIELDS)
    if not f.obj():
        return Measured(fingerprint=None, matmul={}, elementwise={}, collectives={})
    by_dtype = {
        section: {dtype: _curve(points) for dtype, points in _section(f, section, DTYPES)}
        for section in _BY_DTYPE
    }
    collectives = {
        (kind, *_group_key(key, points, kind)): _curve(points)
        for kind in COLLECTIVE_KINDS
        for key, points in _section(f, kind)
    }
    redistribute = f.get("redistribute_overhead")
    return Measured(
        fingerprint=_fingerprint(f["fingerprint"]),
        matmul=by_dtype["matmul"],
        elementwise=by_dtype["elementwise"],
        collectives=collectives,
        activation=by_dtype["activation"],
        redistribute_overhead=None if redistribute is None else _overhead_curve(redistribute),
        op_overheads={op: s.seconds() for op, s in _section(f, "op_overheads")},
        **{name: None if (s := f.get(name)) is None else s.seconds() for name in OVERHEADS},
    )


def _section(
    measured: JsonField, name: str, keys: tuple[str, ...] | None = None
) -> list[tuple[str, JsonField]]:
    """The fields of the optional object `name` of the measured section (null is no object),
    refused if one is not among `keys` (when given)."""
    if name not in measured.obj():
        return []
    section = measured[name]
    return (section if keys is None else section.only(keys)).items()


def _overhead_curve(f: JsonField) -> Curve:
    if isinstance(f.value, int | float) and not isinstance(f.value, bool):
        raise f.problem(
            "one number, as profiles written before 2026-11-22 stored it; it is now a curve by "
            "tensor size (a larger tensor's redistribution costs more): profile the cluster "
            "again (autoplan profile)"
        )
    return _curve(f)


def _group_key(key: str, f: JsonField, kind: str) -> tuple[str, int]:
    """The link class and group size of the collective curve `f`, keyed `key` ("intra/2")."""
    link, _, size = key.partition("/")
    canonical = size.isdecimal() and str(int(size)) == size
    pair = kind == "send_recv"  # one message between two ranks
    if not (link in LINK_CLASSES and canonical and (int(size) == 2 if pair else int(size) >= 2)):
        raise f.problem(
            f"a {kind} curve is keyed '<link>/<group size>' with link "
            f"{' or '.join(LINK_CLASSES)} and group size {'2' if pair else 'an integer >= 2'}, "
            f"got {key!r}"
        )
    return link, int(size)


def _curve(f: JsonField) -> Curve:
    xs: list[float] = []
    seconds: list[float] = []
    for point in f.elements("a non-empty list of [size, seconds] pairs", min_count=1):
        size, time = point.elements("a [size, seconds] pair", min_count=2, max_count=2)
        x, s = size.positive(), time.seconds()
        if xs and x <= xs[-1]:
            raise point.problem(f"sizes must increase, but {x!r} follows {xs[-1]!r}")
        if seconds and s < seconds[-1]:
            raise point.problem(
                f"seconds must not decrease with size (a curve is monotone), but {s!r} follows "
                f"{seconds[-1]!r}; profile the cluster again"
            )
        xs.append(x)
        seconds.append(s)
    return Curve(tuple(xs), tuple(seconds))


def _fingerprint(f: JsonField) -> Fingerprint:
    f.only(_FINGERPRINT_FIELDS)
    hosts = f["hosts"].elements("a non-empty list of host hashes", min_count=1)
    return Fingerprint(
        device=f["device"].text(non_empty=True),
        device_count=f["device_count"].integer(minimum=1),
        torch=f["torch"].text(non_empty=True),
        driver=f["driver"].text(non_empty=True),
        hosts=tuple(h.text(non_empty=True) for h in hosts),
    )


def warn_if_profiled_elsewhere(
    curves: Measured, where: str, *, backend: str, num_nodes: int, devices_per_node: int
) -> None:
    """Log a warning when the curves of the cluster file `where` were measured on other
    hardware than this machine, with the command that would profile it again."""
    stored = curves.fingerprint
    if stored is None:
        return
    here = machine_fingerprint(backend)
    if not stored.matches(here):
        # a profile without collectives measured one device, on a base cluster file
        how = (
            f"--nproc {devices_per_node} --nnodes {num_nodes}"
            if curves.collectives
            else "--nproc 1 --base BASE.json"
        )
        log.warning(
            "%s was profiled on %s but this machine is %s; its measured curves are still used. "
            "If they no longer describe the cluster, re-profile on it: autoplan profile %s -o %s",
            where,
            stored.describe(),
            here.describe(),
            how,
            where,
        )
