"""The fusion knowledge repository: per execution provider, which fusions measured slower.

A fused kernel is a win on one provider and a loss on another, and that changes between
onnxruntime versions (onnxruntime 1.32's CPU SkipLayerNormalization takes 7x the time of the
Add + LayerNormalization it replaces). ``fusectl tune`` times each site class of a model fused
and unfused and records the verdict here; ``fusectl optimize --providers P`` then declines
every site whose class the repository marks slower on P, with the measured reason, and counts
the hit as ATC counts hits in its knowledge repository (``repository_hit_times``).

The file is JSON::

    {"format": "fusectl-repository", "version": 1,
     "sections": [{"provider": "CPUExecutionProvider", "onnxruntime": "1.32.0",
                   "device": "<CPU model> (x86_64)", "threads": 1, "measured": "<UTC time>",
                   "fusectl": "<version>", "models": [...],
                   "sites": {"<site class key>": {"decision": "unfused", "fused_ms": 0.49,
                                                  "unfused_ms": 0.065, "ratio": 7.5, ...},
                             "<another key>": {"decision": "unsupported",
                                               "error": "<why the provider refused it>"}}}]}

A section is keyed by provider, onnxruntime version and device; a lookup takes the section
that matches all three, else the provider's section measured with the same onnxruntime, else
the provider's newest (with a warning that the measurement was made elsewhere). A site class
the section has not seen keeps its pass's default.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnxruntime as ort

from fusectl.core import logs
from fusectl.errors import FusectlError
from fusectl.rewrite.sites import FLOATING_NAMES, SiteClass, is_kernel, site_class

if TYPE_CHECKING:
    import onnx_ir as ir

    from fusectl.rewrite.context import PassContext

FORMAT = "fusectl-repository"
VERSION = 1
# Verdicts: the fused kernel measured slower (the site stays unfused), faster, or no
# difference beyond the noise (the pass default, fusing, stands); or the provider cannot run the
# fused op at all (no kernel for those types or attributes there: CUDA's FusedConv takes no Clip).
UNFUSED, FUSED, SAME, UNSUPPORTED = "unfused", "fused", "same", "unsupported"
DECISIONS = (UNFUSED, FUSED, SAME, UNSUPPORTED)
KEPT_UNFUSED = (UNFUSED, UNSUPPORTED)
SHIPPED = "repository.json"
# The fields of a repository entry that a provider's refusal depends on, in _refusal's order.
_REFUSAL_FIELDS = ("pass", "fused", "attributes", "inputs", "kernel_types")
NONE = "none"


def provider_name(text: str) -> str:
    """The full name of an execution provider: 'cpu' and 'cuda' are short for the full names.
    Any provider onnxruntime knows is accepted, installed or not: a model may be optimized here
    for a device it will run on elsewhere."""
    known = ort.get_all_providers()
    folded = {name.lower().removesuffix("executionprovider"): name for name in known}
    name = folded.get(text.strip().lower().removesuffix("executionprovider"))
    if name is None:
        raise FusectlError(
            f"--providers: '{text.strip()}' is not an onnxruntime execution provider "
            f"(known: {', '.join(known)})"
        )
    return name


def parse_provider_list(text: str | Sequence[str] | None) -> list[str]:
    """--providers as a list of full names; the first is the one the output is tuned for."""
    items = text.split(",") if isinstance(text, str) else list(text or ())
    names = [provider_name(item) for item in items if item.strip()]
    return names or ["CPUExecutionProvider"]


def device_identity(provider: str) -> str:
    """What the measurements depend on besides the provider: the CPU model for the CPU
    provider, the GPU's name (from nvidia-smi, when there is one) for CUDA and TensorRT."""
    if provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        try:
            found = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            if found:
                return found.splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
        return "unknown GPU"
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or 'unknown CPU'} ({platform.machine()})"


