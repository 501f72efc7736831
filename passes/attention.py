"""UB fusion: scaled dot-product attention written out by exporters -> onnxruntime's
MultiHeadAttention.

Exporters spell the core the same way (transformers' sdpa and eager paths, TorchScript and
dynamo), but the head split and the key transpose differ, so this pass is hand-written and
anchored at the Softmax instead of being a pattern per spelling:

    q = Transpose(Reshape(Q, [B,S,N,H]), [0,2,1,3])          Q, K, V: [B,S,N*H] projections
    kT = Transpose(Reshape(K), [0,2,3,1])                     or [0,2,1,3] then [0,1,3,2], or
         Reshape(Transpose(Reshape(k, 3-D), [0,2,1]), 4-D)    (dynamo), single-input Concats
    p = Softmax(MatMul(q * s1, kT * s2) [+ bias ...])        scale s1*s2, or a Div of the product
    p = Where(IsNaN(p), 0, p)                                 optional guard
    out = Reshape(Transpose(MatMul(p, v), [0,2,1,3]), [B,S,N*H])

The additive mask / position bias becomes attention_bias ([B or 1, N or 1, S, L]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fusectl import runtime
from fusectl.context import PassContext
from fusectl.patterns import constant_value, replace_subgraph, uses_outside
from fusectl.registry import Category, FusionPass, Numerics, PassSpec, register_pass

MS = "com.microsoft"
_HEADS = [0, 2, 1, 3]


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _perm(node: ir.Node) -> list[int] | None:
    perm = node.attributes.get_ints("perm", None)
    return None if perm is None else list(perm)


def _through_concat(value: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """Skip the single-input Concat TorchScript writes for an empty KV cache."""
    concat = _producer(value, "Concat")
    if concat is not None and len(concat.inputs) == 1:
        nodes.append(concat)
        return concat.inputs[0]
    return value


def _split_heads(value: ir.Value, nodes: list[ir.Node]) -> ir.Value | None:
    """[B,N,S,H] from Transpose(Reshape(X[B,S,N*H]), [0,2,1,3]): returns X."""
    value = _through_concat(value, nodes)
    transpose = _producer(value, "Transpose")
    if transpose is None or _perm(transpose) != _HEADS:
        return None
    reshape = _producer(transpose.inputs[0], "Reshape")
    if reshape is None:
        return None
    nodes += [transpose, reshape]
    return reshape.inputs[0]


def _key_source(value: ir.Value, nodes: list[ir.Node]) -> ir.Value | None:
    """K from K^T [B,N,H,L] in the three spellings exporters use."""
    transpose = _producer(value, "Transpose")
    if transpose is not None and _perm(transpose) == [0, 2, 3, 1]:
        reshape = _producer(transpose.inputs[0], "Reshape")
        if reshape is None:
            return None
        nodes += [transpose, reshape]
        return reshape.inputs[0]
    if transpose is not None and _perm(transpose) == [0, 1, 3, 2]:
        nodes.append(transpose)
        return _split_heads(transpose.inputs[0], nodes)
    back = _producer(value, "Reshape")  # dynamo: 4-D -> 3-D, swap the last two, -> 4-D
    swap = _producer(back.inputs[0], "Transpose") if back is not None else None
    flat = _producer(swap.inputs[0], "Reshape") if swap is not None else None
    if flat is None or _perm(swap) != [0, 2, 1]:
        return None
    nodes += [back, swap, flat]
    return _split_heads(flat.inputs[0], nodes)


def _scalar(value: ir.Value | None) -> float | None:
    array = constant_value(value)
    return None if array is None or array.size != 1 else float(array.reshape(-1)[0])


def _unscale(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float]:
    """x or x * c (either order) -> (x, c)."""
    mul = _producer(value, "Mul")
    if mul is not None:
        for data, factor in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            scale = _scalar(factor)
            if scale is not None:
                nodes.append(mul)
                return data, scale
    return value, 1.0


@dataclass
class _Attention:
    heads: ir.Value  # the query split into heads, [B, N, S, H]
    guarded: bool  # the Softmax output went through Where(IsNaN(p), 0, p)
    query: ir.Value
    key: ir.Value
    value: ir.Value
    scale: float
    biases: list[ir.Value]
    output: ir.Value
    root: ir.Node
    nodes: list[ir.Node] = field(default_factory=list)


def _scores(
    value: ir.Value, nodes: list[ir.Node], biases: list[ir.Value]
) -> tuple[ir.Node | None, float]:
    """Walk Add(bias) and a scaling of the product (Div or Mul by a constant, as eager
    attention writes it) back to the MatMul of the scores: the MatMul and that scale."""
    for _ in range(3):
        add = _producer(value, "Add")
        if add is None:
            break
        for scores, bias in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            if _leads_to_matmul(scores):
                nodes.append(add)
                biases.append(bias)
                value = scores
                break
        else:
            return None, 1.0
    scale = 1.0
    divide = _producer(value, "Div")
    if divide is not None and _scalar(divide.inputs[1]):
        nodes.append(divide)
        scale = 1.0 / _scalar(divide.inputs[1])
        value = divide.inputs[0]
    elif _producer(value, "Mul") is not None:
        product, factor = _unscale(value, nodes)
        if product is not value:
            scale, value = factor, product
    return _producer(value, "MatMul"), scale


def _leads_to_matmul(value: ir.Value | None, depth: int = 4) -> bool:
    """Whether a few Adds / Muls / Divs up from ``value`` there is the scores' MatMul."""
    node = value.producer() if value is not None else None
    if node is None or depth == 0:
        return False
    if node.op_type == "MatMul":
        return True
    if node.op_type not in ("Add", "Div", "Mul"):
        return False
    return any(_leads_to_matmul(v, depth - 1) for v in node.inputs)


