"""``--check_custom``: a custom pass is checked at every site it rewrites, not trusted.

Before a custom pass's rewrite lands, the matched nodes and their replacement are each cut out
into a small model whose inputs are the values the match reads, fed with generated data of the
matched shapes and types, and run on onnxruntime. A replacement that computes something else
is caught at the site, named by its nodes, and the site is left as it was.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from rich.console import Console

from fusectl.diagnostics.inputs import generate_feeds
from fusectl.diagnostics.verify import TOLERANCES, Tolerance, compare
from fusectl.errors import FusectlError
from fusectl.rewrite.graph import constant_value
from fusectl.rewrite.sites import site_inputs

if TYPE_CHECKING:
    from fusectl.rewrite.context import PassContext

OK, MISMATCH, UNCHECKED = "ok", "mismatch", "unchecked"


@dataclass
class SiteCheck:
    """The verdict on one rewrite of a custom pass."""

    pass_name: str
    pattern: str
    site: str
    nodes: list[str]
    verdict: str
    detail: str = ""
    max_abs: float = 0.0
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": self.pass_name,
            "pattern": self.pattern,
            "site": self.site,
            "nodes": self.nodes,
            "verdict": self.verdict,
            "detail": self.detail or None,
            "max_abs": self.max_abs if math.isfinite(self.max_abs) else str(self.max_abs),
        }


@dataclass
class SiteChecker:
    """Checks the rewrites of custom passes during one run and keeps every verdict."""

    ir_version: int
    opsets: dict[str, int]
    seed: int = 0
    results: list[SiteCheck] = field(default_factory=list)

    @classmethod
    def for_model(cls, model: ir.Model, seed: int = 0) -> SiteChecker:
        return cls(model.ir_version, dict(model.opset_imports), seed)

    def mismatches(self) -> list[SiteCheck]:
        return [r for r in self.results if r.verdict == MISMATCH]

    def summary(self) -> str:
        bad = self.mismatches()
        passes = ", ".join(dict.fromkeys(r.pass_name for r in bad))
        return f"check_custom: {len(bad)} site(s) of {passes} compute something else"

    def to_json(self) -> dict[str, Any]:
        counts = Counter(r.verdict for r in self.results)
        return {
            "checked": counts[OK] + counts[MISMATCH],
            "mismatched": counts[MISMATCH],
            "unchecked": counts[UNCHECKED],
            # Sites that passed are many and say nothing; the others are the findings.
            "sites": [r.to_json() for r in self.results if r.verdict != OK],
        }

    def print_summary(self, console: Console) -> None:
        """One line per site that differs or could not be checked, then the totals."""
        for record in self.results:
            if record.verdict == OK:
                continue
            action = "left unfused" if record.verdict == MISMATCH else "fused unchecked"
            console.print(
                f"check_custom: {record.pass_name} at {record.site} "
                f"(nodes {', '.join(record.nodes)}): {record.detail}; {action}",
                markup=False,
                soft_wrap=True,
            )
        totals = self.to_json()
        console.print(
            f"check_custom: {totals['checked']} site(s) of custom passes checked, "
            f"{totals['mismatched']} differ, {totals['unchecked']} could not be checked",
            markup=False,
            soft_wrap=True,
        )

    def review(
        self,
        ctx: PassContext,
        pattern: str,
        site: str,
        old_nodes: Sequence[ir.Node],
        new_nodes: Sequence[ir.Node],
        old_outputs: Sequence[ir.Value],
        new_outputs: Sequence[ir.Value],
    ) -> str | None:
        """Run both sides; the reason to leave the site alone when they differ, else None."""
        # The matcher lists the root first; reversed, a chain reads in execution order.
        nodes = [n.name or n.op_type for n in reversed(old_nodes)]
        record = SiteCheck(ctx.spec.name, pattern, site, nodes, OK)
        self.results.append(record)
        try:
            record.verdict, record.reason, record.detail, record.max_abs = self._compare(
                ctx, old_nodes, new_nodes, old_outputs, new_outputs
            )
        except Uncut as why:
            record.verdict, record.detail = UNCHECKED, str(why)
        if record.verdict != MISMATCH:
            return None
        # The reason is what --report groups near misses by: the same for every such site.
        return f"check_custom: {record.reason}"

    def _compare(
        self,
        ctx: PassContext,
        old_nodes: Sequence[ir.Node],
        new_nodes: Sequence[ir.Node],
        old_outputs: Sequence[ir.Value],
        new_outputs: Sequence[ir.Value],
    ) -> tuple[str, str, str, float]:
        """(verdict, reason shared by like sites, detail naming the output, max abs error)."""
        original, replacement = cut_site(
            ctx, self.opsets, self.ir_version, old_nodes, new_nodes, old_outputs, new_outputs
        )
        try:
            feeds, _ = generate_feeds(ir.from_proto(original), seed=self.seed)
        except FusectlError as error:
            raise Uncut(f"no inputs for the match: {error}") from None
        try:
            expected = _run(original, feeds)
        except _RunFailed as error:
            raise Uncut(f"the matched nodes do not run on their own: {error}") from None
        try:
            actual = _run(replacement, feeds)
        except _RunFailed as error:
            reason = "the replacement does not run on onnxruntime"
            return MISMATCH, reason, f"{reason}: {error}", math.inf
        atol, rtol = TOLERANCES[ctx.spec.numerics]
        tolerance = Tolerance(atol, rtol, ctx.spec.numerics.value)
        worst = 0.0
        for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
            name = old_outputs[index].name or f"output {index}"
            result = compare(name, want, got, tolerance)
            if not result.passed:
                what = result.note or f"max abs error {result.max_abs:.3g}"
                reason = (
                    f"the replacement differs from the matched nodes beyond "
                    f"{ctx.spec.numerics.value} tolerance (atol {atol:g}, rtol {rtol:g})"
                )
                detail = f"the replacement differs from the matched nodes on {name}: {what} "
                detail += f"(atol {atol:g}, rtol {rtol:g}, {ctx.spec.numerics.value})"
                return MISMATCH, reason, detail, result.max_abs
            worst = max(worst, result.max_abs)
        return OK, "", "", worst


class Uncut(Exception):
    """The site cannot be cut out on its own (unknown shapes, nodes that need the rest of the
    graph)."""


def cut_site(
    ctx: PassContext,
    opsets: dict[str, int],
    ir_version: int,
    old_nodes: Sequence[ir.Node],
    new_nodes: Sequence[ir.Node],
    old_outputs: Sequence[ir.Value],
    new_outputs: Sequence[ir.Value],
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The matched nodes and their replacement, each as a model of its own with the same
    inputs (the values the match reads; constants go in as initializers) and outputs."""
    cut = _Cut(ctx, opsets, ir_version)
    inputs = site_inputs([*old_nodes, *new_nodes])
    original = cut.model("original", old_nodes, inputs, old_outputs, old_outputs)
    replacement = cut.model("replacement", new_nodes, inputs, new_outputs, old_outputs)
    return original, replacement


