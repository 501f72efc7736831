"""The pass catalogue: how a pass is declared, and the one registry every pass lives in.

Built-in passes and user plugins register through the same decorator, so the CLI, the switch
resolver and the reports never need to know where a pass came from.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import difflib
import enum
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar

from fusectl.rewrite.graph import node_label

if TYPE_CHECKING:
    import onnx_ir as ir

    from fusectl.rewrite.context import PassContext


class Category(str, enum.Enum):
    """The two Ascend namespaces; a switch file addresses each separately."""

    GRAPH = "GraphFusion"
    UB = "UBFusion"


class Numerics(str, enum.Enum):
    """How far a pass's output may drift from the original in floating point."""

    EXACT = "exact"
    REASSOCIATING = "reassociating"
    APPROXIMATE = "approximate"


# Ascend FE priority bands (lower runs earlier). User-file priorities take 0-2999 (see
# fusectl.core.switches); built-in passes declare one of these or fall into the default band.
BUILTIN_TOP = range(3000, 4000)
BUILTIN_MAIN = range(4000, 5000)
BUILTIN_DOWN = range(5000, 6000)
CUSTOM_DEFAULT_PRIORITY = 6000
BUILTIN_DEFAULT_PRIORITY = 8000
DOWN_BAND_OFFSET = 10000

BUILTIN_ORIGIN = "built-in"

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")

ALL_TARGETS = ("ort", "onnx")


@dataclass(frozen=True)
class PassSpec:
    """Everything the catalogue, the switch resolver and the reports need to know of a pass."""

    name: str
    category: Category
    description: str
    aliases: tuple[str, ...] = ()
    default_on: bool = True
    closable: bool = True
    numerics: Numerics = Numerics.EXACT
    priority: int | None = None
    targets: tuple[str, ...] = ALL_TARGETS
    min_opset: int = 1
    emits: tuple[str, ...] = ()
    emits_domain: str = ""
    # Where the pass comes from: "built-in", "plugin <file>", "entry point <name> (<dist>)",
    # "python <module>". Stamped by the registry when the pass registers (see loading_origin).
    origin: str = BUILTIN_ORIGIN
    counted: bool = True
    required: bool = False
    # The settings (ctx.options keys, from CLI flags) the pass reads.
    options: tuple[str, ...] = ()
    # A canonicalization: consecutive canonical passes run again, as a group, until none of
    # them changes the graph, since each can expose work for another (a folded dimension
    # makes a Slice whole; a removed Slice makes the next Shape static).
    canonical: bool = False
    # Whether what the pass fuses is in every layer of a model that has it: when not (the one
    # norm with no residual Add in front), the per-layer coverage does not flag the others.
    every_layer: bool = True
    # A graph pass the engine runs once more after the UB fusions, when it is enabled: it
    # merges chains the fusions make adjacent (two Reshapes that a removed op stood between),
    # which a second run of fusectl would otherwise find.
    again_after_fusions: bool = False

    def __post_init__(self) -> None:
        for label in (self.name, *self.aliases):
            if not _NAME_RE.match(label) or label == "ALL":
                raise ValueError(
                    f"pass name {label!r} is not valid: use letters, digits, '_', '.', '-'"
                )
        if self.required and self.closable:
            raise ValueError(f"pass {self.name}: a required pass cannot be closable")

    @property
    def custom(self) -> bool:
        """A pass a user added (plugin, entry point, API call), not one fusectl ships."""
        return self.origin != BUILTIN_ORIGIN

    @property
    def effective_priority(self) -> int:
        """Where this pass runs within its category when no switch file reorders it."""
        if self.priority is None:
            return CUSTOM_DEFAULT_PRIORITY if self.custom else BUILTIN_DEFAULT_PRIORITY
        if self.priority in BUILTIN_DOWN:
            return self.priority + DOWN_BAND_OFFSET
        return self.priority


class FusionPass(abc.ABC):
    """A registered pass: a spec plus an in-place transformation of the model."""

    spec: ClassVar[PassSpec]
    # True when every change the pass makes to the graph's nodes is counted on its context
    # (ctx.changed: replace_subgraph, record_fusion) or changes the node count (nodes only
    # removed): a run of it that changed nothing then leaves the engine's op index valid. A
    # pass that may add, reorder or retype nodes without counting it keeps the default.
    counts_changes: ClassVar[bool] = False

    @abc.abstractmethod
    def run(self, model: ir.Model, ctx: PassContext) -> None:
        """Rewrite ``model`` in place, recording matches, effects and declines on ``ctx``."""

    def keep_unfused(self, nodes: Sequence[ir.Node]) -> bool:
        """Called for a site the knowledge repository keeps unfused (the fused kernel measured
        slower): rewrite ``nodes`` exactly so that onnxruntime's own online fusion cannot fuse
        them into that kernel at ORT_ENABLE_ALL. True when the graph changed. Most passes emit
        kernels onnxruntime does not fuse on its own, and leave the site as it is."""
        return False

    def check_options(self, options: Mapping[str, str]) -> None:
        """Raise FusectlError for settings this pass cannot use: called when the plan is made,
        so a bad flag stops the run before any pass has run. Most passes read none."""
        return None