def _match(softmax: ir.Node) -> _Attention | str | None:
    """The attention around this Softmax, a reason it cannot fuse, or None if it is none."""
    nodes: list[ir.Node] = [softmax]
    biases: list[ir.Value] = []
    matmul, product_scale = _scores(softmax.inputs[0], nodes, biases)
    if matmul is None:
        return None
    nodes.append(matmul)
    q_scaled, q_scale = _unscale(matmul.inputs[0], nodes)
    k_scaled, k_scale = _unscale(matmul.inputs[1], nodes)
    scale = q_scale * k_scale * product_scale
    heads = q_scaled
    query = _split_heads(q_scaled, nodes)
    key = _key_source(k_scaled, nodes)
    if query is None or key is None:
        return None
    probabilities = softmax.outputs[0]
    uses = [user for user, _ in probabilities.uses()]
    guard = next((u for u in uses if u.op_type == "IsNaN"), None)
    if guard is not None:
        where = next((u for u in uses if u.op_type == "Where"), None)
        if where is None or _scalar(where.inputs[1]) != 0.0:
            return "the NaN guard after Softmax is not Where(IsNaN(p), 0, p)"
        nodes += [guard, where]
        probabilities = where.outputs[0]
        uses = [user for user, _ in probabilities.uses()]
    if len(uses) != 1 or uses[0].op_type != "MatMul" or uses[0].inputs[0] is not probabilities:
        return None
    context = uses[0]
    nodes.append(context)
    value = _split_heads(context.inputs[1], nodes)
    if value is None:
        return None
    result = context.outputs[0]
    extra = _producer_user(result, "Reshape")  # TorchScript: a no-op 4-D Reshape first
    if extra is not None and _producer_user(extra.outputs[0], "Transpose") is not None:
        nodes.append(extra)
        result = extra.outputs[0]
    merge = _producer_user(result, "Transpose")
    if merge is None or _perm(merge) != _HEADS:
        return None
    final = _producer_user(merge.outputs[0], "Reshape")
    if final is None:
        return None
    nodes += [merge, final]
    return _Attention(
        heads, guard is not None, query, key, value, scale, biases, final.outputs[0], final, nodes
    )


def _producer_user(value: ir.Value, op_type: str) -> ir.Node | None:
    """The value's only consumer apart from Shape readers, if it has that op type."""
    users = [user for user, _ in value.uses() if user.op_type not in _SHAPE_READERS]
    if len(users) != 1 or value.is_graph_output():
        return None
    user = users[0]
    return user if user.op_type == op_type and user.domain in ("", "ai.onnx") else None


_SHAPE_READERS = frozenset({"Shape", "Size"})
_INDEX_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})