def cut_released(
    ctx: PassContext,
    opsets: dict[str, int],
    ir_version: int,
    old_nodes: Sequence[ir.Node],
    new_nodes: Sequence[ir.Node],
    sibling: Callable[[ir.Node], bool],
    landed: Sequence[set[ir.Node]] = (),
) -> list[tuple[onnx.ModelProto, int]]:
    """What the rewrite leaves to die besides the matched nodes, each part as a model of its
    own with the number of sites it is shared by: first what only this site reads (a bias the
    fused op takes in, a layer's own conversion of the padding mask; 1), then what dies only
    once every sibling site has landed too (an attention mask all layers read, or the
    construction each layer's own conversion reads). A sibling is a node ``sibling`` names
    (one the pass's other sites match) reading where this site's match reads what it frees;
    each is assumed to free its own copy as this one does. ``landed``: what each sibling site
    already rewritten freed (released_producers), for the sites that no longer read it. Empty
    when the rewrite frees nothing: what any other node reads, or a graph output, stays."""
    matched = set(old_nodes)
    places = {
        (user.domain, user.op_type, index)
        for value in _released_values(old_nodes, new_nodes)
        for user, index in value.uses()
        if user in matched
    }

    def replaced(node: ir.Node) -> bool:  # a node a site matches: fused, not freed
        return node in matched or sibling(node)

    own = _dying(site_inputs(old_nodes), lambda user, _: user in matched, replaced)
    kinds = {(node.domain, node.op_type) for node in own}

    def sibling_read(user: ir.Node, index: int) -> bool:
        return sibling(user) and (user.domain, user.op_type, index) in places

    def mirror(node: ir.Node) -> bool:  # a sibling's own copy of a node this site frees
        if any(node in freed for freed in landed):
            return True
        uses = [use for value in node.outputs for use in value.uses()]
        return (
            node not in own
            and (node.domain, node.op_type) in kinds
            and bool(uses)
            and not any(value.is_graph_output() for value in node.outputs)
            and all(sibling_read(user, i) and user not in matched for user, i in uses)
        )

    def shared_dies(user: ir.Node, index: int) -> bool:
        return user in own or user in matched or sibling_read(user, index) or mirror(user)

    shared = _dying(site_inputs([*old_nodes, *own]), shared_dies, replaced)
    readers = {user for node in shared for value in node.outputs for user, _ in value.uses()}
    readers -= shared
    # The sites that share it: this one, each sibling's own copy of what this site frees, each
    # sibling reading it directly, and each sibling site already rewritten that read it.
    copies = [node for node in readers if mirror(node)]
    direct = [node for node in readers if sibling(node) and node not in matched]
    before = [freed for freed in landed if freed & shared]
    sharing = 1 + len(copies) + len(direct) + len(before)
    parts = []
    for nodes, taken_by, sites in ((own, matched, 1), (shared, readers, sharing)):
        ordered = [node for node in (old_nodes[0].graph or ()) if node in nodes]
        outputs = [
            value
            for node in ordered
            for value in node.outputs
            if any(user in taken_by for user, _ in value.uses())
        ]
        if not ordered or not outputs:
            continue
        try:
            model = _Cut(ctx, opsets, ir_version).model(
                "released", ordered, site_inputs(ordered), outputs, outputs
            )
        except Uncut:
            break  # the shared part is measured with the own part or not at all
        parts.append((model, sites))
    return parts


