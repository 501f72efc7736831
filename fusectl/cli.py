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

from fusectl import api
from fusectl.core import logs, reports
from fusectl.core.plugins import load_passes
from fusectl.core.repository import choose_repository
from fusectl.core.switches import SwitchRequest, resolve
from fusectl.diagnostics.bench import print_result as print_bench
from fusectl.diagnostics.bisect import per_pass_errors, print_attribution
from fusectl.diagnostics.bisect import print_result as print_bisect
from fusectl.diagnostics.verify import VerifyFailed, print_result
from fusectl.errors import FusectlError
from fusectl.rewrite.registry import Category
from fusectl.version import __version__

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


# Commands without --log read the level from Ascend's variable only.
_ENV_TRACEBACK = "set ASCEND_GLOBAL_LOG_LEVEL=0"

_log_option = _option(
    "--log",
    "log_level",
    type=click.Choice(list(logs.LEVELS)),
    default=None,
    help="Log level on stderr [warning, or ASCEND_GLOBAL_LOG_LEVEL].",
)


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
    "--providers",
    default=None,
    help="Execution provider(s) the output is for, e.g. cpu, cuda [cpu]; the first decides "
    "which fusions the knowledge repository declines as slower there.",
)
@_option(
    "--repository",
    default=None,
    help="Knowledge repository (from `fusectl tune`) deciding which fusions pay on the "
    "provider; none: no repository [the one shipped with fusectl: CPU and CUDA].",
)
@_option(
    "--external_data",
    is_flag=True,
    help="Write the weights to OUT.onnx.data even when MODEL keeps them inline: onnxruntime "
    "memory-maps them, so sessions start faster. [as MODEL]",
)
@_option(
    "--pass_errors",
    type=click.Choice(["skip", "raise"]),
    default=None,
    help="A built-in pass that raises on MODEL (a fusectl bug): skip optimizes MODEL again "
    "without it and warns; raise stops with exit 3. [FUSECTL_PASS_ERRORS, else skip]",
)
@_log_option
def optimize(**options: Any) -> None:
    """Run the enabled fusion passes on MODEL and write the optimized model."""
    _guarded(lambda: _optimize(**options))


def _guarded(action: Callable[[], None], *, traceback: str = "run with --log debug") -> None:
    """One-line errors with the documented exit codes instead of tracebacks; ``traceback``
    says how this command shows the one an internal error had."""
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
            f"({traceback} for the traceback)",
            markup=False,
            soft_wrap=True,
        )
        sys.exit(INTERNAL_ERROR_EXIT)


def _optimize(
    *,
    model_arg: Path | None,
    model_opt: Path | None,
    output: Path | None,
    fusion_result: Path | None,
    export_compile_stat: str,
    as_json: bool,
    log_level: str | None,
    **options: Any,
) -> None:
    logs.configure(log_level or logs.default_level())
    if model_arg and model_opt and model_arg != model_opt:
        raise FusectlError("two different models given (MODEL and --model)")
    model_path = model_arg or model_opt
    if model_path is None:
        raise FusectlError("no model given: fusectl optimize MODEL.onnx -o OUT.onnx")
    if output is None:
        raise FusectlError("no output given: use -o OUT.onnx (or --output)")
    if export_compile_stat != "0" and fusion_result is None:
        fusion_result = reports.default_fusion_result_path()

    # A transient progress line, only where a person watches a terminal.
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal or log_level == "null",
    )
    task = progress.add_task("fusing", total=None)

    def on_pass(name: str, done: int, total: int) -> None:
        progress.update(task, description=name, completed=done, total=total)

    with progress:
        result = api.optimize(
            model_path,
            output,
            fusion_result=fusion_result,
            export_compile_stat=export_compile_stat,
            on_pass=on_pass,
            **options,
        )
    if as_json:
        click.echo(json.dumps(result.report, indent=2))
    checked, checker = result.verify, result.site_check
    written = result.paths["output"]
    if log_level != "null":
        reports.print_summary(stderr, result.run, result.layers)
        if result.repository is not None and result.repository.decisions:
            stderr.print(reports.repository_line(result.repository), markup=False, soft_wrap=True)
        data_path = result.paths.get("external_data")
        stderr.print(f"wrote {written}" + (f" (+ {data_path.name})" if data_path else ""))
        if checker is not None:
            checker.print_summary(stderr)
        if checked is not None:
            print_result(stderr, checked)
    if checked is not None and not checked.passed:
        raise VerifyFailed(f"{checked.summary()}; {written} stays written")
    if checker is not None and checker.mismatches():
        raise VerifyFailed(f"{checker.summary()}; {written} stays written without them")


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
@_log_option
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
    log_level: str | None,
    **options: Any,
) -> None:
    logs.configure(log_level or logs.default_level())
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
    result = api.verify(original, optimized, golden=golden, **options)
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
    "--session_runs",
    type=int,
    default=3,
    show_default=True,
    help="Session creations per model and level (interleaved); the median is reported.",
)
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
@_log_option
def bench(**options: Any) -> None:
    """Time ORIGINAL, OPTIMIZED (and more models) on onnxruntime, side by side.

    Runs are interleaved round-robin across the models; the table (or --json) gives session
    creation time, median and p10/p90 latency, and each median's ratio to ORIGINAL's.
    """
    _guarded(lambda: _bench(**options))


