"""Log lines in the Ascend formats, so grep recipes written for ATC logs keep working."""

from __future__ import annotations

import logging
import os
import sys

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
