"""Properties every run must keep, over every committed fixture: running fusectl on its own
output changes nothing (the passes reach their fixed point in one run), and the same input
always gives the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES, optimize

MODELS = sorted(p.stem for p in FIXTURES.glob("*.onnx"))


@pytest.mark.parametrize("name", MODELS)
def test_second_run_is_a_no_op(name: str, tmp_path: Path) -> None:
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    first = optimize(FIXTURES / f"{name}.onnx", first_dir, "--log", "null")
    second = optimize(first.output, second_dir, "--log", "null")
    assert second.output.read_bytes() == first.output.read_bytes()
    assert all(
        p.get("effected", 0) == 0
        for p in second.report["passes"]
        if not p["name"].endswith(("EliminationPass", "SortPass", "ImportPass"))
    )
