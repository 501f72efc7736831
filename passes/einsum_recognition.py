"""A MatMul between chains of layout ops is the Einsum it computes, written as one.

tf2onnx takes every Einsum apart (Keras's attention, ``aecd,abcd->acbe`` for the scores): each
operand unsqueezed and transposed to [batch..., rows, k] or [batch..., k, columns], the batch
axes folded into one by a Reshape whose target is computed at run time (Shape, Gather,
ReduceProd, Concat), a 3-D MatMul, the product unfolded (the Max of both batch sizes) and
squeezed. The attention passes read none of it.

What the chains compute is read off where each axis's elements go (``fusectl.rewrite.layout``,
the run-time targets traced symbolically), not off how tf2onnx spells them. Where every operand
axis reaches the MatMul whole, and every result axis is one whole axis of an operand, the site
computes an Einsum over those axes: one node, which EinsumMatMulCanonicalizationPass then
writes as the Transposes and MatMul the attention passes read (only such an Einsum is
written). Each operand's chain is read from as far back as that holds (a head split before it
divides an axis, so it stays), the product's up to the last point where it holds (a head merge
after it joins two). The Shapes of the site's values go with it where only its Reshape targets
read them, and are read from the operands' axes where something else does.

A site the fusions read as it is stays: Transposes alone, or fairseq's heads folded into the
batch for 3-D MatMuls, which the attention passes follow from the scores through the Softmax to
the context (rewriting one of the two products would leave them a layout they do not).
"""

from __future__ import annotations

import string

import onnx_ir as ir

from fusectl.rewrite.context import PassContext
from fusectl.rewrite.einsum import plan
from fusectl.rewrite.graph import (
    DEFAULT_DOMAINS,
    absorb_shape_arithmetic,
    disconnect,
    node_label,
    replace_subgraph,
    typed,
)
from fusectl.rewrite.layout import Layout, advance, follow, origin
from fusectl.rewrite.registry import Category, FusionPass, PassSpec, register_pass
from fusectl.rewrite.size_reads import Part, move_before_readers, read_again, read_axes

_PATTERN = "EinsumRecognition"
_LAYOUT_OPS = ("Reshape", "Transpose", "Unsqueeze", "Squeeze")


def _layout_op(node: ir.Node | None, graph: ir.Graph) -> bool:
    return (
        node is not None
        and node.op_type in _LAYOUT_OPS
        and node.domain in DEFAULT_DOMAINS
        and node.graph is graph
    )


def _only_next(value: ir.Value, reader: ir.Node) -> bool:
    """Whether ``value`` goes on only into ``reader``'s data input, besides Shapes of it (the
    run-time targets the chain's Reshapes compute)."""
    if value.is_graph_output():
        return False
    readers = [(node, index) for node, index in value.uses() if node.op_type != "Shape"]
    return readers == [(reader, 0)]


def _operand_chain(value: ir.Value, graph: ir.Graph) -> list[ir.Node]:
    """The layout ops in front of a MatMul operand, furthest first, each read only by the next."""
    chain: list[ir.Node] = []
    reader = None
    while True:
        node = value.producer()
        if not _layout_op(node, graph) or (reader is not None and not _only_next(value, reader)):
            return chain
        assert node is not None and node.inputs[0] is not None
        chain.insert(0, node)
        reader, value = node, node.inputs[0]


def _product_chain(matmul: ir.Node, graph: ir.Graph) -> list[ir.Node]:
    """The layout ops after the MatMul, nearest first, each reading only the one before."""
    chain: list[ir.Node] = []
    value = matmul.outputs[0]
    while True:
        readers = [node for node, _ in value.uses() if node.op_type != "Shape"]
        node = readers[0] if len(readers) == 1 else None
        if not _layout_op(node, graph) or not _only_next(value, node):  # type: ignore[arg-type]
            return chain
        assert node is not None
        chain.append(node)
        value = node.outputs[0]


