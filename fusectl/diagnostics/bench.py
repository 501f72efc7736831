"""`fusectl bench`: onnxruntime latency of ORIGINAL and OPTIMIZED (and more) side by side.

Every model runs on the same feeds (``fusectl.diagnostics.inputs``, as ``verify`` builds them),
once per onnxruntime graph optimization level asked for: ``all`` (ORT_ENABLE_ALL, what a
deployment gets) and ``none`` (ORT_DISABLE_ALL, fusectl's rewrite alone). Session creation is
timed first, several times per model and level, interleaved across both; then, level by level,
each model's session is created again for warm-up runs and the timed runs.

The timed runs are interleaved: each round runs every model once, and the order rotates from
round to round, so that clock-frequency drift, a noisy neighbour or a cache flush lands on all
models alike instead of on whichever ran in that window. On a small or shared machine this
matters more than the number of runs. The median and the 10th/90th percentiles summarise each
model; the ratio is its median over the first model's (ORIGINAL) at the same level.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from rich.console import Console
from rich.table import Table

from fusectl.core.model_io import load_model
from fusectl.diagnostics.device import binds_on_device, runner
from fusectl.diagnostics.inputs import FeedPlan, describe_feeds
from fusectl.diagnostics.verify import parse_providers, reference_run
from fusectl.errors import FusectlError
from fusectl.rewrite.shapes import parse_input_shape

OPT_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def parse_opt_levels(text: str) -> list[str]:
    """``"all,none"`` -> ["all", "none"]: the levels in the order given, each once."""
    levels: list[str] = []
    for item in (part.strip().lower() for part in text.split(",")):
        if not item:
            continue
        if item not in OPT_LEVELS:
            raise FusectlError(
                f"--opt-levels: '{item}' is not a level (choose from {', '.join(OPT_LEVELS)})"
            )
        if item not in levels:
            levels.append(item)
    if not levels:
        raise FusectlError("--opt-levels names no level")
    return levels


@dataclass
class Timing:
    """One model at one optimization level: session creations and the timed runs."""

    sessions_s: list[float] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)

    @property
    def session_s(self) -> float:
        """The median session creation time: the cold-start cost a deployment pays."""
        return float(np.median(self.sessions_s))

    @property
    def median_ms(self) -> float:
        return float(np.median(self.times_ms))

    @property
    def p10_ms(self) -> float:
        return float(np.percentile(self.times_ms, 10))

    @property
    def p90_ms(self) -> float:
        return float(np.percentile(self.times_ms, 90))


@dataclass
class BenchResult:
    """Every timing of one bench run, with the settings needed to reproduce it."""

    models: list[Path]
    levels: list[str]
    providers: list[str]
    threads: int
    runs: int
    warmup: int
    feeds: dict[str, np.ndarray]
    plans: dict[str, FeedPlan]
    session_runs: int = 1
    timings: dict[tuple[int, str], Timing] = field(default_factory=dict)  # (model index, level)
    on_device: bool = False  # inputs and outputs bound in GPU memory (no copies timed)

    def ratio(self, index: int, level: str) -> float:
        """This model's median over the first model's at the same level."""
        return self.timings[index, level].median_ms / self.timings[0, level].median_ms

    def session_ratio(self, index: int, level: str) -> float:
        """This model's session creation over the first model's at the same level."""
        return self.timings[index, level].session_s / self.timings[0, level].session_s

    def cold_start(self, index: int) -> float | None:
        """This model's session creation with onnxruntime's optimizer off over the first
        model's with it fully on: what fusing offline saves at start-up (None unless both
        levels were benched)."""
        if "none" not in self.levels or "all" not in self.levels:
            return None
        return self.timings[index, "none"].session_s / self.timings[0, "all"].session_s

    def to_json(self) -> dict[str, Any]:
        return {
            "providers": self.providers,
            "threads": self.threads,
            "runs": self.runs,
            "warmup": self.warmup,
            "session_runs": self.session_runs,
            "io_on_device": self.on_device,
            "inputs": {
                name: {"dtype": str(array.dtype), "shape": list(array.shape)}
                for name, array in self.feeds.items()
            },
            "models": [
                {
                    "path": str(path),
                    "cold_start": self.cold_start(index),
                    "levels": {
                        level: {
                            "session_s": self.timings[index, level].session_s,
                            "session_runs": len(self.timings[index, level].sessions_s),
                            "session_ratio": self.session_ratio(index, level),
                            "median_ms": self.timings[index, level].median_ms,
                            "p10_ms": self.timings[index, level].p10_ms,
                            "p90_ms": self.timings[index, level].p90_ms,
                            "runs": len(self.timings[index, level].times_ms),
                            "ratio": self.ratio(index, level),
                        }
                        for level in self.levels
                    },
                }
                for index, path in enumerate(self.models)
            ],
        }


def rotations(count: int, rounds: int) -> Iterator[list[int]]:
    """Each round's order over ``count`` items: all of them, starting one further each round,
    so that no item always goes first (or always follows the same one)."""
    for round_ in range(rounds):
        shift = round_ % count
        yield [*range(shift, count), *range(shift)]


def _failure(path: Path, error: Exception) -> FusectlError:
    message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return FusectlError(f"onnxruntime cannot run it: {message}", path=path)


def _readable(path: Path) -> None:
    """A model file that exists and parses; what it holds is onnxruntime's to judge (another
    optimizer's output may use onnxruntime-only ops that fusectl's own validation refuses)."""
    if not path.is_file():
        raise FusectlError("no such file" if not path.exists() else "not a file", path=path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # protobuf raises DecodeError, onnx others for broken files
        raise FusectlError(f"not an ONNX model: {error}", path=path) from None
    if not proto.HasField("graph"):
        raise FusectlError("not an ONNX model (no graph)", path=path)


def _session(
    path: Path, level: str, providers: Sequence[str], threads: int
) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = OPT_LEVELS[level]
    options.intra_op_num_threads = threads
    options.log_severity_level = 4  # its errors come back as one line of ours
    # A pool left spinning after its run would steal cores from the next model in the round.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), options, providers=list(providers))
    except Exception as error:  # onnxruntime raises its own types for load errors
        raise _failure(path, error) from None


def bench_models(
    models: Sequence[Path],
    *,
    runs: int = 20,
    warmup: int = 3,
    threads: int = 1,
    opt_levels: str = "all,none",
    providers: str | None = None,
    input_shape: str = "",
    inputs: Path | None = None,
    seed: int = 0,
    session_runs: int = 3,
) -> BenchResult:
    """Time every model at every level on the first model's feeds, interleaving the runs
    and the ``session_runs`` session creations (the median of those is the cold start).

    Bad arguments, a file that is not an ONNX model and a model that onnxruntime cannot load or
    run raise FusectlError naming the file (exit 2).
    """
    if len(models) < 2:
        raise FusectlError(f"bench takes ORIGINAL and OPTIMIZED (or more), got {len(models)}")
    if runs < 1:
        raise FusectlError(f"--runs must be at least 1, not {runs}")
    if warmup < 0:
        raise FusectlError(f"--warmup must be 0 or more, not {warmup}")
    if session_runs < 1:
        raise FusectlError(f"--session_runs must be at least 1, not {session_runs}")
    if threads < 0:
        raise FusectlError(f"--threads must be 0 (onnxruntime's choice) or more, not {threads}")
    levels = parse_opt_levels(opt_levels)
    chosen = parse_providers(providers)
    shapes = parse_input_shape(input_shape)
    paths = [Path(m) for m in models]
    for path in paths[1:]:
        _readable(path)  # a missing or non-ONNX file fails here, before any timing
    feeds, plans, _, _ = reference_run(
        paths[0], load_model(paths[0]).model, shapes, inputs, seed, chosen
    )
    result = BenchResult(paths, levels, chosen, threads, runs, warmup, feeds, plans, session_runs)

    # Session creations, interleaved across models and levels as the runs are across models, so
    # the cold start (one level against the other) compares creations taken side by side. One
    # untimed creation first pays onnxruntime's once-per-process start-up (its environment and
    # kernel registries), which would otherwise land on the first model's first creation.
    pairs = [(index, level) for level in levels for index in range(len(paths))]
    for pair in pairs:
        result.timings[pair] = Timing()
    _session(paths[0], levels[0], chosen, threads)  # untimed, dropped at once
    for order in rotations(len(pairs), session_runs):
        for index, level in (pairs[k] for k in order):
            start = time.perf_counter()
            created = _session(paths[index], level, chosen, threads)
            result.timings[index, level].sessions_s.append(time.perf_counter() - start)
            del created  # one session alive at a time: creations do not compete for memory

    for level in levels:
        runs_of: list[Callable[[], None]] = []
        for path in paths:
            session = _session(path, level, chosen, threads)
            wanted = {value.name for value in session.get_inputs()}
            missing = sorted(wanted - feeds.keys())
            if missing:
                raise FusectlError(
                    f"needs input(s) {', '.join(map(repr, missing))} that {paths[0]} lacks",
                    path=path,
                )
            result.on_device = binds_on_device(session)
            try:
                runs_of.append(runner(session, {k: v for k, v in feeds.items() if k in wanted}))
            except Exception as error:  # onnxruntime's own types, copying feeds to the device
                raise _failure(path, error) from None
        for index, run in enumerate(runs_of):
            try:
                for _ in range(warmup):
                    run()
            except Exception as error:  # onnxruntime raises its own types for run errors
                raise _failure(paths[index], error) from None
        for order in rotations(len(paths), runs):
            for index in order:
                run = runs_of[index]
                try:
                    start = time.perf_counter()
                    run()
                    elapsed = time.perf_counter() - start
                except Exception as error:
                    raise _failure(paths[index], error) from None
                result.timings[index, level].times_ms.append(elapsed * 1e3)
        del runs_of  # free one level's sessions before building the next
    return result


def print_result(console: Console, result: BenchResult) -> None:
    """The side-by-side table, then the settings the numbers depend on."""
    table = Table(title="fusectl bench (onnxruntime latency)", title_justify="left")
    for column, justify in (
        ("model", "left"),
        ("ort opt", "left"),
        ("session s", "right"),
        ("median ms", "right"),
        ("p10 ms", "right"),
        ("p90 ms", "right"),
        ("vs first", "right"),
    ):
        # Long names fold rather than truncate: two models often differ only at the end.
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    # File names when they tell the models apart; whole paths only when they do not.
    labels = [path.name for path in result.models]
    if len(set(labels)) < len(labels):
        labels = [str(path) for path in result.models]
    for level in result.levels:
        for index, label in enumerate(labels):
            timing = result.timings[index, level]
            table.add_row(
                label,
                level,
                # The session's ratio to the first model's beside it: one column, as wide.
                f"{timing.session_s:.3f} ({result.session_ratio(index, level):.2f}x)",
                f"{timing.median_ms:.3f}",
                f"{timing.p10_ms:.3f}",
                f"{timing.p90_ms:.3f}",
                f"{result.ratio(index, level):.2f}x",
            )
        if level != result.levels[-1]:
            table.add_section()
    console.print(table)
    for index, label in enumerate(labels[1:], 1):
        cold = result.cold_start(index)
        if cold is not None:
            console.print(
                f"cold start: {label} creates its session with onnxruntime's optimizer off in "
                f"{cold:.2f}x the time {labels[0]} takes with it fully on",
                markup=False,
                soft_wrap=True,
            )
    console.print(describe_feeds(result.feeds, result.plans), markup=False, soft_wrap=True)
    threads = "onnxruntime's choice" if result.threads == 0 else str(result.threads)
    console.print(
        f"{result.runs} timed run(s) per model, interleaved, after {result.warmup} warm-up; "
        f"session time: median of {result.session_runs} creation(s); "
        f"intra-op threads {threads}; providers {', '.join(result.providers)}"
        + ("; inputs and outputs bound in device memory" if result.on_device else ""),
        markup=False,
        soft_wrap=True,
    )