def released_producers(old_nodes: Sequence[ir.Node], new_nodes: Sequence[ir.Node]) -> set[ir.Node]:
    """The nodes computing what the match reads and the replacement does not: left without
    readers once the rewrite lands."""
    return {value.producer() for value in _released_values(old_nodes, new_nodes)} - {None}


def _released_values(old_nodes: Sequence[ir.Node], new_nodes: Sequence[ir.Node]) -> list[ir.Value]:
    kept = set(site_inputs(new_nodes))
    return [value for value in site_inputs(old_nodes) if value not in kept]


def _dying(
    values: Sequence[ir.Value],
    dies: Callable[[ir.Node, int], bool],
    replaced: Callable[[ir.Node], bool],
) -> set[ir.Node]:
    """The producers of ``values`` and their ancestors (constants and ``replaced`` nodes
    aside) that compute nothing but what nodes in the set, or the reads ``dies`` names, take."""
    ancestors: set[ir.Node] = set()
    pending = [value.producer() for value in values if _constant(value) is None]
    while pending:
        node = pending.pop()
        if node is None or node in ancestors or replaced(node):
            continue
        ancestors.add(node)
        pending.extend(
            value.producer()
            for value in node.inputs
            if value is not None and _constant(value) is None
        )
    if not ancestors:
        return ancestors
    # Readers come after what they read: one pass from the end decides every node.
    cone: set[ir.Node] = set()
    graph = next(iter(ancestors)).graph
    for node in reversed(list(graph or ())):
        if node in ancestors and all(
            not value.is_graph_output()
            and all(user in cone or dies(user, index) for user, index in value.uses())
            for value in node.outputs
        ):
            cone.add(node)
    return cone


