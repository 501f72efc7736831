"""The canonicalization group (passes/canonical.py): no-op Slices and Concats, run-time
Reshape targets made constant, repeated shape arithmetic merged. Each fires on real exports,
leaves alone what it must, and keeps outputs equal on onnxruntime (optimize_checked)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.conftest import Run, digest, optimize
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

CANONICAL = "NoOpSliceConcatEliminationPass"
RESHAPE = "ReshapeTargetCanonicalizationPass"
CSE = "CommonSubexpressionEliminationPass"


# ---------------------------------------------------------------------------------------------
# The canonical Slice / Concat forms on small graphs: what goes and what must stay.
# ---------------------------------------------------------------------------------------------


def _slices_model(tmp_path: Path, x_shape: list, start: int, end: int, name: str) -> Path:
    """y = Concat(Slice(x, start:end on the last axis), x) * 2."""
    nodes = [
        helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["part"], name="cut"),
        helper.make_node("Concat", ["part", "x"], ["joined"], axis=-1, name="join"),
        helper.make_node("Mul", ["joined", "two"], ["y"], name="double"),
    ]
    inits = [
        const("starts", [start], np.int64),
        const("ends", [end], np.int64),
        const("axes", [-1], np.int64),
        const("two", 2.0),
    ]
    return save_model(
        tmp_path / f"{name}.onnx", nodes, [value("x", x_shape)], [value("y", ["b", "w"])], inits
    )


def test_empty_slice_operand_and_single_concat_go(tmp_path: Path) -> None:
    """x[..., 8:] of an axis of 8 is empty: the Concat drops it and, left with x alone, goes
    in the same rewrite."""
    model = _slices_model(tmp_path, ["batch", 8], 8, 2**63 - 1, "empty_part")
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, CANONICAL) == {"EmptyConcatOperand": (1, 1)}
    assert run.op_counts() == Counter({"Mul": 1})


def test_whole_slice_goes(tmp_path: Path) -> None:
    model = _slices_model(tmp_path, ["batch", 8], 0, 8, "whole_part")
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, CANONICAL) == {"WholeSlice": (1, 1)}
    assert run.op_counts() == Counter({"Concat": 1, "Mul": 1})


@pytest.mark.parametrize(
    ("shape", "start", "end", "why"),
    [
        (["batch", 8], 0, 4, "keeps half of the axis"),
        (["batch", "width"], 0, 8, "the axis has no static size"),
        (["batch", "width"], 8, 2**63 - 1, "may be empty, may not"),
    ],
)
def test_slices_that_change_something_stay(
    shape: list, start: int, end: int, why: str, tmp_path: Path
) -> None:
    model = _slices_model(tmp_path, shape, start, end, "kept")
    run = optimize_checked(model, tmp_path)
    assert run.counts(CANONICAL) == (0, 0), why
    assert run.op_counts() == Counter({"Slice": 1, "Concat": 1, "Mul": 1})


def test_whole_slice_between_graph_input_and_output_stays(tmp_path: Path) -> None:
    """Removing it would make the graph output the graph input itself: the decline says so."""
    nodes = [helper.make_node("Slice", ["x", "starts", "ends"], ["y"], name="copy")]
    inits = [const("starts", [0], np.int64), const("ends", [4], np.int64)]
    model = save_model(tmp_path / "copy.onnx", nodes, [value("x", [4])], [value("y", [4])], inits)
    run = optimize_checked(model, tmp_path)
    assert run.counts(CANONICAL) == (1, 0)
    assert reasons(run, CANONICAL) == {
        "it links a graph input or initializer straight to a graph output": 1
    }


# ---------------------------------------------------------------------------------------------
# Reshape targets computed at run time, and repeated shape arithmetic.
# ---------------------------------------------------------------------------------------------

TWO_UNKNOWN = (
    "more than one size of the target is read at run time from another tensor than the data, "
    "at another position"
)


@pytest.mark.parametrize(
    ("name", "reshape", "cse", "nodes"),
    [
        # GPT-2: the head split / merge targets become [0, 0, 2, 16] / [0, 0, 32]; the
        # flattened projections (Conv1D) are MatMul + Add on the 3-D input before this pass
        # sees them (FlattenedGemmCanonicalizationPass); the Constants are initializers
        # (lifted by ConstantFoldingPass), and repeated shape arithmetic on equal ones merges.
        # The targets that read two sizes at run time from other tensors (position ids, the
        # context's merge `reshape(*input_shape, -1)`) are constant too: each size read there
        # traces to the same named dimension as the data's at that position, and the merge's
        # -1 is counted from the sizes traced through the attention. The causal mask's
        # reshape to another tensor's whole shape stays declined.
        ("gpt2_tiny_ts17", (14, 13), (5, 5), 64),
        # LLaMA: its first RMS norm too fused (DoubledRmsNormFusionPass); the rotary's two
        # Muls by its attention scaling of 1.0 go (NeutralOperandEliminationPass); the value
        # heads' merge after repeat_kv, its -1 counted from the element count, is constant too
        # (the causal mask's reshape to another tensor's whole shape: declined, as GPT-2's).
        # Shape inference resolves the rotary's view's -1 (_minus_ones in the shape oracle),
        # so the shape arithmetic reading it folds before it repeats: two merges fewer. The
        # context's merge and the targets reading sizes of other tensors are constant as
        # GPT-2's, and leave less to merge.
        ("llama_tiny_ts17", (15, 14), (15, 15), 86),
    ],
)
def test_torchscript_shape_arithmetic_folds(
    name: str, reshape: tuple[int, int], cse: tuple[int, int], nodes: int, tmp_path: Path
) -> None:
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(RESHAPE) == reshape
    assert reasons(run, RESHAPE) == {TWO_UNKNOWN: reshape[0] - reshape[1]}
    assert run.counts(CSE) == cse
    assert run.report["model"]["after"]["nodes"] == nodes


def _reshape_model(tmp_path: Path, name: str, parts: list, x_shape: list, out: list) -> Path:
    """y = Reshape(x, Concat(parts)): an int part is a constant, "sK" is Shape(src)[K]
    unsqueezed (TorchScript's spelling of a size read at run time). src is [batch, sequence,
    width]; the tests feed every symbolic size 2."""
    nodes = [helper.make_node("Shape", ["src"], ["shape"], name="shape")]
    pieces = []
    for index, part in enumerate(parts):
        if isinstance(part, int):
            pieces.append(f"c{index}")
            continue
        nodes += [
            helper.make_node("Gather", ["shape", f"i{part[1]}"], [f"g{index}"], axis=0),
            helper.make_node("Unsqueeze", [f"g{index}", "axis0"], [f"u{index}"]),
        ]
        pieces.append(f"u{index}")
    nodes += [
        helper.make_node("Concat", pieces, ["target"], axis=0, name="target"),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    inits = [const("axis0", [0], np.int64)]
    inits += [const(f"i{i}", np.array(i), np.int64) for i in range(3)]
    inits += [const(f"c{i}", [p], np.int64) for i, p in enumerate(parts) if isinstance(p, int)]
    inputs = [value("x", x_shape), value("src", ["batch", "sequence", "width"])]
    return save_model(tmp_path / f"{name}.onnx", nodes, inputs, [value("y", out)], inits)


def _target(run: Run) -> list[int]:
    (target,) = onnx.load(str(run.output)).graph.initializer
    return onnx.numpy_helper.to_array(target).tolist()


def test_copied_sizes_become_zero(tmp_path: Path) -> None:
    """x [batch, sequence, 6] -> [batch, sequence, 2, 3], batch and sequence read from another
    tensor of the same named sizes: the target is [0, 0, 2, 3] and the Shape -> Gather ->
    Unsqueeze -> Concat arithmetic is gone."""
    x, out = ["batch", "sequence", 6], ["batch", "sequence", 2, 3]
    model = _reshape_model(tmp_path, "copied", ["s0", "s1", 2, 3], x, out)
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 1)
    assert run.op_counts() == Counter({"Reshape": 1})
    assert _target(run) == [0, 0, 2, 3]


def test_one_size_of_another_tensor_becomes_minus_one(tmp_path: Path) -> None:
    """x [n, 6] -> [width, 6]: width is not x's size at that position; the one such size
    becomes -1, which the element count determines."""
    model = _reshape_model(tmp_path, "minus_one", ["s2", 6], ["n", 6], ["width", 6])
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 1)
    assert _target(run) == [-1, 6]


def test_two_sizes_of_another_tensor_stay(tmp_path: Path) -> None:
    """x [n, 6] -> [batch, sequence, 3]: two sizes no constant target can spell."""
    model = _reshape_model(tmp_path, "two", ["s0", "s1", 3], ["n", 6], ["batch", "sequence", 3])
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 0)
    assert reasons(run, RESHAPE) == {TWO_UNKNOWN: 1}
    assert run.op_counts()["Shape"] == 1


def test_a_minus_one_counted_from_the_element_count_frees_it(tmp_path: Path) -> None:
    """x [batch, 2, 3, sequence, 4] -> [batch, -1, sequence, 4] (``flatten(1, 2)`` of a head
    repeat, the sequence read at another position): the -1 is 6 whatever the symbols, so the
    sequence becomes the target's -1: [0, 6, -1, 4]."""
    x, out = ["batch", 2, 3, "sequence", 4], ["batch", 6, "sequence", 4]
    model = _reshape_model(tmp_path, "counted", ["s0", -1, "s1", 4], x, out)
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 1)
    assert _target(run) == [0, 6, -1, 4]
    assert run.op_counts() == Counter({"Reshape": 1})


