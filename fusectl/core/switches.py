"""Fusion switches: the Ascend switch-file formats, the CLI switches, and which passes run.

Precedence per pass, highest first: --optimization_switch, --enable_pass/--disable_pass,
required (forced on), --pattern_fusion_pass off (custom passes), --oo_level O1, an exact name
in the switch file, ALL of the pass's category, the pass's default. A pass whose output cannot
run on --target stays off whatever asked for it. GraphFusion and UBFusion are separate
namespaces in the file.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fusectl.errors import FusectlError
from fusectl.rewrite.registry import (
    DOWN_BAND_OFFSET,
    Category,
    FusionPass,
    PassRegistry,
)

ALL = "ALL"
_TOP_KEYS = ("Switch", "Priority", "ExceptionalPassOfO1Level")
_BANDS = {"Top": range(0, 1000), "Main": range(1000, 2000), "Down": range(2000, 3000)}


@dataclass
class SwitchFile:
    """A parsed fusion switch file: on/off entries and priorities per category."""

    path: Path
    legacy: bool
    entries: dict[Category, dict[str, bool]] = field(default_factory=dict)
    priorities: dict[Category, dict[str, int]] = field(default_factory=dict)
    o1_exceptions: tuple[str, ...] = ()
    warnings: list[str] = field(default_factory=list)


def parse_switch_file(path: str | Path) -> SwitchFile:
    """Read a switch file in the JSON format, or the legacy ``Name:on|off`` line format."""
    file_path = Path(path)
    try:
        raw = file_path.read_bytes()
    except FileNotFoundError:
        raise FusectlError("switch file does not exist", path=file_path) from None
    except IsADirectoryError:
        raise FusectlError("switch file is a directory", path=file_path) from None
    except OSError as error:
        raise FusectlError(f"cannot read switch file: {error.strerror}", path=file_path) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise FusectlError("switch file is not UTF-8 text", path=file_path) from None
    if not text.strip():
        raise FusectlError("switch file is empty", path=file_path)
    if text.lstrip()[0] in "{[":
        return _parse_json(file_path, text)
    return _parse_legacy(file_path, text)


def _bad(path: Path, message: str) -> FusectlError:
    return FusectlError(message, path=path)


def _parse_json(path: Path, text: str) -> SwitchFile:
    duplicates: list[str] = []

    def keep_last(pairs: list[tuple[str, object]]) -> dict[str, object]:
        seen: dict[str, object] = {}
        for key, value in pairs:
            if key.strip() in seen:
                duplicates.append(key.strip())
            seen[key.strip()] = value
        return seen

    try:
        document = json.loads(text, object_pairs_hook=keep_last)
    except json.JSONDecodeError as error:
        raise _bad(
            path, f"invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except RecursionError:
        raise _bad(path, "JSON nested too deeply for a switch file") from None
    if not isinstance(document, dict):
        raise _bad(path, f"top level is a JSON {type(document).__name__}, it must be an object")
    result = SwitchFile(path, legacy=False)
    result.warnings.extend(f"duplicate key '{key}': the last one is used" for key in duplicates)
    for key, value in document.items():
        if key not in _TOP_KEYS:
            raise _bad(path, f"first-level key '{key}' is not one of {', '.join(_TOP_KEYS)}")
        if key == "ExceptionalPassOfO1Level":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise _bad(path, "ExceptionalPassOfO1Level must be an array of pass names")
            result.o1_exceptions = tuple(v.strip() for v in value)
            continue
        for category_key, body in _categories(path, key, value):
            if key == "Switch":
                result.entries[category_key] = _switch_entries(path, category_key, body)
            else:
                result.priorities[category_key] = _priority_entries(path, category_key, body)
    return result


def _categories(path: Path, section: str, value: object) -> Iterable[tuple[Category, dict]]:
    if not isinstance(value, dict):
        raise _bad(path, f"'{section}' must be an object with GraphFusion and/or UBFusion")
    for key, body in value.items():
        try:
            category = Category(key)
        except ValueError:
            raise _bad(
                path, f"key '{section}.{key}' is not valid: it must be GraphFusion or UBFusion"
            ) from None
        if not isinstance(body, dict):
            raise _bad(path, f"'{section}.{key}' must be an object")
        yield category, body


def _switch_entries(path: Path, category: Category, body: dict) -> dict[str, bool]:
    entries = {}
    for name, value in body.items():
        where = f"Switch.{category.value}.{name}"
        if not isinstance(value, str):
            raise _bad(
                path,
                f'value of \'{where}\' must be the string "on" or "off", not {json.dumps(value)}',
            )
        state = value.strip()
        if state not in ("on", "off"):
            raise _bad(path, f'value of \'{where}\' is "{value}": it must be "on" or "off"')
        entries[name] = state == "on"
    return entries


def _priority_entries(path: Path, category: Category, body: dict) -> dict[str, int]:
    priorities: dict[str, int] = {}
    for band, passes in body.items():
        where = f"Priority.{category.value}.{band}"
        if band not in _BANDS:
            raise _bad(path, f"key '{where}' is not valid: it must be Top, Main or Down")
        if not isinstance(passes, dict):
            raise _bad(path, f"'{where}' must be an object of pass name to priority")
        allowed = _BANDS[band]
        for name, raw in passes.items():
            try:
                value = int(raw.strip()) if isinstance(raw, str) else raw
            except ValueError:
                value = None
            if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
                raise _bad(
                    path,
                    f"priority of '{where}.{name}' is {json.dumps(raw)}: it must be an integer "
                    f"in [{allowed.start}, {allowed.stop})",
                )
            if name in priorities:
                raise _bad(path, f"pass '{name}' has more than one priority in {category.value}")
            priorities[name] = value + (DOWN_BAND_OFFSET if band == "Down" else 0)
    return priorities


def _parse_legacy(path: Path, text: str) -> SwitchFile:
    """``PassName:on|off`` per line; applies to both categories, as in Ascend FE."""
    entries: dict[str, bool] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, colon, value = stripped.partition(":")
        if not colon:
            raise _bad(path, f"line {number}: '{stripped}' is not 'PassName:on' or 'PassName:off'")
        name, value = name.strip(), value.strip()
        if not name:
            raise _bad(path, f"line {number}: pass name is empty")
        if value not in ("on", "off"):
            raise _bad(
                path,
                f"line {number}: the switch value of pass {name} must be on or off, "
                f"instead of '{value}'",
            )
        if name in entries:
            raise _bad(path, f"line {number}: pass {name} is repeated")
        entries[name] = value == "on"
    if not entries:
        raise _bad(path, "switch file has no entries")
    return SwitchFile(
        path, legacy=True, entries={Category.GRAPH: dict(entries), Category.UB: dict(entries)}
    )


def parse_optimization_switch(text: str) -> dict[str, bool]:
    """``"A:on;B:off"`` as ATC's --optimization_switch takes it."""
    result: dict[str, bool] = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        name, colon, value = item.partition(":")
        name, value = name.strip(), value.strip()
        if not colon or not name or value not in ("on", "off"):
            raise FusectlError(
                f"--optimization_switch entry '{item.strip()}' is not 'PassName:on' or "
                "'PassName:off'"
            )
        result[name] = value == "on"
    return result


