"""SelectArithmeticCanonicalizationPass: tf2onnx's SelectV2, Cast(m) * a + Cast(Not(m)) * b,
written as the Where it is, which the attention passes read as a mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.pass_helpers import (
    assert_second_run_changes_nothing,
    compare_on_feeds,
    const,
    fixture_path,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

PASS = "SelectArithmeticCanonicalizationPass"
CAUSAL = fixture_path("keras_causal_dynamic_tf2onnx")


def _ids(batch: int, length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"ids": rng.integers(-3, 50, (batch, length)).astype(np.int32)}


def test_keras_causal_attention_through_tf2onnx_fuses(tmp_path: Path) -> None:
    """Keras's causal MultiHeadAttention (tests/fixtures/make_keras_fixtures.py): the scores'
    mask and the embedding's map of negative ids become Wheres; the mask's Expand to the
    scores' shape goes (BroadcastExpandEliminationPass), the mask's sizes, which Keras reads
    from the scores, are read from the input ids, and the attention fuses."""
    run = optimize_checked(CAUSAL, tmp_path)
    assert pattern_counts(run, PASS) == {"ArithmeticSelect": (2, 2)}
    assert reasons(run, PASS) == {}
    assert run.counts("BroadcastExpandEliminationPass") == (1, 1)
    ops = run.op_counts()
    assert ops["MultiHeadAttention"] == 1
    assert (ops["Where"], ops["Softmax"], ops["MatMul"]) == (2, 0, 0)
    for batch, length in ((1, 1), (2, 6), (3, 13)):  # negative ids too: the embedding's Where
        compare_on_feeds(CAUSAL, run.output, _ids(batch, length))
    assert_second_run_changes_nothing(run, tmp_path, PASS)


def _gated_sum(path: Path, *, negated: str = "m", float_type: int = TensorProto.FLOAT) -> Path:
    """y = Cast(m) * a + Cast(Not(<negated>)) * b for boolean m and n [2, 3]."""
    nodes = [
        helper.make_node("Cast", ["m"], ["gate"], to=float_type),
        helper.make_node("Not", [negated], ["other"]),
        helper.make_node("Cast", ["other"], ["other_gate"], to=float_type),
        helper.make_node("Mul", ["gate", "a"], ["kept"]),
        helper.make_node("Mul", ["b", "other_gate"], ["filled"]),
        helper.make_node("Add", ["kept", "filled"], ["y"]),
    ]
    inputs = [
        value("m", [2, 3], TensorProto.BOOL),
        value("n", [2, 3], TensorProto.BOOL),
        value("a", [2, 3], float_type),
        value("b", [1, 3], float_type),
    ]
    return save_model(path, nodes, inputs, [value("y", [2, 3], float_type)])


def _feeds(dtype: type) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "m": rng.random((2, 3)) < 0.5,
        "n": rng.random((2, 3)) < 0.5,
        "a": rng.standard_normal((2, 3)).astype(dtype),
        "b": rng.standard_normal((1, 3)).astype(dtype),
    }


@pytest.mark.parametrize(
    ("float_type", "dtype"),
    [(TensorProto.FLOAT, np.float32), (TensorProto.INT32, np.int32)],
    ids=["float", "int32"],
)
def test_gated_sum_is_a_where(float_type: int, dtype: type, tmp_path: Path) -> None:
    """The choice in either order of the sum's and the products' operands, for any type the
    products have (the embedding's ids are int32); b broadcasts as the Where broadcasts it."""
    model = _gated_sum(tmp_path / "gated.onnx", float_type=float_type)
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PASS) == {"ArithmeticSelect": (1, 1)}
    graph = onnx.load(str(run.output)).graph
    (where,) = graph.node
    assert (where.op_type, list(where.input)) == ("Where", ["m", "a", "b"])
    compare_on_feeds(model, run.output, _feeds(dtype))


def test_gates_of_two_masks_are_no_choice(tmp_path: Path) -> None:
    """Cast(m) * a + Cast(Not(n)) * b: where m and not n are both true, both are added."""
    model = _gated_sum(tmp_path / "two_masks.onnx", negated="n")
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PASS) == {"ArithmeticSelect": (1, 0)}
    assert reasons(run, PASS) == {"the two gates are not one boolean and its negation": 1}
    assert run.op_counts()["Where"] == 0
    compare_on_feeds(model, run.output, _feeds(np.float32))


def test_a_gate_read_elsewhere_stays(tmp_path: Path) -> None:
    """The mask's Cast is read by another output too: it stays, the choice is a Where."""
    model = _gated_sum(tmp_path / "shared.onnx")
    proto = onnx.load(str(model))
    proto.graph.output.append(value("gate", [2, 3]))
    onnx.save(proto, str(model))
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PASS) == {"ArithmeticSelect": (1, 1)}
    assert (run.op_counts()["Where"], run.op_counts()["Cast"]) == (1, 1)
    compare_on_feeds(model, run.output, _feeds(np.float32))


def test_sum_of_two_products_without_gates_is_not_a_candidate(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Mul", ["a", "w"], ["p"]),
        helper.make_node("Mul", ["b", "w"], ["q"]),
        helper.make_node("Add", ["p", "q"], ["y"]),
    ]
    inputs = [value(name, [2, 3]) for name in ("a", "b")]
    model = save_model(
        tmp_path / "plain.onnx", nodes, inputs, [value("y", [2, 3])], [const("w", np.ones(3))]
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(PASS) == (0, 0)
