"""fusectl bisect: rewrite numbering, culprit pass and sites, per-pass attribution."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusectl import PatternPass, Rule, Site, register_pass, unregister_pass
from fusectl.core.engine import run_plan
from fusectl.core.model_io import load_model, save_model
from fusectl.core.plugins import load_builtin_passes
from fusectl.core.switches import SwitchRequest, resolve
from fusectl.rewrite.context import Rewrites
from fusectl.rewrite.registry import REGISTRY, Category, Numerics, PassSpec
from fusectl.rewrite.shapes import ShapeOracle
from tests.conftest import FIXTURES, assert_same_outputs, optimize, run_cli

BLOCKS = 12
WRONG_BLOCKS = (2, 6, 9)
# The divisor the blocks in WRONG_BLOCKS spell sqrt(2) with: close enough for GELU fusion,
# and the marker the wrong pass keys on.
MARKED_ROOT2 = np.float32(1.41421)


def _erf_gelu(op: Any, x: Any, root2: Any, one: Any, half_value: Any) -> Any:
    return op.Mul(op.Mul(x, op.Add(op.Erf(op.Div(x, root2)), one)), half_value)


def _marked(site: Site, root2: Any, **_: Any) -> str | None:
    value = site.constant(root2)
    return None if value is not None and value.size == 1 and value == MARKED_ROOT2 else "unmarked"


def _wrong_gelu(op: Any, site: Site, x: Any, one: Any, half_value: Any, **_: Any) -> Any:
    wrong = site.initializer(op, np.array(1.3, np.float32), "wrong_root2")
    return op.Mul(op.Mul(x, op.Add(op.Erf(op.Div(x, wrong)), one)), half_value)


class WrongGeluPass(PatternPass):
    """Rewrites an erf GELU with a wrong divisor: an error bisect has to find."""

    spec = PassSpec(
        name="WrongGeluPass",
        category=Category.GRAPH,
        description="test: erf GELU rewritten with 1.3 for sqrt(2)",
        numerics=Numerics.EXACT,
        priority=3500,
        origin="test",
    )
    rules = (Rule("WrongGelu", _erf_gelu, _wrong_gelu, _marked, commute=False),)


@pytest.fixture
def wrong_pass() -> Iterator[None]:
    register_pass(WrongGeluPass)
    try:
        yield
    finally:
        unregister_pass("WrongGeluPass")


def _gelu_chain(path: Path) -> Path:
    """x -> 12 x (MatMul, erf GELU); blocks in WRONG_BLOCKS carry the marked divisor."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    h = "x"
    for i in range(BLOCKS):
        root2 = MARKED_ROOT2 if i in WRONG_BLOCKS else np.float32(math.sqrt(2))
        inits += [
            numpy_helper.from_array(rng.normal(0, 0.4, (16, 16)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(np.array(root2, np.float32), f"root2_{i}"),
        ]
        p = f"block{i}"
        nodes += [
            helper.make_node("MatMul", [h, f"w{i}"], [f"{p}/mm"], name=f"{p}/MatMul"),
            helper.make_node("Div", [f"{p}/mm", f"root2_{i}"], [f"{p}/d"], name=f"{p}/Div"),
            helper.make_node("Erf", [f"{p}/d"], [f"{p}/e"], name=f"{p}/Erf"),
            helper.make_node("Add", [f"{p}/e", "one"], [f"{p}/a"], name=f"{p}/Add"),
            helper.make_node("Mul", [f"{p}/mm", f"{p}/a"], [f"{p}/m"], name=f"{p}/Mul"),
            helper.make_node("Mul", [f"{p}/m", "half"], [f"{p}/y"], name=f"{p}/Mul_1"),
        ]
        h = f"{p}/y"
    inits += [
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu_chain",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info(h, onnx.TensorProto.FLOAT, [4, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def test_unregister_pass_takes_a_registered_pass_back() -> None:
    register_pass(WrongGeluPass)
    assert REGISTRY.canonical("WrongGeluPass") == "WrongGeluPass"
    assert isinstance(unregister_pass("WrongGeluPass"), WrongGeluPass)
    assert REGISTRY.canonical("WrongGeluPass") is None
    with pytest.raises(KeyError):
        unregister_pass("WrongGeluPass")


def test_exact_model_has_nothing_to_find(tmp_path: Path) -> None:
    switch = tmp_path / "switch.cfg"
    result = run_cli(
        "bisect", FIXTURES / "mlp_torchscript.onnx", "--output_switch", switch, "--json"
    )
    assert result.exit_code == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["passed"] and found["culprits"] == [] and found["rounds"] == 1
    assert found["rewrites"] > 0
    assert "nothing to find" in result.stderr
    assert not switch.exists()


def test_bisect_pins_the_wrong_pass_and_its_sites(tmp_path: Path, wrong_pass: None) -> None:
    model = _gelu_chain(tmp_path / "chain.onnx")
    switch = tmp_path / "fusion_switch.cfg"
    result = run_cli("bisect", model, "--output_switch", switch, "--json")
    assert result.exit_code == 1, result.stderr
    found = json.loads(result.stdout)
    assert found["culprit_passes"] == ["WrongGeluPass"]
    culprits = found["culprits"]
    assert [c["pass"] for c in culprits] == ["WrongGeluPass"] * len(WRONG_BLOCKS)
    assert [c["original_nodes"][0] for c in culprits] == [f"block{i}/Div" for i in WRONG_BLOCKS]
    assert all(c["max_abs_with"] > c["max_abs_before"] for c in culprits)
    assert found["resolved"]
    rewrites = found["rewrites"]
    assert rewrites >= BLOCKS
    # 1 full run, per culprit a binary search plus the run leaving it out, 1 switch check.
    assert found["rounds"] <= len(WRONG_BLOCKS) * (math.ceil(math.log2(rewrites)) + 1) + 2
    assert found["with_switch_file"]["passed"]
    assert json.loads(switch.read_text()) == {"Switch": {"GraphFusion": {"WrongGeluPass": "off"}}}
    assert "culprit rewrite #" in result.stderr and "block2/Div" in result.stderr

    # The switch file works outside bisect too: optimize with it, then verify passes.
    optimize(model, tmp_path, "--fusion_switch_file", switch, "--verify")
    optimize(model, tmp_path, "--verify", expect=1)


def test_per_pass_attribution_shows_where_error_enters(tmp_path: Path, wrong_pass: None) -> None:
    model = _gelu_chain(tmp_path / "chain.onnx")
    result = run_cli("bisect", model, "--per_pass", "--output_switch", tmp_path / "s.cfg", "--json")
    assert result.exit_code == 1, result.stderr
    rows = json.loads(result.stdout)["per_pass"]
    names = [row["pass"] for row in rows]
    assert "WrongGeluPass" in names and "BiasGeluFusionPass" in names
    first_bad = next(row for row in rows if not row["passed"])
    assert first_bad["pass"] == "WrongGeluPass" and first_bad["rewrites"] == len(WRONG_BLOCKS)
    assert all(row["passed"] for row in rows[: names.index("WrongGeluPass")])
    assert "error after each pass" in result.stderr


def test_numbering_is_the_same_below_the_limit(tmp_path: Path, wrong_pass: None) -> None:
    from fusectl.core.switches import SwitchRequest, resolve
    from fusectl.diagnostics.bisect import Bisector

    model = _gelu_chain(tmp_path / "chain.onnx")
    plan = resolve(REGISTRY, SwitchRequest())
    bisector = Bisector(
        model,
        plan,
        target="ort",
        input_shape="",
        inputs=None,
        seed=0,
        providers=None,
        atol=None,
        rtol=None,
        workdir=tmp_path,
    )
    full = bisector.trial()
    limited = bisector.trial(limit=5)
    assert sorted(limited.sites) == [0, 1, 2, 3, 4]
    for index in limited.sites:
        assert limited.sites[index][1].new_names == full.sites[index][1].new_names
    skipped = bisector.trial(skip=frozenset({1}))
    assert 1 not in skipped.sites and 0 in skipped.sites


@pytest.mark.parametrize(
    "args",
    [
        ["--atol", "-1"],
        ["--rtol", "nan"],
        ["--fusion_switch_file", "missing.cfg"],
        ["--output_switch", "."],
    ],
)
def test_bad_arguments_exit_2(args: list[str]) -> None:
    result = run_cli("bisect", FIXTURES / "mlp_torchscript.onnx", *args)
    assert result.exit_code == 2, result.stderr
    assert "fusectl: error:" in result.stderr


def test_missing_model_exits_2(tmp_path: Path) -> None:
    result = run_cli("bisect", tmp_path / "none.onnx")
    assert result.exit_code == 2 and "no such file" in result.stderr


# Passes that share new values between sites (GroupQueryAttention's sequence lengths, the
# rotary caches, the standard Attention's clamped mask): a site a bisection leaves out must
# take the values it would have created with it, or later sites would read values no node
# computes.
@pytest.mark.parametrize(
    ("fixture", "pattern"),
    [
        ("llama_tiny_ts17", "GroupQueryAttention"),
        ("llama_tiny_dynamo", "RotaryEmbedding"),
        ("bert_tiny_eager_dynamo23", "Attention"),
    ],
)
def test_a_left_out_site_takes_its_shared_values_with_it(
    fixture: str, pattern: str, tmp_path: Path
) -> None:
    path = FIXTURES / f"{fixture}.onnx"
    plan = resolve(load_builtin_passes(), SwitchRequest())

    def run(skip: frozenset[int]) -> tuple[Any, list[Any]]:
        loaded = load_model(path)
        result = run_plan(
            loaded.model,
            plan,
            target="ort",
            shapes=ShapeOracle(loaded.model, loaded.proto),
            rewrites=Rewrites(skip=skip),
        )
        sites = [s for r in result.runs if r.ctx for s in r.ctx.sites if s.pattern == pattern]
        return loaded.model, sites

    _, sites = run(frozenset())
    assert len(sites) >= 2  # the first creates the shared values, a later one reads them
    model, left = run(frozenset({sites[0].index}))
    assert len(left) == len(sites) - 1
    output = tmp_path / "skipped.onnx"
    save_model(model, output, external=False)
    onnx.checker.check_model(onnx.load(str(output)), full_check=True)
    assert_same_outputs(path, output)
