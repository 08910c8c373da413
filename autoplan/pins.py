"""User pins: fix how named parameters are placed.

A pin maps a parameter name (``"layers.0.weight"``), or ``"input:<i>"`` / ``"target"`` for the
step's inputs (``{"input:0": "S(0)", "target": "S(0)"}`` forces data parallelism), to
* a placement per mesh axis, e.g. ``("R", "S(0)")`` or ``"S(0)"`` on a 1-D mesh: the parameter
  is stored that way and every op reads it that way; or
* ``{"storage": ..., "use": ...}``: stored one way and gathered to another before use, e.g.
  ``{"storage": "S(0)", "use": "R"}`` for ZeRO-3 / FSDP. Either key may be left out.
  ``"state"`` places its optimizer state, split where it is stored whole (ZeRO-1/2,
  `autoplan.strategies.zero_state`), and ``"grad"`` its synchronized gradient (the state's
  placement: ZeRO-2): ``{"storage": "R", "state": "S(0)", "grad": "S(0)"}``. A state placed
  as stored (or the storage alone given) keeps it whole; without ``"state"`` the planner
  chooses.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from autoplan.errors import AutoplanError
from autoplan.graph.blocks import BlockSharing
from autoplan.graph.ir import Graph
from autoplan.modes import NodeKind
from autoplan.strategies.placement import Spec, is_placement, on_mesh
from autoplan.strategies.space import NodeStrategies

Pin = str | Sequence[str] | Mapping[str, str | Sequence[str]]


@dataclass(frozen=True)
class ParsedPin:
    param: str  # the FQN the user wrote
    storage: Spec | None
    use: Spec | None
    state: Spec | None = None  # ZeRO-1/2's optimizer state (the storage's: kept whole)
    grad: Spec | None = None  # ZeRO-2's gradient placement


def _spec(value: str | Sequence[str], param: str) -> Spec:
    spec = (value,) if isinstance(value, str) else tuple(value)
    bad = [p for p in spec if not isinstance(p, str) or not is_placement(p)]
    if not spec or bad:
        raise AutoplanError(
            f'pin for {param!r}: {value!r} is not a placement; write one of "R", "S(<dim>)" '
            '(or "S(<dim>)x<pieces>", strided) per mesh axis, e.g. ("R", "S(0)") on a 2-D mesh'
        )
    return spec


def _pinnable(graph: Graph) -> dict[str, str]:
    """Pin key -> node name: parameters by FQN, inputs as input:<i>, the last one also as target."""
    by_key = {n.target: n.name for n in graph if n.kind == NodeKind.PARAM}
    inputs = [n.name for n in graph if n.kind == NodeKind.INPUT]
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
            unknown = set(value) - set(_KEYS)
            if unknown:
                raise AutoplanError(
                    f"pin for {fqn!r} has unknown keys {sorted(unknown)}; use {', '.join(_KEYS)}"
                )
            specs = {k: _spec(v, fqn) for k, v in value.items()}
            if "state" in specs and "storage" not in specs:
                raise AutoplanError(
                    f"pin for {fqn!r} places its state: give its storage too (the state is "
                    'split further than it is stored), e.g. {"storage": "R", "state": "S(0)"}'
                )
            parsed[by_fqn[fqn]] = ParsedPin(fqn, *(specs.get(k) for k in _KEYS))
            continue
        storage = use = _spec(value, fqn)
        parsed[by_fqn[fqn]] = ParsedPin(fqn, storage, use)
    return parsed


_KEYS = ("storage", "use", "state", "grad")


def keep_sharing_consistent(layers: BlockSharing, pins: Mapping[str, ParsedPin]) -> BlockSharing:
    """Repeated layers share decisions only if their copies are pinned alike."""

    def key(name: str) -> ParsedPin | None:
        p = pins.get(name)
        return replace(p, param="") if p else None

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
        for spec in (pin.storage, pin.use, pin.state, pin.grad):
            if spec is not None and len(spec) != len(mesh_shape):
                raise AutoplanError(
                    f"pin for {pin.param!r} gives {len(spec)} placement(s) but the mesh has "
                    f"{len(mesh_shape)} axis(es); give one placement per axis"
                )
        if pin.storage is not None:
            stored = on_mesh(pin.storage, mesh_shape)
            out[name] = _keep(space[name], lambda s, spec=stored: s.output == spec, pin, "stored")
            if pin.state is not None or pin.grad is not None:
                zero = _zero_pin(pin, mesh_shape)
                out[name] = _keep(
                    out[name],
                    lambda s, z=zero: (s.state, s.grad) == z,
                    pin,
                    "with that state and gradient",
                )
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


def _zero_pin(pin: ParsedPin, mesh_shape: tuple[int, ...]) -> tuple[Spec | None, Spec | None]:
    """The (state, grad) of the strategies a pin's ZeRO-1/2 keys keep: a state placed as
    stored is no split (None); a gradient placed as stored is ZeRO-1's (None)."""
    assert pin.storage is not None
    stored = on_mesh(pin.storage, mesh_shape)
    state = on_mesh(pin.state, mesh_shape) if pin.state is not None else stored
    grad = on_mesh(pin.grad, mesh_shape) if pin.grad is not None else stored
    if grad not in (stored, state):
        raise AutoplanError(
            f"pin for {pin.param!r}: its gradient is kept as stored (ZeRO-1) or as its state "
            f"(ZeRO-2), not {pin.grad}"
        )
    return (None if state == stored else state), (None if grad == stored else grad)


def _keep(ns: NodeStrategies, ok: object, pin: ParsedPin, what: str) -> NodeStrategies:
    kept = tuple(s for s in ns.strategies if ok(s))  # type: ignore[operator]
    if not kept:
        raise AutoplanError(
            f"pin for {pin.param!r} cannot hold: no strategy of {ns.node} has it {what} as "
            f"storage={pin.storage} use={pin.use}"
            + (f" state={pin.state} grad={pin.grad}" if pin.state or pin.grad else "")
            + " (a split must divide the dim evenly and the op must support it; a state is "
            "split along the first dim its storage leaves whole that divides evenly, else the "
            "largest, unevenly)"
        )
    return replace(ns, strategies=kept)
