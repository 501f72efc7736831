"""The fusectl command line: load -> resolve switches -> run passes -> report -> save."""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from fusectl import __version__, logs, reports
from fusectl.bench import bench_models
from fusectl.bench import print_result as print_bench
from fusectl.bisect import bisect_model, per_pass_errors, print_attribution
from fusectl.bisect import print_result as print_bisect
from fusectl.dump import GraphDumper
from fusectl.engine import PassRun, run_plan
from fusectl.errors import FusectlError
from fusectl.model_io import check_output_path, load_model, save_model
from fusectl.plugins import load_passes
from fusectl.registry import Category
from fusectl.shapes import ShapeOracle, apply_input_shapes, parse_input_shape
from fusectl.sitecheck import SiteChecker
from fusectl.switches import (
    Decision,
    SwitchRequest,
    parse_optimization_switch,
    parse_switch_file,
    resolve,
    split_pass_list,
)
from fusectl.verify import VerifyFailed, print_result, verify_models

INTERNAL_ERROR_EXIT = 3

stderr = Console(stderr=True, highlight=False)


def _option(*names: str, **kwargs: Any) -> Callable:
    """An option spelled as ATC writes it (--fusion_switch_file) with the dashed alias."""
    spellings = []
    for name in names:
        spellings.append(name)
        if name.startswith("--") and "_" in name:
            spellings.append(name.replace("_", "-"))
    return click.option(*spellings, **kwargs)


def _plugin_option(help_text: str) -> Callable:
    return _option(
        "--plugin",
        "plugins",
        multiple=True,
        type=click.Path(path_type=Path),
        help=help_text,
    )


_PLUGIN_HELP = "A Python file that registers custom passes (repeatable)."
_PATTERN_FUSION_PASS = _option(
    "--pattern_fusion_pass",
    type=click.Choice(["on", "off"]),
    default="on",
    show_default=True,
    help="off turns every custom (plugin) pass off at once, as TorchAir's pattern_fusion_pass; "
    "--enable_pass still turns one on.",
)

