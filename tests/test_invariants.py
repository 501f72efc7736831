"""Properties every run must keep, over every committed fixture: running fusectl on its own
output changes nothing (the passes reach their fixed point in one run), and the same input
always gives the same bytes."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from tests.conftest import FIXTURES, optimize
from tests.pass_helpers import ARCH_FIXTURES as ARCH
from tests.pass_helpers import check_output

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


def _dims(path: Path) -> dict[str, list[int | str]]:
    model = onnx.load(str(path))
    return {
        value.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
        for value in model.graph.output
        for dims in [value.type.tensor_type.shape.dim]
    }


def test_graph_outputs_keep_their_declared_names(tmp_path: Path) -> None:
    """The interface stays: CLIP's pooled output, declared ``[batch, 32]`` (as torch.onnx's
    dynamic_axes name it), kept its size but lost its name to inference (``unk__40``), which
    no longer tied it to the inputs' batch. (A size inference proves static replaces an
    exporter's made-up name: the ViT fixtures' ``Addlast_hidden_state_dim_1`` becomes 17.)"""
    model = onnx.load(str(ARCH / "clip_text_ts17.onnx"))
    for value in model.graph.output:
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    source = tmp_path / "clip_named.onnx"
    onnx.save(model, str(source))
    run = optimize(source, tmp_path)
    check_output(run)
    assert _dims(run.output) == {
        "last_hidden_state": ["batch", "LayerNormalizationlast_hidden_state_dim_1", 32],
        "pooler_output": ["batch", 32],
    }
    vit = optimize(FIXTURES / "vit_tiny_ts14.onnx", tmp_path)
    assert _dims(vit.output)["last_hidden_state"] == ["Addlast_hidden_state_dim_0", 17, 32]