def test_a_minus_one_the_symbols_do_not_count_stays(tmp_path: Path) -> None:
    """x [batch, 2, n, sequence, 4] -> [batch, -1, sequence, 4]: n is no size of the target,
    so the -1 is not a number known before run time, and two sizes stay unknown."""
    x, out = ["batch", 2, "n", "sequence", 4], ["batch", "m", "sequence", 4]
    model = _reshape_model(tmp_path, "uncounted", ["s0", -1, "s1", 4], x, out)
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 0)
    assert reasons(run, RESHAPE) == {TWO_UNKNOWN: 1}


def _cache_view_model(tmp_path: Path, start: int) -> Path:
    """torchtune's rotary cache view: ``cache[start:n].view(-1, n, 1, 4, 2)``, n the length of
    x read at run time, the cache a [6, 4, 2] constant; y = that view times x's last axis."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["length"], axis=0),
        helper.make_node("Slice", ["cache", "start", "length", "zero"], ["rows"]),
        helper.make_node(
            "Concat", ["minus_one", "length", "unit", "four", "two"], ["view"], axis=0
        ),
        helper.make_node("Reshape", ["rows", "view"], ["table"], name="reshape"),
        helper.make_node("Reshape", ["x", "pairs"], ["xs"]),
        helper.make_node("Mul", ["xs", "table"], ["y"]),
    ]
    cache = np.random.default_rng(0).normal(size=(6, 4, 2))
    inits = [
        const("cache", cache),
        const("one", [1], np.int64),
        const("zero", [0], np.int64),
        const("start", [start], np.int64),
        const("minus_one", [-1], np.int64),
        const("unit", [1], np.int64),
        const("four", [4], np.int64),
        const("two", [2], np.int64),
        const("pairs", [0, 0, 1, 4, 2], np.int64),
    ]
    inputs = [value("x", ["batch", "length", 8])]
    outputs = [value("y", ["batch", "length", 1, 4, 2])]
    return save_model(tmp_path / f"cache_{start}.onnx", nodes, inputs, outputs, inits)


def test_a_minus_one_bounded_by_a_slice_to_the_read_length_is_one(tmp_path: Path) -> None:
    """cache[:n] has at most n rows, so its view as [-1, n, 1, 4, 2] can only be [1, n, ...]
    wherever it runs: the -1 is 1, and n, read elsewhere, becomes the target's -1."""
    model = _cache_view_model(tmp_path, start=0)
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 1)
    table = onnx.load(str(run.output))
    (reshape,) = [n for n in table.graph.node if n.input[0] == "rows"]
    (target,) = [t for t in table.graph.initializer if t.name == reshape.input[1]]
    assert onnx.numpy_helper.to_array(target).tolist() == [1, -1, 1, 4, 2]
    feeds = {"x": np.random.default_rng(1).normal(size=(2, 5, 8)).astype(np.float32)}
    compare_on_feeds(model, run.output, feeds)