def _absorb_shape_arithmetic(ctx: PassContext, nodes: list[ir.Node], keep: set[ir.Value]) -> None:
    """Add the integer side computations (Shape -> Gather -> Concat ... -> a Reshape's target)
    that exist only for the matched nodes: they die with them. Values in ``keep`` (what the
    fused op reads) are never absorbed."""
    members = set(nodes)
    changed = True
    while changed:
        changed = False
        for node in list(members):
            for value in node.inputs:
                producer = value.producer() if value is not None else None
                if producer is None or producer in members or value in keep:
                    continue
                outputs = producer.outputs
                if any(ctx.dtype(v) not in _INDEX_TYPES or v.is_graph_output() for v in outputs):
                    continue
                if all(user in members for v in outputs for user, _ in v.uses()):
                    members.add(producer)
                    nodes.append(producer)
                    changed = True


def _bias(ctx: PassContext, match: _Attention) -> tuple[list[ir.Value], str | None]:
    """The attention_bias inputs: the additive mask / position bias, dropped when zero."""
    kept = []
    for bias in match.biases:
        array = constant_value(bias)
        if array is not None and not np.any(array):
            continue  # an all-true mask folded to zeros adds nothing
        shape = ctx.shape(bias)
        if shape is None or len(shape) != 4:
            return [], "the additive mask or bias is not 4-D [batch, heads, query, key]"
        kept.append(bias)
    return kept, None


def _finite(bias: ir.Value) -> bool:
    """Whether the additive bias is known to hold no -inf (then no row can become NaN)."""
    array = constant_value(bias)
    if array is not None:
        return bool(np.all(np.isfinite(array)))
    where = _producer(bias, "Where")
    if where is None:
        return False
    branches = [constant_value(v) for v in where.inputs[1:]]
    return all(b is not None and bool(np.all(np.isfinite(b))) for b in branches)


def _num_heads(heads: ir.Shape | None, query: ir.Shape) -> int | None:
    """N from the split query [B, N, S, H], or hidden / H when only the head size is known."""
    if heads is None or len(heads) != 4:
        return None
    if isinstance(heads[1], int):
        return int(heads[1])
    if isinstance(heads[3], int) and isinstance(query[2], int) and query[2] % heads[3] == 0:
        return int(query[2]) // int(heads[3])
    return None


def _fused_shape(query: ir.Shape, value: ir.Shape, replaced: ir.Shape | None) -> ir.Shape:
    """MultiHeadAttention's output: [batch, sequence] of the query by the value's hidden size.

    onnx cannot infer the contrib op, and the replaced output's batch may be a fresh symbol
    (the scores broadcast against the mask's batch), where proving that a later residual Add
    broadcasts nothing needs the query's. The rest of a replaced shape stays as inferred: a
    hidden size made static here would let a second run fold what the first could not.
    """
    if replaced is None or len(replaced) != 3:
        return ir.Shape([query[0], query[1], value[2]])
    old = list(replaced)
    leading = [o if isinstance(o, int) else q for o, q in zip(old[:2], query[:2], strict=True)]
    return ir.Shape([*leading, old[2]])


_VIEWS = frozenset({"Reshape", "Transpose", "Concat"})


def _still_read(ctx: PassContext, nodes: list[ir.Node], output: ir.Value) -> set[ir.Node] | None:
    """The matched nodes that must stay because a value they compute is read outside the
    match, with the matched nodes they read; None if any of them is more than data movement
    or integer shape arithmetic (keeping it would duplicate real work).

    TorchScript's T5 takes the key length for its position bias from a transposed copy of the
    key's head split: that Reshape stays beside the fused op, computing what it did.
    """
    members = set(nodes)

    def read_outside(node: ir.Node) -> bool:
        return any(
            value is not output
            and (value.is_graph_output() or any(user not in members for user, _ in value.uses()))
            for value in node.outputs
        )

    pending = [node for node in nodes if read_outside(node)]
    staying: set[ir.Node] = set()
    while pending:
        node = pending.pop()
        if node in staying:
            continue
        integer = all(ctx.dtype(value) in _INDEX_TYPES for value in node.outputs)
        if not integer and (node.op_type not in _VIEWS or node.domain not in ("", "ai.onnx")):
            return None
        staying.add(node)
        pending += [v.producer() for v in node.inputs if v is not None and v.producer() in members]
    return staying


