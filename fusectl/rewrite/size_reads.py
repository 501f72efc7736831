"""Shapes read from values a fusion removes, read instead from values that stay.

A subgraph often reads the shape of an intermediate of the computation a pass fuses: XLNet's
relative shift takes the key length from the attention scores (``klen = ac.shape[3]``). The
scores go with the fusion, the shift does not, so the fusion would have to keep the product
that computes them. But each size is copied from somewhere (size_sources: a MatMul's rows from
its first operand, element-wise ops from their inputs ...), and is read from there instead:
each ``x.shape[i]`` (a Gather of the Shape) from its copy's Shape, a Shape read whole as a
Concat of those sizes (constants where static).

A value the fused op computes itself can be read ahead of it too: GPT-2's mask takes the key
length from the KV cache's present (``present.shape[2]``), and the fused op that now computes
the present reads the mask. Such a size along the cache's Concat axis is the sum of its parts'
(the past's and the new keys'), read from those.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from fusectl.rewrite.axes import input_axis_name, size_sources, symbolic_size
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_value, new_constant, new_unsqueeze, typed
from fusectl.rewrite.shapes import named

# Shape's start and end attributes came with opset 15.
_SHAPE_RANGE_OPSET = 15

# A size: (value, axis) it is read from, a static size, or a sum of sizes (a Concat's axis).
Part = tuple[ir.Value, int] | int | list["Part"]


def size_reads(
    ctx: PassContext,
    nodes: Sequence[ir.Node],
    outputs: Sequence[ir.Value],
    kept: Collection[ir.Value] = (),
    taken: Collection[ir.Value] = (),
) -> dict[ir.Node, list[Part]] | None:
    """The Shapes outside ``nodes`` that read a value the nodes compute (other than the
    ``outputs`` a fusion replaces, except the ``taken`` ones: outputs computed before the root,
    which a size read ahead of the fused op may need), each with where its sizes can be read
    instead: static, copied from a value no matched node computes, one of the ``kept`` ones
    (the fused op's inputs) first, or summed over a Concat's parts. None where some size has no
    such source."""
    members = set(nodes)
    found: dict[ir.Node, list[Part]] = {}
    for node in nodes:
        for value in node.outputs:
            if value in outputs and value not in taken:
                continue
            for reader, _ in value.uses():
                if reader in members or reader.op_type != "Shape" or reader in found:
                    continue
                parts = _sources(ctx, reader, value, members, kept)
                if parts is None:
                    return None
                found[reader] = parts
    return found


def _sources(
    ctx: PassContext,
    reader: ir.Node,
    value: ir.Value,
    members: set[ir.Node],
    kept: Collection[ir.Value],
) -> list[Part] | None:
    """Where each size ``reader`` reads of ``value`` can be read instead (_source)."""
    shape = ctx.shape(value)
    if shape is None:
        return None
    rank = len(shape)
    start = reader.attributes.get_int("start", 0)
    end = reader.attributes.get_int("end", rank)
    graph = reader.graph
    read: list[list[ir.Value]] = []

    def inputs() -> list[ir.Value]:  # a walk of the graph: only for a size no copy gives
        if not read:
            read.append(_inputs_read(graph) if graph is not None else [])
        return read[0]

    parts = [_source(ctx, value, axis, members, kept, inputs) for axis in range(rank)[start:end]]
    return None if None in parts else parts  # type: ignore[return-value]


def _inputs_read(graph: ir.Graph) -> list[ir.Value]:
    """The graph's inputs, and for an If branch or a loop body the enclosing graphs' inputs it
    reads (Optimum's merged decoder reads input_ids from inside its branches)."""
    found = dict.fromkeys(graph.inputs)
    for node in graph:
        for value in node.inputs:
            if value is not None and value.is_graph_input():
                found.setdefault(value)
    return list(found)


def _source(
    ctx: PassContext,
    value: ir.Value,
    axis: int,
    members: set[ir.Node],
    kept: Collection[ir.Value],
    inputs: Callable[[], list[ir.Value]],
) -> Part | None:
    """A static size; else a copy of it that stays for sure: a graph input's axis of that one
    named size (every layer reads that one, and the reads merge), one the fused op reads;
    else the farthest copy outside the fused nodes (the nearer ones may live only for them,
    and a later fusion may take the farthest); else, for a matched Concat, a part's size (the
    sum of its parts' along its axis)."""
    shape = ctx.shape(value)
    dim = shape[axis] if shape is not None else None
    if isinstance(dim, int):
        return dim
    maker = value.producer()
    if maker is None or maker not in members:
        return value, axis  # stays: the graph's or computed outside the fused nodes
    if dim is None:
        return None
    copies = [
        (source, index)
        for source, index in size_sources(ctx, value, axis)[1:]
        if (producer := source.producer()) is None
        or (producer.graph is not None and producer not in members)
    ]
    given = named_input_axis(ctx, value, axis, inputs)
    if given is not None:
        return given
    read = next(((source, index) for source, index in copies if source in kept), None)
    if read is not None:
        return read
    if copies:
        return copies[-1]
    # A matched Concat: along its axis the sum of its parts' sizes, off it any part's.
    if maker.op_type != "Concat" or maker.domain not in ("", "ai.onnx") or None in maker.inputs:
        return None
    parts = [_source(ctx, operand, axis, members, kept, inputs) for operand in maker.inputs]  # type: ignore[arg-type]
    if maker.attributes.get_int("axis", 0) % len(shape) != axis:  # type: ignore[arg-type]
        return next((part for part in parts if part is not None), None)
    if None in parts:
        return None
    if all(isinstance(part, int) for part in parts):
        return sum(parts)  # type: ignore[arg-type]
    return parts  # type: ignore[return-value]


def named_input_axis(
    ctx: PassContext, value: ir.Value, axis: int, inputs: Callable[[], list[ir.Value]]
) -> tuple[ir.Value, int] | None:
    """The axis of one of the ``inputs`` (asked for only where needed: it may walk the graph)
    that has the one named size ``value`` has along ``axis``: equal names, equal sizes."""
    size = symbolic_size(ctx, value, axis)
    if size is None or size[0] != 1 or len(size[1]) != 1:
        return None
    for given in inputs():
        for index, input_dim in enumerate(given.shape or ()):
            if named(input_dim) and input_dim.value == size[1][0]:  # type: ignore[union-attr]
                return given, index
            if input_axis_name(given, index) == size[1][0]:
                return given, index
    return None


class Reread(NamedTuple):
    """A Shape read again: the new nodes, the readers of the Shape they replace too, the values
    replaced, each by the new value at its position, and the nodes reading the sizes (new or
    already there) that must come before the replaced values' readers."""

    nodes: list[ir.Node]
    replaced_nodes: list[ir.Node]
    replaced: list[ir.Value]
    values: list[ir.Value]
    reading: list[ir.Node]


def read_again(
    ctx: PassContext,
    graph: ir.Graph,
    name: str,
    reader: ir.Node,
    parts: list[Part],
    removed: Collection[ir.Node] = (),
) -> Reread:
    """The Shape ``reader`` read again from ``parts``. Where each of its readers takes one
    size (Gather of a constant scalar index, TorchScript's ``x.shape[i]``), that Gather reads
    it from its source's Shape (a static size: a constant), the Shape and Gather already in the
    graph where there are such and they are not among the ``removed`` nodes (a second run then
    finds nothing to merge); else the whole shape is rebuilt (_Sizes.joined)."""
    shape = reader.outputs[0]
    users = [user for user, _ in shape.uses()]
    picks = [_picked(user, len(parts)) for user in users]
    build = _Sizes(ctx, graph, name, set(removed))
    if shape.is_graph_output() or not users or None in picks:
        built = build.joined(parts)
        reading = list(dict.fromkeys([*build.reading, *built]))  # what a sum reused too
        return Reread(built, [], [shape], [built[-1].outputs[0]], reading)
    forwards: list[ir.Node] = []
    for index in picks:
        size = build.scalar(parts[index])  # type: ignore[index]
        forwards.append(ir.node("Identity", [size]))  # bypassed once it replaces the Gather
        typed(forwards[-1].outputs[0], ir.DataType.INT64, ir.Shape([]))
    values = [node.outputs[0] for node in forwards]
    return Reread(
        build.made + forwards, users, [user.outputs[0] for user in users], values, build.reading
    )


@dataclass
class _Sizes:
    """Builds sizes as nodes: ``made`` the new ones, ``reading`` those (new or already there)
    that must come before the replaced values' readers, never reusing a ``removed`` node."""

    ctx: PassContext
    graph: ir.Graph
    name: str
    removed: set[ir.Node]
    made: list[ir.Node] = field(default_factory=list)
    reading: list[ir.Node] = field(default_factory=list)

    def scalar(self, part: Part) -> ir.Value:
        """One size as an int64 scalar: a constant, a read (size_of), or the Add of a sum's."""
        if isinstance(part, int):
            return new_constant(self.graph, f"{self.name}/size", np.array(part, np.int64))
        if isinstance(part, tuple):
            return self.size_of(*part)
        total = self.scalar(part[0])
        for term in part[1:]:
            add = ir.node("Add", [total, self.scalar(term)])
            typed(add.outputs[0], ir.DataType.INT64, ir.Shape([]))
            self.made.append(add)
            self.reading.append(add)
            total = add.outputs[0]
        return total

    def size_of(self, source: ir.Value, axis: int) -> ir.Value:
        """``source.shape[axis]`` as a scalar, read by the Shape and Gather of source already
        there in this graph (made earlier by this pass too), else by new ones."""
        shape = next(
            (
                user
                for user, _ in source.uses()
                if user.op_type == "Shape"
                and not user.attributes
                and user.graph is self.graph  # an outer value's readers live elsewhere
                and user not in self.removed
            ),
            None,
        )
        if shape is None:
            shape = ir.node("Shape", [source])
            rank = len(source_shape) if (source_shape := self.ctx.shape(source)) else None
            typed(shape.outputs[0], ir.DataType.INT64, ir.Shape([rank]))
            self.made.append(shape)
        rank = shape.outputs[0].shape[0] if shape.outputs[0].shape else None
        length = rank if isinstance(rank, int) else axis + 1
        gather = next(
            (
                user
                for user, index in shape.outputs[0].uses()
                if index == 0 and user not in self.removed and _picked(user, length) == axis
            ),
            None,
        )
        if gather is None:
            position = new_constant(self.graph, f"{self.name}/axis", np.array(axis, np.int64))
            gather = ir.node("Gather", [shape.outputs[0], position], attributes={"axis": 0})
            typed(gather.outputs[0], ir.DataType.INT64, ir.Shape([]))
            self.made.append(gather)
        self.reading += [node for node in (shape, gather) if node not in self.reading]
        return gather.outputs[0]

    def joined(self, parts: list[Part]) -> list[ir.Node]:
        """Nodes computing the 1-D shape ``parts`` describe, the last one giving it: runs of one
        value's consecutive sizes read with one Shape (or Shape then Gather below opset 15),
        the static sizes one constant each, a sum as its scalar, joined by a Concat."""
        runs: list[list[Part]] = []
        for part in parts:
            last = runs[-1][-1] if runs else None
            follows = (
                isinstance(part, tuple)
                and isinstance(last, tuple)
                and part[0] is last[0]
                and part[1] == last[1] + 1
            )
            if follows:
                runs[-1].append(part)
            else:
                runs.append([part])
        ctx, graph, name = self.ctx, self.graph, self.name
        pieces: list[ir.Value] = []
        for index, run in enumerate(runs):
            first = run[0]
            if isinstance(first, int):
                sizes = np.array([first], np.int64)
                pieces.append(new_constant(graph, f"{name}/size_{index}", sizes))
                continue
            if isinstance(first, list):  # a sum: its scalar as a 1-element piece
                total = self.scalar(first)
                axes = f"{name}/sum_axes_{index}"
                self.made.append(new_unsqueeze(ctx, graph, total, [0], axes))
                typed(self.made[-1].outputs[0], ir.DataType.INT64, ir.Shape([1]))
                pieces.append(self.made[-1].outputs[0])
                continue
            source, axis = first  # type: ignore[misc]
            if ctx.opset >= _SHAPE_RANGE_OPSET:
                end = axis + len(run)
                read = [ir.node("Shape", [source], attributes={"start": axis, "end": end})]
            else:
                positions = np.arange(axis, axis + len(run), dtype=np.int64)
                taken = new_constant(graph, f"{name}/axes_{index}", positions)
                whole = ir.node("Shape", [source])
                read = [whole, ir.node("Gather", [whole.outputs[0], taken], attributes={"axis": 0})]
            typed(read[0].outputs[0], ir.DataType.INT64, None)
            typed(read[-1].outputs[0], ir.DataType.INT64, ir.Shape([len(run)]))
            self.made += read
            pieces.append(read[-1].outputs[0])
        joined = ir.node("Concat", pieces, attributes={"axis": 0})
        typed(joined.outputs[0], ir.DataType.INT64, ir.Shape([len(parts)]))
        return [*self.made, joined]


def shape_nodes(ctx: PassContext, graph: ir.Graph, name: str, parts: list[Part]) -> list[ir.Node]:
    """New nodes computing the 1-D shape ``parts`` describe, the last one giving it."""
    return _Sizes(ctx, graph, name, set()).joined(parts)


def read_axes(reader: ir.Node, rank: int) -> list[int]:
    """The axes whose sizes the readers of the Shape ``reader`` (of a rank-``rank`` value)
    take: the ones they pick, where each picks one (``x.shape[i]``); else all of them."""
    shape = reader.outputs[0]
    picks = [_picked(user, rank) for user, _ in shape.uses()]
    if shape.is_graph_output() or not picks or None in picks:
        return list(range(rank))
    return sorted(set(picks))  # type: ignore[type-var]


def _picked(user: ir.Node, length: int) -> int | None:
    """The size a Gather(shape, i) of a constant scalar i takes, where it is one."""
    if user.op_type != "Gather" or user.domain not in ("", "ai.onnx") or len(user.inputs) < 2:
        return None
    index = constant_value(user.inputs[1])
    if user.attributes.get_int("axis", 0) != 0 or index is None or index.ndim != 0:
        return None
    position = int(index)
    return position % length if -length <= position < length else None


def move_before_readers(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Move ``nodes`` (in their order) in front of the first node outside them that reads
    one of their outputs, which a replacement placed them after: the graph stays sorted."""
    moved = set(nodes)
    readers = {user for node in nodes for v in node.outputs for user, _ in v.uses()} - moved
    first = next((node for node in graph if node in readers), None)
    if first is None:
        return
    graph.remove(nodes)
    graph.insert_before(first, nodes)
