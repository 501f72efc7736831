"""SelectArithmeticCanonicalizationPass: a choice written as arithmetic, tf2onnx's SelectV2
Cast(m) * a + Cast(Not(m)) * b and GPT-1's w * b + -1e4 * (1 - b) over a 0/1 buffer, written as
the Where it is, which the attention passes read as a mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import named_dim_feeds
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
ARCH = Path(__file__).parent / "fixtures" / "arch"


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
    assert reasons(run, PASS) == {"the two gates are not one gate and its complement": 1}
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


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_gpt1_causal_buffer_is_a_mask_and_the_attention_fuses(
    exporter: str, tmp_path: Path
) -> None:
    """transformers' OpenAI GPT keeps its causal mask as a 0/1 float buffer and writes
    w * b + -1e4 * (1 - b), b a Slice of it sized at run time: each layer's sum becomes
    Where(Cast(b, bool), w, -1e4), a masked_fill, and both attentions fuse (0/2 before)."""
    model = ARCH / f"openai_gpt_{exporter}.onnx"
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, PASS) == {"ArithmeticSelect": (2, 2)}
    ops = run.op_counts()
    assert (ops["MultiHeadAttention"], ops["Softmax"]) == (2, 0)
    for batch, length in ((1, 1), (2, 8), (3, 13)):  # the last row padded (named_dim_feeds)
        feeds = named_dim_feeds(model, {"batch": batch, "sequence": length})
        compare_on_feeds(model, run.output, feeds)
    assert_second_run_changes_nothing(run, tmp_path, PASS)


def _buffer_choice(
    path: Path, gate: np.ndarray, *, one: np.ndarray | None = None, other: np.ndarray | None = None
) -> Path:
    """y = x * g + -1e4 * (one - g), g the constant ``gate`` [4, 4] Sliced to x's [S, S]; with
    ``other``, y = x * g + -1e4 * h instead, h that buffer Sliced alike."""
    one = np.ones((), np.float32) if one is None else one

    def sliced(buffer: str, name: str) -> list[onnx.NodeProto]:
        return [
            helper.make_node("Slice", [buffer, "zero", "size", "rows"], [f"{name}_rows"]),
            helper.make_node("Slice", [f"{name}_rows", "zero", "size", "columns"], [name]),
        ]

    nodes = [helper.make_node("Shape", ["x"], ["size"], start=0, end=1), *sliced("buffer", "g")]
    if other is None:
        nodes.append(helper.make_node("Sub", ["one", "g"], ["complement"]))
    else:
        nodes += sliced("other", "complement")
    nodes += [
        helper.make_node("Mul", ["x", "g"], ["kept"]),
        helper.make_node("Mul", ["complement", "fill"], ["filled"]),
        helper.make_node("Add", ["kept", "filled"], ["y"]),
    ]
    constants = [
        const("buffer", gate),
        const("one", one),
        const("fill", [-1e4]),
        const("zero", [0], np.int64),
        const("rows", [0], np.int64),
        const("columns", [1], np.int64),
        *([] if other is None else [const("other", other)]),
    ]
    wide = [2, "S", "S"] if one.ndim > 2 else ["S", "S"]
    return save_model(path, nodes, [value("x", ["S", "S"])], [value("y", wide)], constants)


def _square(length: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(2).standard_normal((length, length)).astype(np.float32)}


def test_a_slice_of_a_zero_one_buffer_is_a_gate(tmp_path: Path) -> None:
    model = _buffer_choice(tmp_path / "causal.onnx", np.tril(np.ones((4, 4))))
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PASS) == {"ArithmeticSelect": (1, 1)}
    ops = run.op_counts()
    assert (ops["Where"], ops["Mul"], ops["Sub"], ops["Cast"]) == (1, 0, 0, 1)
    for length in (1, 3, 4):
        compare_on_feeds(model, run.output, _square(length))


@pytest.mark.parametrize(
    ("gate", "why"),
    [
        (np.tril(np.ones((4, 4))) * 0.5, "a buffer of 0 and 0.5 weighs, it does not choose"),
        (np.ones((4, 4)), "a buffer of ones alone chooses nothing"),
    ],
)
def test_a_buffer_that_is_no_gate_is_no_choice(gate: np.ndarray, why: str, tmp_path: Path) -> None:
    model = _buffer_choice(tmp_path / "weights.onnx", gate)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(PASS) == (0, 0), why
    assert run.op_counts()["Where"] == 0
    compare_on_feeds(model, run.output, _square(4))


def test_one_minus_the_gate_that_broadcasts_wider_is_no_complement(tmp_path: Path) -> None:
    """(ones [2, 1, 1] - g) widens the sum to [2, S, S], which Where(g, x, fill) would not."""
    wider = np.ones((2, 1, 1), np.float32)
    model = _buffer_choice(tmp_path / "wider.onnx", np.tril(np.ones((4, 4))), one=wider)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(PASS) == (0, 0)
    compare_on_feeds(model, run.output, _square(3))


def test_gates_of_two_buffers_are_no_choice(tmp_path: Path) -> None:
    """x * g + fill * h, h taken from another 0/1 buffer: where both are 1, both are added."""
    causal = np.tril(np.ones((4, 4)))
    model = _buffer_choice(tmp_path / "two.onnx", causal, other=np.triu(np.ones((4, 4))))
    run = optimize_checked(model, tmp_path, compare=False)
    assert pattern_counts(run, PASS) == {"ArithmeticSelect": (1, 0)}
    assert reasons(run, PASS) == {"the two gates are not one gate and its complement": 1}
    compare_on_feeds(model, run.output, _square(4))