def _read_as_is(ctx: PassContext, nodes: list[ir.Node]) -> bool:
    """Whether the fusions read the site as it is: Transposes alone, or heads folded into the
    batch and back between 4-D and 3-D (fairseq's attention), which the attention passes
    follow. tf2onnx's 5-D detours and the 2-D flattening of a tensordot they do not."""
    if all(node.op_type in ("Transpose", "MatMul") for node in nodes):
        return True
    shapes = [ctx.shape(value) for node in nodes for value in [*node.inputs[:1], node.outputs[0]]]
    return all(shape is not None and len(shape) in (3, 4) for shape in shapes)


def _whole_axes(layout: Layout) -> bool:
    """Whether each axis is one piece and no piece was divided (an Einsum's output has no
    axis that is no operand's)."""
    return not layout.parts and all(len(axis) == 1 for axis in layout.axes)


# Where each axis of a value in a site is read from once the site is one Einsum: an operand's
# axis (value, axis), a static size, or None (axes merged).
Copies = dict[ir.Value, list[Part | None]]


def _copies(layout: Layout, whole: dict[int, tuple[ir.Value, int]]) -> list[Part | None]:
    """Each axis of ``layout`` as a source axis it is whole, a static size, or None."""
    found: list[Part | None] = []
    for axis in layout.axes:
        leaves = layout.leaves(axis)
        size = layout.axis_size(axis)
        if not size[1]:
            found.append(size[0])
        elif len(leaves) == 1 and leaves[0] in whole:
            found.append(whole[leaves[0]])
        else:
            found.append(None)
    return found


def _operand(
    ctx: PassContext, value: ir.Value, chain: list[ir.Node]
) -> tuple[ir.Value, list[ir.Node], Layout] | str:
    """The furthest source the chain to the MatMul operand ``value`` reaches whose every axis
    arrives whole, the chain from it and the layout it gives; why none (the operand itself,
    tried last, arrives whole unless its rank is unknown or an axis has size 1)."""
    reason = ""
    for start in range(len(chain) + 1):
        source = chain[start].inputs[0] if start < len(chain) else value
        assert source is not None
        layout = follow(ctx, source, chain[start:])
        if isinstance(layout, str):
            reason = layout
        elif layout is not None and not all(layout.source):
            reason = "an operand has an axis of size 1"
        elif layout is not None and not layout.parts:
            return source, chain[start:], layout
    return reason


def _chain_copies(ctx: PassContext, source: ir.Value, chain: list[ir.Node]) -> Copies:
    """Where each size of each value the chain computes is read from: ``source``'s axes."""
    layout = origin(ctx, source)
    assert not isinstance(layout, str)
    whole = {axis[0]: (source, index) for index, axis in enumerate(layout.source) if axis}
    copies: Copies = {}
    for node in chain:
        advance(ctx, layout, node)
        copies[node.outputs[0]] = _copies(layout, whole)
    return copies


class _Labels:
    """Einsum labels for the operands' pieces, a contracted or batch piece of B sharing A's."""

    def __init__(self) -> None:
        self.of: dict[tuple[int, int], str] = {}
        self._letters = iter(string.ascii_letters)

    def label(self, operand: int, piece: int) -> str:
        key = (operand, piece)
        if key not in self.of:
            self.of[key] = next(self._letters)
        return self.of[key]

    def join(self, a: Layout, a_axis: list[int], b: Layout, b_axis: list[int]) -> bool:
        """Give B's pieces of an axis A's labels, piece by piece; False where the sizes of the
        pieces differ (the axes are not the same axis)."""
        a_leaves, b_leaves = a.leaves(a_axis), b.leaves(b_axis)
        sizes = ([a.size[p] for p in a_leaves], [b.size[p] for p in b_leaves])
        if sizes[0] != sizes[1]:
            return False
        for a_piece, b_piece in zip(a_leaves, b_leaves, strict=True):
            self.of[(1, b_piece)] = self.label(0, a_piece)
        return True


def _term(labels: _Labels, operand: int, layout: Layout) -> str:
    return "".join(labels.label(operand, axis[0]) for axis in layout.source)