def test_a_slice_not_from_the_start_does_not_bound_the_minus_one(tmp_path: Path) -> None:
    """cache[1:n] holds at most n - 1 rows, and a view of it as [-1, n, ...] is no proof:
    nothing says which size the -1 is, and two stay unknown."""
    model = _cache_view_model(tmp_path, start=1)
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(RESHAPE) == (1, 0)
    assert reasons(run, RESHAPE) == {TWO_UNKNOWN: 1}


def test_merges_shape_arithmetic_not_activations(tmp_path: Path) -> None:
    """Two Shape(x) reads and two equal small Constants merge; two Relu(x) (an activation)
    and two equal 32-element constants do not."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s1"], name="s1"),
        helper.make_node("Shape", ["x"], ["s2"], name="s2"),
        helper.make_node("Concat", ["s1", "s2"], ["shapes"], axis=0, name="shapes"),
        helper.make_node("Relu", ["x"], ["r1"], name="r1"),
        helper.make_node("Relu", ["x"], ["r2"], name="r2"),
        helper.make_node("Add", ["r1", "r2"], ["y"], name="add"),
    ]
    small = onnx.numpy_helper.from_array(np.arange(4, dtype=np.float32))
    large = onnx.numpy_helper.from_array(np.arange(32, dtype=np.float32))
    for index, tensor in enumerate([small, small, large, large]):
        nodes.append(helper.make_node("Constant", [], [f"k{index}"], value=tensor))
    nodes.append(helper.make_node("Sum", ["k0", "k1", "y"], ["z"], name="sum_small"))
    nodes.append(helper.make_node("Concat", ["k2", "k3"], ["w"], axis=0, name="cat_large"))
    model = save_model(
        tmp_path / "repeats.onnx",
        nodes,
        [value("x", [4])],
        [value("z", [4]), value("w", [64]), value("shapes", [2], onnx.TensorProto.INT64)],
    )
    run = optimize_checked(model, tmp_path, "--disable_pass", "ConstantFoldingPass")
    assert run.counts(CSE) == (2, 2)
    assert run.op_counts() == Counter(
        {"Shape": 1, "Concat": 2, "Relu": 2, "Add": 1, "Constant": 3, "Sum": 1}
    )


def _flatten_model(
    tmp_path: Path, name: str, leading: list[onnx.NodeProto], extra: Sequence = ()
) -> Path:
    """y = Reshape(x, Concat(leading, [-1])), x [batch, 4, 2, 3]: ``x.flatten(2)`` as the
    exporters write it, the leading sizes read from x as one run ("lead")."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        *leading,
        helper.make_node("Concat", ["lead", "rest"], ["target"], axis=0, name="target"),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    inits = [
        const("rest", [-1], np.int64),
        const("zero", [0], np.int64),
        const("two", [2], np.int64),
        const("four", [4], np.int64),
        const("minus_four", [-4], np.int64),
        const("minus_two", [-2], np.int64),
        *extra,
    ]
    inputs = [value("x", ["batch", 4, 2, 3])]
    return save_model(
        tmp_path / f"{name}.onnx", nodes, inputs, [value("y", ["batch", 4, 6])], inits
    )