class NodeByNodePass(FusionPass):
    """A pass that judges each node of one op type alone: ``judge`` rewrites at it, or says
    why not (a near miss under ``pattern``), or returns None where it is no candidate."""

    anchor: ClassVar[str]
    pattern: ClassVar[str]

    def run(self, model: ir.Model, ctx: PassContext) -> None:
        graph = model.graph
        stats = ctx.pattern(self.pattern)
        for node in ctx.op_index.of_type(graph, self.anchor):
            if node.graph is graph:  # not removed by an earlier rewrite of this run
                reason = self.judge(ctx, node)
                if reason is not None:
                    stats.decline(reason, node_label(node))

    @abc.abstractmethod
    def judge(self, ctx: PassContext, node: ir.Node) -> str | None:
        """Rewrite at ``node`` if it is a site; why not where it nearly is; else None."""


@dataclass
class PassRegistry:
    """Passes by canonical name, in registration order, with their aliases."""

    _passes: dict[str, FusionPass] = field(default_factory=dict)
    _lookup: dict[str, str] = field(default_factory=dict)

    def register(self, fusion_pass: FusionPass, *, replace: bool = False) -> None:
        spec = fusion_pass.spec
        origin = _origin_of(fusion_pass)
        if origin != spec.origin:
            spec = fusion_pass.spec = dataclasses.replace(spec, origin=origin)
        labels = (spec.name, *spec.aliases)
        if spec.name in self._passes and not replace:
            raise ValueError(
                f"a pass named {spec.name!r} is already registered "
                f"({self._passes[spec.name].spec.origin}); pass replace=True to replace it"
            )
        if spec.name in self._passes:
            self.unregister(spec.name)
        for label in labels:
            owner = self._lookup.get(label)
            if owner is not None:
                raise ValueError(f"name {label!r} of pass {spec.name} is already used by {owner}")
        self._passes[spec.name] = fusion_pass
        for label in labels:
            self._lookup[label] = spec.name

    def unregister(self, name: str) -> None:
        removed = self._passes.pop(name)
        for label in (removed.spec.name, *removed.spec.aliases):
            self._lookup.pop(label, None)

    def snapshot(self) -> PassRegistry:
        """A copy to restore later: tests and notebooks register passes for a while."""
        return PassRegistry(dict(self._passes), dict(self._lookup))

    def restore(self, saved: PassRegistry) -> None:
        self._passes = dict(saved._passes)
        self._lookup = dict(saved._lookup)

    def canonical(self, name: str) -> str | None:
        """The canonical name for a canonical name or alias, or None when unknown."""
        return self._lookup.get(name)

    def suggest(self, name: str) -> str | None:
        """The closest known name, for 'did you mean' hints."""
        folded = {label.lower(): label for label in self._lookup}
        hits = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.6)
        return folded[hits[0]] if hits else None

    def __getitem__(self, name: str) -> FusionPass:
        return self._passes[name]

    def __iter__(self) -> Iterator[FusionPass]:
        return iter(list(self._passes.values()))

    def __len__(self) -> int:
        return len(self._passes)


REGISTRY = PassRegistry()

# The origin of the passes registering now, set while fusectl imports a plugin or its own passes.
_LOADING: contextvars.ContextVar[str | None] = contextvars.ContextVar("origin", default=None)
_BUILTIN_MODULES = ("fusectl.passes.", "passes.")


@contextlib.contextmanager
def loading_origin(origin: str) -> Iterator[None]:
    """Stamp every pass registered inside the block with ``origin``."""
    token = _LOADING.set(origin)
    try:
        yield
    finally:
        _LOADING.reset(token)


def _origin_of(fusion_pass: FusionPass) -> str:
    loading = _LOADING.get()
    if loading is not None:
        return loading
    if fusion_pass.spec.origin != BUILTIN_ORIGIN:
        return fusion_pass.spec.origin
    module = type(fusion_pass).__module__
    return BUILTIN_ORIGIN if module.startswith(_BUILTIN_MODULES) else f"python {module}"


PassT = TypeVar("PassT", bound=type[FusionPass])


def register_pass(
    cls: PassT | None = None, *, replace: bool = False
) -> PassT | Callable[[PassT], PassT]:
    """Class decorator that instantiates a FusionPass subclass and adds it to the registry."""

    def decorate(pass_cls: PassT) -> PassT:
        REGISTRY.register(pass_cls(), replace=replace)
        return pass_cls

    return decorate if cls is None else decorate(cls)


def unregister_pass(name: str) -> FusionPass:
    """Remove a pass (by canonical name or alias) that ``register_pass`` added, and return
    it: tests and interactive sessions register a pass for a while, then take it back."""
    canonical = REGISTRY.canonical(name)
    if canonical is None:
        raise KeyError(f"no pass named {name!r} is registered")
    removed = REGISTRY[canonical]
    REGISTRY.unregister(canonical)
    return removed