def _bench(
    *, models: tuple[Path, ...], as_json: bool, log_level: str | None, **options: Any
) -> None:
    logs.configure(log_level or logs.default_level())
    result = api.bench(models, **options)
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
    "--force",
    is_flag=True,
    help="Replace --output_switch if it exists (never the --fusion_switch_file given).",
)
@_option(
    "--repository",
    default=None,
    help="Knowledge repository, as optimize (for the first of --providers) [the shipped one].",
)
@_option(
    "--per_pass",
    is_flag=True,
    help="First print the error after each pass that rewrote something (one round per pass).",
)
@_plugin_option(_PLUGIN_HELP)
@_PATTERN_FUSION_PASS
@_option("--json", "as_json", is_flag=True, help="Print the findings as JSON on stdout.")
@_log_option
def bisect(**options: Any) -> None:
    """Find the pass and the fusion sites that push MODEL's outputs beyond tolerance.

    Rewrites are numbered in execution order and the search binary-searches how many run.
    Exit 0 when the optimized model is within tolerance, 1 when a culprit was found (and a
    switch file turning it off written), 2 on bad arguments.
    """
    _guarded(lambda: _bisect(**options))


def _bisect(*, model: Path, as_json: bool, log_level: str | None, **options: Any) -> None:
    logs.configure(log_level or logs.default_level())
    result = api.bisect(model, **options)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    print_bisect(stderr, result)
    if not result.full.passed:
        raise VerifyFailed(f"culprit pass(es): {', '.join(result.culprit_passes) or 'not found'}")


@cli.command("tune")
@click.argument("model", metavar="MODEL", type=click.Path(path_type=Path))
@_option(
    "--providers",
    default="cpu",
    show_default=True,
    help="The execution provider to measure on (installed in this onnxruntime).",
)
@_option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="onnxruntime intra-op threads while timing (0: its choice).",
)
@_option(
    "--input_shape",
    default="",
    help='Tuning sizes for symbolic dims: "ids:1,128;mask:1,128" [batch 1, others 128].',
)
@_option(
    "--repository",
    type=click.Path(path_type=Path),
    default=Path("fusion_repository.json"),
    show_default=True,
    help="Repository file the verdicts are merged into (created if missing).",
)
@_option(
    "--budget",
    "budget_s",
    type=float,
    default=3.0,
    show_default=True,
    help="Seconds of timing per site class at most.",
)
@_option(
    "--fusion_switch_file",
    type=click.Path(path_type=Path),
    help="Tune the passes this switch file selects.",
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
@_plugin_option(_PLUGIN_HELP)
@_option("--seed", type=int, default=0, show_default=True, help="Seed for generated inputs.")
@_option("--json", "as_json", is_flag=True, help="Print the measurements as JSON on stdout.")
@_log_option
def tune(**options: Any) -> None:
    """Measure which fusions pay on a provider, site class by site class, and record it.

    Each class of site the passes would rewrite in MODEL is cut out fused and unfused, both
    are timed interleaved on the provider, and the verdict (with its timings) is merged into
    the repository file, which `fusectl optimize --repository` then applies.
    """
    _guarded(lambda: _tune(**options))


def _tune(*, model: Path, as_json: bool, log_level: str | None, **options: Any) -> None:
    logs.configure(log_level or logs.default_level())
    result = api.tune(
        model, progress=lambda line: stderr.print(line, markup=False, soft_wrap=True), **options
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    verdicts = [c.verdict for c in result.classes]
    stderr.print(
        f"tune: {len(result.classes)} site class(es) on {result.provider} in "
        f"{result.seconds:.1f} s: {verdicts.count('unfused')} slower fused (kept unfused), "
        f"{verdicts.count('fused')} faster fused, {verdicts.count('same')} no difference, "
        f"{verdicts.count('unsupported')} not run by the provider fused, "
        f"{verdicts.count(None)} not measured; wrote {result.repository}",
        markup=False,
        soft_wrap=True,
    )


@cli.command("passes")
@_option("--json", "as_json", is_flag=True, help="Print the catalogue as JSON.")
@_option("--category", type=click.Choice([c.value for c in Category]), default=None)
@_option(
    "--repository",
    default=None,
    help="Show this knowledge repository's verdicts [the one shipped with fusectl].",
)
@_plugin_option(_PLUGIN_HELP)
def list_passes(
    as_json: bool, category: str | None, repository: str | None, plugins: Sequence[Path]
) -> None:
    """List every registered pass in default execution order, and the knowledge repository."""
    _guarded(lambda: _list_passes(as_json, category, repository, plugins), traceback=_ENV_TRACEBACK)


def _list_passes(
    as_json: bool, category: str | None, repository: str | None, plugins: Sequence[Path]
) -> None:
    logs.configure(logs.default_level())
    registry = load_passes(plugins)
    specs = [d.fusion_pass.spec for d in resolve(registry, SwitchRequest()).decisions]
    if category:
        specs = [s for s in specs if s.category.value == category]
    known = choose_repository(repository, "CPUExecutionProvider")
    if as_json:
        click.echo(json.dumps(reports.catalogue_document(specs, known), indent=2))
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
    for line in reports.repository_lines(known):
        console.print(line, markup=False, soft_wrap=True)


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
    _guarded(lambda: _switch_template(all_state, plugins), traceback=_ENV_TRACEBACK)


def _switch_template(all_state: str | None, plugins: Sequence[Path]) -> None:
    logs.configure(logs.default_level())
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