FLATTEN_RUNS = {
    # TorchScript: Slice(Shape(x), [0], [2])
    "slice": [helper.make_node("Slice", ["shape", "zero", "two"], ["lead"], name="lead")],
    # the same run counted from the end: Slice(Shape(x), [-4], [-2])
    "from_end": [helper.make_node("Slice", ["shape", "minus_four", "minus_two"], ["lead"])],
    # dynamo: Shape(x, start=0, end=2), read again (the first Shape is left unused)
    "shape": [helper.make_node("Shape", ["x"], ["lead"], start=0, end=2, name="lead")],
}


@pytest.mark.parametrize("spelling", sorted(FLATTEN_RUNS))
def test_a_run_of_copied_sizes_becomes_zeros(spelling: str, tmp_path: Path) -> None:
    """Each spelling of a run of x's leading sizes is read size by size: the batch a copy (0),
    the static 4 itself, so the target is [0, 4, -1] and the shape arithmetic goes."""
    model = _flatten_model(tmp_path, spelling, FLATTEN_RUNS[spelling])
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 1)
    assert _target(run) == [0, 4, -1]
    assert run.op_counts() == Counter({"Reshape": 1})


def test_a_strided_read_of_sizes_stays(tmp_path: Path) -> None:
    """Slice(Shape(x), [0], [4], [0], [2]) reads every other size (batch and 2): no run of
    copies, so the target stays computed."""
    leading = [
        helper.make_node("Slice", ["shape", "zero", "four", "zero", "two"], ["lead"], name="lead")
    ]
    model = _flatten_model(tmp_path, "strided", leading)
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (0, 0)
    assert run.op_counts()["Shape"] == 1