_GRAPH_KERNEL_FLAGS = _option(
    "--graph_kernel_flags",
    default="",
    help='Tune TbeEltwiseFusionPass (MindSpore style): "--enable_cluster_ops=Pow '
    '--disable_cluster_ops=Cast".',
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fusectl")
def cli() -> None:
    """ATC-style fusion optimizer for ONNX models."""


@cli.command()
@click.argument("model_arg", metavar="MODEL", required=False, type=click.Path(path_type=Path))
@_option("--model", "model_opt", type=click.Path(path_type=Path), help="Input model (ATC form).")
@_option("-o", "--output", type=click.Path(path_type=Path), help="Optimized model to write.")
@_option(
    "--fusion_switch_file",
    type=click.Path(path_type=Path),
    help="Ascend switch file: JSON {'Switch': ...} or 'PassName:on|off' lines.",
)
@_option("--enable_pass", multiple=True, help="Comma-separated passes to turn on (repeatable).")
@_option("--disable_pass", multiple=True, help="Comma-separated passes to turn off (repeatable).")
@_option("--optimization_switch", default="", help='"A:on;B:off"; beats every other switch.')
@_option(
    "--oo_level",
    type=click.Choice(["O1", "O3"]),
    default="O3",
    show_default=True,
    help="O1 turns every fusion off except ExceptionalPassOfO1Level.",
)
@_option(
    "--target",
    type=click.Choice(["ort", "onnx"]),
    default="ort",
    show_default=True,
    help="ort allows onnxruntime contrib ops; onnx keeps to standard ONNX ops.",
)
@_GRAPH_KERNEL_FLAGS
@_option("--input_shape", default="", help='Fix input dims: "ids:1,128;mask:1,128".')
@_option(
    "--fusion_result",
    type=click.Path(path_type=Path),
    help="Where to write fusion_result.json [./fusion_result.json].",
)
@_option(
    "--export_compile_stat",
    type=click.Choice(["0", "1", "2"]),
    default="1",
    show_default=True,
    help="0: no fusion_result.json; 1: write at exit; 2: write once passes finish.",
)
@_option(
    "--fusion_result_format",
    type=click.Choice(reports.FUSION_RESULT_FORMATS),
    default="v3",
    show_default=True,
    help="Layout of fusion_result.json.",
)
@_option("--report", type=click.Path(path_type=Path), help="Write the per-pass JSON report.")
@_option(
    "--dump_graph",
    type=click.Path(path_type=Path),
    help="Write the model before and after each pass that changed it to DIR.",
)
@_option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@_option(
    "--verify",
    is_flag=True,
    help="Then run MODEL and the output on onnxruntime and compare (as `fusectl verify`); "
    "exit 1 beyond tolerance. The output stays written either way.",
)
@_plugin_option(_PLUGIN_HELP)
@_PATTERN_FUSION_PASS
@_option(
    "--check_custom/--no_check_custom",
    default=None,
    help="Check every rewrite of a custom pass: run the matched nodes and the replacement on "
    "onnxruntime and leave sites that differ unfused (exit 1). [on with --verify when a custom "
    "pass is enabled]",
)
@_option("--strict", is_flag=True, help="Unknown pass names are errors, not warnings.")
@_option(
    "--log",
    "log_level",
    type=click.Choice(list(logs.LEVELS)),
    default=None,
    help="Log level on stderr [warning, or ASCEND_GLOBAL_LOG_LEVEL].",
)
def optimize(**options: Any) -> None:
    """Run the enabled fusion passes on MODEL and write the optimized model."""
    _guarded(lambda: _optimize(**options))


def _guarded(action: Callable[[], None]) -> None:
    """One-line errors with the documented exit codes instead of tracebacks."""
    try:
        action()
    except FusectlError as error:
        label = getattr(error, "label", "error")
        stderr.print(f"fusectl: {label}: {error}", markup=False, soft_wrap=True)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        stderr.print("fusectl: interrupted", markup=False)
        sys.exit(130)
    except Exception as error:
        logs.logger.debug("internal error", exc_info=True)
        stderr.print(
            f"fusectl: internal error: {type(error).__name__}: {error} "
            "(run with --log debug for the traceback)",
            markup=False,
            soft_wrap=True,
        )
        sys.exit(INTERNAL_ERROR_EXIT)


def _pass_options(graph_kernel_flags: str) -> dict[str, str]:
    """The settings passes read from ctx.options; only those given are present."""
    return {"graph_kernel_flags": graph_kernel_flags} if graph_kernel_flags.strip() else {}


def _output_path(model: Path, output: Path | None) -> Path:
    if output is None:
        raise FusectlError("no output given: use -o OUT.onnx (or --output)")
    # ATC's --output takes a name without extension; keep that habit working.
    return output if output.suffix else output.with_suffix(".onnx")


def _optimize(
    *,
    model_arg: Path | None,
    model_opt: Path | None,
    output: Path | None,
    fusion_switch_file: Path | None,
    enable_pass: Sequence[str],
    disable_pass: Sequence[str],
    optimization_switch: str,
    oo_level: str,
    target: str,
    graph_kernel_flags: str,
    input_shape: str,
    fusion_result: Path | None,
    export_compile_stat: str,
    fusion_result_format: str,
    report: Path | None,
    dump_graph: Path | None,
    as_json: bool,
    verify: bool,
    plugins: Sequence[Path],
    pattern_fusion_pass: str,
    check_custom: bool | None,
    strict: bool,
    log_level: str | None,
) -> None:
    logs.configure(log_level or logs.default_level())
    if model_arg and model_opt and model_arg != model_opt:
        raise FusectlError("two different models given (MODEL and --model)")
    model_path = model_arg or model_opt
    if model_path is None:
        raise FusectlError("no model given: fusectl optimize MODEL.onnx -o OUT.onnx")
    output = _output_path(model_path, output)

    registry = load_passes(plugins)
    request = SwitchRequest(
        switch_file=parse_switch_file(fusion_switch_file) if fusion_switch_file else None,
        enable=split_pass_list(enable_pass),
        disable=split_pass_list(disable_pass),
        optimization_switch=parse_optimization_switch(optimization_switch),
        oo_level=oo_level,
        target=target,
        strict=strict,
        custom_passes=pattern_fusion_pass == "on",
        pass_options=_pass_options(graph_kernel_flags),
    )
    plan = resolve(registry, request)
    if check_custom is None:  # on when --verify would otherwise find a plugin's error late
        check_custom = verify and any(d.fusion_pass.spec.custom for d in plan.enabled())
    shapes = parse_input_shape(input_shape)

    loaded = load_model(model_path)
    check_output_path(loaded, output)
    model = loaded.model
    apply_input_shapes(model, shapes, model_path)
    for message in plan.warnings + plan.notes:
        logs.logger.warning("%s", message)

    result_path = None
    if export_compile_stat != "0":
        result_path = fusion_result or reports.default_fusion_result_path()
        result_path.unlink(missing_ok=True)  # never leave a stale result from an earlier run
    dumper = GraphDumper(dump_graph) if dump_graph else None
    before = reports.model_stats(model)
    if dumper:
        dumper.dump(model, "original")

    # A transient progress line, only where a person watches a terminal.
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal or log_level == "null",
    )
    task = progress.add_task("fusing", total=len(plan.enabled()))

    def before_pass(decision: Decision) -> None:
        progress.update(task, description=decision.name)

    def after_pass(run: PassRun, current: Any) -> None:
        progress.advance(task)
        if dumper and run.ctx is not None and run.ctx.changed:
            dumper.dump(current, run.decision.name)

    checker = SiteChecker.for_model(model) if check_custom else None
    with progress:
        result = run_plan(
            model,
            plan,
            target=target,
            shapes=ShapeOracle(model, loaded.proto),
            before_pass=before_pass,
            after_pass=after_pass,
            site_checker=checker,
        )
    fusion_text = reports.render_fusion_result(result, fusion_result_format)
    if result_path and export_compile_stat == "2":
        reports.write_text_atomic(result_path, fusion_text)
    data_path = save_model(model, output, external=loaded.uses_external_data, source=loaded.path)
    if result_path and export_compile_stat == "1":
        reports.write_text_atomic(result_path, fusion_text)

    checked = verify_models(model_path, output, input_shape=input_shape) if verify else None

    layers = reports.model_layers(result, model)
    document = reports.report_document(
        plan=plan,
        layers=layers,
        result=result,
        model_before=before,
        model_after=model,
        paths={
            "model": str(model_path),
            "output": str(output),
            "external_data": str(data_path) if data_path else None,
            "fusion_result": str(result_path) if result_path else None,
            "dump_graph": str(dump_graph) if dump_graph else None,
        },
        options={
            "target": target,
            "oo_level": oo_level,
            "fusion_switch_file": str(fusion_switch_file) if fusion_switch_file else None,
            "enable_pass": list(request.enable),
            "disable_pass": list(request.disable),
            "optimization_switch": optimization_switch or None,
            "input_shape": input_shape or None,
            "plugins": [str(path) for path in plugins],
            "pattern_fusion_pass": pattern_fusion_pass,
            "check_custom": check_custom,
            "graph_kernel_flags": graph_kernel_flags or None,
        },
    )
    if checked is not None:
        document["verify"] = checked.to_json()
    if checker is not None:
        document["check_custom"] = checker.to_json()
    if report:
        reports.write_text_atomic(report, json.dumps(document, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(document, indent=2))
    if log_level != "null":
        reports.print_summary(stderr, result, layers)
        stderr.print(f"wrote {output}" + (f" (+ {data_path.name})" if data_path else ""))
        if checker is not None:
            checker.print_summary(stderr)
        if checked is not None:
            print_result(stderr, checked)
    if checked is not None and not checked.passed:
        raise VerifyFailed(f"{checked.summary()}; {output} stays written")
    if checker is not None and checker.mismatches():
        raise VerifyFailed(f"{checker.summary()}; {output} stays written without them")


@cli.command("verify")
@click.argument("models", metavar="ORIGINAL OPTIMIZED", nargs=-1, type=click.Path(path_type=Path))
@_option("--input_shape", default="", help='Sizes for symbolic dims: "ids:1,128;mask:1,128".')
@_option("--inputs", type=click.Path(path_type=Path), help="Feeds from an .npz (one per input).")
@_option(
    "--golden",
    type=click.Path(path_type=Path),
    help="Compare the model with these stored outputs (.npz by output name) instead of running "
    "ORIGINAL: `fusectl verify --golden G.npz MODEL`.",
)
@_option("--atol", type=float, default=None, help="Absolute tolerance [by the passes that fired].")
@_option("--rtol", type=float, default=None, help="Relative tolerance [by the passes that fired].")
@_option(
    "--providers",
    default=None,
    help="Comma list of onnxruntime execution providers [CPUExecutionProvider].",
)
@_option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs.")
@_option(
    "--per_pass",
    is_flag=True,
    help="Also optimize ORIGINAL again with the default passes, stopping after each pass that "
    "rewrote something, and print the error there: where error enters.",
)
@_plugin_option("With --per_pass: a Python file that registers custom passes (repeatable).")
@_option("--json", "as_json", is_flag=True, help="Print the comparison as JSON on stdout.")
def verify(**options: Any) -> None:
    """Run ORIGINAL and OPTIMIZED on onnxruntime and compare every output.

    Exit 0 when every output is within tolerance, 1 when one is not (or OPTIMIZED does not
    run), 2 on bad arguments or inputs.
    """
    _guarded(lambda: _verify(**options))


def _verify(
    *,
    models: tuple[Path, ...],
    as_json: bool,
    golden: Path | None,
    per_pass: bool,
    plugins: Sequence[Path],
    **options: Any,
) -> None:
    logs.configure(logs.default_level())
    if golden is not None:
        if len(models) != 1:
            raise FusectlError(
                "--golden replaces running ORIGINAL: fusectl verify --golden G.npz MODEL"
            )
        original, optimized = None, models[0]
    else:
        if len(models) != 2:
            raise FusectlError(
                f"verify takes ORIGINAL and OPTIMIZED, got {len(models)} model(s) "
                "(or --golden G.npz MODEL)"
            )
        original, optimized = models
    if per_pass and original is None:
        raise FusectlError("--per_pass optimizes ORIGINAL again: give ORIGINAL, not --golden")
    result = verify_models(original, optimized, golden=golden, **options)
    document = result.to_json()
    if per_pass:
        plan = resolve(load_passes(plugins), SwitchRequest())
        rows = per_pass_errors(original, plan, **options)
        document["per_pass"] = [row.to_json() for row in rows]
    if as_json:
        click.echo(json.dumps(document, indent=2))
    print_result(stderr, result)
    if per_pass:
        print_attribution(stderr, rows)
    if not result.passed:
        raise VerifyFailed(result.summary())


@cli.command("bench")
@click.argument(
    "models", metavar="ORIGINAL OPTIMIZED [MORE...]", nargs=-1, type=click.Path(path_type=Path)
)
@_option("--runs", type=int, default=20, show_default=True, help="Timed runs per model.")
@_option("--warmup", type=int, default=3, show_default=True, help="Untimed runs first.")
@_option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="onnxruntime intra-op threads (0: its choice). 1 keeps numbers comparable across "
    "machines and runs: no thread pool contention, no core count dependence.",
)
@_option(
    "--opt_levels",
    default="all,none",
    show_default=True,
    help="onnxruntime graph optimization levels: all (ORT_ENABLE_ALL), none (ORT_DISABLE_ALL).",
)
@_option(
    "--providers",
    default=None,
    help="Comma list of onnxruntime execution providers [CPUExecutionProvider].",
)
@_option("--input_shape", default="", help='Sizes for symbolic dims: "ids:1,128;mask:1,128".')
@_option("--inputs", type=click.Path(path_type=Path), help="Feeds from an .npz (one per input).")
@_option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs.")
@_option("--json", "as_json", is_flag=True, help="Print the timings as JSON on stdout.")
def bench(**options: Any) -> None:
    """Time ORIGINAL, OPTIMIZED (and more models) on onnxruntime, side by side.

    Runs are interleaved round-robin across the models; the table (or --json) gives session
    creation time, median and p10/p90 latency, and each median's ratio to ORIGINAL's.
    """
    _guarded(lambda: _bench(**options))


