"""User pins: fix how named parameters are placed.

A pin maps a parameter name (``"layers.0.weight"``), or ``"input:<i>"`` / ``"target"`` for the
step's inputs (``{"input:0": "S(0)", "target": "S(0)"}`` forces data parallelism), to
* a placement per mesh axis, e.g. ``("R", "S(0)")`` or ``"S(0)"`` on a 1-D mesh: the parameter
  is stored that way and every op reads it that way; or
* ``{"storage": ..., "use": ...}``: stored one way and gathered to another before use, e.g.
  ``{"storage": "S(0)", "use": "R"}`` for ZeRO-3 / FSDP. Either key may be left out.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from autoplan.errors import AutoplanError
from autoplan.graph.blocks import BlockSharing
from autoplan.graph.ir import INPUT, PARAM, Graph
from autoplan.strategies.placement import Spec, is_placement, on_mesh
from autoplan.strategies.space import NodeStrategies

Pin = str | Sequence[str] | Mapping[str, str | Sequence[str]]


@dataclass(frozen=True)
class ParsedPin:
    param: str  # the FQN the user wrote
    storage: Spec | None
    use: Spec | None


def _spec(value: str | Sequence[str], param: str) -> Spec:
    spec = (value,) if isinstance(value, str) else tuple(value)
    bad = [p for p in spec if not isinstance(p, str) or not is_placement(p)]
    if not spec or bad:
        raise AutoplanError(
            f'pin for {param!r}: {value!r} is not a placement; write one of "R", "S(<dim>)" '
            'per mesh axis, e.g. ("R", "S(0)") on a 2-D mesh'
        )
    return spec


def _pinnable(graph: Graph) -> dict[str, str]:
    """Pin key -> node name: parameters by FQN, inputs as input:<i>, the last one also as target."""
    by_key = {n.target: n.name for n in graph if n.kind == PARAM}
    inputs = [n.name for n in graph if n.kind == INPUT]
    by_key.update({f"input:{i}": name for i, name in enumerate(inputs)})
    if inputs:
        by_key["target"] = inputs[-1]
    return by_key


def parse_pins(pins: Mapping[str, Pin], graph: Graph) -> dict[str, ParsedPin]:
    """Pins keyed by node name; unknown names and bad placements are errors."""
    by_fqn = _pinnable(graph)
    parsed = {}
    for fqn, value in sorted(pins.items()):
        if fqn not in by_fqn:
            close = difflib.get_close_matches(fqn, list(by_fqn), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise AutoplanError(
                f"pin names {fqn!r}, which is not a parameter of the model (nor input:<i> or "
                f"target){hint}"
            )
        if isinstance(value, Mapping):
            unknown = set(value) - {"storage", "use"}
            if unknown:
                raise AutoplanError(
                    f"pin for {fqn!r} has unknown keys {sorted(unknown)}; use storage, use"
                )
            storage = _spec(value["storage"], fqn) if "storage" in value else None
            use = _spec(value["use"], fqn) if "use" in value else None
        else:
            storage = use = _spec(value, fqn)
        parsed[by_fqn[fqn]] = ParsedPin(fqn, storage, use)
    return parsed


def keep_sharing_consistent(layers: BlockSharing, pins: Mapping[str, ParsedPin]) -> BlockSharing:
    """Repeated layers share decisions only if their copies are pinned alike."""

    def key(name: str) -> tuple[Spec | None, Spec | None] | None:
        p = pins.get(name)
        return (p.storage, p.use) if p else None

    if all(key(n) == key(rep) for n, rep in layers.canonical.items()):
        return layers
    return replace(layers, canonical={})


def apply_pins(
    space: dict[str, NodeStrategies],
    graph: Graph,
    pins: Mapping[str, ParsedPin],
    mesh_shape: tuple[int, ...],
) -> dict[str, NodeStrategies]:
    """Keep only the strategies that agree with the pins (on nodes present in ``space``). A
    pin's placement on an axis of size 1 is met by "R" there (`on_mesh`)."""
    out = dict(space)
    for name, pin in pins.items():
        if name not in space:
            continue  # a copy of a repeated layer: its representative carries the same pin
        for spec in (pin.storage, pin.use):
            if spec is not None and len(spec) != len(mesh_shape):
                raise AutoplanError(
                    f"pin for {pin.param!r} gives {len(spec)} placement(s) but the mesh has "
                    f"{len(mesh_shape)} axis(es); give one placement per axis"
                )
        if pin.storage is not None:
            stored = on_mesh(pin.storage, mesh_shape)
            out[name] = _keep(space[name], lambda s, spec=stored: s.output == spec, pin, "stored")
        if pin.use is not None:
            used = on_mesh(pin.use, mesh_shape)
            for user in graph.users(name):
                if user not in out:
                    continue
                slots = [i for i, r in enumerate(graph.node(user).refs) if r.name == name]
                out[user] = _keep(
                    out[user],
                    lambda s, spec=used, slots=slots: all(s.inputs[i] == spec for i in slots),
                    pin,
                    f"read by {user}",
                )
    return out


def _keep(ns: NodeStrategies, ok: object, pin: ParsedPin, what: str) -> NodeStrategies:
    kept = tuple(s for s in ns.strategies if ok(s))  # type: ignore[operator]
    if not kept:
        raise AutoplanError(
            f"pin for {pin.param!r} cannot hold: no strategy of {ns.node} has it {what} as "
            f"storage={pin.storage} use={pin.use} (a split must divide the dim evenly and the "
            "op must support it)"
        )
    return replace(ns, strategies=kept)