def test_a_size_read_through_views_becomes_zero(tmp_path: Path) -> None:
    """paddle2onnx reads one size as Unsqueeze(Reshape(Squeeze(Slice(Shape(x), [i], [i + 1])),
    [])): views of the one element, which is x's size i all the same. x [batch, 4, 2, 3] ->
    [batch, 4, 6]: the target is [0, 4, -1], as for the other spellings."""
    leading = [
        helper.make_node("Slice", ["shape", "zero", "one"], ["first"]),
        helper.make_node("Squeeze", ["first", "zero"], ["scalar"]),
        helper.make_node("Reshape", ["scalar", "scalar_shape"], ["size"]),
        helper.make_node("Unsqueeze", ["size", "zero"], ["batch"]),
        helper.make_node("Concat", ["batch", "four"], ["lead"], axis=0),
    ]
    model = _flatten_model(
        tmp_path,
        "views",
        leading,
        [const("one", [1], np.int64), const("scalar_shape", np.zeros(0), np.int64)],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(RESHAPE) == (1, 1)
    assert _target(run) == [0, 4, -1]
    assert run.op_counts() == Counter({"Reshape": 1})


# ---------------------------------------------------------------------------------------------
# Expand(x, Shape(y)) read by an element-wise op that also reads y (expand_as masks).
# ---------------------------------------------------------------------------------------------

EXPAND = "BroadcastExpandEliminationPass"


def _expanded_mask(tmp_path: Path, *, shape_of: str, add_t: bool = True) -> Path:
    """y = Where(Cast(Expand(keep, Shape(<shape_of>)), bool), s, -1e9) + t (without the Add:
    ``add_t``): masked_fill with expand_as; keep [B, 1, 1, L] (0/1 floats), s and t
    [B, N, S, L]."""
    nodes = [
        helper.make_node("Shape", [shape_of], ["target"], name="target"),
        helper.make_node("Expand", ["keep", "target"], ["expanded"], name="expand_as"),
        helper.make_node("Cast", ["expanded"], ["flag"], to=onnx.TensorProto.BOOL, name="flag"),
        helper.make_node("Where", ["flag", "s", "fill"], ["filled" if add_t else "y"], name="fill"),
    ]
    if add_t:
        nodes.append(helper.make_node("Add", ["filled", "t"], ["y"], name="add"))
    dims = ["batch", "heads", "seq", "len"]
    inputs = [value("keep", ["batch", 1, 1, "len"]), value("s", dims), value("t", dims)]
    path = tmp_path / f"expand_as_{shape_of}.onnx"
    return save_model(path, nodes, inputs, [value("y", dims)], [const("fill", np.array(-1e9))])


def test_expand_to_a_co_operands_shape_goes(tmp_path: Path) -> None:
    """The Where broadcasts the mask to s's shape anyway: the Expand and its Shape go, the
    Cast reads the mask itself, and the outputs stay equal."""
    model = _expanded_mask(tmp_path, shape_of="s")
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, EXPAND)["BroadcastExpand"] == (1, 1)
    counts = run.op_counts()
    assert (counts["Expand"], counts["Shape"]) == (0, 0)
    graph = onnx.load(str(run.output)).graph
    (cast,) = [n for n in graph.node if n.op_type == "Cast"]
    assert list(cast.input) == ["keep"]


