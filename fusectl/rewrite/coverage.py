"""Fusion coverage by op class: of the attention, normalization, GELU-class and rotary
computations in the optimized model, how many are fused ops and which are still written out.

A written-out computation is recognized by what makes it that computation, whatever the
spelling: attention is a Softmax between two MatMuls; a normalization divides by the square root
of a mean (one variance ReduceMean per norm, or the ReduceMean of a Pow(x, 2) for RMS); an exact
GELU has an Erf, a tanh GELU a Tanh fed by x**3 terms; rotary has the rotate-half Concat of a
negated half (or of the negated odd elements: rotate-every-two). The report lists every
written-out site with the near-miss reason a pass gave for it, or says that no pass recognized
it: nothing stays unfused silently.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

if TYPE_CHECKING:
    from fusectl.core.engine import PassRun

from fusectl.rewrite.graph import constant_value, squared, within

FUSED_OPS: dict[str, frozenset[str]] = {
    "attention": frozenset(
        {
            "MultiHeadAttention",
            "GroupQueryAttention",
            "Attention",
            "PackedAttention",
            "PackedMultiHeadAttention",
            "SparseAttention",
        }
    ),
    "norms": frozenset(
        {
            "LayerNormalization",
            "SkipLayerNormalization",
            "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization",
            "RMSNormalization",
            "EmbedLayerNormalization",
        }
    ),
    "GELU": frozenset({"Gelu", "FastGelu", "BiasGelu", "BiasFastGelu", "QuickGelu"}),
    "rotary": frozenset({"RotaryEmbedding"}),
}


# Products as they stand after the passes (a scaled product is a FusedMatMul by then; an
# Einsum that is no plain matrix product stays one).
_MATMULS = frozenset({"MatMul", "FusedMatMul", "Gemm", "Einsum"})
_SQRT = frozenset({"Sqrt"})
_SELECTIONS = frozenset({"TopK", "ArgMax", "ArgMin"})


@dataclass
class ClassCoverage:
    fused: int = 0
    unfused: list[dict[str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.fused + len(self.unfused)


def measure(graphs: Sequence[ir.Graph], runs: Sequence[PassRun]) -> dict[str, ClassCoverage]:
    """Coverage per op class in ``graphs`` (the model's graphs as optimized). Each
    written-out site gets the near-miss reason a pass gave for one of its nodes, else a pass
    that could fuse it and is switched off, else "no pass recognized this spelling"."""
    found: dict[str, list[str]] = {}
    for run in runs:
        if run.ctx is None:
            continue
        for stats in run.ctx.patterns.values():
            for reason, sites in stats.decline_examples.items():
                for site in sites:
                    said = found.setdefault(site, [])
                    if not any(s.endswith(f": {reason}") for s in said):
                        said.append(f"{run.decision.name}: {reason}")
    # Every pass's distinct reason, the opset requirements of passes for other opsets last.
    reasons = {
        site: "; ".join(sorted(said, key=lambda s: "needs opset" in s))
        for site, said in found.items()
    }
    classes = {name: ClassCoverage() for name in FUSED_OPS}
    for node in (node for graph in graphs for node in graph):
        for name, ops in FUSED_OPS.items():
            if node.op_type in ops and node.domain in ("", "ai.onnx", "com.microsoft"):
                classes[name].fused += 1
        if node.domain not in ("", "ai.onnx"):
            continue
        kind = _written_out(node)
        if kind is None:
            continue
        site = _site_nodes(node)
        reason = next((reasons[n.name] for n in site if n.name in reasons), None)
        reason = reason or _switched_off(kind, site, runs) or "no pass recognized this spelling"
        classes[kind].unfused.append({"node": node.name or node.op_type, "reason": reason})
    return classes


def _site_nodes(anchor: ir.Node, depth: int = 6) -> list[ir.Node]:
    """The anchor and the nodes a few ops below it, nearest first: a pass labels a decline
    with the root of its match, which is the anchor or follows it."""
    nodes: list[ir.Node] = []
    frontier = [anchor]
    for _ in range(depth):
        following = []
        for node in frontier:
            if node not in nodes:
                nodes.append(node)
            following += [user for value in node.outputs for user, _ in value.uses()]
        frontier = following
    return nodes


def _switched_off(kind: str, site: Sequence[ir.Node], runs: Sequence[PassRun]) -> str | None:
    """The first pass, switched off, that emits this class's fused ops and could take the site:
    a pattern pass whose rules' op skeletons fit none of its nodes would not (a norm whose
    epsilon is added after the square root is no RMS norm, whichever norm pass is off)."""
    for run in runs:
        fusion_pass = run.decision.fusion_pass
        if run.decision.enabled or not set(fusion_pass.spec.emits) & FUSED_OPS[kind]:
            continue
        could_match = getattr(fusion_pass, "could_match", None)
        if could_match is not None and not any(could_match(node) for node in site):
            continue
        return f"{run.decision.name} is off ({run.decision.source.value})"
    return None


def _written_out(node: ir.Node) -> str | None:
    """The op class whose written-out form this node anchors (one anchor per computation)."""
    if node.op_type == "Softmax":
        return "attention" if attention_shaped(node) else None
    if node.op_type == "ReduceMean":
        # The variance (or mean square) a norm takes the square root of; 4 ops down when the
        # variance is the mean square less the squared mean, clamped (Flax's LayerNorm).
        source = node.inputs[0].producer() if node.inputs[0] is not None else None
        variance = squared(source) is not None and within(
            node.outputs[0], _SQRT, upward=False, depth=4
        )
        return "norms" if variance else None
    if node.op_type == "Erf":
        return "GELU"
    if node.op_type == "Tanh":
        return "GELU" if _has_cube(node.inputs[0]) else None
    if node.op_type == "Concat":
        halves = len(node.inputs) == 2 and any(_negated(v) for v in node.inputs)
        return "rotary" if halves or _rotated_halves(node) else None
    return None


def _rotated_halves(concat: ir.Node) -> bool:
    """Concat(a*c - b*s, b*c + a*s), maybe among other parts: a rotation computed half by half
    (GPT-OSS, DeepSeek; TorchScript flattens DeepSeek's Concat(q_pass, rotated halves)), or
    pair by pair, each part unsqueezed to be stacked (llama2.c's complex pairs)."""
    for first, second in itertools.pairwise(_unstacked(v) for v in concat.inputs):
        if [_producer_type(first), _producer_type(second)] != ["Sub", "Add"]:
            continue
        parts = [v.producer() for v in (first, second) if v is not None]
        if all(_producer_type(v) == "Mul" for part in parts if part for v in part.inputs):
            return True
    return False


def _unstacked(value: ir.Value | None) -> ir.Value | None:
    """The value an Unsqueeze stacks, else the value itself."""
    node = value.producer() if value is not None else None
    return node.inputs[0] if node is not None and node.op_type == "Unsqueeze" else value


def _negated(value: ir.Value | None) -> bool:
    """A negated half (rotate_half) or negated odd elements, unsqueezed to pair them up
    again (GPT-J's rotate_every_two)."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Unsqueeze":
        return _producer_type(node.inputs[0]) == "Neg"
    return node is not None and node.op_type == "Neg"


def _producer_type(value: ir.Value | None) -> str | None:
    node = value.producer() if value is not None else None
    return node.op_type if node is not None else None


def _has_cube(value: ir.Value | None, depth: int = 4) -> bool:
    """Whether the 0.044715 * x**3 term of the tanh GELU is a few ops up."""
    node = value.producer() if value is not None else None
    if node is None or depth == 0:
        return False
    for operand in node.inputs:
        array = constant_value(operand)
        scalar = float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None
        if scalar is not None and (
            np.isclose(scalar, 0.044715, rtol=1e-3) or (node.op_type == "Pow" and scalar == 3)
        ):
            return True
    return any(_has_cube(v, depth - 1) for v in node.inputs)


def attention_shaped(softmax: ir.Node) -> bool:
    """A Softmax between two MatMuls: scores computed from a MatMul a few ops up, weights read
    by a MatMul a few ops down, not through a selection (a mixture-of-experts router picks
    its top experts from a Softmax of a MatMul). Every such Softmax left unfused is reported."""
    return within(softmax.inputs[0], _MATMULS, upward=True) and within(
        softmax.outputs[0], _MATMULS, upward=False, depth=4, stop=_SELECTIONS
    )


def same_class(ops: Sequence[str], others: Sequence[str]) -> bool:
    """Whether two passes emit fused ops of one class (attention, norms, ...)."""
    return any(set(ops) & members and set(others) & members for members in FUSED_OPS.values())


def to_json(classes: dict[str, ClassCoverage]) -> dict[str, dict]:
    return {
        name: {"fused": found.fused, "total": found.total, "unfused": found.unfused}
        for name, found in classes.items()
        if found.total
    }


def summary_line(classes: dict[str, ClassCoverage]) -> str | None:
    """'attention 2/2, norms 5/5, GELU 2/2' for the classes the model has."""
    parts = [f"{name} {c.fused}/{c.total}" for name, c in classes.items() if c.total]
    return "coverage: " + ", ".join(parts) if parts else None