class _RunFailed(Exception):
    pass


class _Cut:
    """Cuts a set of nodes out of the graph into a model of its own. Both sides of a site get
    the same input names, so one set of feeds serves both."""

    def __init__(self, ctx: PassContext, opsets: dict[str, int], ir_version: int) -> None:
        self.ctx = ctx
        self.opsets = opsets
        self.ir_version = ir_version
        self.names: dict[ir.Value, str] = {}

    def name(self, value: ir.Value) -> str:
        found = self.names.get(value)
        if found is None:
            found = self.names[value] = f"v{len(self.names)}"
        return found

    def model(
        self,
        graph_name: str,
        nodes: Sequence[ir.Node],
        inputs: Sequence[ir.Value],
        outputs: Sequence[ir.Value],
        typed_like: Sequence[ir.Value],
    ) -> onnx.ModelProto:
        fed: list[onnx.ValueInfoProto] = []
        constants: list[onnx.TensorProto] = []
        for value in inputs:
            array = _constant(value)
            if array is not None:
                constants.append(onnx.numpy_helper.from_array(array, self.name(value)))
                continue
            fed.append(self._input_info(value))
        node_protos = []
        domains = dict(self.opsets)
        for node in nodes:
            # Built by hand: a replacement's new values have no names yet, which serde refuses.
            proto = onnx.NodeProto(op_type=node.op_type, domain=node.domain, name=node.name or "")
            proto.input.extend(self.name(v) if v is not None else "" for v in node.inputs)
            proto.output.extend(self.name(v) for v in node.outputs)
            proto.attribute.extend(
                ir.serde.serialize_attribute(a) for a in node.attributes.values()
            )
            domains.setdefault(node.domain, 1)
            node_protos.append(proto)
        graph = onnx.helper.make_graph(
            node_protos,
            graph_name,
            fed,
            [self._output_info(v, like) for v, like in zip(outputs, typed_like, strict=True)],
            constants,
        )
        opset_imports = [onnx.helper.make_opsetid(d, v) for d, v in domains.items()]
        return onnx.helper.make_model(
            graph, opset_imports=opset_imports, ir_version=self.ir_version
        )

    def _input_info(self, value: ir.Value) -> onnx.ValueInfoProto:
        dtype, shape = self.ctx.dtype(value), self.ctx.shape(value)
        what = value.name or "a value the match reads"
        if dtype is None or shape is None:
            raise Uncut(f"the {'element type' if dtype is None else 'shape'} of {what} is unknown")
        dims = [d if isinstance(d, int) else d.value for d in shape]
        info = onnx.helper.make_tensor_value_info(self.name(value), int(dtype), dims)
        info.doc_string = value.name or ""  # its name in the model: what it holds, its size
        return info

    def _output_info(self, value: ir.Value, like: ir.Value) -> onnx.ValueInfoProto:
        dtype = self.ctx.dtype(like)
        if dtype is None:
            raise Uncut(f"the element type of {like.name or 'a matched output'} is unknown")
        return onnx.helper.make_tensor_value_info(self.name(value), int(dtype), None)


def _constant(value: ir.Value) -> np.ndarray | None:
    """A constant the match reads (an initializer, a Constant, one the rewrite adds)."""
    array = constant_value(value)
    if array is None and value.const_value is not None and not value.is_graph_input():
        array = value.const_value.numpy()
    return array


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        wanted = {i.name for i in session.get_inputs()}
        return session.run(None, {k: v for k, v in feeds.items() if k in wanted})
    except Exception as error:  # onnxruntime raises its own types for load and run errors
        text = str(error).strip()
        raise _RunFailed(text.splitlines()[0] if text else repr(error)) from None