def test_expand_of_a_constant_anded_with_the_mask_goes(tmp_path: Path) -> None:
    """Keras's causal mask through tf2onnx: And(Expand(True, Cast(Cast(Shape(s)))), m), then
    the Where that reads s. The And broadcasts too, and the Where to s's shape anyway: the
    Expand goes through the And and the int32 round trip of the shape."""
    nodes = [
        helper.make_node("Shape", ["s"], ["target"]),
        helper.make_node("Cast", ["target"], ["target32"], to=onnx.TensorProto.INT32),
        helper.make_node("Cast", ["target32"], ["target64"], to=onnx.TensorProto.INT64),
        helper.make_node("Expand", ["true", "target64"], ["ones"], name="ones_like"),
        helper.make_node("And", ["ones", "causal"], ["mask"]),
        helper.make_node("Where", ["mask", "s", "fill"], ["y"]),
    ]
    dims = ["batch", "heads", 4, 4]
    initializers = [
        const("true", np.array(True), np.bool_),
        const("causal", np.tril(np.ones((1, 1, 4, 4))), np.bool_),
        const("fill", np.array(-1e9)),
    ]
    path = save_model(
        tmp_path / "and.onnx", nodes, [value("s", dims)], [value("y", dims)], initializers
    )
    run = optimize_checked(path, tmp_path)
    assert pattern_counts(run, EXPAND)["BroadcastExpand"] == (1, 1)
    counts = run.op_counts()
    assert (counts["Expand"], counts["Shape"], counts["Cast"]) == (0, 0, 0)


def test_expand_to_the_shape_of_a_tensor_added_later_goes(tmp_path: Path) -> None:
    """Expanded to the shape of t, which only the Add after the Where reads: every op on the
    way broadcasts, so the Where computes on the narrower mask and the Add widens the same."""
    model = _expanded_mask(tmp_path, shape_of="t")
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, EXPAND)["BroadcastExpand"] == (1, 1)
    assert run.op_counts()["Expand"] == 0


def test_expand_to_another_tensors_shape_stays(tmp_path: Path) -> None:
    """Expanded to the shape of t, which nothing after it reads: the Expand widens the
    output, so it stays."""
    model = _expanded_mask(tmp_path, shape_of="t", add_t=False)
    run = optimize_checked(model, tmp_path)
    assert EXPAND not in {p["name"] for p in run.report["passes"] if p.get("effected")}
    assert run.op_counts()["Expand"] == 1


# ---------------------------------------------------------------------------------------------
# x + zeros spread to run-time shapes, read by an op that broadcasts to them anyway (paddle's
# where, as paddle2onnx writes it).
# ---------------------------------------------------------------------------------------------

ZERO = "BroadcastZeroEliminationPass"
PADDLE_GPT = fixture_path("paddle_gpt_paddle2onnx")