def split_pass_list(values: Sequence[str]) -> list[str]:
    """Comma-separated names from a repeatable option."""
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


class Source(str, enum.Enum):
    """Why a pass is on or off, as the report states it."""

    DEFAULT = "default"
    FILE = "file"
    ALL = "ALL"
    CLI = "CLI"
    FORCED = "forced"
    OO_LEVEL = "oo_level"
    CUSTOM = "pattern_fusion_pass"
    TARGET = "target"
    FAILED = "failed"  # raised on this model (a fusectl bug): run again without it


@dataclass
class Decision:
    fusion_pass: FusionPass
    enabled: bool
    source: Source
    detail: str
    priority: int

    @property
    def name(self) -> str:
        return self.fusion_pass.spec.name


@dataclass
class Plan:
    """Every registered pass in execution order, with its state and the reason for it."""

    decisions: list[Decision]
    warnings: list[str]
    notes: list[str]
    # Settings passes read while they run (ctx.options), e.g. graph_kernel_flags.
    options: dict[str, str] = field(default_factory=dict)

    def enabled(self) -> list[Decision]:
        return [d for d in self.decisions if d.enabled]


@dataclass
class SwitchRequest:
    """Everything the user said about which passes run."""

    switch_file: SwitchFile | None = None
    enable: Sequence[str] = ()
    disable: Sequence[str] = ()
    optimization_switch: dict[str, bool] = field(default_factory=dict)
    oo_level: str = "O3"
    target: str = "ort"
    strict: bool = False
    # False turns every custom pass off at once (TorchAir's pattern_fusion_pass); naming one
    # with --enable_pass or --optimization_switch still turns it on.
    custom_passes: bool = True
    pass_options: dict[str, str] = field(default_factory=dict)


class _Names:
    """Turns user-written names into canonical ones, collecting warnings for unknown names."""

    def __init__(self, registry: PassRegistry, strict: bool) -> None:
        self.registry = registry
        self.strict = strict
        self.unknown: list[str] = []

    def resolve(self, name: str, where: str) -> str | None:
        canonical = self.registry.canonical(name)
        if canonical is None:
            hint = self.registry.suggest(name)
            message = f"unknown pass name '{name}' in {where}"
            message += f"; did you mean '{hint}'?" if hint else ""
            if message not in self.unknown:
                self.unknown.append(message)
        return canonical

    def resolve_map(self, entries: dict[str, bool], where: str) -> dict[str, bool]:
        return {
            canonical: value
            for name, value in entries.items()
            if name != ALL and (canonical := self.resolve(name, where)) is not None
        }


