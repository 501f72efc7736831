"""The library API: the whole optimize flow (load -> switches -> passes -> report -> save) as one
function, the diagnostics as thin functions over their modules, and an onnx-ir pass adapter.

The CLI is a layer over these; what it writes, the API writes byte for byte.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from fusectl.core import logs, reports
from fusectl.core.dump import GraphDumper
from fusectl.core.engine import PassFailure, PassRun, RunResult, run_plan
from fusectl.core.model_io import (
    LoadedModel,
    load_source,
    save_model,
    stage_model,
)
from fusectl.core.outside_ir import OutsideIR
from fusectl.core.paths import StagedOutputs, check_outputs, write_text_atomic
from fusectl.core.plugins import load_passes, load_plugin_file
from fusectl.core.repository import RepositoryGate, parse_provider_list, repository_gate
from fusectl.core.switches import (
    Plan,
    Source,
    SwitchRequest,
    parse_optimization_switch,
    parse_switch_file,
    resolve,
    split_pass_list,
)
from fusectl.core.validate import OutputInvariantError
from fusectl.diagnostics.bench import BenchResult, bench_models
from fusectl.diagnostics.bisect import BisectResult, bisect_model
from fusectl.diagnostics.sitecheck import SiteChecker
from fusectl.diagnostics.tune import TuneResult, merged_repository, tune_model, tune_section
from fusectl.diagnostics.verify import VerifyResult, parse_providers, verify_models
from fusectl.errors import FusectlError
from fusectl.rewrite.shapes import ShapeOracle, apply_input_shapes, parse_input_shape

PathLike = str | os.PathLike[str]
ModelSource = PathLike | onnx.ModelProto | ir.Model
PassNames = str | Sequence[str]


@dataclass
class OptimizeResult:
    """What one optimize run produced. ``report`` is the document ``--report`` writes."""

    model: ir.Model
    report: dict[str, Any]
    fusion_result: Any
    fusion_result_text: str
    run: RunResult
    plan: Plan
    layers: set[str]
    # The files written, by role: output, external_data, fusion_result, report, dump_graph.
    paths: dict[str, Path] = field(default_factory=dict)
    verify: VerifyResult | None = None
    site_check: SiteChecker | None = None
    # The knowledge repository's decisions in this run (None when none applied).
    repository: RepositoryGate | None = None
    outside_ir: OutsideIR = field(default_factory=OutsideIR)

    def to_proto(self) -> onnx.ModelProto:
        proto = ir.serde.serialize_model(self.model)
        self.outside_ir.put_back(proto)
        return proto

    @property
    def passed(self) -> bool:
        """False when --verify found an output beyond tolerance or a custom rewrite differed."""
        verified = self.verify is None or self.verify.passed
        return verified and not (self.site_check and self.site_check.mismatches())


def _names(value: PassNames) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _optional_path(value: PathLike | None) -> Path | None:
    return None if value is None else Path(value)


def _on_off(value: str | bool) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


def _log_plan(plan: Plan) -> None:
    for message in plan.warnings + plan.notes:
        logs.logger.warning("%s", message)


def switch_plan(
    *,
    fusion_switch_file: PathLike | None = None,
    enable_pass: PassNames = (),
    disable_pass: PassNames = (),
    optimization_switch: str = "",
    oo_level: str = "O3",
    target: str = "ort",
    strict: bool = False,
    plugins: Sequence[PathLike] = (),
    pattern_fusion_pass: str | bool = "on",
    graph_kernel_flags: str = "",
) -> tuple[Plan, SwitchRequest]:
    """Which passes run, in which order, and why: the switches resolved against the registry."""
    switch_file = _optional_path(fusion_switch_file)
    request = SwitchRequest(
        switch_file=parse_switch_file(switch_file) if switch_file else None,
        enable=split_pass_list(_names(enable_pass)),
        disable=split_pass_list(_names(disable_pass)),
        optimization_switch=parse_optimization_switch(optimization_switch),
        oo_level=oo_level,
        target=target,
        strict=strict,
        custom_passes=_on_off(pattern_fusion_pass) == "on",
        pass_options=(
            {"graph_kernel_flags": graph_kernel_flags} if graph_kernel_flags.strip() else {}
        ),
    )
    registry = load_passes()
    saved = registry.snapshot()
    try:
        for path in plugins:
            load_plugin_file(Path(path))
        return resolve(registry, request), request
    finally:
        # A call's plugins are that call's: the plan holds their passes, and the next call in
        # this process (a pipeline optimizing several models) starts without them.
        registry.restore(saved)


@logs.collecting_warnings
def optimize(
    model: ModelSource,
    output: PathLike | None = None,
    *,
    fusion_switch_file: PathLike | None = None,
    enable_pass: PassNames = (),
    disable_pass: PassNames = (),
    optimization_switch: str = "",
    oo_level: str = "O3",
    target: str = "ort",
    graph_kernel_flags: str = "",
    input_shape: str = "",
    fusion_result: PathLike | None = None,
    export_compile_stat: str | int = "1",
    fusion_result_format: str = "v3",
    report: PathLike | None = None,
    dump_graph: PathLike | None = None,
    verify: bool = False,
    plugins: Sequence[PathLike] = (),
    pattern_fusion_pass: str | bool = "on",
    check_custom: bool | None = None,
    strict: bool = False,
    providers: str | Sequence[str] | None = None,
    repository: PathLike | None = None,
    external_data: bool = False,
    pass_errors: str | None = None,
    on_pass: Callable[[str, int, int], None] | None = None,
) -> OptimizeResult:
    """Optimize ``model`` (a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``) as
    ``fusectl optimize`` does, with the CLI's options as keyword arguments.

    Files are written only where asked: the model at ``output``, fusion_result.json at
    ``fusion_result`` (unless ``export_compile_stat`` is 0; there is no implicit
    ./fusion_result.json as on the command line), the report at ``report``, the dumps in
    ``dump_graph``. Every path is checked before anything is written and all of them appear
    together at the end, or none on an error. ``verify`` compares the output on onnxruntime
    (in a temporary folder when there is no file to compare). ``on_pass(name, done, total)`` is
    called before each enabled pass. ``providers`` names the execution provider(s) the output
    is for (default CPU; the first decides); ``repository`` is the knowledge repository whose
    measurements for it decline fusions that are slower there: a path, ``"none"``, or by
    default the one shipped with fusectl. ``external_data`` writes the weights beside the
    output (``OUT.onnx.data``, memory-mapped by onnxruntime: a faster session creation) even
    when the input keeps them inline. ``pass_errors`` says what a built-in pass that raises on
    this model (a fusectl bug) does: ``"skip"`` optimizes the model again without it and warns,
    ``"raise"`` raises (default: the ``FUSECTL_PASS_ERRORS`` environment variable, else skip).
    Raises FusectlError on bad input.
    """
    on_error = _pass_errors(pass_errors)
    output_path = _optional_path(output)
    if output_path is not None and not output_path.suffix:
        output_path = output_path.with_suffix(".onnx")  # ATC's --output takes a bare name
    plan, request = switch_plan(
        fusion_switch_file=fusion_switch_file,
        enable_pass=enable_pass,
        disable_pass=disable_pass,
        optimization_switch=optimization_switch,
        oo_level=oo_level,
        target=target,
        strict=strict,
        plugins=plugins,
        pattern_fusion_pass=pattern_fusion_pass,
        graph_kernel_flags=graph_kernel_flags,
    )
    if check_custom is None:  # on when verify would otherwise find a plugin's error late
        check_custom = verify and any(d.fusion_pass.spec.custom for d in plan.enabled())
    shapes = parse_input_shape(input_shape)
    gate = repository_gate(providers, repository)
    loaded = load_source(model)
    dump_dir = _optional_path(dump_graph)
    report_path = _optional_path(report)
    result_path = _optional_path(fusion_result) if str(export_compile_stat) != "0" else None
    check_outputs(
        {"output path": output_path, "--fusion_result": result_path, "--report": report_path}
        | _external_data_role(loaded, output_path, external_data),
        protected=loaded.protected_files(),
        dump_dir=dump_dir,
    )
    working = loaded.model
    apply_input_shapes(working, shapes, loaded.path or "<in-memory model>")
    _log_plan(plan)
    if result_path is not None:
        result_path.unlink(missing_ok=True)  # never leave a stale result from an earlier run

    with StagedOutputs() as staged:
        dumper = GraphDumper(staged.directory(dump_dir), loaded.outside_ir) if dump_dir else None
        before = reports.model_stats(working)
        if dumper:
            dumper.dump(working, "original")
        while True:
            try:
                run = _run(loaded, plan, target, dumper, check_custom, on_pass, gate)
                break
            except PassFailure as failure:
                if on_error == "raise" or failure.decision.fusion_pass.spec.required:
                    raise
                # The failed run left its copy part-rewritten: start again from the input.
                plan = _without(plan, failure, loaded.path)
                loaded = load_source(model)
                working = loaded.model
                apply_input_shapes(working, shapes, loaded.path or "<in-memory model>")
                gate = repository_gate(providers, repository)
                if dumper:
                    dumper.discard()
                    dumper = GraphDumper(dumper.directory, loaded.outside_ir)
                    dumper.dump(working, "original")
        fusion_text = reports.render_fusion_result(run.result, fusion_result_format)
        data_path = None
        if output_path is not None:
            try:
                data_path = stage_model(
                    working,
                    output_path,
                    staged,
                    external=external_data or loaded.uses_external_data,
                    outside_ir=loaded.outside_ir,
                    source=loaded.path,
                )
            except OutputInvariantError as error:
                if not shapes:
                    raise
                # Sizes the model cannot take (a sequence past its position table) show only
                # once shape arithmetic is folded: the user's sizes, not a fusectl bug.
                text = str(error)
                problem = text[text.find("(") + 1 : text.rfind("); nothing written")]
                raise FusectlError(
                    f"--input_shape {input_shape!r} gives sizes the model cannot take: with "
                    f"them its optimized form fails onnx.checker ({problem}); nothing written",
                    path=loaded.path,
                ) from None
        elif dumper is not None:  # the returned model must not depend on staged dump files
            ir.external_data.load_to_model(working)
        if result_path is not None:
            staged.write_text(result_path, fusion_text)
        layers = reports.model_layers(run.result, working)
        paths = {
            "model": str(loaded.path) if loaded.path else None,
            "output": str(output_path) if output_path else None,
            "external_data": str(data_path) if data_path else None,
            "fusion_result": str(result_path) if result_path else None,
            "dump_graph": str(dump_graph) if dump_graph else None,
        }
        options = {
            "target": target,
            "oo_level": oo_level,
            "fusion_switch_file": str(fusion_switch_file) if fusion_switch_file else None,
            "enable_pass": list(request.enable),
            "disable_pass": list(request.disable),
            "optimization_switch": optimization_switch or None,
            "input_shape": input_shape or None,
            "plugins": [str(path) for path in plugins],
            "pattern_fusion_pass": _on_off(pattern_fusion_pass),
            "check_custom": check_custom,
            "graph_kernel_flags": graph_kernel_flags or None,
            "providers": parse_provider_list(providers),
            "repository": str(repository) if repository is not None else None,
            "external_data": external_data,
        }
        # verify needs the output on disk: the report is written once its result is known.
        staged_report = report_path is not None and not verify
        document = _report(plan, run, before, working, layers, paths, options, None)
        if staged_report:
            assert report_path is not None
            staged.write(report_path, lambda path: reports.write_report(path, document))
        staged.commit()
    if gate is not None:  # once all is written: a bad input gets its one line, and only it
        gate.warn()

    checked = None
    if verify:
        checked = _verify_output(loaded, output_path, working, input_shape)
        document = _report(plan, run, before, working, layers, paths, options, checked)
        if report_path is not None:
            write_text_atomic(report_path, reports.report_json(document))
    written = {
        role: Path(value) for role, value in paths.items() if role != "model" and value is not None
    }
    if report_path is not None:
        written["report"] = report_path
    return OptimizeResult(
        model=working,
        report=document,
        fusion_result=reports.fusion_result_document(run.result, fusion_result_format),
        fusion_result_text=fusion_text,
        run=run.result,
        plan=plan,
        layers=layers,
        paths=written,
        verify=checked,
        site_check=run.checker,
        repository=run.gate,
        outside_ir=loaded.outside_ir,
    )


_PASS_ERRORS = ("skip", "raise")


def _pass_errors(value: str | None) -> str:
    """What a built-in pass that raises does: the argument, else FUSECTL_PASS_ERRORS, else skip."""
    chosen = value if value is not None else os.environ.get("FUSECTL_PASS_ERRORS") or "skip"
    if chosen not in _PASS_ERRORS:
        where = "pass_errors" if value is not None else "FUSECTL_PASS_ERRORS"
        raise FusectlError(f"{where} is skip or raise, not {chosen!r}")
    return chosen


def _without(plan: Plan, failure: PassFailure, path: Path | None) -> Plan:
    """The plan with the pass that raised turned off, saying why, and the warning that says so."""
    error = failure.error
    detail = f"it raised {type(error).__name__}: {error} on this model"
    logs.logger.warning(
        "%s: %s raised %s: %s; the model was optimized again without it. This is a fusectl "
        "bug: please report it with the model (FUSECTL_PASS_ERRORS=raise and --log debug show "
        "the traceback)",
        path or "<in-memory model>",
        failure.decision.name,
        type(error).__name__,
        error,
    )
    decisions = [
        replace(d, enabled=False, source=Source.FAILED, detail=detail)
        if d is failure.decision
        else d
        for d in plan.decisions
    ]
    return replace(plan, decisions=decisions)


def _external_data_role(
    loaded: LoadedModel, output: Path | None, external_data: bool
) -> dict[str, Path | None]:
    """The output's weight file is an output too when it is asked for or the input keeps
    weights outside."""
    if output is None or not (external_data or loaded.uses_external_data):
        return {}
    return {"the output's external data file": output.with_name(output.name + ".data")}


@dataclass
class _Run:
    result: RunResult
    checker: SiteChecker | None
    gate: RepositoryGate | None = None


def _run(
    loaded: LoadedModel,
    plan: Plan,
    target: str,
    dumper: GraphDumper | None,
    check_custom: bool,
    on_pass: Callable[[str, int, int], None] | None,
    gate: RepositoryGate | None,
) -> _Run:
    model = loaded.model
    total = len(plan.enabled())
    done = 0

    def before_pass(decision: Any) -> None:
        if on_pass is not None:
            on_pass(decision.name, done, total)

    def after_pass(run: PassRun, current: ir.Model) -> None:
        nonlocal done
        done += 1
        if dumper and run.ctx is not None and run.ctx.changed:
            dumper.dump(current, run.decision.name)

    checker = SiteChecker.for_model(model) if check_custom else None
    result = run_plan(
        model,
        plan,
        target=target,
        shapes=ShapeOracle(model, lambda: loaded.proto),
        before_pass=before_pass,
        after_pass=after_pass,
        site_checker=checker,
        site_gates=(gate,) if gate is not None else (),
    )
    return _Run(result, checker, gate)


def _report(
    plan: Plan,
    run: _Run,
    before: dict[str, Any],
    model: ir.Model,
    layers: set[str],
    paths: dict[str, str | None],
    options: dict[str, Any],
    checked: VerifyResult | None,
) -> dict[str, Any]:
    document = reports.report_document(
        plan=plan,
        layers=layers,
        result=run.result,
        model_before=before,
        model_after=model,
        paths=paths,
        options=options,
    )
    said = set(plan.warnings + plan.notes)
    # dict.fromkeys: a model loaded again after a pass failed says its warnings twice.
    heard = dict.fromkeys(m for m in logs.heard() if m not in said)
    document["warnings"] = plan.warnings + list(heard)
    if checked is not None:
        document["verify"] = checked.to_json()
    if run.checker is not None:
        document["check_custom"] = run.checker.to_json()
    if run.gate is not None:
        document["repository"] = reports.repository_document(run.gate)
    return document


def _verify_output(
    loaded: LoadedModel, output: Path | None, model: ir.Model, input_shape: str
) -> VerifyResult:
    """Compare on onnxruntime; models that exist only in memory go to a temporary folder."""
    if loaded.path is not None and output is not None:
        return verify_models(loaded.path, output, input_shape=input_shape)
    with tempfile.TemporaryDirectory(prefix="fusectl-verify-") as tmp:
        original = loaded.path
        if original is None:
            original = Path(tmp, "original.onnx")
            onnx.save(loaded.proto, str(original))
        optimized = output
        if optimized is None:
            optimized = Path(tmp, "optimized.onnx")
            save_model(model, optimized, external=False, outside_ir=loaded.outside_ir)
        return verify_models(original, optimized, input_shape=input_shape)


def verify(
    original: PathLike | None,
    optimized: PathLike,
    *,
    golden: PathLike | None = None,
    input_shape: str = "",
    inputs: PathLike | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    providers: str | None = None,
    seed: int = 0,
) -> VerifyResult:
    """Run ORIGINAL (or the ``golden`` outputs) and OPTIMIZED on onnxruntime and compare, as
    ``fusectl verify``; ``result.passed`` tells whether every output is within tolerance."""
    return verify_models(
        _optional_path(original),
        Path(optimized),
        golden=_optional_path(golden),
        input_shape=input_shape,
        inputs=_optional_path(inputs),
        atol=atol,
        rtol=rtol,
        providers=providers,
        seed=seed,
    )


def bisect(
    model: PathLike,
    *,
    output_switch: PathLike | None = None,
    force: bool = False,
    input_shape: str = "",
    inputs: PathLike | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    providers: str | None = None,
    seed: int = 0,
    per_pass: bool = False,
    repository: PathLike | None = None,
    **switches: Any,
) -> BisectResult:
    """Find the pass(es) and sites that push MODEL's outputs beyond tolerance, as
    ``fusectl bisect``; writes a switch file turning them off only at ``output_switch``.

    ``switches`` choose the optimization to bisect, as :func:`switch_plan` takes them
    (fusion_switch_file, enable_pass, disable_pass, target, plugins, ...)."""
    plan, _ = switch_plan(**switches)
    _log_plan(plan)
    return bisect_model(
        Path(model),
        plan,
        target=switches.get("target", "ort"),
        input_shape=input_shape,
        inputs=_optional_path(inputs),
        atol=atol,
        rtol=rtol,
        seed=seed,
        providers=providers,
        output_switch=_optional_path(output_switch),
        force=force,
        protected=_optional_path(switches.get("fusion_switch_file")),
        per_pass=per_pass,
        repository=None if repository is None else str(repository),
    )


def bench(
    models: Sequence[PathLike],
    *,
    runs: int = 20,
    warmup: int = 3,
    threads: int = 1,
    opt_levels: str = "all,none",
    providers: str | None = None,
    input_shape: str = "",
    inputs: PathLike | None = None,
    seed: int = 0,
    session_runs: int = 3,
) -> BenchResult:
    """Time the models side by side on onnxruntime, as ``fusectl bench``."""
    return bench_models(
        [Path(m) for m in models],
        runs=runs,
        warmup=warmup,
        threads=threads,
        opt_levels=opt_levels,
        providers=providers,
        input_shape=input_shape,
        inputs=_optional_path(inputs),
        seed=seed,
        session_runs=session_runs,
    )


def tune(
    model: PathLike,
    *,
    providers: str = "cpu",
    threads: int = 1,
    input_shape: str = "",
    repository: PathLike | None = None,
    budget_s: float = 3.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    **switches: Any,
) -> TuneResult:
    """Measure each class of fusion site in MODEL fused and unfused on the (first) provider, as
    ``fusectl tune``; the verdicts are merged into the repository file at ``repository`` when
    one is given (created if missing). ``switches`` choose the passes, as :func:`switch_plan`
    takes them. ``progress`` receives one line per measured class."""
    if threads < 0:
        raise FusectlError(f"--threads must be 0 (onnxruntime's choice) or more, not {threads}")
    provider = parse_providers(providers)[0]
    plan, _ = switch_plan(**switches)
    _log_plan(plan)
    path = _optional_path(repository)
    loaded = load_source(model)
    if path is not None:
        check_outputs({"--repository": path}, protected=loaded.protected_files())
        merged_repository(path, tune_section([], provider, threads, ""))  # bad file: fail early
    began = time.perf_counter()
    classes, _ = tune_model(
        loaded,
        plan,
        target=switches.get("target", "ort"),
        provider=provider,
        threads=threads,
        input_shapes=parse_input_shape(input_shape),
        budget_s=budget_s,
        seed=seed,
        progress=progress,
    )
    name = loaded.path.name if loaded.path is not None else "<in-memory model>"
    section = tune_section(classes, provider, threads, name)
    if path is not None:
        write_text_atomic(path, merged_repository(path, section).text())
    return TuneResult(provider, section, classes, path, time.perf_counter() - began)


class FusectlPass(ir.passes.InPlacePass):
    """fusectl's passes as one onnx-ir pass, to compose in ``onnx_ir.passes.Sequential``.

    Takes the switches of :func:`optimize` that choose passes (enable_pass, disable_pass,
    fusion_switch_file, optimization_switch, oo_level, target, plugins, ...) and its
    ``providers`` and ``repository``. Works in place on the model it is given, as onnx-ir's
    in-place passes do.
    """

    def __init__(
        self,
        *,
        providers: str | Sequence[str] | None = None,
        repository: PathLike | None = None,
        **switches: Any,
    ) -> None:
        super().__init__()
        self.plan, _ = switch_plan(**switches)
        self.target = switches.get("target", "ort")
        self.providers, self.repository = providers, repository
        repository_gate(providers, repository)  # a bad repository fails here, not mid-pipeline

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        gate = repository_gate(self.providers, self.repository)
        if gate is not None:
            gate.warn()
        result = run_plan(
            model,
            self.plan,
            target=self.target,
            shapes=ShapeOracle(model, None),
            site_gates=(gate,) if gate is not None else (),
        )
        modified = any(run.ctx is not None and run.ctx.changed for run in result.runs)
        return ir.passes.PassResult(model, modified)


__all__ = [
    "FusectlError",
    "FusectlPass",
    "OptimizeResult",
    "bench",
    "bisect",
    "optimize",
    "tune",
    "verify",
]