def _ids(batch: int, length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(length)
    return {"input_ids": rng.integers(0, 64, (batch, length)).astype(np.int64)}


def test_paddle_where_broadcast_goes_and_the_attention_fuses(tmp_path: Path) -> None:
    """paddle's where(causal, scores, full_like(scores, -1e9)) in a GPT block
    (tests/fixtures/make_paddle_fixtures.py): the zeros it adds to its three operands go, the
    mask's bool -> float -> bool round trip with them (CastCastFusionPass), and the attention
    reads the Where as a masked fill and fuses. Before, the attention stayed written out (and
    its rank-2 mask then reached a bias widening that assumed a bias already in the graph)."""
    run = optimize_checked(PADDLE_GPT, tmp_path)
    assert pattern_counts(run, ZERO) == {"BroadcastZero": (3, 3)}
    assert reasons(run, ZERO) == {}
    ops = run.op_counts()
    assert (ops["MultiHeadAttention"], ops["Where"], ops["Softmax"], ops["Expand"]) == (1, 1, 0, 1)
    assert run.report["model"]["after"]["nodes"] == 22
    for batch, length in ((1, 1), (2, 7), (3, 16)):
        compare_on_feeds(PADDLE_GPT, run.output, _ids(batch, length))
    assert_second_run_changes_nothing(run, tmp_path, ZERO)


def _broadcast_where(tmp_path: Path, zeros_of: tuple[str, ...]) -> Path:
    """y = Where(Cast(Cast(c) + z, bool), s + z, f + z), z the sum of Expand(0, Shape(t)) for t
    in ``zeros_of`` (paddle's broadcasting where): c bool [seq, len], s [batch, 2, seq, len], f
    a [1] fill, w [3, batch, 2, seq, len] a tensor no operand is."""
    nodes = [helper.make_node("Cast", ["c"], ["c_float"], to=onnx.TensorProto.FLOAT)]
    zeros = []
    for tensor in zeros_of:
        nodes += [
            helper.make_node("Shape", [tensor], [f"{tensor}_shape"]),
            helper.make_node("Expand", ["zero", f"{tensor}_shape"], [f"{tensor}_zeros"]),
        ]
        zeros.append(f"{tensor}_zeros")
    total = zeros[0]
    for index, other in enumerate(zeros[1:]):
        nodes.append(helper.make_node("Add", [total, other], [f"sum{index}"]))
        total = f"sum{index}"
    nodes += [
        helper.make_node("Add", ["c_float", total], ["c_wide"]),
        helper.make_node("Cast", ["c_wide"], ["c_flag"], to=onnx.TensorProto.BOOL),
        helper.make_node("Add", ["s", total], ["s_wide"]),
        helper.make_node("Add", ["f", total], ["f_wide"]),
        helper.make_node("Where", ["c_flag", "s_wide", "f_wide"], ["y"]),
    ]
    inputs = [
        value("c", ["seq", "len"], onnx.TensorProto.BOOL),
        value("s", ["batch", 2, "seq", "len"]),
        value("w", [3, "batch", 2, "seq", "len"]),
    ]
    inits = [const("zero", 0.0), const("f", [-1e9])]
    wide = [3, "batch", 2, "seq", "len"] if "w" in zeros_of else ["batch", 2, "seq", "len"]
    out = [value("y", wide)]
    return save_model(tmp_path / "where.onnx", nodes, inputs, out, inits)


def _where_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "c": rng.random((3, 4)) < 0.5,
        "s": rng.standard_normal((2, 2, 3, 4)).astype(np.float32),
        "w": rng.standard_normal((3, 2, 2, 3, 4)).astype(np.float32),
    }


def test_zeros_spread_to_the_where_operands_go(tmp_path: Path) -> None:
    """Spread to the shapes of the Where's own operands, the zeros add nothing the Where does
    not broadcast to: all three Adds go, and the Where reads c, s and f. (s, the widest, is
    provably as wide as the zeros: NeutralOperandEliminationPass takes its Add first.)"""
    model = _broadcast_where(tmp_path, ("s", "f", "c_float"))
    run = optimize_checked(model, tmp_path, compare=False)  # a bool input: fed below
    assert pattern_counts(run, "NeutralOperandEliminationPass")["NeutralOperand"][1] == 1
    assert pattern_counts(run, ZERO) == {"BroadcastZero": (2, 2)}
    assert run.op_counts() == Counter({"Where": 1})
    compare_on_feeds(model, run.output, _where_feeds())


def test_zeros_spread_to_another_tensor_stay(tmp_path: Path) -> None:
    """Spread to the shape of w as well, which the Where does not read: the zeros widen its
    output, so they stay."""
    model = _broadcast_where(tmp_path, ("s", "f", "w"))
    run = optimize_checked(model, tmp_path, compare=False)
    assert reasons(run, ZERO) == {
        "the zeros widen the value to a shape its reader does not broadcast to": 3
    }
    assert run.counts(ZERO) == (3, 0)
    compare_on_feeds(model, run.output, _where_feeds())


# ---------------------------------------------------------------------------------------------
# A constant of one value spread to a full shape, read by an op that broadcasts to it anyway.
# ---------------------------------------------------------------------------------------------

SPLAT = "SplatConstantCanonicalizationPass"
MINDSPORE_GPT = fixture_path("mindspore_gpt_ms")