def _equation(
    ctx: PassContext,
    operands: list[tuple[ir.Value, Layout]],
    matmul: ir.Node,
    product: list[ir.Node],
) -> tuple[str, int, Copies] | str:
    """(equation, how many product ops it covers, where the sizes of the product's values are
    read from), or why the site is no Einsum that EinsumMatMulCanonicalization lowers."""
    (_, a), (_, b) = operands
    if len(a.axes) < 2 or len(b.axes) < 2:
        return "an operand of the MatMul is a vector"
    labels = _Labels()
    if not labels.join(a, a.axes[-1], b, b.axes[-2]):
        return "the contracted axes are not the same axes of both operands"
    batch_rank = max(len(a.axes), len(b.axes)) - 2
    batch: list[tuple[list[int], int]] = []  # each batch axis's pieces, of A (0) or B (1)
    for position in range(-batch_rank - 2, -2):
        a_axis = a.axes[position] if -position <= len(a.axes) else []
        b_axis = b.axes[position] if -position <= len(b.axes) else []
        if a_axis and b_axis and not labels.join(a, a_axis, b, b_axis):
            return "a batch axis of the MatMul is different axes of the two operands"
        batch.append((a_axis, 0) if a_axis or not b_axis else (b_axis, 1))
    columns = [*batch, (a.axes[-2], 0), (b.axes[-1], 1)]
    order = [labels.label(operand, piece) for pieces, operand in columns for piece in pieces]
    sizes = {labels.label(0, p): a.size[p] for p in a.size}
    sizes |= {labels.label(1, p): b.size[p] for p in b.size}
    result = Layout([sizes[label] for label in order])
    grouped = [(a if operand == 0 else b).axis_size(pieces) for pieces, operand in columns]
    if not result.reshape(grouped):
        return "the MatMul's product cannot be laid out over the operands' axes"
    name_of = dict(enumerate(order))  # the result's first pieces, in order, are the labels
    axis_of = {
        labels.label(operand, axis[0]): (source, index)
        for operand, (source, layout) in enumerate(operands)
        for index, axis in enumerate(layout.source)
    }
    whole = {piece: axis_of[label] for piece, label in name_of.items()}
    copies: Copies = {matmul.outputs[0]: _copies(result, whole)}
    found: tuple[str, int, Copies] | str = "the product's axes are not the operands' axes"
    for covered in range(len(product) + 1):
        if covered and advance(ctx, result, product[covered - 1]) is not True:
            break
        if covered:
            copies[product[covered - 1].outputs[0]] = _copies(result, whole)
        if _whole_axes(result):
            terms = f"{_term(labels, 0, a)},{_term(labels, 1, b)}"
            output = "".join(name_of[axis[0]] for axis in result.axes)
            found = f"{terms}->{output}", covered, copies
    if isinstance(found, tuple):
        lowered = plan(found[0], (len(a.source), len(b.source)))
        return lowered if isinstance(lowered, str) else found
    return found