@register_pass
class MultiHeadAttentionFusionPass(FusionPass):
    spec = PassSpec(
        name="MultiHeadAttentionFusionPass",
        category=Category.UB,
        description="written-out scaled dot-product attention (BERT/ViT bidirectional, GPT-2 "
        "causal, T5 position bias) -> com.microsoft MultiHeadAttention",
        aliases=("FlashAttentionFusionV1", "multi_head_attention_fusion", "AttentionFusion"),
        numerics=Numerics.REASSOCIATING,
        priority=4500,
        targets=("ort",),
        emits=("MultiHeadAttention",),
        emits_domain=MS,
    )

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        stats = ctx.pattern("MultiHeadAttention")
        for softmax in [n for n in model.graph if n.op_type == "Softmax" and n.domain == ""]:
            if softmax.graph is not model.graph:
                continue
            found = _match(softmax)
            if found is None:
                continue
            label = softmax.name or softmax.op_type
            reason = found if isinstance(found, str) else self._fuse(ctx, found)
            if reason is not None:
                stats.decline(reason, label)

    @staticmethod
    def _fuse(ctx: PassContext, match: _Attention) -> str | None:
        shapes = [ctx.shape(v) for v in (match.query, match.key, match.value, match.output)]
        if any(shape is None for shape in shapes):
            return "a Q/K/V projection or the output has an unknown rank"
        if any(len(shape) != 3 for shape in shapes[:3]):
            return "a Q/K/V projection is not 3-D [batch, sequence, hidden]"
        heads = _num_heads(ctx.shape(match.heads), shapes[0])
        if heads is None:
            return "the number of heads is unknown"
        keep = {match.query, match.key, match.value, *match.biases}
        # Flattened to 2-D for the next Linear (a later Reshape folded into this one): the
        # fused op's [B, S, hidden] output gets that Reshape back.
        flatten = len(shapes[3]) != 3
        if flatten:
            keep.add(match.root.inputs[1])
        _absorb_shape_arithmetic(ctx, match.nodes, keep)
        staying = _still_read(ctx, match.nodes, match.output)
        if staying is None:
            return uses_outside(match.nodes, [match.output])
        dtype = ctx.dtype(match.query)
        if ctx.target == "ort" and not runtime.has_kernel("MultiHeadAttention", MS, 1, dtype):
            return f"onnxruntime has no com.microsoft.MultiHeadAttention kernel for {dtype}"
        biases, reason = _bias(ctx, match)
        if reason is not None:
            return reason
        new_nodes = []
        bias: ir.Value | None = None
        if len(biases) == 1:
            bias = biases[0]
        elif biases:
            total = ir.node("Add", biases[:2])
            new_nodes.append(total)
            bias = total.outputs[0]
        inputs = [match.query, match.key, match.value, None, None, bias]
        while inputs[-1] is None:
            inputs.pop()
        attention = ir.node(
            "MultiHeadAttention",
            inputs,
            attributes={"num_heads": heads, "scale": float(match.scale)},
            domain=MS,
        )
        new_nodes.append(attention)
        result = attention.outputs[0]
        constants = []
        if match.guarded and not all(_finite(b) for b in biases):
            # A query row masked everywhere with -inf makes the kernel's softmax NaN, where
            # the original's guard gave it zero weights: zero those context rows the same way.
            zero = ir.Value(
                name=f"{ctx.spec.name}/{match.root.name}/zero",
                type=ir.TensorType(ir.DataType.FLOAT),
                shape=ir.Shape([1]),
                const_value=ir.tensor(np.zeros(1, np.float32)),
            )
            constants.append(zero)
            nan = ir.node("IsNaN", [result])
            guard = ir.node("Where", [nan.outputs[0], zero, result])
            new_nodes += [nan, guard]
            result = guard.outputs[0]
        if flatten:
            reshape = ir.node("Reshape", [result, match.root.inputs[1]])
            new_nodes.append(reshape)
            result = reshape.outputs[0]
        replace_subgraph(
            ctx,
            "MultiHeadAttention",
            match.root,
            [node for node in match.nodes if node not in staying],
            new_nodes,
            [match.output],
            [result],
            constants,
        )
        # After the replacement, which gives ``result`` the replaced value's shape and type.
        output = attention.outputs[0]
        output.shape = _fused_shape(shapes[0], shapes[2], None if flatten else shapes[3])
        if output.type is None and dtype is not None:
            output.type = ir.TensorType(dtype)
        if not flatten:
            result.shape = output.shape  # the NaN guard keeps the shape
        return None