def resolve(registry: PassRegistry, request: SwitchRequest) -> Plan:
    """Decide, for every registered pass, whether it runs, why, and in which order."""
    names = _Names(registry, request.strict)
    warnings: list[str] = []
    notes: list[str] = []
    file = request.switch_file
    file_label = (
        f"fusion switch config file, Option[ge.fusionSwitchFile][{file.path}]" if file else ""
    )
    if file:
        warnings.extend(f"{file.path}: {w}" for w in file.warnings)

    opt_switch = names.resolve_map(request.optimization_switch, "--optimization_switch")
    enable = {n for raw in request.enable if (n := names.resolve(raw, "--enable_pass"))}
    disable = {n for raw in request.disable if (n := names.resolve(raw, "--disable_pass"))}
    if both := sorted(enable & disable):
        raise FusectlError(f"--enable_pass and --disable_pass both name {', '.join(both)}")

    file_entries: dict[Category, dict[str, bool]] = {}
    file_all: dict[Category, bool] = {}
    file_priority: dict[Category, dict[str, int]] = {}
    o1_exceptions: set[str] = set()
    if file:
        for category, entries in file.entries.items():
            if ALL in entries:
                file_all[category] = entries[ALL]
            where = f"{file.path} ({category.value})" if not file.legacy else str(file.path)
            resolved = names.resolve_map(entries, where)
            if not file.legacy:
                for canonical in resolved:
                    actual = registry[canonical].spec.category
                    if actual != category:
                        warnings.append(
                            f"{file.path}: {canonical} is a {actual.value} pass; its entry under "
                            f"{category.value} has no effect"
                        )
                resolved = {
                    n: v for n, v in resolved.items() if registry[n].spec.category == category
                }
            file_entries[category] = resolved
        for category, priorities in file.priorities.items():
            file_priority[category] = {
                canonical: value
                for name, value in priorities.items()
                if (canonical := names.resolve(name, f"{file.path} (Priority)"))
            }
        o1_exceptions = {
            n for raw in file.o1_exceptions if (n := names.resolve(raw, f"{file.path} (O1)"))
        }
    if names.unknown:
        if request.strict:
            raise FusectlError(names.unknown[0] + " (--strict)")
        warnings.extend(names.unknown)

    decisions: list[Decision] = []
    kept_on_by_force: dict[Category, list[str]] = {}
    for fusion_pass in registry:
        spec = fusion_pass.spec
        name, category = spec.name, spec.category
        entries = file_entries.get(category, {})
        asked_off = (
            opt_switch.get(name) is False
            or name in disable
            or entries.get(name) is False
            or (name not in entries and file_all.get(category) is False)
        )
        if spec.required:
            enabled, source, detail = True, Source.FORCED, "required infrastructure, always runs"
            if asked_off:
                if file_all.get(category) is False and name not in entries:
                    kept_on_by_force.setdefault(category, []).append(name)
                else:
                    warnings.append(f"pass {name} is required and cannot be switched off")
        elif name in opt_switch:
            enabled, source, detail = opt_switch[name], Source.CLI, "--optimization_switch"
        elif name in enable or name in disable:
            enabled = name in enable
            source = Source.CLI
            detail = "--enable_pass" if enabled else "--disable_pass"
        elif spec.custom and not request.custom_passes:
            enabled, source, detail = False, Source.CUSTOM, "--pattern_fusion_pass off"
        elif request.oo_level == "O1" and name not in o1_exceptions:
            enabled, source, detail = False, Source.OO_LEVEL, "--oo_level O1"
        elif request.oo_level == "O1":
            enabled, source, detail = True, Source.OO_LEVEL, "ExceptionalPassOfO1Level"
        elif name in entries:
            enabled, source, detail = entries[name], Source.FILE, file_label
        elif category in file_all:
            enabled, source = file_all[category], Source.ALL
            detail = f"ALL in {category.value} of {file_label}"
        else:
            enabled, source = spec.default_on, Source.DEFAULT
            detail = f"default of {spec.origin}" if spec.custom else "built-in default"
        if enabled and request.target not in spec.targets:
            if source is not Source.DEFAULT and source is not Source.ALL:
                warnings.append(
                    f"pass {name} stays off: its output does not run with --target {request.target}"
                )
            enabled, source = False, Source.TARGET
            detail = f"--target {request.target}: emits {', '.join(spec.emits) or 'non-standard'}"
            detail += " ops that only " + "/".join(spec.targets) + " runs"
        priority = file_priority.get(category, {}).get(name, spec.effective_priority)
        decisions.append(Decision(fusion_pass, enabled, source, detail, priority))

    for option in request.pass_options:
        readers = [d for d in decisions if option in d.fusion_pass.spec.options]
        for decision in readers:
            if decision.enabled:
                decision.fusion_pass.check_options(request.pass_options)
        if not any(d.enabled for d in readers):
            off = ", ".join(d.name for d in readers) or "no pass reads it"
            warnings.append(f"--{option} has no effect: {off} is off")
    for category, kept in kept_on_by_force.items():
        notes.append(
            f"ALL:off in {category.value} left {len(kept)} required pass(es) on: {', '.join(kept)}"
        )
    order = {Category.GRAPH: 0, Category.UB: 1}
    position = {d.name: i for i, d in enumerate(decisions)}
    decisions.sort(
        key=lambda d: (
            d.fusion_pass.spec.required,
            order[d.fusion_pass.spec.category],
            d.priority,
            position[d.name],
        )
    )
    return Plan(decisions, warnings, notes, dict(request.pass_options))