@register_pass
class EinsumRecognitionPass(FusionPass):
    """Not a pattern: each MatMul is judged by what the layout ops around it compute."""

    spec = PassSpec(
        name="EinsumRecognitionPass",
        category=Category.GRAPH,
        description="MatMul between chains of Reshape/Transpose/Unsqueeze/Squeeze whose axes "
        "stay whole (tf2onnx's decomposed Einsum, batch axes folded at run time) -> the "
        "Einsum it computes, for EinsumMatMulCanonicalization to lower",
        aliases=("einsum_recognition",),
        priority=3024,  # before EinsumMatMulCanonicalization lowers what it writes
        emits=("Einsum",),
        canonical=True,
        every_layer=False,
    )
    counts_changes = True

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        for matmul in list(ctx.op_index.of_type(graph, "MatMul", DEFAULT_DOMAINS)):
            if matmul.graph is graph and None not in matmul.inputs[:2]:
                self._recognize(ctx, graph, matmul)
        if ctx.changed and ctx.shapes is not None:
            ctx.shapes.invalidate()

    def _recognize(self, ctx: PassContext, graph: ir.Graph, matmul: ir.Node) -> None:
        inputs: list[ir.Value] = matmul.inputs[:2]  # type: ignore[assignment]
        chains = [_operand_chain(value, graph) for value in inputs]
        product = _product_chain(matmul, graph)
        unfolded = any(node.op_type in ("Reshape", "Squeeze") for node in product)
        if not unfolded or _read_as_is(ctx, [*chains[0], *chains[1], matmul, *product]):
            return  # no fold undone after the product (a classifier's flatten), or read as is
        site = node_label(matmul)
        operands = [
            _operand(ctx, value, chain) for value, chain in zip(inputs, chains, strict=True)
        ]
        reason = next((operand for operand in operands if isinstance(operand, str)), None)
        layouts = [(o[0], o[2]) for o in operands if not isinstance(o, str)]
        found = reason or _equation(ctx, layouts, matmul, product)
        if isinstance(found, str):
            ctx.pattern(_PATTERN).decline(found, site)
            return
        (a, a_chain, _), (b, b_chain, _) = operands  # type: ignore[misc]
        equation, covered, copies = found
        site_nodes = [*a_chain, *b_chain, matmul, *product[:covered]]
        if _read_as_is(ctx, site_nodes):
            return  # GPT-2's context: its 4-D head merge, then a flatten the site stops before
        end = site_nodes[-1]
        members = list(site_nodes)  # and the size arithmetic that only their targets read
        absorb_shape_arithmetic(ctx, members, set())
        elsewhere = _read_elsewhere(site_nodes, end, set(members))
        if isinstance(elsewhere, str):
            ctx.pattern(_PATTERN).decline(elsewhere, site)
            return
        rereads = []
        if elsewhere:  # read from the operands' axes, which stay
            for source, chain in ((a, a_chain), (b, b_chain)):
                copies |= _chain_copies(ctx, source, chain)
            sources = {reader: copies[reader.inputs[0]] for reader in elsewhere}  # type: ignore[index]
            needed = [(parts, read_axes(reader, len(parts))) for reader, parts in sources.items()]
            if any(parts[axis] is None for parts, axes in needed for axis in axes):
                reason = "a size read outside the site is no axis of an operand (axes merged)"
                ctx.pattern(_PATTERN).decline(reason, site)
                return
            name = f"{self.spec.name}/{site}"
            rereads = [
                read_again(ctx, graph, name, reader, sources[reader], set(members))
                for reader in elsewhere
            ]
        einsum = ir.node("Einsum", [a, b], attributes={"equation": equation})
        typed(einsum.outputs[0], ctx.dtype(end.outputs[0]), ctx.shape(end.outputs[0]))
        sizes = [node for reread in rereads for node in reread.nodes]
        rewritten = [node for reread in rereads for node in reread.replaced_nodes]
        old = [*members, *elsewhere, *rewritten]
        refused = replace_subgraph(
            ctx,
            _PATTERN,
            end,
            old,
            [einsum, *sizes],
            [end.outputs[0], *(v for reread in rereads for v in reread.replaced)],
            [einsum.outputs[0], *(v for reread in rereads for v in reread.values)],
        )
        if refused is not None:
            disconnect(sizes)
            return
        for reread in rereads:  # placed at the Einsum; their readers may come before it
            move_before_readers(graph, reread.reading)


def _read_elsewhere(
    site: list[ir.Node], end: ir.Node, members: set[ir.Node]
) -> list[ir.Node] | str:
    """The Shapes outside ``members`` that read the site's intermediates, to be read again
    from what stays; why not, where anything but a Shape reads one."""
    found: list[ir.Node] = []
    for node in site:
        if node is end:
            continue
        for value in node.outputs:
            if value.is_graph_output():
                return "an intermediate of the site is a graph output"
            for reader, _ in value.uses():
                if reader in members or reader in found:
                    continue
                if reader.op_type != "Shape":
                    return f"an intermediate of the site is read by {reader.op_type} outside it"
                found.append(reader)
    return found
