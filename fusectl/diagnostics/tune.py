"""``fusectl tune``: measure, for each class of fusion site in a model, whether the fused kernel
pays on an execution provider, and record the verdict in a knowledge repository.

The passes run as ``optimize`` would run them, twice: on the model as it is, which names each
site's class (symbolic dimensions stay ``?``, so the verdict serves every batch and sequence
length), and on a copy whose inputs are fixed at the tuning shapes (``--input_shape``, else
batch 1 and 128 for every other free dimension), from which each class's first site is cut out
as two small models, the matched nodes and their replacement (the ``--check_custom`` cut). Both
run on the provider with onnxruntime's own graph optimizations off, interleaved: rounds of a
batch of runs of each, in alternating order, until a sign test over the rounds separates them
and the medians differ by more than the noise margin, or the round or time budget runs out
(then they are the same). The unfused side is charged with what the rewrite leaves to die
besides the matched nodes (sitecheck.cut_released: a bias the fused op takes in, the mask
construction all attention layers share, divided among them), timed beside it in each round.
A class whose fused kernel is slower is recorded ``unfused``; one
whose fused op the provider refuses while it runs the unfused nodes (at session creation, by
placing it on another provider for want of a kernel for its types, or at run time on inputs the
unfused nodes compute with), ``unsupported``.
On a GPU provider both models read their inputs from device memory and leave their outputs there
(diagnostics.device), so the times are the kernels' and not the copies'.
"""

from __future__ import annotations

import datetime
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from fusectl.core.engine import run_plan
from fusectl.core.model_io import LoadedModel, model_copy
from fusectl.core.repository import (
    FUSED,
    SAME,
    UNFUSED,
    UNSUPPORTED,
    Repository,
    Section,
    device_identity,
    load_repository,
    ms,
)
from fusectl.core.switches import Plan
from fusectl.diagnostics.device import runner
from fusectl.diagnostics.inputs import generate_feeds, graph_inputs
from fusectl.diagnostics.sitecheck import Uncut, cut_released, cut_site, released_producers
from fusectl.errors import FusectlError
from fusectl.rewrite.shapes import ShapeOracle, apply_input_shapes
from fusectl.rewrite.sites import SiteClass, is_kernel, op_name, site_class
from fusectl.version import __version__

if TYPE_CHECKING:
    from fusectl.rewrite.context import PassContext
    from fusectl.rewrite.registry import PassSpec

# Rewrites that only move data (a merged Reshape, a removed Transpose pair) always pay.
_DATA_MOVEMENT = frozenset(
    {"Reshape", "Transpose", "Identity", "Cast", "Concat", "Squeeze", "Unsqueeze", "Flatten"}
)
# Tuning sizes for free input dimensions.
TUNE_BATCH = 1
TUNE_LENGTH = 128
# Two timings closer than this are the same kernel speed for the repository's purposes.
NOISE_MARGIN = 0.03
MIN_ROUNDS = 7
MAX_ROUNDS = 41
# A batch of runs lasts at least this long, so timer resolution and call overhead vanish.
_BATCH_S = 0.01
_MAX_BATCH = 500


def tuned(spec: PassSpec) -> bool:
    """Whether a pass's sites are measured: it emits a fused op, not only data movement."""
    return bool(spec.emits) and not spec.canonical and not set(spec.emits) <= _DATA_MOVEMENT