def _bench(*, models: tuple[Path, ...], as_json: bool, **options: Any) -> None:
    logs.configure(logs.default_level())
    result = bench_models(models, **options)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        print_bench(stderr, result)


@cli.command("bisect")
@click.argument("model", metavar="MODEL", type=click.Path(path_type=Path))
@_option("--input_shape", default="", help='Sizes for symbolic dims: "ids:1,128;mask:1,128".')
@_option("--inputs", type=click.Path(path_type=Path), help="Feeds from an .npz (one per input).")
@_option("--atol", type=float, default=None, help="Absolute tolerance [by the passes that fired].")
@_option("--rtol", type=float, default=None, help="Relative tolerance [by the passes that fired].")
@_option("--providers", default=None, help="onnxruntime execution providers [CPU].")
@_option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs.")
@_option(
    "--fusion_switch_file",
    type=click.Path(path_type=Path),
    help="Bisect the optimization this switch file selects.",
)
@_option("--enable_pass", multiple=True, help="Comma-separated passes to turn on (repeatable).")
@_option("--disable_pass", multiple=True, help="Comma-separated passes to turn off (repeatable).")
@_option(
    "--target",
    type=click.Choice(["ort", "onnx"]),
    default="ort",
    show_default=True,
    help="As optimize.",
)
@_GRAPH_KERNEL_FLAGS
@_option(
    "--output_switch",
    type=click.Path(path_type=Path),
    default=Path("fusion_switch.cfg"),
    show_default=True,
    help="Where to write the switch file that turns the culprit pass(es) off.",
)
@_option(
    "--per_pass",
    is_flag=True,
    help="First print the error after each pass that rewrote something (one round per pass).",
)
@_plugin_option(_PLUGIN_HELP)
@_PATTERN_FUSION_PASS
@_option("--json", "as_json", is_flag=True, help="Print the findings as JSON on stdout.")
def bisect(**options: Any) -> None:
    """Find the pass and the fusion sites that push MODEL's outputs beyond tolerance.

    Rewrites are numbered in execution order and the search binary-searches how many run.
    Exit 0 when the optimized model is within tolerance, 1 when a culprit was found (and a
    switch file turning it off written), 2 on bad arguments.
    """
    _guarded(lambda: _bisect(**options))


