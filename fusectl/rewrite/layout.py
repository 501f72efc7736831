"""What a chain of Reshapes and Transposes computes, read off where the source's elements go.

Every axis is followed as a list of pieces of the source's axes, in row-major order: a Reshape
regroups the pieces (dividing one where a size falls inside it), a Transpose reorders the axes.
Sizes are products of static and named dimensions (``sizes.Size``), so a conclusion holds for
every size the model takes. The chain is then one Transpose when each result axis is exactly
one source axis, one Reshape when the source's order is kept.
"""

from __future__ import annotations

import itertools

import onnx_ir as ir

from fusectl.rewrite.axes import symbolic_size
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.graph import constant_value, node_axes, transpose_perm
from fusectl.rewrite.sizes import Size, product, quotient

_ONE: Size = (1, ())


def _times(a: Size, b: Size) -> Size:
    result = product(a, b)
    assert result is not None  # only None for an unknown factor
    return result


class Layout:
    """Each axis of a value as a list of pieces of the source's axes. A piece a Reshape
    divides is refined into sub-pieces wherever it appears."""

    def __init__(self, sizes: list[Size]) -> None:
        self._ids = itertools.count()
        self.size: dict[int, Size] = {}
        self.parts: dict[int, list[int]] = {}
        self.axes = [[self._piece(size)] if size != _ONE else [] for size in sizes]
        self.source = [list(axis) for axis in self.axes]

    def _piece(self, size: Size) -> int:
        piece = next(self._ids)
        self.size[piece] = size
        return piece

    def leaves(self, pieces: list[int]) -> list[int]:
        result: list[int] = []
        for piece in pieces:
            result += self.leaves(self.parts[piece]) if piece in self.parts else [piece]
        return result

    def axis_size(self, axis: list[int]) -> Size:
        total = _ONE
        for piece in self.leaves(axis):
            total = _times(total, self.size[piece])
        return total

    def transpose(self, perm: list[int]) -> bool:
        if sorted(perm) != list(range(len(self.axes))):
            return False
        self.axes = [self.axes[axis] for axis in perm]
        return True

    def unsqueeze(self, axes: list[int]) -> bool:
        """Insert unit axes at ``axes`` of the result."""
        rank = len(self.axes) + len(axes)
        positions = sorted(axis % rank for axis in axes if -rank <= axis < rank)
        if len(set(positions)) != len(axes):
            return False
        for position in positions:
            self.axes.insert(position, [])
        return True

    def squeeze(self, axes: list[int] | None) -> bool:
        """Remove ``axes`` (every unit axis where None), each of size 1 for every size the
        model takes: a size-1 axis is squeezed only where it has no named factor."""
        rank = len(self.axes)
        sizes = [self.axis_size(axis) for axis in self.axes]
        if axes is None:
            if any(size[1] for size in sizes):
                return False
            axes = [axis for axis, size in enumerate(sizes) if size == _ONE]
        positions = {axis % rank for axis in axes if -rank <= axis < rank}
        if len(positions) != len(axes) or any(sizes[axis] != _ONE for axis in positions):
            return False
        self.axes = [axis for position, axis in enumerate(self.axes) if position not in positions]
        return True

    def reshape(self, sizes: list[Size]) -> bool:
        """Regroup the pieces, in order, into axes of ``sizes``; False when a boundary is not
        proven (a size that is no product of whole or divided pieces)."""
        pending = [leaf for axis in self.axes for leaf in self.leaves(axis)]
        axes: list[list[int]] = []
        for size in sizes:
            axis: list[int] = []
            need: Size | None = size
            while need != _ONE:
                if need is None or not pending:
                    return False
                leaf = pending.pop(0)
                rest = quotient(need, self.size[leaf])
                if rest is not None:
                    axis.append(leaf)
                    need = rest
                    continue
                remainder = quotient(self.size[leaf], need)
                if remainder is None:
                    return False
                head, tail = self._piece(need), self._piece(remainder)
                self.parts[leaf] = [head, tail]
                axis.append(head)
                pending.insert(0, tail)
                need = _ONE
            axes.append(axis)
        if pending:
            return False
        self.axes = axes
        return True

    def as_transpose(self) -> list[int] | None:
        """The permutation of the source's axes this layout is, when each axis is one of them
        (unit axes, which hold no piece, matched in order)."""
        if len(self.axes) != len(self.source):
            return None
        wanted = [self.leaves(axis) for axis in self.source]
        unit = [j for j, leaves in enumerate(wanted) if not leaves]
        perm: list[int] = []
        for axis in self.axes:
            leaves = self.leaves(axis)
            if not leaves:
                if not unit:
                    return None
                perm.append(unit.pop(0))
            elif leaves in wanted:
                perm.append(wanted.index(leaves))
            else:
                return None
        return perm if len(set(perm)) == len(perm) else None

    def as_reshape(self) -> list[int] | None:
        """A Reshape target for this layout when it keeps the source's order: static sizes as
        they are, 0 where an axis is the source's axis at the same position, one -1 for the
        rest."""
        return self._reshape_target(self.axes)

    def _reshape_target(self, axes: list[list[int]]) -> list[int] | None:
        flat = [leaf for axis in self.source for leaf in self.leaves(axis)]
        if [leaf for axis in axes for leaf in self.leaves(axis)] != flat:
            return None
        target: list[int] = []
        for position, axis in enumerate(axes):
            size = self.axis_size(axis)
            source = self.source[position] if position < len(self.source) else None
            if not size[1]:
                target.append(size[0])
            elif source is not None and self.leaves(source) == self.leaves(axis):
                target.append(0)
            else:
                target.append(-1)
        return target if target.count(-1) <= 1 else None

    def as_reshape_transpose(self) -> tuple[list[int], list[int]] | None:
        """(Reshape target, perm) when this layout is a Reshape of the source that keeps its
        order, then a Transpose: each axis one run of the source's pieces (a head split: the
        runs regrouped, then reordered). A unit axis, which holds no piece, goes just before
        the next axis that does (a batch of 1 stays in front of the heads)."""
        flat = [leaf for axis in self.source for leaf in self.leaves(axis)]
        runs = [self.leaves(axis) for axis in self.axes]
        if not any(runs):
            return None
        starts = [flat.index(run[0]) if run and run[0] in flat else -1 for run in runs]
        following = len(flat)
        for axis in reversed(range(len(runs))):  # a unit axis: the start of the next run
            if runs[axis]:
                following = starts[axis]
            else:
                starts[axis] = following
        order = sorted(range(len(runs)), key=lambda axis: (starts[axis], bool(runs[axis])))
        if [leaf for axis in order for leaf in runs[axis]] != flat:
            return None
        target = self._reshape_target([self.axes[axis] for axis in order])
        perm = [order.index(axis) for axis in range(len(runs))]
        return None if target is None else (target, perm)