@dataclass
class ClassResult:
    """One site class of the model: where it occurs and what the measurement found."""

    site_class: SiteClass
    sites: list[str] = field(default_factory=list)
    verdict: str | None = None  # None: not measured (see note)
    fused_ms: float = 0.0
    unfused_ms: float = 0.0
    rounds: int = 0
    runs_per_round: int = 0
    shapes: dict[str, list[int]] = field(default_factory=dict)
    note: str = ""
    error: str = ""  # the provider's refusal of the fused op (verdict "unsupported")
    # What the rewrite leaves to die besides the matched nodes (sitecheck.cut_released): the
    # time per run charged to this site, included in unfused_ms, and how many sites share the
    # part freed only once all of them land (0: none).
    released_ms: float = 0.0
    released_shared_by: int = 0

    @property
    def ratio(self) -> float:
        return self.fused_ms / self.unfused_ms if self.unfused_ms else math.inf

    def entry(self, model: str) -> dict[str, Any]:
        """The repository entry for this class."""
        if self.verdict == UNSUPPORTED:
            return {
                **self.site_class.to_json(),
                "decision": self.verdict,
                "error": self.error,
                "model": model,
                "sites_in_model": len(self.sites),
            }
        return {
            **self.site_class.to_json(),
            "decision": self.verdict,
            "fused_ms": round(self.fused_ms, 5),
            "unfused_ms": round(self.unfused_ms, 5),
            "ratio": round(self.ratio, 4),
            "rounds": self.rounds,
            "runs_per_round": self.runs_per_round,
            "measured_shapes": self.shapes,
            **({"released_ms": round(self.released_ms, 5)} if self.released_ms else {}),
            **({"released_shared_by": self.released_shared_by} if self.released_shared_by else {}),
            "model": model,
            "sites_in_model": len(self.sites),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "class": self.site_class.key,
            "sites": self.sites,
            "decision": self.verdict,
            "fused_ms": self.fused_ms,
            "unfused_ms": self.unfused_ms,
            "released_ms": self.released_ms or None,
            "rounds": self.rounds,
            "note": self.note or None,
            "error": self.error or None,
        }


@dataclass
class TuneResult:
    provider: str
    section: Section
    classes: list[ClassResult]
    repository: Path | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "provenance": self.section.provenance,
            "repository": str(self.repository) if self.repository else None,
            "seconds": round(self.seconds, 3),
            "classes": [c.to_json() for c in self.classes],
        }