def _bisect(
    *,
    model: Path,
    fusion_switch_file: Path | None,
    enable_pass: Sequence[str],
    disable_pass: Sequence[str],
    target: str,
    graph_kernel_flags: str,
    plugins: Sequence[Path],
    pattern_fusion_pass: str,
    as_json: bool,
    **options: Any,
) -> None:
    logs.configure(logs.default_level())
    request = SwitchRequest(
        switch_file=parse_switch_file(fusion_switch_file) if fusion_switch_file else None,
        enable=split_pass_list(enable_pass),
        disable=split_pass_list(disable_pass),
        target=target,
        custom_passes=pattern_fusion_pass == "on",
        pass_options=_pass_options(graph_kernel_flags),
    )
    plan = resolve(load_passes(plugins), request)
    for message in plan.warnings + plan.notes:
        logs.logger.warning("%s", message)
    result = bisect_model(model, plan, target=target, **options)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    print_bisect(stderr, result)
    if not result.full.passed:
        raise VerifyFailed(f"culprit pass(es): {', '.join(result.culprit_passes) or 'not found'}")


@cli.command("passes")
@_option("--json", "as_json", is_flag=True, help="Print the catalogue as JSON.")
@_option("--category", type=click.Choice([c.value for c in Category]), default=None)
@_plugin_option(_PLUGIN_HELP)
def list_passes(as_json: bool, category: str | None, plugins: Sequence[Path]) -> None:
    """List every registered pass in default execution order."""
    _guarded(lambda: _list_passes(as_json, category, plugins))