def _reshape_sizes(ctx: PassContext, layout: Layout, node: ir.Node) -> list[Size] | str | None:
    """A Reshape's result sizes: from a constant target (0 copies the axis at the same
    position, -1 takes what is left), else traced as ``symbolic_size`` traces them (a target
    computed at run time from the model's dimensions). A reason when the sizes are unknown,
    None when the target cannot hold in the layout."""
    target = constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if target is None:
        shape = ctx.shape(node.outputs[0])
        traced = [symbolic_size(ctx, node.outputs[0], axis) for axis in range(len(shape or []))]
        if shape is None or None in traced:
            return "a Reshape in the chain has a target neither constant nor traced"
        return [size for size in traced if size is not None]
    if target.ndim != 1 or (node.attributes.get_int("allowzero", 0) and (target == 0).any()):
        return None
    current = [layout.axis_size(axis) for axis in layout.axes]
    sizes: list[Size | None] = []
    for position, value in enumerate(int(v) for v in target):
        if value == 0 and position < len(current):
            sizes.append(current[position])
        elif value == -1:
            sizes.append(None)
        elif value > 0:
            sizes.append((value, ()) if value != 1 else _ONE)
        else:
            return None
    if sizes.count(None) == 1:
        total, known = _ONE, _ONE
        for size in current:
            total = _times(total, size)
        for size in sizes:
            known = _times(known, size) if size is not None else known
        sizes[sizes.index(None)] = quotient(total, known)
    if None in sizes:
        return None
    return [size for size in sizes if size is not None]


# Names for sizes nothing traces: each its own, never equal to another's (a size unknown in
# one layout is not the size unknown in another).
_UNKNOWN = (f"?{n}" for n in itertools.count())


def origin(ctx: PassContext, source: ir.Value) -> Layout | str:
    """``source``'s own layout, one piece per axis; a reason where its rank is unknown."""
    shape = ctx.shape(source)
    if shape is None:
        return "the rank of the chain's input is unknown"
    sizes: list[Size] = []
    for axis, dim in enumerate(shape):
        if dim == 0:
            return "the chain's input is empty"
        size = symbolic_size(ctx, source, axis)
        sizes.append(size if size is not None else (1, (next(_UNKNOWN),)))
    return Layout([_ONE if size == (1, ()) else size for size in sizes])


def advance(ctx: PassContext, layout: Layout, node: ir.Node) -> bool | str:
    """Apply one Reshape, Transpose, Unsqueeze or Squeeze to ``layout``: True, a reason when
    the op cannot be read (a target of unknown sizes, axes computed at run time), False when
    it is not proven to regroup whole pieces."""
    if node.op_type == "Transpose":
        order = transpose_perm(node, len(layout.axes))
        return order is not None and layout.transpose(order)
    if node.op_type in ("Unsqueeze", "Squeeze"):
        axes = node_axes(node)
        computed = len(node.inputs) > 1 and node.inputs[1] is not None
        if axes is None and (node.op_type == "Unsqueeze" or computed):
            return f"a {node.op_type} in the chain has axes that are not constant"
        return layout.unsqueeze(axes) if node.op_type == "Unsqueeze" else layout.squeeze(axes)
    sizes = _reshape_sizes(ctx, layout, node)
    if sizes is None or isinstance(sizes, str):
        return sizes or False
    return layout.reshape(sizes)


def follow(ctx: PassContext, source: ir.Value, chain: list[ir.Node]) -> Layout | str | None:
    """The layout ``chain`` (Reshapes, Transposes, Unsqueezes and Squeezes, each reading the
    previous) gives ``source``'s elements; a reason when the chain cannot be read (an unknown
    rank, a target of unknown sizes), None when a step is not proven to regroup whole pieces."""
    layout = origin(ctx, source)
    if isinstance(layout, str):
        return layout
    for node in chain:
        moved = advance(ctx, layout, node)
        if moved is not True:
            return moved or None
    return layout
