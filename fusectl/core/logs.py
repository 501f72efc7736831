"""Log lines in the Ascend formats, so grep recipes written for ATC logs keep working."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

from fusectl.core.switches import Decision
from fusectl.rewrite.context import MAIN_GRAPH, PassContext
from fusectl.rewrite.registry import Category

logger = logging.getLogger("fusectl")

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "null": logging.CRITICAL + 10,
}
# ASCEND_GLOBAL_LOG_LEVEL: 0 debug, 1 info, 2 warning, 3 error, 4 null.
_ASCEND_LEVELS = ("debug", "info", "warning", "error", "null")


def default_level() -> str:
    value = os.environ.get("ASCEND_GLOBAL_LOG_LEVEL", "")
    return _ASCEND_LEVELS[int(value)] if value in ("0", "1", "2", "3", "4") else "warning"


def configure(level: str) -> None:
    """Send fusectl's log to stderr at the given level, replacing any earlier set-up."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            "[%(levelname)s] fusectl(%(process)d):%(asctime)s.%(msecs)03d %(message)s",
            datefmt="%Y-%m-%d-%H:%M:%S",
        )
    )
    logger.addHandler(handler)
    logger.setLevel(LEVELS[level])
    logger.propagate = False


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_HEARD: ContextVar[list[str] | None] = ContextVar("fusectl_warnings", default=None)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def heard() -> list[str]:
    """The warnings logged so far inside the innermost ``collecting()``."""
    return list(_HEARD.get() or ())


def collecting_warnings(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``function`` inside ``collecting()``, so that its report can list them."""

    @functools.wraps(function)
    def collected(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with collecting():
            return function(*args, **kwargs)

    return collected


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """The warnings logged while open, for the report, whatever level the log shows: a quieter
    log keeps its own handlers at that level."""
    collector = _Collector()
    token = _HEARD.set(collector.messages)
    level = logger.level
    shown = [(handler, handler.level) for handler in logger.handlers]
    effective = logger.getEffectiveLevel()
    if effective > logging.WARNING:
        for handler, before in shown:
            handler.setLevel(max(before, effective))
        logger.setLevel(logging.WARNING)
    logger.addHandler(collector)
    try:
        yield collector.messages
    finally:
        _HEARD.reset(token)
        logger.removeHandler(collector)
        logger.setLevel(level)
        for handler, before in shown:
            handler.setLevel(before)


def skipped(decision: Decision) -> None:
    logger.info("[FusionPass][SKIP] Pass [%s] is disabled by %s.", decision.name, decision.detail)


def pass_finished(ctx: PassContext, seconds: float, nodes_before: int, nodes_after: int) -> None:
    """The Ascend lines for one pass on one graph: ``GraphId[N]`` is the graph's number (the
    N of its id ``0_N``); the timing line names a graph other than the main one."""
    spec = ctx.spec
    graph = ctx.graph_id.rpartition("_")[2]
    if spec.category is Category.UB:
        for stats in ctx.patterns.values():
            logger.debug(
                "Match times of buffer fusion pass[%s] and pattern[%s] is [%d].",
                spec.name,
                stats.name,
                stats.matched,
            )
        logger.info("Run buffer fusion pass successfully, pass name:%s.", spec.name)
    else:
        for stats in ctx.patterns.values():
            line = (
                f"GraphFusionPass[{spec.name}]: pattern={stats.name}, "
                f"matched_times={stats.matched}, effected_times={stats.effected}."
            )
            if stats.matched:
                logger.info("GraphId[%s], %s", graph, line)
            else:
                logger.debug("%s", line)
    for reason, count in ctx.declines().items():
        logger.debug("Pass [%s] declined %d candidate(s): %s.", spec.name, count, reason)
    where = "" if ctx.graph_id == MAIN_GRAPH else f" in graph {ctx.graph_id}"
    logger.info(
        "Pass [%s] took %.3f ms, nodes %d -> %d%s.",
        spec.name,
        seconds * 1e3,
        nodes_before,
        nodes_after,
        where,
    )