@dataclass
class Section:
    """The measurements of one provider, onnxruntime version and device."""

    provider: str
    onnxruntime: str
    device: str
    threads: int = 1
    measured: str = ""
    fusectl: str = ""
    models: list[str] = field(default_factory=list)
    sites: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def provenance(self) -> str:
        return (
            f"{self.provider}, onnxruntime {self.onnxruntime}, {self.device}, "
            f"{self.threads} thread(s), measured {self.measured or 'at an unknown time'}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "onnxruntime": self.onnxruntime,
            "device": self.device,
            "threads": self.threads,
            "measured": self.measured,
            "fusectl": self.fusectl,
            "models": self.models,
            "sites": {key: self.sites[key] for key in sorted(self.sites)},
        }


@dataclass
class Repository:
    """A repository file's sections, and where it came from."""

    path: Path | None
    sections: list[Section] = field(default_factory=list)

    def section(self, provider: str) -> tuple[Section | None, str | None]:
        """The section that decides for ``provider`` here, and a warning when it was measured
        with another onnxruntime or on another device."""
        mine = [s for s in self.sections if s.provider == provider]
        if not mine:
            return None, None
        version, device = ort.__version__, device_identity(provider)
        for wanted in (
            lambda s: s.onnxruntime == version and s.device == device,
            lambda s: s.onnxruntime == version,
        ):
            found = [s for s in mine if wanted(s)]
            if found:
                chosen = found[-1]
                if chosen.device != device:
                    return chosen, (
                        f"knowledge repository {self.label}: {provider} measured on "
                        f"{chosen.device}, this is {device}"
                    )
                return chosen, None
        chosen = max(mine, key=lambda s: s.measured)
        return chosen, (
            f"knowledge repository {self.label}: {provider} measured with onnxruntime "
            f"{chosen.onnxruntime}, this is {version}"
        )

    def update(self, section: Section) -> None:
        """Merge ``section``'s sites into the one with its key, or add it."""
        for existing in self.sections:
            if (existing.provider, existing.onnxruntime, existing.device, existing.threads) == (
                section.provider,
                section.onnxruntime,
                section.device,
                section.threads,
            ):
                existing.sites.update(section.sites)
                existing.models = list(dict.fromkeys([*existing.models, *section.models]))
                existing.measured, existing.fusectl = section.measured, section.fusectl
                return
        self.sections.append(section)

    @property
    def label(self) -> str:
        if self.path is None:
            return "(in memory)"
        return "shipped with fusectl" if self.path == shipped_path() else str(self.path)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "sections": [section.to_json() for section in self.sections],
        }

    def text(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def shipped_path() -> Path:
    """The repository that ships with fusectl: a CPU and a CUDA section, each measured as its
    provenance says."""
    return Path(str(resources.files("fusectl") / "data" / SHIPPED))


def _require(condition: bool, path: Path, what: str) -> None:
    if not condition:
        raise FusectlError(f"not a fusectl knowledge repository: {what}", path=path)


def _section(data: Any, path: Path, index: int) -> Section:
    where = f"sections[{index}]"
    _require(isinstance(data, Mapping), path, f"{where} is not an object")
    for name in ("provider", "onnxruntime", "device"):
        _require(isinstance(data.get(name), str), path, f"{where}.{name} is not a string")
    threads = data.get("threads", 1)
    _require(isinstance(threads, int), path, f"{where}.threads is not an integer")
    sites = data.get("sites", {})
    _require(isinstance(sites, Mapping), path, f"{where}.sites is not an object")
    for key, entry in sites.items():
        label = f"{where}.sites[{key!r}]"
        _require(isinstance(entry, Mapping), path, f"{label} is not an object")
        _require(
            entry.get("decision") in DECISIONS,
            path,
            f"{label}.decision is {entry.get('decision')!r}, not one of {', '.join(DECISIONS)}",
        )
        if entry["decision"] == UNSUPPORTED:
            _require(isinstance(entry.get("error"), str), path, f"{label}.error is not a string")
            continue
        for name in ("fused_ms", "unfused_ms"):
            _require(
                isinstance(entry.get(name), int | float) and entry[name] >= 0,
                path,
                f"{label}.{name} is not a non-negative number",
            )
    models = data.get("models", [])
    _require(isinstance(models, list), path, f"{where}.models is not a list")
    return Section(
        provider=data["provider"],
        onnxruntime=data["onnxruntime"],
        device=data["device"],
        threads=threads,
        measured=str(data.get("measured", "")),
        fusectl=str(data.get("fusectl", "")),
        models=[str(m) for m in models],
        sites={str(k): dict(v) for k, v in sites.items()},
    )


def load_repository(path: Path | str, *, missing_ok: bool = False) -> Repository:
    """Read and check a repository file; a bad one is a FusectlError naming what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing_ok:
            return Repository(path)
        raise FusectlError("knowledge repository not found", path=path) from None
    except (OSError, UnicodeDecodeError) as error:
        raise FusectlError(f"cannot read the knowledge repository: {error}", path=path) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise FusectlError(
            f"knowledge repository is not valid JSON: {error.msg} "
            f"(line {error.lineno}, column {error.colno})",
            path=path,
        ) from None
    _require(isinstance(data, Mapping), path, "the document is not an object")
    _require(data.get("format") == FORMAT, path, f'"format" is not "{FORMAT}"')
    _require(
        data.get("version") == VERSION,
        path,
        f'"version" {data.get("version")!r} is not supported (this fusectl reads {VERSION})',
    )
    sections = data.get("sections")
    _require(isinstance(sections, list), path, '"sections" is not a list')
    return Repository(path, [_section(item, path, i) for i, item in enumerate(sections)])


def choose_repository(repository: str | os.PathLike[str] | None, provider: str) -> Repository:
    """The repository a run uses: ``none`` for none, a path, or by default the shipped one
    (CPU and CUDA measurements; other providers find no section in it)."""
    if repository is not None and str(repository).lower() == NONE:
        return Repository(None)
    if repository is None:
        return load_repository(shipped_path())
    return load_repository(Path(repository))


def _family(pass_name: Any, pattern: Any, fused: Any, attributes: Any) -> tuple | None:
    """Site classes that differ only in their input shapes and the values of floating-point
    attributes: one fusion, one set of the attributes its cost may depend on."""
    if not all(isinstance(v, str) for v in (pass_name, pattern)) or not isinstance(fused, list):
        return None
    return (
        pass_name,
        pattern,
        tuple(fused),
        json.dumps(_cost_attributes(attributes), sort_keys=True),
    )


# A verdict this decisive (the slower side at least this many times the faster) also decides
# the same kernel matched in another spelling of what it computes: spellings one pass matches
# differ by a few element-wise ops, which do not close such a gap.
DECISIVE = 2.0


def _decisive(entry: Mapping[str, Any]) -> bool:
    fused, unfused = entry.get("fused_ms"), entry.get("unfused_ms")
    if entry.get("decision") not in (FUSED, UNFUSED) or not fused or not unfused:
        return False
    slower, faster = (fused, unfused) if entry["decision"] == UNFUSED else (unfused, fused)
    return slower >= DECISIVE * faster


def _tensor_inputs(inputs: Sequence[str]) -> list[str]:
    """A site's inputs but its scalar constants (an epsilon, an exponent: what one spelling
    reads as inputs and another as attributes)."""
    return [signature for signature in inputs if not re.fullmatch(r"const \S+\[\]", signature)]


def _cost_attributes(attributes: Any) -> Any:
    """The attributes a kernel's time may depend on: all but the floating-point ones (an
    epsilon, a scale), which change what it computes, not how long it takes (a norm measured
    with BERT's epsilon of 1e-12 decides for Flax's 1e-6)."""
    if isinstance(attributes, list):
        return [_cost_attributes(item) for item in attributes]
    if isinstance(attributes, Mapping):
        return {k: v for k, v in attributes.items() if not isinstance(v, float)}
    return attributes


def _text_attributes(attributes: Any) -> frozenset:
    """The attributes a kernel picks its computation by (an activation's or a mode's name):
    the text-valued ones, of any fused op."""
    if isinstance(attributes, list):
        return frozenset().union(*(_text_attributes(item) for item in attributes))
    if isinstance(attributes, Mapping):
        return frozenset((k, v) for k, v in attributes.items() if isinstance(v, str))
    return frozenset()


def _refusal(
    pass_name: Any, fused: Any, attributes: Any, inputs: Any, kernel_types: Any
) -> tuple | None:
    """What a provider's refusal of a fused op depends on: the fusion's kernels (its fused ops
    outside onnx's domain), their text attributes and the floating-point types they compute
    on (recorded with the class; for an entry written before, the types of the site's inputs
    that are not constants). Not the sizes, nor the pattern, the other ops it matched or their
    constants, which vary from one exporter to another: a provider registers a kernel for type
    constraints and refuses it for what it computes."""
    if not isinstance(pass_name, str) or not isinstance(fused, list | tuple):
        return None
    if not isinstance(inputs, list | tuple):
        return None
    kernels = tuple(sorted({str(op) for op in fused if is_kernel(str(op))})) or tuple(fused)
    if isinstance(kernel_types, list | tuple) and kernel_types:
        types = ("kernels", frozenset(map(str, kernel_types)))
    else:
        types = ("inputs", frozenset({str(s).partition("[")[0] for s in inputs} & FLOATING_NAMES))
    return pass_name, kernels, _text_attributes(attributes), types


def _fits(measured: str, site: str) -> bool:
    """A measured input signature covers a site's: same kind and element type, the same rank,
    each dimension equal or symbolic (``?``) in the measured one."""
    measured_head, _, measured_dims = measured.partition("[")
    site_head, _, site_dims = site.partition("[")
    wanted, given = measured_dims.rstrip("]").split(","), site_dims.rstrip("]").split(",")
    return (
        measured_head == site_head
        and len(wanted) == len(given)
        and all(m in ("?", s) for m, s in zip(wanted, given, strict=True))
    )


def _covers(measured: Sequence[str], site: Sequence[str]) -> bool:
    """Every input of the site fits a distinct measured input (exact ones first)."""
    free = list(measured)
    if len(free) != len(site):
        return False
    for signature in site:
        match = (
            signature if signature in free else next((m for m in free if _fits(m, signature)), None)
        )
        if match is None:
            return False
        free.remove(match)
    return True


def repository_gate(
    providers: str | Sequence[str] | None, repository: str | os.PathLike[str] | None
) -> RepositoryGate | None:
    """A fresh gate applying the repository's verdicts for the first provider, if it has a
    section for it; one measured elsewhere is used with a warning (RepositoryGate.warn)."""
    provider = parse_provider_list(providers)[0]
    section, warning = choose_repository(repository, provider).section(provider)
    return RepositoryGate(section, warning=warning) if section is not None else None


def ms(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.0f}"


@dataclass
class RepositoryGate:
    """Declines, during a run, each site whose class the section marks slower on its provider.

    Every site whose class the section has a verdict for is a hit (counted on the pass's
    context as ``repository_hits``); ``decisions`` keeps one line per hit for the report."""

    section: Section
    # Where the section was measured, when not with this onnxruntime on this device.
    warning: str | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    _passes: frozenset[str] = frozenset()
    _vetoed: dict[tuple[str, ir.Node], str] = field(default_factory=dict)

    _families: dict[tuple, list[tuple[list[str], str]]] = field(default_factory=dict)
    # Decisive verdicts (DECISIVE), by kernel: (pass, fused ops, attributes) with any pattern.
    _kernels: dict[tuple, list[tuple[list[str], str]]] = field(default_factory=dict)
    _refusals: dict[tuple, str] = field(default_factory=dict)  # unsupported, by _refusal
    # lookup's answers: a model's sites fall in a handful of classes.
    _found: dict[SiteClass, tuple[str, dict[str, Any]] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._passes = frozenset(key.split("/", 1)[0] for key in self.section.sites if "/" in key)
        for key, entry in self.section.sites.items():
            family = _family(
                entry.get("pass"), entry.get("pattern"), entry.get("fused"), entry.get("attributes")
            )
            if family is not None and isinstance(entry.get("inputs"), list):
                self._families.setdefault(family, []).append((entry["inputs"], key))
                if _decisive(entry):
                    kernel = (family[0], *family[2:])
                    tensors = _tensor_inputs(entry["inputs"])
                    self._kernels.setdefault(kernel, []).append((tensors, key))
            if entry["decision"] == UNSUPPORTED:
                refusal = _refusal(*(entry.get(k) for k in _REFUSAL_FIELDS))
                if refusal is not None:
                    self._refusals.setdefault(refusal, key)

    def warn(self) -> None:
        """Log where the verdicts were measured, if elsewhere (once a run has succeeded, so
        that a bad input still gets its one line)."""
        if self.warning is not None:
            logs.logger.warning("%s", self.warning)

    def lookup(self, found: SiteClass) -> tuple[str, dict[str, Any]] | None:
        """The measurement that decides a site of class ``found``: its own class, else the
        most specific measured class of the same fusion (floating-point attributes aside)
        whose inputs cover the site's (a dimension measured symbolic, ``?``, covers any size:
        a class measured for every batch size holds for batch 1), else a refusal of the same
        fused ops with the same text attributes and element types at other sizes."""
        if found not in self._found:
            self._found[found] = self._measured(found)
        return self._found[found]

    def _measured(self, found: SiteClass) -> tuple[str, dict[str, Any]] | None:
        entry = self.section.sites.get(found.key)
        if entry is not None:
            return found.key, entry
        family = _family(
            found.pass_name, found.pattern, list(found.fused), json.loads(found.attributes)
        )
        covering = [
            (sum(s.count("?") for s in inputs), key)
            for inputs, key in self._families.get(family, [])
            if _covers(inputs, found.inputs)
        ]
        if not covering and family is not None:  # the same kernel matched in another spelling
            tensors = _tensor_inputs(found.inputs)
            covering = [
                (sum(s.count("?") for s in inputs), key)
                for inputs, key in self._kernels.get((family[0], *family[2:]), [])
                if _covers(inputs, tensors)
            ]
        if not covering:
            # By the types the kernels compute on, else as an entry without them reads.
            for types in (found.kernel_types, ()):
                refused = self._refusals.get(
                    _refusal(
                        found.pass_name,
                        found.fused,
                        json.loads(found.attributes),
                        found.inputs,
                        types,
                    )
                )
                if refused is not None:
                    return refused, self.section.sites[refused]
            return None
        key = min(covering)[1]
        return key, self.section.sites[key]

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
        if ctx.spec.name not in self._passes:
            return None
        # A smaller pattern of the same pass over nodes a measured-slower site covered would
        # emit the same slow kernel without the part that was measured: it is declined alike.
        for node in old_nodes:
            earlier = self._vetoed.get((ctx.spec.name, node))
            if earlier is not None:
                return earlier
        found = site_class(ctx, pattern, old_nodes, new_nodes)
        measured = self.lookup(found) if found is not None else None
        if measured is None:
            return None
        measured_key, entry = measured
        ctx.repository_hits += 1
        decision = entry["decision"]
        record = {"pass": ctx.spec.name, "site": site, "class": measured_key, "decision": decision}
        if decision == UNSUPPORTED:
            record["error"] = entry["error"]
            reason = f"does not run on {self.section.provider}: {entry['error']}"
        else:
            fused, unfused = float(entry["fused_ms"]), float(entry["unfused_ms"])
            record.update(fused_ms=fused, unfused_ms=unfused)
            reason = f"slower on {self.section.provider}: {ms(fused)} vs {ms(unfused)} ms"
        self.decisions.append(record)
        if decision not in KEPT_UNFUSED:
            return None
        for node in old_nodes:
            self._vetoed[ctx.spec.name, node] = reason
        if ctx.keep_unfused is not None and ctx.keep_unfused(old_nodes):
            ctx.changed = True
        return reason

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for decision in self.decisions:
            counts[decision["decision"]] = counts.get(decision["decision"], 0) + 1
        return {"hits": len(self.decisions), "by_decision": counts}