def tuning_shapes(model: ir.Model, given: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every input's shape for tuning: ``given`` first, then a free dimension takes the size
    another input gives its name, else batch 1 or length 128."""
    symbols: dict[str, int] = {}
    for value in model.graph.inputs:
        dims = given.get(value.name or "")
        if dims is not None and value.shape is not None:
            for declared, size in zip(value.shape, dims, strict=False):
                if isinstance(declared, ir.SymbolicDim) and declared.value and size >= 0:
                    symbols.setdefault(declared.value, size)
    shapes: dict[str, list[int]] = {}
    for spec in graph_inputs(model):
        if spec.dims is None:
            if spec.name in given:
                shapes[spec.name] = given[spec.name]
            continue
        fixed = given.get(spec.name, [-1] * len(spec.dims))
        dims = []
        for axis, declared in enumerate(spec.dims):
            if fixed[axis] >= 0:
                dims.append(fixed[axis])
            elif isinstance(declared, int):
                dims.append(declared)
            elif declared and declared in symbols:
                dims.append(symbols[declared])
            else:
                batch = declared is not None and re.search("batch", declared, re.I)
                size = TUNE_BATCH if batch else TUNE_LENGTH
                dims.append(size)
                if declared:
                    symbols[declared] = size
        shapes[spec.name] = dims
    return shapes


@dataclass(frozen=True)
class _Site:
    """A tuned site of one run: its pass, pattern, label and the names of the nodes it fuses."""

    pass_name: str
    pattern: str
    label: str
    nodes: frozenset[str]

    def same_place(self, other: _Site) -> bool:
        """Whether two runs' sites fuse the same part of the model: same pass, and most of the
        nodes of the smaller one (fixed shapes fold shape arithmetic away, and with it may
        change the pattern: BERT's position Gather becomes a constant)."""
        if self.pass_name != other.pass_name:
            return False
        shared = len(self.nodes & other.nodes)
        return shared > 0 and shared * 2 >= min(len(self.nodes), len(other.nodes))


def _site(ctx: PassContext, pattern: str, label: str, nodes: Sequence[ir.Node]) -> _Site:
    return _Site(ctx.spec.name, pattern, label, frozenset(map(_node_identity, nodes)))


def _matched_by(names: set[str], node: ir.Node) -> bool:
    return _node_identity(node) in names


def _node_identity(node: ir.Node) -> str:
    """What names a node in both runs: its name, or for a node without one (models written
    with onnx.helper often name none) the name of its first output."""
    if node.name:
        return node.name
    first = node.outputs[0].name if node.outputs else None
    return f"-> {first}" if first else f"{node.op_type} #{id(node)}"


class _ClassNamer:
    """A site gate that approves every rewrite and notes the class of each tuned one."""

    def __init__(self) -> None:
        self.classes: dict[_Site, SiteClass | None] = {}

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
        if tuned(ctx.spec):
            found = site_class(ctx, pattern, old_nodes, new_nodes)
            self.classes.setdefault(_site(ctx, pattern, site, old_nodes), found)
        return None


class _SiteCutter:
    """A site gate that approves every rewrite and cuts out the sites asked for: each site of
    this run that fuses the same place as one of ``wanted`` (a site of the symbolic run). With
    ``released`` (the sites measured), what each of those frees besides its match
    (cut_released) instead, noting what every site frees as it lands."""

    def __init__(
        self, model: ir.Model, wanted: Sequence[_Site], *, released: Set[_Site] | None = None
    ) -> None:
        self.opsets = dict(model.opset_imports)
        self.ir_version = model.ir_version
        self.wanted = list(wanted)
        self.released = released
        # The nodes each pass's sites match: a site's siblings, for what dies with them all.
        self.matched: dict[str, set[str]] = {}
        for site in self.wanted:
            self.matched.setdefault(site.pass_name, set()).update(site.nodes)
        self.cuts: dict[_Site, Any] = {}
        self.seen: set[_Site] = set()
        self.landed: dict[str, list[set[ir.Node]]] = {}  # what each pass's sites so far freed

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
        if not tuned(ctx.spec):
            return None
        here = _site(ctx, pattern, site, old_nodes)
        wanted = next((w for w in self.wanted if w not in self.seen and w.same_place(here)), None)
        if wanted is None:
            return None
        self.seen.add(wanted)
        cut = (ctx, self.opsets, self.ir_version, old_nodes, new_nodes)
        if self.released is not None:
            landed = self.landed.setdefault(here.pass_name, [])
            if wanted in self.released:  # only the site a class is measured at is cut
                sibling = partial(_matched_by, self.matched[here.pass_name])
                self.cuts[wanted] = cut_released(*cut, sibling, landed)
            landed.append(released_producers(old_nodes, new_nodes))
            return None
        try:
            self.cuts[wanted] = cut_site(*cut, old_outputs, new_outputs)
        except Uncut as why:
            self.cuts[wanted] = str(why)
        return None


# onnxruntime 1.30 and later say which provider each node was placed on.
_RECORDS_PLACEMENT = hasattr(ort.InferenceSession, "get_provider_graph_assignment_info")


def _session(model: onnx.ModelProto, provider: str, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = threads
    options.log_severity_level = 4
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if _RECORDS_PLACEMENT:
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=[provider])


def placed_elsewhere(session: ort.InferenceSession, ops: Sequence[str]) -> dict[str, str]:
    """The ops of ``ops`` (as site classes name them) that onnxruntime placed on another
    provider than the session's first, with that provider.

    A provider without a kernel for an op's types leaves the node to the CPU provider, with
    copies to and from its device around it: the session loads, and a timing would compare the
    CPU kernel, not the provider's (CUDA has no float32 GroupQueryAttention)."""
    if not _RECORDS_PLACEMENT:
        return {}
    wanted = session.get_providers()[0]
    elsewhere = {}
    for subgraph in session.get_provider_graph_assignment_info():
        if subgraph.ep_name == wanted:
            continue
        for node in subgraph.get_nodes():
            name = op_name(node.domain, node.op_type)
            if name in ops:
                elsewhere[name] = subgraph.ep_name
    return elsewhere


def _sign_test(slower: int, rounds: int) -> float:
    """Two-sided p-value that ``slower`` of ``rounds`` coin flips came up one way."""
    extreme = max(slower, rounds - slower)
    tail = sum(math.comb(rounds, k) for k in range(extreme, rounds + 1)) / 2**rounds
    return min(1.0, 2 * tail)


@dataclass
class Timing:
    fused_ms: float
    unfused_ms: float
    rounds: int
    runs_per_round: int
    verdict: str
    released_ms: float = 0.0  # what the unfused side was charged for the freed work, per run


@dataclass
class Freed:
    """Work the unfused side leaves to die with the rewrite (cut_released): a session of it,
    its feeds, and how many sites share it. Each round charges the unfused side its time
    divided among them."""

    session: ort.InferenceSession
    feeds: dict[str, np.ndarray]
    sites: int


def time_pair(
    fused: ort.InferenceSession,
    unfused: ort.InferenceSession,
    feeds: dict[str, np.ndarray],
    *,
    budget_s: float = 3.0,
    freed: Sequence[Freed] = (),
) -> Timing:
    """Time both sessions interleaved until they separate or the budget is spent."""
    runs = [runner(fused, feeds), runner(unfused, feeds)]
    runs += [runner(part.session, part.feeds) for part in freed]
    for run in runs:  # warm up: first runs allocate
        for _ in range(3):
            run()
    began = time.perf_counter()
    for run in runs[:2]:
        run()
    once = max((time.perf_counter() - began) / 2, 1e-6)
    batch = max(1, min(_MAX_BATCH, int(_BATCH_S / once)))
    per_run: tuple[list[float], ...] = tuple([] for _ in runs)
    verdict = SAME
    started = time.perf_counter()
    while True:
        rounds = len(per_run[0])
        order = (0, 1) if rounds % 2 == 0 else (1, 0)
        for index in (*order, *range(2, len(runs))):
            run = runs[index]
            start = time.perf_counter()
            for _ in range(batch):
                run()
            per_run[index].append((time.perf_counter() - start) / batch)
        per_run[1][-1] += sum(per_run[2 + i][-1] / part.sites for i, part in enumerate(freed))
        rounds += 1
        if rounds < MIN_ROUNDS:
            continue
        ratio = statistics.median(per_run[0]) / statistics.median(per_run[1])
        slower = sum(f > u for f, u in zip(per_run[0], per_run[1], strict=True))
        p_value = _sign_test(slower, rounds)
        separated = p_value < 0.01 and abs(ratio - 1) > NOISE_MARGIN
        if separated or rounds >= MAX_ROUNDS or time.perf_counter() - started > budget_s:
            if separated or (p_value < 0.05 and abs(ratio - 1) > NOISE_MARGIN):
                verdict = UNFUSED if ratio > 1 else FUSED
            break
    return Timing(
        statistics.median(per_run[0]) * 1e3,
        statistics.median(per_run[1]) * 1e3,
        len(per_run[0]),
        batch,
        verdict,
        sum(statistics.median(per_run[2 + i]) / p.sites for i, p in enumerate(freed)) * 1e3,
    )


def _concrete_copy(loaded: LoadedModel, shapes: dict[str, list[int]]) -> ir.Model:
    """The model with its inputs fixed at the tuning shapes and intermediate shapes forgotten,
    so that inference derives them concrete."""
    model = model_copy(loaded)
    apply_input_shapes(model, shapes, loaded.path or Path("<in-memory model>"))
    for node in model.graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None
    return model


def tune_model(
    loaded: LoadedModel,
    plan: Plan,
    *,
    target: str,
    provider: str,
    threads: int = 1,
    input_shapes: dict[str, list[int]] | None = None,
    budget_s: float = 3.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[ClassResult], dict[str, list[int]]]:
    """Each tuned site class of the model, measured on ``provider``."""
    say = progress or (lambda _: None)
    symbolic = model_copy(loaded)
    namer = _ClassNamer()
    run_plan(symbolic, plan, target=target, shapes=ShapeOracle(symbolic, None), site_gates=[namer])
    classes: dict[str, ClassResult] = {}
    members: dict[str, list[_Site]] = {}
    unnamed = []
    for site, found in namer.classes.items():
        if found is None:
            unnamed.append(site)
            continue
        classes.setdefault(found.key, ClassResult(found)).sites.append(site.label)
        members.setdefault(found.key, []).append(site)
    shapes = tuning_shapes(symbolic, input_shapes or {})
    wanted = [site for sites in members.values() for site in sites]
    concrete = _concrete_copy(loaded, shapes)
    cutter = _SiteCutter(concrete, wanted)
    run_plan(concrete, plan, target=target, shapes=ShapeOracle(concrete, None), site_gates=[cutter])
    # Each class is measured at its first site found again at fixed shapes (a cut that could
    # not be made stands for it with its reason).
    measured: dict[str, _Site] = {}
    for class_key, sites in members.items():
        found = [s for s in sites if s in cutter.cuts]
        cut = [s for s in found if not isinstance(cutter.cuts[s], str)]
        if found:
            measured[class_key] = (cut or found)[0]
    # What each rewrite frees is cut from a second run at the model's own sizes: at the tuning
    # shapes its size arithmetic (a mask's Shape and Range grids) would fold away, which the
    # optimized model still computes at run time.
    again = model_copy(loaded)
    releases = _SiteCutter(again, wanted, released=set(measured.values()))
    run_plan(again, plan, target=target, shapes=ShapeOracle(again, None), site_gates=[releases])
    sizes = _ConcreteSizes(loaded, shapes)
    say(
        f"tune: {len(namer.classes)} site(s) in {len(classes)} class(es) to measure on "
        f"{provider}" + (f"; {len(unnamed)} with unknown input shapes left out" if unnamed else "")
    )
    for number, (class_key, record) in enumerate(classes.items(), 1):
        site = measured.get(class_key)
        cut = cutter.cuts[site] if site is not None else None
        if cut is None:
            record.note = "the site is not there once the inputs are fixed at the tuning shapes"
        elif isinstance(cut, str):
            record.note = f"cannot be cut out: {cut}"
        else:
            freed = _freed(releases.cuts.get(site, []), sizes, provider, threads, seed)
            _measure(record, cut, freed, provider, threads, budget_s, seed)
        if record.verdict == UNSUPPORTED:
            outcome = f"the fused op does not run on {provider}: {record.error}"
        elif record.verdict is not None:
            outcome = (
                f"fused {ms(record.fused_ms)} ms, unfused {ms(record.unfused_ms)} ms"
                f"{_freed_note(record)} -> {record.verdict}"
            )
        else:
            outcome = f"not measured: {record.note}"
        say(f"tune: [{number}/{len(classes)}] {class_key}: {outcome}")
    return list(classes.values()), shapes


def _measure(
    record: ClassResult,
    cut: tuple[onnx.ModelProto, onnx.ModelProto],
    freed: Sequence[Freed],
    provider: str,
    threads: int,
    budget_s: float,
    seed: int,
) -> None:
    original, replacement = cut
    try:
        feeds, _ = generate_feeds(ir.from_proto(original), seed=seed, names=_model_names(original))
        unfused = _session(original, provider, threads)
    except FusectlError as error:
        record.note = f"no inputs for the site: {error}"
        return
    except Exception as error:  # onnxruntime's own error types
        record.note = f"does not run on its own: {_first_line(error)}"
        return
    try:
        fused = _session(replacement, provider, threads)
    except Exception as error:
        # The unfused ops load where the fused one does not: the provider has no kernel for it
        # with these types or attributes (a fact of the provider, not of the generated inputs).
        record.verdict, record.error = UNSUPPORTED, _first_line(error)
        return
    # Only the fused kernels (ops outside onnx's domain): onnxruntime places onnx's own ops on
    # the CPU by choice where they compute sizes an op reads in host memory (the Cast and Sub
    # of GroupQueryAttention's total_sequence_length), though every provider has kernels.
    kernels = [op for op in record.site_class.fused if is_kernel(op)]
    elsewhere = placed_elsewhere(fused, kernels)
    if elsewhere:
        record.verdict = UNSUPPORTED
        record.error = "; ".join(
            f"no {provider} kernel for {op} with these types: onnxruntime runs it on {other}"
            for op, other in sorted(elsewhere.items())
        )
        return
    try:
        timing = time_pair(fused, unfused, feeds, budget_s=budget_s, freed=freed)
    except Exception as error:
        if _refuses_what_the_original_runs(original, replacement, unfused, feeds):
            record.verdict, record.error = UNSUPPORTED, _first_line(error)
        else:  # generated numbers for a value another site computes, checked more strictly
            record.note = f"does not run on its own: {_first_line(error)}"
        return
    record.shapes = {name: list(array.shape) for name, array in feeds.items()}
    record.fused_ms, record.unfused_ms = timing.fused_ms, timing.unfused_ms
    record.rounds, record.runs_per_round = timing.rounds, timing.runs_per_round
    record.verdict = timing.verdict
    record.released_ms = timing.released_ms
    record.released_shared_by = max((part.sites for part in freed if part.sites > 1), default=0)


class _ConcreteSizes:
    """The size of each value of the model at the tuning shapes, by name: what a cut made at
    the model's own sizes is fed at. The copy it infers on is made on first use (most classes
    free nothing)."""

    def __init__(self, loaded: LoadedModel, shapes: dict[str, list[int]]) -> None:
        self.loaded, self.shapes = loaded, shapes
        self.values: dict[str, ir.Value] | None = None

    def __call__(self, name: str) -> list[int] | None:
        if self.values is None:
            model = _concrete_copy(self.loaded, self.shapes)
            self.oracle = ShapeOracle(model, None)
            self.values = {v.name: v for v in model.graph.inputs if v.name}
            self.values.update((v.name, v) for node in model.graph for v in node.outputs if v.name)
        value = self.values.get(name)
        if value is None:
            return None
        shape = self.oracle.shape(value)
        if shape is not None and all(isinstance(d, int) for d in shape):
            return [int(d) for d in shape]
        # onnx leaves a size it cannot follow through a broadcast unknown; onnxruntime's
        # symbolic inference derives it from the fixed inputs.
        (dims,) = self.oracle.symbolic_dims([value])
        if dims is None or not all(isinstance(d, int) for d in dims):
            return None
        return [int(d) for d in dims]


def _freed_note(record: ClassResult) -> str:
    """How much of the unfused time is work the fusion frees besides its match."""
    if not record.released_ms:
        return ""
    shared = f", shared by {record.released_shared_by} sites" if record.released_shared_by else ""
    return f" (of which {ms(record.released_ms)} ms freed with it{shared})"


def _model_names(cut: onnx.ModelProto) -> dict[str, str]:
    """What each input of a cut was called in the model (sitecheck records it)."""
    return {spec.name: spec.doc_string for spec in cut.graph.input if spec.doc_string}


def _freed(
    released: Sequence[tuple[onnx.ModelProto, int]],
    sizes: Callable[[str], list[int] | None],
    provider: str,
    threads: int,
    seed: int,
) -> list[Freed]:
    """Sessions of what a rewrite frees, fed at the tuning sizes of the values it reads, the
    parts that run on their own (one that does not is left uncharged: the site is timed as
    before)."""
    parts = []
    for model, sites in released:
        shapes = {}
        for spec in model.graph.input:
            dims = sizes(spec.doc_string)
            if dims is not None:
                shapes[spec.name] = dims
        try:
            feeds, _ = generate_feeds(ir.from_proto(model), shapes, seed, names=_model_names(model))
            session = _session(model, provider, threads)
            runner(session, feeds)()
        except Exception:  # inputs it cannot take, or no kernel: left uncharged
            continue
        parts.append(Freed(session, feeds, sites))
    return parts


def _refuses_what_the_original_runs(
    original: onnx.ModelProto,
    replacement: onnx.ModelProto,
    unfused: ort.InferenceSession,
    feeds: dict[str, np.ndarray],
) -> bool:
    """Whether the fused side failed where the unfused nodes compute: it reads no input they
    do not read (a value another site computes, here generated numbers), and they run on the
    same feeds. The provider then refuses the fused op as written, at run time (CUDA's
    GroupQueryAttention without present outputs), not the generated inputs."""
    read = {name for node in original.graph.node for name in node.input}
    own = {name for node in replacement.graph.node for name in node.input} - read
    if own & {value.name for value in replacement.graph.input}:
        return False
    try:
        runner(unfused, feeds)()
    except Exception:  # onnxruntime's own types: the inputs, not the fusion
        return False
    return True


# onnxruntime's status prefix, repeated once per layer the error passed through.
_ORT_STATUS = re.compile(r"\[ONNXRuntimeError\] : \d+ : [A-Z_]+ : ")


def _first_line(error: Exception) -> str:
    """The error's own words: its first line, from after onnxruntime's last status prefix
    (the kernel's reason, not the source file and signature that wrap it)."""
    text = str(error).strip()
    if not text:
        return repr(error)
    line = text.splitlines()[0]
    return _ORT_STATUS.split(line)[-1].strip()[:400] or line[:400]


def tune_section(
    classes: Sequence[ClassResult], provider: str, threads: int, model_name: str
) -> Section:
    """The repository section the measured classes make."""
    return Section(
        provider=provider,
        onnxruntime=ort.__version__,
        device=device_identity(provider),
        threads=threads,
        measured=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        fusectl=__version__,
        models=[model_name],
        sites={c.site_class.key: c.entry(model_name) for c in classes if c.verdict is not None},
    )


def merged_repository(path: Path | None, section: Section) -> Repository:
    """The repository at ``path`` (or a new one) with ``section`` merged in."""
    repository = load_repository(path, missing_ok=True) if path else Repository(None)
    repository.update(section)
    return repository