def test_mindspore_full_fill_becomes_a_scalar_and_the_attention_fuses(tmp_path: Path) -> None:
    """MindSpore's ops.select(mask, full([2, 4, 8, 8], -1e9), scores) in a GPT block
    (tests/fixtures/make_mindspore_fixtures.py): the fill is one value as large as the scores,
    which the Where broadcasts to anyway. As a scalar, the Where is a masked fill the attention
    reads, and it fuses; before, it stayed written out."""
    run = optimize_checked(MINDSPORE_GPT, tmp_path)
    assert pattern_counts(run, SPLAT) == {"SplatConstant": (1, 1)}
    ops = run.op_counts()
    assert (ops["MultiHeadAttention"], ops["Softmax"], ops["Where"]) == (1, 0, 0)
    rng = np.random.default_rng(5)
    compare_on_feeds(
        MINDSPORE_GPT, run.output, {"input_ids": rng.integers(0, 64, (2, 8)).astype(np.int32)}
    )


def _filled(tmp_path: Path, fill_shape: list[int]) -> Path:
    """y = Where(c, full(fill_shape, -1e9), s), c bool [2, 3, 4], s [2, 3, 4]."""
    nodes = [helper.make_node("Where", ["c", "fill", "s"], ["y"], name="fill")]
    out = list(np.broadcast_shapes(tuple(fill_shape), (2, 3, 4)))
    inputs = [value("c", [2, 3, 4], onnx.TensorProto.BOOL), value("s", [2, 3, 4])]
    inits = [const("fill", np.full(fill_shape, -1e9, np.float32))]
    return save_model(tmp_path / "filled.onnx", nodes, inputs, [value("y", out)], inits)


def test_a_full_constant_the_op_broadcasts_to_becomes_its_element(tmp_path: Path) -> None:
    model = _filled(tmp_path, [2, 3, 4])
    run = optimize_checked(model, tmp_path, compare=False)  # a bool input: fed below
    assert pattern_counts(run, SPLAT) == {"SplatConstant": (1, 1)}
    (fill,) = onnx.load(str(run.output)).graph.initializer
    assert list(fill.dims) == []
    rng = np.random.default_rng(0)
    feeds = {
        "c": rng.random((2, 3, 4)) < 0.5,
        "s": rng.standard_normal((2, 3, 4)).astype(np.float32),
    }
    compare_on_feeds(model, run.output, feeds)


def test_a_full_constant_that_widens_the_output_stays(tmp_path: Path) -> None:
    """A fill of [5, 2, 3, 4] makes the Where's output larger than its other operands: it is
    the fill's shape that the output takes, so the constant stays."""
    model = _filled(tmp_path, [5, 2, 3, 4])
    run = optimize_checked(model, tmp_path, compare=False)
    assert run.counts(SPLAT) == (0, 0)
    (fill,) = onnx.load(str(run.output)).graph.initializer
    assert list(fill.dims) == [5, 2, 3, 4]


@pytest.mark.parametrize(
    ("tool", "reshape", "nodes"),
    [
        # onnx-simplifier folds LeViT's shape arithmetic: some targets are read from a fused
        # op's output, and become constants once the fusions have run.
        # The head merges' -1s, counted from the sizes traced through the attention, make
        # the rest constant too (and the fifth attention fuses).
        ("onnxsim", (33, 33), 150),
        # onnxoptimizer takes away the Reshape back from a BatchNorm's flatten: a target read
        # from the activation becomes a constant once the layout chain before it is merged to
        # a constant target (a pass later in the same round).
        ("onnxoptimizer", (32, 28), 164),
    ],
)
def test_targets_constant_only_after_the_fusions_are_made_so_in_one_run(
    tool: str, reshape: tuple[int, int], nodes: int, tmp_path: Path
) -> None:
    """LeViT through another tool first (tests/fixtures/make_preprocessed_fixtures.py): the
    targets a second run made constants before are made so in the first, which runs the pass
    again after the fusions, on shapes inferred again after every round that changed the
    graph. A second run then changes nothing."""
    run = optimize_checked(fixture_path(f"preprocessed/levit_ts17_{tool}"), tmp_path)
    assert run.counts(RESHAPE) == reshape
    assert run.report["coverage"]["attention"] == {"fused": 5, "total": 5, "unfused": []}
    assert run.report["model"]["after"]["nodes"] == nodes
    (tmp_path / "second").mkdir()
    again = optimize(run.output, tmp_path / "second")
    # The targets read from another tensor's sizes stay declined, as in the first run.
    assert again.counts(RESHAPE)[1] == 0
    assert digest(again.output) == digest(run.output)