def _list_passes(as_json: bool, category: str | None, plugins: Sequence[Path]) -> None:
    registry = load_passes(plugins)
    specs = [d.fusion_pass.spec for d in resolve(registry, SwitchRequest()).decisions]
    if category:
        specs = [s for s in specs if s.category.value == category]
    if as_json:
        click.echo(json.dumps(reports.catalogue_document(specs), indent=2))
        return
    console = Console(highlight=False)
    for group in Category:
        members = [s for s in specs if s.category is group]
        if not members:
            continue
        console.print(f"[bold underline]{group.value}[/] ({len(members)} passes, run order)")
        for spec in members:
            state = "required" if spec.required else ("on" if spec.default_on else "off")
            aliases = f"  [dim]aka {', '.join(spec.aliases)}[/]" if spec.aliases else ""
            origin = f"  [cyan]({escape(spec.origin)})[/]" if spec.custom else ""
            console.print(
                f"  [bold]{spec.name}[/]  {state}, {spec.numerics.value}{origin}{aliases}",
                soft_wrap=True,
            )
            console.print(f"      {spec.description}", markup=False)
        console.print()


@cli.command("switch-template")
@_option(
    "--all",
    "all_state",
    type=click.Choice(["on", "off"]),
    default=None,
    help="Set every pass to this state instead of its default.",
)
@_plugin_option(_PLUGIN_HELP)
def switch_template(all_state: str | None, plugins: Sequence[Path]) -> None:
    """Print a fusion switch file (JSON) that names every registered pass."""
    _guarded(lambda: _switch_template(all_state, plugins))


def _switch_template(all_state: str | None, plugins: Sequence[Path]) -> None:
    switch: dict[str, dict[str, str]] = {c.value: {} for c in Category}
    for fusion_pass in load_passes(plugins):
        spec = fusion_pass.spec
        state = all_state or ("on" if spec.default_on else "off")
        switch[spec.category.value][spec.name] = state
    click.echo(json.dumps({"Switch": switch}, indent=4))


def main() -> None:
    """The console entry point: a one-shot process, so it skips what only long runs need.

    The cyclic garbage collector would scan the model's graph (a web of reference cycles)
    again and again for nothing, and tearing down a 100k-node graph at exit takes seconds;
    with output flushed, the process can simply end.
    """
    gc.disable()
    try:
        cli(prog_name="fusectl")
        code: int | str | None = 0
    except SystemExit as stop:
        code = stop.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
