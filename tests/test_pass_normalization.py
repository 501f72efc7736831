"""LayerNormFusionPass (standard LayerNormalization, opset 17) and AddLayerNormFusionPass
(residual Add + layer norm -> onnxruntime SkipLayerNormalization)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from fusectl.rewrite import shapes
from fusectl.rewrite.axes import size_sources
from fusectl.rewrite.context import PassContext
from fusectl.rewrite.registry import Category, PassSpec
from tests.conftest import (
    Run,
    assert_same_outputs,
    named_dim_feeds,
    optimize,
    random_feeds,
    run_model,
)
from tests.pass_helpers import (
    assert_declined,
    check_output,
    const,
    edited_fixture,
    feed_scalar,
    fixture_path,
    node_named,
    optimize_checked,
    pattern_counts,
    reasons,
    save_model,
    value,
)

LN, SKIP = "LayerNormFusionPass", "AddLayerNormFusionPass"
SHAPE = [2, 5, 8]
SKIP_OP = "SkipLayerNormalization"


def _n(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=output, **attrs)


def _layer_norm(
    x: str, out: str, *, square: str = "pow", axes: list[int] | None = None, opset: int = 17
) -> list[onnx.NodeProto]:
    axes = axes or [-1]
    reduce = {"axes": axes} if opset < 18 else {}
    axes_input = [] if opset < 18 else ["axes"]
    squared = _n("Pow", ["d", "two"], "sq") if square == "pow" else _n("Mul", ["d", "d"], "sq")
    return [
        _n("ReduceMean", [x, *axes_input], "mean", **reduce),
        _n("Sub", [x, "mean"], "d"),
        squared,
        _n("ReduceMean", ["sq", *axes_input], "var", **reduce),
        _n("Add", ["var", "eps"], "ve"),
        _n("Sqrt", ["ve"], "std"),
        _n("Div", ["d", "std"], "norm"),
        _n("Mul", ["norm", "gamma"], "scaled"),
        _n("Add", ["scaled", "beta"], out),
    ]


def _model(
    path: Path,
    *,
    residual: bool,
    reuse_sum: bool = False,
    opset: int = 17,
    shape: list[int] = SHAPE,
    two: float = 2.0,
    **kwargs: object,
) -> Path:
    rng = np.random.default_rng(0)
    inputs = [value("a", shape)]
    nodes: list[onnx.NodeProto] = []
    x = "a"
    if residual:
        inputs.append(value("b", shape))
        nodes.append(_n("Add", ["a", "b"], "total"))
        x = "total"
    nodes += _layer_norm(x, "y", opset=opset, **kwargs)
    outputs = [value("y", shape)]
    if reuse_sum:  # pre-LN style: the sum also feeds the next residual
        nodes.append(_n("Add", ["y", "total"], "next"))
        outputs = [value("next", shape)]
    inits = [
        const("two", np.array(two, np.float32)),
        const("eps", np.array(1e-5, np.float32)),
        const("gamma", rng.uniform(0.5, 1.5, shape[-1])),
        const("beta", rng.normal(0, 0.1, shape[-1])),
        const("axes", np.array(kwargs.get("axes") or [-1], np.int64), np.int64),
    ]
    return save_model(path, nodes, inputs, outputs, inits, opset=opset)


@pytest.mark.parametrize("square", ["pow", "mul"])
def test_layer_norm_becomes_layer_normalization(square: str, tmp_path: Path) -> None:
    run = optimize_checked(_model(tmp_path / "ln.onnx", residual=False, square=square), tmp_path)
    assert run.counts(LN) == (1, 1)
    assert run.op_counts() == Counter({"LayerNormalization": 1})
    (node,) = onnx.load(str(run.output)).graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["epsilon"] == pytest.approx(1e-5)


def test_layer_norm_below_opset_17_says_why(tmp_path: Path) -> None:
    run = optimize_checked(_model(tmp_path / "ln14.onnx", residual=False, opset=14), tmp_path)
    assert_declined(run, LN, "LayerNormalization needs opset >= 17, model has 14", "y")
    # A layer norm is the RMS norm of its centred input (plus beta): that core still fuses,
    # checker-valid, as the doubled skip norm; the mean, Sub and beta Add stay.
    assert run.counts("DoubledRmsNormFusionPass") == (1, 1)
    assert run.op_counts() == Counter(
        {"ReduceMean": 1, "Sub": 1, "SkipSimplifiedLayerNormalization": 1, "Add": 1}
    )


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"two": 3.0}, "the square is not Pow(d, 2)"),
        ({"axes": [1]}, "the normalised axes are not the trailing ones"),
    ],
    ids=["cube", "middle_axis"],
)
def test_layer_norm_near_misses(kwargs: dict, reason: str, tmp_path: Path) -> None:
    run = optimize_checked(_model(tmp_path / "miss.onnx", residual=False, **kwargs), tmp_path)
    assert_declined(run, LN, reason, "y")


@pytest.mark.parametrize("opset", [14, 17, 18])
def test_residual_add_and_layer_norm_become_skip_layer_norm(opset: int, tmp_path: Path) -> None:
    run = optimize_checked(_model(tmp_path / "skip.onnx", residual=True, opset=opset), tmp_path)
    assert run.counts(SKIP) == (1, 1)
    assert run.op_counts() == Counter({"SkipLayerNormalization": 1})
    (node,) = onnx.load(str(run.output)).graph.node
    assert list(node.input) == ["a", "b", "gamma", "beta"] and len(node.output) == 1


def test_sum_read_elsewhere_comes_from_the_fourth_output(tmp_path: Path) -> None:
    model = _model(tmp_path / "reuse.onnx", residual=True, reuse_sum=True)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    skip = next(n for n in graph.node if n.op_type == "SkipLayerNormalization")
    add = next(n for n in graph.node if n.op_type == "Add")
    assert len(skip.output) == 4 and skip.output[3] == "total"
    assert sorted(add.input) == sorted([skip.output[0], "total"])


def _projected(
    path: Path,
    *,
    bias_shape: tuple[int, ...] | None = None,
    bias_read: bool = False,
    fed_bias: bool = False,
    beta: bool = True,
) -> Path:
    """MatMul(x, w) + bias, then the residual Add and LayerNormalization: BERT's output block.
    ``bias_read`` makes the biased projection a second graph output; ``fed_bias`` feeds the
    bias as a graph input; without ``beta`` the norm has no bias (MPT's, OLMo's)."""
    rng = np.random.default_rng(1)
    hidden = SHAPE[-1]
    shape = bias_shape or (hidden,)
    nodes = [
        _n("MatMul", ["x", "w"], "proj"),
        _n("Add", ["proj", "bias"], "dense"),
        _n("Add", ["dense", "residual"], "total"),
        helper.make_node(
            "LayerNormalization", ["total", "gamma", "beta"][: 3 if beta else 2], ["y"], axis=-1
        ),
    ]
    inputs = [value("x", SHAPE), value("residual", SHAPE)]
    outputs = [value("y", SHAPE)] + ([value("dense", SHAPE)] if bias_read else [])
    inits = [
        const("w", rng.normal(0, 0.3, (hidden, hidden))),
        const("gamma", rng.uniform(0.5, 1.5, hidden)),
        const("beta", rng.normal(0, 0.1, hidden)),
    ]
    if fed_bias:
        inputs.append(value("bias", [hidden]))
    else:
        inits.append(const("bias", rng.normal(0, 0.5, shape)))
    return save_model(path, nodes, inputs, outputs, inits, opset=17)


def test_projection_bias_goes_into_the_skip_kernel(tmp_path: Path) -> None:
    run = optimize_checked(_projected(tmp_path / "bias.onnx"), tmp_path)
    assert run.counts(SKIP) == (1, 1)
    assert run.op_counts() == Counter({"MatMul": 1, "SkipLayerNormalization": 1})
    skip = next(n for n in onnx.load(str(run.output)).graph.node if n.op_type == SKIP_OP)
    assert list(skip.input) == ["proj", "residual", "gamma", "beta", "bias"]


@pytest.mark.parametrize(
    ("kwargs", "inputs"),
    [
        ({}, ["proj", "residual", "gamma", "", "bias"]),
        ({"bias_read": True}, ["dense", "residual", "gamma"]),
    ],
    ids=["with_the_projection_bias", "alone"],
)
def test_layer_norm_without_beta_is_a_skip_norm_without_beta(
    kwargs: dict, inputs: list[str], tmp_path: Path
) -> None:
    """LayerNormalization(x, gamma) (MPT's and OLMo's dynamo exports; OLMo's gamma is ones):
    SkipLayerNormalization's beta is optional, left empty where the projection bias follows."""
    run = optimize_checked(_projected(tmp_path / "no_beta.onnx", beta=False, **kwargs), tmp_path)
    assert run.counts(SKIP) == (1, 1)
    assert pattern_counts(run, SKIP)["AddLayerNormalizationNoBeta"] == (1, 1)
    skip = next(n for n in onnx.load(str(run.output)).graph.node if n.op_type == SKIP_OP)
    assert list(skip.input) == inputs


@pytest.mark.parametrize(
    "kwargs",
    [{"bias_read": True}, {"fed_bias": True}, {"bias_shape": (1, 1, SHAPE[-1])}],
    ids=["biased_projection_read_elsewhere", "bias_is_an_input", "bias_is_3d"],
)
def test_projection_bias_stays_outside_when_it_must(kwargs: dict, tmp_path: Path) -> None:
    """The skip norm still fuses; only the bias Add stays where it is."""
    run = optimize_checked(_projected(tmp_path / "bias.onnx", **kwargs), tmp_path)
    assert run.counts(SKIP) == (1, 1)
    assert run.op_counts() == Counter({"MatMul": 1, "Add": 1, "SkipLayerNormalization": 1})
    skip = next(n for n in onnx.load(str(run.output)).graph.node if n.op_type == SKIP_OP)
    assert list(skip.input) == ["dense", "residual", "gamma", "beta"]


def _declined_as_not_one_shape(run: Run) -> None:
    """The residual norm (the LayerNormalization LayerNormFusionPass made of y) declined."""
    assert_declined(
        run,
        SKIP,
        "the residual Add's inputs are not two 3-D tensors of one shape",
        "LayerNormFusionPass/y",
    )


def test_skip_layer_norm_needs_3d_inputs(tmp_path: Path) -> None:
    model = _model(tmp_path / "flat.onnx", residual=True, shape=[4, 8])
    run = optimize_checked(model, tmp_path)
    # LayerNormFusionPass ran first: the candidate is the LayerNormalization it made.
    _declined_as_not_one_shape(run)
    assert run.op_counts() == Counter({"Add": 1, "LayerNormalization": 1})


def test_unnamed_dims_prove_nothing(tmp_path: Path) -> None:
    """Two inputs of shape [?, 5, 8]: one may be [1, 5, 8] and the Add broadcast it, which the
    fused kernel would not (it would return the first input's shape)."""
    model = _model(tmp_path / "unnamed.onnx", residual=True, shape=[None, 5, 8])
    run = optimize_checked(model, tmp_path)
    _declined_as_not_one_shape(run)
    feeds = {"a": np.ones((1, 5, 8), np.float32), "b": np.ones((2, 5, 8), np.float32)}
    assert run_model(run.output, feeds)[0].shape == (2, 5, 8)


def _norm_constants(rng: np.random.Generator) -> list[onnx.TensorProto]:
    """two, eps, gamma and beta of a written-out layer norm over 8 channels."""
    return [
        const("two", np.array(2.0, np.float32)),
        const("eps", np.array(1e-5, np.float32)),
        const("gamma", rng.uniform(0.5, 1.5, 8)),
        const("beta", rng.normal(0, 0.1, 8)),
    ]


def _reshaped_residual(path: Path, target: list[onnx.NodeProto], c_shape: list[int | str]) -> Path:
    """total = a + Reshape(c, target), a: [B, S, 8]; the Reshape output is declared with
    symbols of its own ([n, s, 8]), as when onnx could not tie them to a's, so that only the
    computed target can prove (or not) that the Add broadcasts nothing."""
    rng = np.random.default_rng(0)
    nodes = [
        _n("Shape", ["a"], "shape_a"),
        *target,
        _n("Reshape", ["c", "target"], "b"),
        _n("Add", ["a", "b"], "total"),
        *_layer_norm("total", "y"),
    ]
    inits = [
        *_norm_constants(rng),
        const("zero", np.array(0, np.int64), np.int64),
        const("one", np.array(1, np.int64), np.int64),
        const("axis0", np.array([0], np.int64), np.int64),
        const("hidden", np.array([8], np.int64), np.int64),
        const("batch1", np.array([1], np.int64), np.int64),
        const("start1", np.array([1], np.int64), np.int64),
        const("end3", np.array([3], np.int64), np.int64),
    ]
    return save_model(
        path,
        nodes,
        [value("a", ["B", "S", 8]), value("c", c_shape)],
        [value("y", ["B", "S", 8])],
        inits,
        value_info=[value("b", ["n", "s", 8])],
    )


def test_reshape_to_the_other_inputs_shape_proves_one_shape(tmp_path: Path) -> None:
    """TorchScript's Reshape(x, Concat(Shape(a)[0], Shape(a)[1], 8)): b has a's shape."""
    target = [
        _n("Gather", ["shape_a", "zero"], "batch", axis=0),
        _n("Gather", ["shape_a", "one"], "sequence", axis=0),
        _n("Unsqueeze", ["batch", "axis0"], "batch_1d"),
        _n("Unsqueeze", ["sequence", "axis0"], "sequence_1d"),
        _n("Concat", ["batch_1d", "sequence_1d", "hidden"], "target", axis=0),
    ]
    model = _reshaped_residual(tmp_path / "proven.onnx", target, ["M", "S", 8])
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (1, 1)
    assert run.op_counts()["SkipLayerNormalization"] == 1


def test_projection_keeps_its_inputs_leading_dims(tmp_path: Path) -> None:
    """total = a + (MatMul(a, W) + bias) with the projection declared [n, s, 8] (fresh symbols,
    as inferred shapes go stale once an attention op is fused upstream): a constant [8, 8] W
    and [8] bias keep a's [B, S] leading dims, so the Add broadcasts nothing."""
    rng = np.random.default_rng(0)
    nodes = [
        _n("MatMul", ["a", "weight"], "product"),
        _n("Add", ["product", "bias"], "b"),
        _n("Add", ["a", "b"], "total"),
        *_layer_norm("total", "y"),
    ]
    inits = [
        *_norm_constants(rng),
        const("weight", rng.normal(0, 0.3, (8, 8))),
        const("bias", rng.normal(0, 0.1, 8)),
    ]
    model = save_model(
        tmp_path / "projected.onnx",
        nodes,
        [value("a", ["B", "S", 8])],
        [value("y", ["B", "S", 8])],
        inits,
        opset=17,
        value_info=[value("product", ["n", "s", 8]), value("b", ["n", "s", 8])],
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (1, 1)
    assert run.op_counts()["SkipLayerNormalization"] == 1


def test_reshape_to_batch_one_is_a_broadcast_skip(tmp_path: Path) -> None:
    """Reshape(c, Concat(1, Shape(a)[1:3])) is [1, S, 8]: the Add broadcasts it over a's batch,
    as the kernel broadcasts a [1, S, H] skip: the [B, S, 8] a is the input, b the skip."""
    target = [
        _n("Slice", ["shape_a", "start1", "end3"], "rest"),
        _n("Concat", ["batch1", "rest"], "target", axis=0),
    ]
    model = _reshaped_residual(tmp_path / "broadcast.onnx", target, ["S", 8])
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (1, 1)
    skip = next(n for n in onnx.load(str(run.output)).graph.node if n.op_type == SKIP_OP)
    assert list(skip.input[:2]) == ["a", "b"]
    feeds = random_feeds(model, dims={"B": 3, "S": 4})
    for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


# BERT and GPT-2 (tiny configs, random weights) from tests/fixtures/make_transformer_fixtures.py:
# five layer norms, four after a residual Add of two [B, S, H] activations. BERT's embeddings'
# norm becomes EmbedLayerNormalization first (that pass runs before). GPT-2's adds position
# embeddings of shape [1, S, H]: the kernel broadcasts such a skip, which dynamo's export
# proves, and TorchScript's computes at run time (a Range over the sequence: onnxruntime's
# symbolic inference proves it). In GPT-2's TorchScript exports each projection is reshaped
# back to Shape(attention output)[0:2], whose batch onnx cannot tie to the residual's: the
# fused attention output has the query's batch. Outputs are compared at another batch and
# sequence length too.


@pytest.mark.parametrize(
    ("name", "ln", "also", "skip", "why"),
    [
        ("bert_tiny_ts14", (5, 0), "BiasGeluFusionPass", (4, 4), {}),
        ("bert_tiny_ts17", (0, 0), "BiasGeluFusionPass", (4, 4), {}),
        ("bert_tiny_dynamo", (0, 0), "BiasGeluFusionPass", (4, 4), {}),
        ("gpt2_tiny_ts14", (5, 0), "MultiHeadAttentionFusionPass", (5, 5), {}),
        ("gpt2_tiny_ts17", (0, 0), "MultiHeadAttentionFusionPass", (5, 5), {}),
        ("gpt2_tiny_dynamo", (0, 0), "MultiHeadAttentionFusionPass", (5, 5), {}),
    ],
)
def test_residual_norms(
    name: str,
    ln: tuple[int, int],
    also: str,
    skip: tuple[int, int],
    why: dict[str, int],
    tmp_path: Path,
) -> None:
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(LN) == ln
    assert run.counts(also) == (2, 2)
    assert run.counts(SKIP) == skip
    assert reasons(run, SKIP) == why
    counts = run.op_counts()
    assert counts["SkipLayerNormalization"] == skip[1]
    assert counts["LayerNormalization"] + counts["ReduceMean"] == 0
    feeds = random_feeds(fixture_path(name), dims={"batch": 3, "sequence": 5})
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# RMS norm: RmsNormFusionPass (RMSNormalization, opset 23) and AddRmsNormFusionPass.
# ---------------------------------------------------------------------------------------------

RMS, SKIP_RMS = "RmsNormFusionPass", "AddRmsNormFusionPass"


_RANDOM_WEIGHT = np.random.default_rng(1).uniform(0.5, 1.5, SHAPE[-1]).astype(np.float32)


def _rms_model(
    path: Path,
    *,
    inverse: str,
    residual: bool,
    opset: int = 18,
    one: float = 1.0,
    shape: list[int | str] = SHAPE,
    weight: np.ndarray | None = _RANDOM_WEIGHT,
    epsilon: bool = True,
    exponent: float = 2.0,
) -> Path:
    """The RMS norm of ``a`` (after ``a + b`` with ``residual``), times ``weight`` unless it
    is None; without its eps Add unless ``epsilon``; the square Pow(x, ``exponent``)."""
    inputs = [value("a", shape)]
    nodes: list[onnx.NodeProto] = []
    x = "a"
    if residual:
        inputs.append(value("b", SHAPE))
        nodes.append(_n("Add", ["a", "b"], "total"))
        x = "total"
    nodes += [
        _n("Pow", [x, "two"], "sq"),
        _n("ReduceMean", ["sq", "axes"], "ms"),
        _n("Add", ["ms", "eps"], "mse") if epsilon else _n("Identity", ["ms"], "mse"),
        _n("Sqrt", ["mse"], "rms"),
    ]
    if inverse == "Reciprocal":
        nodes += [_n("Reciprocal", ["rms"], "inv"), _n("Mul", [x, "inv"], "scaled")]
    elif inverse == "DivOne":
        nodes += [_n("Div", ["one", "rms"], "inv"), _n("Mul", [x, "inv"], "scaled")]
    else:
        nodes += [_n("Div", [x, "rms"], "scaled")]
    inits = [
        const("two", np.array(exponent, np.float32)),
        const("eps", np.array(1e-6, np.float32)),
        const("one", np.array(one, np.float32)),
        const("axes", np.array([-1], np.int64), np.int64),
    ]
    if not epsilon:
        inits = [init for init in inits if init.name != "eps"]
    if weight is None:
        nodes.append(_n("Identity", ["scaled"], "y"))
    else:
        nodes.append(_n("Mul", ["weight", "scaled"], "y"))
        inits.append(const("weight", weight))
    return save_model(path, nodes, inputs, [value("y", shape)], inits, opset=opset)


@pytest.mark.parametrize("inverse", ["Reciprocal", "DivOne", "Div"])
def test_rms_norm_forms(inverse: str, tmp_path: Path) -> None:
    model = _rms_model(tmp_path / "rms.onnx", inverse=inverse, residual=False, opset=23)
    run = optimize_checked(model, tmp_path)
    assert run.counts(RMS) == (1, 1)
    assert run.op_counts() == Counter({"RMSNormalization": 1})
    residual = _rms_model(tmp_path / "skip.onnx", inverse=inverse, residual=True)
    run = optimize_checked(residual, tmp_path)
    assert_declined(run, RMS, "RMSNormalization needs opset >= 23, model has 18", "y")
    assert run.counts(SKIP_RMS) == (1, 1)
    assert run.op_counts() == Counter({"SkipSimplifiedLayerNormalization": 1})


@pytest.mark.parametrize("inverse", ["Reciprocal", "DivOne", "Div"])
def test_rms_norm_without_epsilon(inverse: str, tmp_path: Path) -> None:
    """x * rsqrt(mean(x^2)) * w with no eps Add (Moshi's dynamo export: its eps of 1e-8 is
    gone) is the RMS norm with epsilon 0 (the Identity in front of the Sqrt goes first)."""
    model = _rms_model(tmp_path / "rms.onnx", inverse=inverse, residual=True, epsilon=False)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP_RMS) == (1, 1)
    assert run.passed(SKIP_RMS)["patterns"][f"AddRmsNorm{inverse}NoEpsilon"] == {
        "matched": 1,
        "effected": 1,
    }
    (node,) = onnx.load(str(run.output)).graph.node
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["epsilon"] == 0.0
    cubed = _rms_model(
        tmp_path / "cubed.onnx", inverse=inverse, residual=True, epsilon=False, exponent=3.0
    )
    run = optimize_checked(cubed, tmp_path)
    assert_declined(run, SKIP_RMS, "the square is not Pow(d, 2)", "y")


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_moshi_rms_norms_with_and_without_epsilon(exporter: str, tmp_path: Path) -> None:
    """Moshi's eps (1e-8) is an Add in the TorchScript export and absent from the dynamo
    export: every norm fuses in both, with that epsilon or 0."""
    run = optimize_checked(fixture_path(f"arch/moshi_{exporter}"), tmp_path)
    assert run.op_counts()["SkipSimplifiedLayerNormalization"] == 5
    assert run.op_counts()["ReduceMean"] == 0
    graph = onnx.load(str(run.output)).graph
    epsilons = {
        round(helper.get_attribute_value(a), 12)
        for n in graph.node
        if n.op_type == "SkipSimplifiedLayerNormalization"
        for a in n.attribute
        if a.name == "epsilon"
    }
    assert epsilons == ({0.0} if exporter == "dynamo" else {4e-8, 1e-8})


DOUBLED = "DoubledRmsNormFusionPass"


@pytest.mark.parametrize("inverse", ["Reciprocal", "DivOne", "Div"])
@pytest.mark.parametrize("shape", [SHAPE, SHAPE[1:], [2, 5, 3, SHAPE[-1]]])
def test_rms_norm_without_residual_is_a_doubled_skip_norm(
    inverse: str, shape: list[int], tmp_path: Path
) -> None:
    """Below opset 23 an RMS norm with no residual Add in front becomes
    SkipSimplifiedLayerNormalization(x, x) with 4x the epsilon (rms(2x) = 2 rms(x), scaled by
    powers of two only); 4-D input is normalised as [B, S*N, H] between two Reshapes."""
    model = _rms_model(tmp_path / "rms.onnx", inverse=inverse, residual=False, shape=shape)
    run = optimize_checked(model, tmp_path, atol=1e-6)
    assert run.counts(DOUBLED) == (1, 1)
    reshapes = 2 if len(shape) == 4 else 0
    assert (
        run.op_counts()
        == Counter({"SkipSimplifiedLayerNormalization": 1, "Reshape": reshapes}) - Counter()
    )
    graph = onnx.load(str(run.output)).graph
    (norm,) = [n for n in graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert norm.domain == "com.microsoft" and norm.input[0] == norm.input[1]
    (epsilon,) = [helper.get_attribute_value(a) for a in norm.attribute]
    assert epsilon == pytest.approx(4e-6, rel=1e-6)


@pytest.mark.parametrize(
    ("shape", "shapes"),
    [([2, 5, "heads", SHAPE[-1]], 0), (["batch", "seq", "heads", SHAPE[-1]], 1)],
)
def test_doubled_skip_norm_reshapes_unknown_inner_axes_back(
    tmp_path: Path, shape: list, shapes: int
) -> None:
    """[B, S, heads, H] with the heads unknown (Gemma-3's per-head q/k norms have the
    sequence there): normalised as [B, -1, H], reshaped back to a constant target whose one
    unknown size is inferred ([0, 5, -1, H]); with two unknown sizes after the batch, to
    Shape(x) read at run time."""
    model = _rms_model(tmp_path / "rms4d.onnx", inverse="Div", residual=False, shape=shape)
    run = optimize_checked(model, tmp_path, atol=1e-6)
    assert run.counts(DOUBLED) == (1, 1)
    counts = run.op_counts()
    expected = {"SkipSimplifiedLayerNormalization": 1, "Reshape": 2, "Shape": shapes}
    assert counts == Counter({op: count for op, count in expected.items() if count})


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_gemma3_per_head_norms_after_the_transpose(exporter: str, tmp_path: Path) -> None:
    """Gemma-3 normalises q and k per head as [B, N, S, H], the sequence (unknown) third: the
    four per-head norms are doubled skip norms reshaped back by their input's own shape, like
    the nine over the hidden size; outputs equal on onnxruntime."""
    name = f"arch/gemma3_{exporter}"
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    assert reasons(run, DOUBLED) == {}
    assert run.op_counts()["SkipSimplifiedLayerNormalization"] == 13
    feeds = named_dim_feeds(fixture_path(name), ARCH_DIMS)
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_negative_epsilon_keeps_the_norm_written_out(tmp_path: Path) -> None:
    """onnxruntime's fused norms refuse a negative epsilon when the session is created, and
    the written-out norm runs with one. Gemma-3's final norm with its epsilon negated stays
    written out, with the reason, and the other twelve norms fuse as before."""

    def negate_epsilon(model: onnx.ModelProto) -> None:
        tensor = node_named(model, "/inner/norm/Constant_1").attribute[0].t
        assert onnx.numpy_helper.to_array(tensor) == np.float32(1e-6)
        tensor.CopyFrom(onnx.numpy_helper.from_array(np.array(-1e-6, np.float32)))

    path = edited_fixture("arch/gemma3_ts17", tmp_path, negate_epsilon, "gemma3_negative_eps")
    run = optimize_checked(path, tmp_path, compare=False)
    reason = "epsilon is -1e-06: the fused kernels take only epsilon >= 0"
    assert reasons(run, "AddRmsNormFusionPass") == {reason: 1}
    assert reasons(run, DOUBLED) == {reason: 1}
    assert run.op_counts()["SkipSimplifiedLayerNormalization"] == 12
    feeds = named_dim_feeds(path, ARCH_DIMS)
    for want, got in zip(run_model(path, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_residual_add_of_a_scalar_is_a_skip_norm_near_miss(tmp_path: Path) -> None:
    """MPT's first residual Add with its attention output replaced by a scalar constant (a
    rank-0 summand: no hidden axis to compare) is declined with its reason; it crashed the
    shape proof before. (Not 0: an Add of 0 is no Add, NeutralOperandEliminationPass.)"""
    path = edited_fixture(
        "arch/mpt_ts17",
        tmp_path,
        lambda model: feed_scalar(model, "/inner/blocks.0/Add", 0, 0.5),
        "mpt_scalar_residual",
    )
    run = optimize_checked(path, tmp_path)
    assert run.counts(SKIP) == (4, 3)
    reason = "the residual Add's inputs are not two 3-D tensors of one shape"
    assert reasons(run, SKIP) == {reason: 1}


def test_doubled_skip_norm_declines_an_unknown_last_axis(tmp_path: Path) -> None:
    model = _rms_model(
        tmp_path / "rms4d.onnx", inverse="Div", residual=False, shape=[2, 5, 3, "hidden"]
    )
    run = optimize_checked(model, tmp_path, compare=False)
    reason = "the input is above 3-D with a last axis of unknown size"
    assert_declined(run, DOUBLED, reason, "y")
    feeds = {"a": np.random.default_rng(2).normal(size=(2, 5, 3, SHAPE[-1])).astype(np.float32)}
    np.testing.assert_allclose(run_model(run.output, feeds)[0], run_model(model, feeds)[0])


@pytest.mark.parametrize("exporter", ["ts17", "dynamo"])
def test_gemma3n_value_norms_without_a_weight(exporter: str, tmp_path: Path) -> None:
    """Gemma-3n normalises the values per head with no weight (``with_scale=False``): a
    doubled skip norm whose weight is ones, after the 20 weighted RMS norms; the insides of
    those are not counted again. Outputs equal on onnxruntime."""
    name = f"arch/gemma3n_text_{exporter}"
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    patterns = {k: v for k, v in run.passed(DOUBLED)["patterns"].items() if v["matched"]}
    weighted, unweighted = sorted(patterns, key=lambda name: name.endswith("Unweighted"))
    assert unweighted == f"{weighted}Unweighted"
    assert patterns == {
        weighted: {"matched": 20, "effected": 20},
        unweighted: {"matched": 2, "effected": 2},
    }
    assert run.counts(RMS) == (24, 0)
    graph = onnx.load(str(run.output)).graph
    ones = [i for i in graph.initializer if i.name.endswith("/weight")]
    assert len(ones) == 2
    assert all(np.array_equal(onnx.numpy_helper.to_array(i), np.ones(16)) for i in ones)
    feeds = named_dim_feeds(fixture_path(name), ARCH_DIMS)
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("inverse", ["Reciprocal", "DivOne", "Div"])
def test_rms_norm_without_a_weight(inverse: str, tmp_path: Path) -> None:
    model = _rms_model(tmp_path / "rms.onnx", inverse=inverse, residual=False, weight=None)
    run = optimize_checked(model, tmp_path, atol=1e-6)
    assert run.counts(DOUBLED) == (1, 1)
    assert run.passed(DOUBLED)["patterns"][f"DoubledRmsNorm{inverse}Unweighted"] == {
        "matched": 1,
        "effected": 1,
    }
    assert run.op_counts() == Counter({"SkipSimplifiedLayerNormalization": 1})
    residual = _rms_model(tmp_path / "skip.onnx", inverse=inverse, residual=True, weight=None)
    run = optimize_checked(residual, tmp_path)
    assert run.counts(SKIP_RMS) == (1, 1)
    assert run.op_counts() == Counter({"SkipSimplifiedLayerNormalization": 1})


def test_rms_norm_weight_broadcast_over_the_normalised_axes(tmp_path: Path) -> None:
    """A scalar weight (DiffLlama's ``1 - lambda_init`` after its group norm) is the weight
    spread over the normalised axis."""
    model = _rms_model(
        tmp_path / "rms.onnx", inverse="Div", residual=False, weight=np.array(0.8, np.float32)
    )
    run = optimize_checked(model, tmp_path, atol=1e-6)
    assert run.counts(DOUBLED) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (weight,) = [i for i in graph.initializer if i.name.endswith("/weight")]
    assert np.array_equal(onnx.numpy_helper.to_array(weight), np.full(SHAPE[-1], 0.8, np.float32))


def test_rms_norm_without_a_weight_needs_static_normalised_axes(tmp_path: Path) -> None:
    model = _rms_model(
        tmp_path / "rms.onnx", inverse="Div", residual=False, shape=[2, 5, "hidden"], weight=None
    )
    run = optimize_checked(model, tmp_path)
    reason = "the norm has no weight and its normalised axes are not static"
    assert_declined(run, DOUBLED, reason, "scaled")


def test_coverage_names_a_switched_off_pass_that_could_take_the_norm(tmp_path: Path) -> None:
    """With every pass that could fuse it switched off, the written-out RMS norm's coverage
    entry names the RMS-norm pass, not the layer-norm pass that is off too."""
    model = _rms_model(tmp_path / "rms.onnx", inverse="Div", residual=False, opset=23)
    off = ",".join([LN, RMS, DOUBLED])
    run = optimize_checked(model, tmp_path, "--disable_pass", off)
    (site,) = run.report["coverage"]["norms"]["unfused"]
    assert site["reason"] == f"{RMS} is off (CLI)"


def test_layer_norm_without_epsilon_fuses_its_core(tmp_path: Path) -> None:
    """I-BERT's float layer norm has no epsilon (and no gamma or beta): its centred core
    d / sqrt(mean(d^2)) is the RMS norm of d with epsilon 0, the doubled skip norm."""
    nodes = [
        _n("ReduceMean", ["a", "axes"], "mean"),
        _n("Sub", ["a", "mean"], "centred"),
        _n("Pow", ["centred", "two"], "sq"),
        _n("ReduceMean", ["sq", "axes"], "var"),
        _n("Sqrt", ["var"], "std"),
        _n("Div", ["centred", "std"], "y"),
    ]
    inits = [
        const("two", np.array(2.0, np.float32)),
        const("axes", np.array([-1], np.int64), np.int64),
    ]
    model = save_model(
        tmp_path / "ln.onnx", nodes, [value("a", SHAPE)], [value("y", SHAPE)], inits, opset=18
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(DOUBLED) == (1, 1)
    assert run.op_counts() == Counter(
        {"ReduceMean": 1, "Sub": 1, "SkipSimplifiedLayerNormalization": 1}
    )
    assert run.report["coverage"]["norms"]["unfused"] == []


def _unscaled_layer_norm(path: Path, shape: list, modulated: bool = False) -> Path:
    """The written-out norm (x - mean) / sqrt(var + eps) with no scale or shift: Keras's
    default scale of ones and shift of zeros once NeutralOperandEliminationPass removed them,
    or DiT's adaLN, modulated by values the model computes (``modulated``: inputs here)."""
    nodes = _layer_norm("a", "unused")[:-2]
    inputs = [value("a", shape)]
    if modulated:
        nodes += [
            _n("Add", ["one", "scale"], "gain"),
            _n("Mul", ["norm", "gain"], "scaled"),
            _n("Add", ["scaled", "shift"], "y"),
        ]
        inputs += [value(name, [shape[0], 1, shape[-1]]) for name in ("scale", "shift")]
    else:
        nodes[-1] = _n("Div", ["d", "std"], "y")
    inits = [const("two", np.array(2.0, np.float32)), const("eps", np.array(1e-6, np.float32))]
    if modulated:
        inits.append(const("one", np.array(1.0, np.float32)))
    return save_model(path, nodes, inputs, [value("y", shape)], inits)


@pytest.mark.parametrize("modulated", [False, True], ids=["bare", "adaLN"])
def test_layer_norm_without_scale_or_shift_takes_a_scale_of_ones(
    modulated: bool, tmp_path: Path
) -> None:
    run = optimize_checked(_unscaled_layer_norm(tmp_path / "ln.onnx", SHAPE, modulated), tmp_path)
    scaled = (1, 0) if modulated else (0, 0)  # the gain is no constant scale: declined
    assert pattern_counts(run, LN) == {
        "LayerNormPow": scaled,
        "LayerNormPowNoShift": scaled,
        "LayerNormPowNoScale": (1, 1),
    }
    assert reasons(run, LN) == ({"gamma is not a constant": 2} if modulated else {})
    expected = {"LayerNormalization": 1} | ({"Add": 2, "Mul": 1} if modulated else {})
    assert run.op_counts() == Counter(expected)
    graph = onnx.load(str(run.output)).graph
    (norm,) = [node for node in graph.node if node.op_type == "LayerNormalization"]
    (ones,) = [init for init in graph.initializer if init.name == norm.input[1]]
    assert np.array_equal(onnx.numpy_helper.to_array(ones), np.ones(SHAPE[-1], np.float32))


def test_layer_norm_without_scale_needs_a_static_normalised_size(tmp_path: Path) -> None:
    model = _unscaled_layer_norm(tmp_path / "ln.onnx", ["batch", "length", "hidden"])
    run = optimize_checked(model, tmp_path)
    assert reasons(run, LN) == {
        "the normalised dimensions are not static (the scale of ones needs them)": 1
    }
    assert run.op_counts()["LayerNormalization"] == 0


def test_coverage_of_a_norm_no_pass_reads(tmp_path: Path) -> None:
    """A norm whose epsilon is added after the square root, x / (sqrt(mean(x^2)) + eps), is
    another function than the fused ops compute: no norm pass recognizes it, and its coverage
    entry says so rather than naming a switched-off pass that would not take it either."""
    nodes = [
        _n("Pow", ["a", "two"], "sq"),
        _n("ReduceMean", ["sq", "axes"], "ms"),
        _n("Sqrt", ["ms"], "rms"),
        _n("Add", ["rms", "eps"], "rms_eps"),
        _n("Div", ["a", "rms_eps"], "y"),
    ]
    inits = [
        const("two", np.array(2.0, np.float32)),
        const("eps", np.array(1e-6, np.float32)),
        const("axes", np.array([-1], np.int64), np.int64),
    ]
    model = save_model(
        tmp_path / "outside.onnx", nodes, [value("a", SHAPE)], [value("y", SHAPE)], inits, opset=18
    )
    run = optimize_checked(model, tmp_path, "--disable_pass", DOUBLED)
    (site,) = run.report["coverage"]["norms"]["unfused"]
    assert site["reason"] == "no pass recognized this spelling"


def test_doubled_skip_norm_not_for_other_targets(tmp_path: Path) -> None:
    model = _rms_model(tmp_path / "rms.onnx", inverse="Div", residual=False)
    run = optimize_checked(model, tmp_path, "--target", "onnx")
    assert run.passed(DOUBLED)["state"] == "off"
    assert run.op_counts()["ReduceMean"] == 1


def test_rms_norm_wrong_numerator(tmp_path: Path) -> None:
    model = _rms_model(tmp_path / "two.onnx", inverse="DivOne", residual=True, one=2.0)
    run = optimize_checked(model, tmp_path)
    assert_declined(run, SKIP_RMS, "the reciprocal is not 1 / sqrt(...)", "y")


# LLaMA and T5 (tiny configs): five RMS norms, four after a residual Add; the TorchScript
# exports wrap each in float32 -> float32 Casts, which IdentityEliminationPass removes first
# (LLaMA: 17; the 8 Casts of the rotary's half head size fold as constants before that).
@pytest.mark.parametrize(
    ("name", "casts"),
    [
        ("llama_tiny_ts14", 17),
        ("llama_tiny_dynamo", 0),
        ("t5_tiny_ts14", 12),
        ("t5_tiny_dynamo", 0),
    ],
)
def test_llama_and_t5_residual_rms_norms(name: str, casts: int, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path)
    assert (
        run.passed("IdentityEliminationPass")
        .get("patterns", {})
        .get("Cast", {"effected": 0})["effected"]
        == casts
    )
    assert run.counts(RMS) == (5, 0)
    assert run.counts(SKIP_RMS) == (4, 4)
    assert run.counts(DOUBLED) == (1, 1)  # the first norm, over the embeddings: x + x
    counts = run.op_counts()
    assert (counts["SkipSimplifiedLayerNormalization"], counts["ReduceMean"]) == (5, 0)


SIMPLIFIED = "SimplifiedLayerNormFusionPass"


# The one RMS norm of LLaMA / T5 without a residual Add in front (LLaMA: the first layer's input
# norm, over the embeddings; T5: the first block's) has no skip form. Below opset 23 only
# onnxruntime's ONNX-domain SimplifiedLayerNormalization fuses it, which the ONNX checker
# rejects: the pass is off unless asked for, and then runs after AddRmsNormFusionPass.
@pytest.mark.parametrize("name", ["llama_tiny_ts17", "llama_tiny_dynamo", "t5_tiny_ts14"])
def test_simplified_layer_norm_on_request(name: str, tmp_path: Path) -> None:
    (tmp_path / "default").mkdir()
    (tmp_path / "on").mkdir()
    default = optimize(fixture_path(name), tmp_path / "default")
    assert default.passed(SIMPLIFIED)["state"] == "off"
    assert default.op_counts()["SimplifiedLayerNormalization"] == 0
    run = optimize(fixture_path(name), tmp_path / "on", "--enable_pass", SIMPLIFIED)
    assert run.counts(SKIP_RMS) == (4, 4)
    assert run.counts(SIMPLIFIED) == (1, 1)
    counts = run.op_counts()
    assert counts["SimplifiedLayerNormalization"] == 1
    assert counts["SkipSimplifiedLayerNormalization"] == 4
    assert counts["ReduceMean"] == 0
    (norm,) = [n for n in onnx.load(str(run.output)).graph.node if n.op_type.startswith("Simpl")]
    assert norm.domain == ""
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(onnx.load(str(run.output)), full_check=True)
    assert_same_outputs(fixture_path(name), run.output, atol=1e-4)


# The fp16 LLaMA (TorchScript, opset 17): each RMS norm runs in float32 on the float32
# residual and is cast to float16 before the fp16 weight, Mul(weight, Cast(norm, to=FLOAT16)).
# The fused op computes in float32 with a float32 copy of the weight, then casts: the original
# rounds to fp16 before multiplying by the weight, the fused form after, so outputs may differ
# by about one fp16 ulp: compared at an fp16 tolerance (atol 1e-2, rtol 1e-2).
FP16 = "fp16_llama_tiny_ts17"


def _assert_float32_skip_norms(run: Run, pattern: str, *, doubled: int) -> None:
    """All five norms fused as SkipSimplifiedLayerNormalization with float32 weights,
    ``doubled`` of them (x, x) by DoubledRmsNormFusionPass's ``pattern``."""
    assert run.counts(DOUBLED) == (doubled, doubled)
    assert run.passed(DOUBLED)["patterns"][pattern] == {"matched": doubled, "effected": doubled}
    counts = run.op_counts()
    assert (counts["SkipSimplifiedLayerNormalization"], counts["ReduceMean"]) == (5, 0)
    graph = onnx.load(str(run.output)).graph
    floats = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    skips = [n for n in graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert all(node.input[2] in floats for node in skips)  # gamma converted to float32


def test_fp16_llama_rms_norms_with_cast_round_trip(tmp_path: Path) -> None:
    (tmp_path / "default").mkdir()
    (tmp_path / "on").mkdir()
    run = optimize(fixture_path(FP16), tmp_path / "default")
    check_output(run)
    assert_same_outputs(fixture_path(FP16), run.output, atol=1e-2, rtol=1e-2)
    assert run.counts(SKIP_RMS) == (4, 4)
    assert run.passed(SKIP_RMS)["patterns"]["AddRmsNormCastDivOne"] == {"matched": 4, "effected": 4}
    assert_declined(
        run,
        RMS,
        "RMSNormalization needs opset >= 23, model has 17",
        "/inner/layers.0/input_layernorm/Mul_1",
        count=5,
    )
    # the first layer's input norm, no residual Add in front: x + x, float32 + Cast
    _assert_float32_skip_norms(run, "DoubledRmsNormCastDivOne", doubled=1)
    # The first layer's input norm, on request (SimplifiedLayerNormalization, float32 + Cast).
    run = optimize(fixture_path(FP16), tmp_path / "on", "--enable_pass", SIMPLIFIED)
    assert run.counts(SIMPLIFIED) == (1, 1)
    assert run.op_counts()["ReduceMean"] == 0
    assert_same_outputs(fixture_path(FP16), run.output, atol=1e-2, rtol=1e-2)


# sqrt(mean(total^2) + eps) of total = a + b, then the reciprocal square root as each
# exporter spells it, and total scaled by it.
_SUMMED_RMS = [
    _n("Add", ["a", "b"], "total"),
    _n("Pow", ["total", "two"], "sq"),
    _n("ReduceMean", ["sq", "axes"], "ms"),
    _n("Add", ["ms", "eps"], "mse"),
    _n("Sqrt", ["mse"], "rms"),
]
_INVERSES = {
    "Reciprocal": [_n("Reciprocal", ["rms"], "inv"), _n("Mul", ["total", "inv"], "scaled")],
    "DivOne": [_n("Div", ["one", "rms"], "inv"), _n("Mul", ["total", "inv"], "scaled")],
    "Div": [_n("Div", ["total", "rms"], "scaled")],
}


def _rms_cast_model(
    path: Path, *, cast_to: int, weight_input: bool = False, inverse: str = "DivOne"
) -> Path:
    """Add(a, b) (float32) -> RMS norm -> Cast(to=cast_to) -> Mul(fp16 weight)."""
    fp16 = onnx.TensorProto.FLOAT16
    nodes = [
        *_SUMMED_RMS,
        *_INVERSES[inverse],
        _n("Cast", ["scaled"], "rounded", to=cast_to),
        _n("Cast", ["weight"], "weight_as", to=cast_to) if cast_to != fp16 else None,
        _n("Mul", ["weight" if cast_to == fp16 else "weight_as", "rounded"], "y"),
    ]
    inputs = [value("a", SHAPE), value("b", SHAPE)]
    inits = [
        const("two", np.array(2.0, np.float32)),
        const("eps", np.array(1e-6, np.float32)),
        const("one", np.array(1.0, np.float32)),
        const("axes", np.array([-1], np.int64), np.int64),
    ]
    weight = const("weight", np.random.default_rng(1).uniform(0.5, 1.5, SHAPE[-1]), np.float16)
    if weight_input:
        inputs.append(value("weight", [SHAPE[-1]], fp16))
    else:
        inits.append(weight)
    outputs = [value("y", SHAPE, cast_to)]
    return save_model(path, [n for n in nodes if n is not None], inputs, outputs, inits, opset=18)


@pytest.mark.parametrize("inverse", list(_INVERSES))
def test_rms_norm_cast_round_trip_synthetic(inverse: str, tmp_path: Path) -> None:
    model = _rms_cast_model(
        tmp_path / "fp16.onnx", cast_to=onnx.TensorProto.FLOAT16, inverse=inverse
    )
    run = optimize(model, tmp_path)
    check_output(run)
    assert_same_outputs(model, run.output, atol=1e-2, rtol=1e-2)  # fp16 tolerance, see above
    assert run.counts(SKIP_RMS) == (1, 1)
    assert run.passed(SKIP_RMS)["patterns"][f"AddRmsNormCast{inverse}"] == {
        "matched": 1,
        "effected": 1,
    }
    assert run.op_counts() == Counter({"SkipSimplifiedLayerNormalization": 1, "Cast": 1})


@pytest.mark.parametrize("inverse", list(_INVERSES))
def test_rms_norm_cast_round_trip_gamma_fed(inverse: str, tmp_path: Path) -> None:
    model = _rms_cast_model(
        tmp_path / "fed.onnx", cast_to=onnx.TensorProto.FLOAT16, weight_input=True, inverse=inverse
    )
    run = optimize(model, tmp_path)
    assert_declined(run, SKIP_RMS, "gamma is a graph input (fed), not a constant", "y")


def test_rms_norm_cast_round_trip_needs_a_float32_norm(tmp_path: Path) -> None:
    """A norm computed in float16 and widened before a float32 weight is not the export's
    round trip: the fused op would compute it in float32, more precisely than the model."""
    fp16 = onnx.TensorProto.FLOAT16
    nodes = [
        *_SUMMED_RMS,
        *_INVERSES["Reciprocal"],
        _n("Cast", ["scaled"], "rounded", to=onnx.TensorProto.FLOAT),
        _n("Mul", ["weight", "rounded"], "y"),
    ]
    inits = [
        const("two", np.array(2.0), np.float16),
        const("eps", np.array(1e-6), np.float16),
        const("axes", np.array([-1]), np.int64),
        const("weight", np.random.default_rng(1).uniform(0.5, 1.5, SHAPE[-1])),
    ]
    model = save_model(
        tmp_path / "widened.onnx",
        nodes,
        [value("a", SHAPE, fp16), value("b", SHAPE, fp16)],
        [value("y", SHAPE)],
        inits,
        opset=18,
    )
    run = optimize(model, tmp_path)
    reason = "the Cast form's normalised input is not float32"
    assert_declined(run, SKIP_RMS, reason, "y")


# The same LLaMA exported by the dynamo exporter: its residual sum is float16 and cast to
# float32 in front of each norm, so no norm has a residual Add right before it; each becomes
# SkipSimplifiedLayerNormalization(x, x) (x the float32 sum, 4x epsilon), torch.rsqrt written
# Reciprocal(Sqrt).
FP16_DYNAMO = "fp16_llama_tiny_dynamo"


def test_fp16_llama_dynamo_rms_norms_with_cast_round_trip(tmp_path: Path) -> None:
    run = optimize(fixture_path(FP16_DYNAMO), tmp_path)
    check_output(run)
    assert_same_outputs(fixture_path(FP16_DYNAMO), run.output, atol=1e-2, rtol=1e-2)
    _assert_float32_skip_norms(run, "DoubledRmsNormCastReciprocal", doubled=5)


def test_simplified_layer_norm_not_for_other_targets(tmp_path: Path) -> None:
    run = optimize(
        fixture_path("llama_tiny_dynamo"), tmp_path, "--enable_pass", SIMPLIFIED, "--target", "onnx"
    )
    assert run.passed(SIMPLIFIED)["state"] == "off"
    assert run.op_counts()["SimplifiedLayerNormalization"] == 0


# ---------------------------------------------------------------------------------------------
# BERT embeddings: EmbedLayerNormFusionPass.
# ---------------------------------------------------------------------------------------------

EMBED = "EmbedLayerNormFusionPass"


@pytest.mark.parametrize("name", ["bert_tiny_ts14", "bert_tiny_ts17", "bert_tiny_dynamo"])
def test_bert_embeddings_become_embed_layer_normalization(name: str, tmp_path: Path) -> None:
    """Word + token-type + position Gathers and the layer norm: the token types come from an
    all-zero buffer, so their row 0 joins the position table; positions are 0..S-1."""
    run = optimize_checked(fixture_path(name), tmp_path)
    assert run.counts(EMBED) == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (node,) = [n for n in graph.node if n.op_type == "EmbedLayerNormalization"]
    assert node.input[1] == "" and node.input[4] == ""  # no segment ids or table left
    tables = {i.name for i in graph.initializer if len(i.dims) == 2 and i.data_type == 1}
    assert not [n for n in graph.node if n.op_type == "Gather" and n.input[0] in tables]


def _filled_token_types(path: Path, fill: int) -> Path:
    """BERT with its token-type ids ConstantOfShape(Shape(input_ids), fill), as RemBERT's and
    BigBird's TorchScript exports build their default token types."""
    model = onnx.load(str(fixture_path("bert_tiny_ts17")))
    (gather,) = [n for n in model.graph.node if "token_type_embeddings/Gather" in n.name]
    model.graph.node.extend(
        [
            helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
            helper.make_node(
                "ConstantOfShape",
                ["ids_shape"],
                ["token_types"],
                value=helper.make_tensor("fill", TensorProto.INT64, [1], [fill]),
            ),
        ]
    )
    gather.input[1] = "token_types"
    sorted_nodes = list(model.graph.node)
    model.graph.ClearField("node")
    model.graph.node.extend(sorted_nodes[-2:] + sorted_nodes[:-2])
    onnx.save(model, str(path))
    return path


def test_token_types_filled_with_zeros_join_the_position_table(tmp_path: Path) -> None:
    model = _filled_token_types(tmp_path / "zeros.onnx", 0)
    run = optimize_checked(model, tmp_path)
    assert run.counts(EMBED) == (1, 1)
    (node,) = [
        n for n in onnx.load(str(run.output)).graph.node if n.op_type == "EmbedLayerNormalization"
    ]
    assert node.input[1] == "" and node.input[4] == ""


def test_token_types_filled_with_ones_are_declined(tmp_path: Path) -> None:
    model = _filled_token_types(tmp_path / "ones.onnx", 1)
    run = optimize_checked(model, tmp_path)
    assert_declined(
        run,
        EMBED,
        "the segment ids are neither a graph input nor all zero",
        "/inner/embeddings/LayerNorm/LayerNormalization",
    )


@pytest.mark.parametrize("name", ["bert_tiny_ts17", "bert_tiny_dynamo"])
def test_bert_embeddings_at_a_fixed_length(name: str, tmp_path: Path) -> None:
    """With --input_shape the position Gather folds into a constant [1, S, H]: its rows are the
    position table EmbedLayerNormalization reads (both exporters)."""
    source = fixture_path(name)
    run = optimize(source, tmp_path, "--input_shape", "input_ids:2,16;attention_mask:2,16")
    check_output(run)
    assert run.counts(EMBED) == (1, 1)
    assert pattern_counts(run, EMBED)["EmbedLayerNormalizationFixedLength"] == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (node,) = [n for n in graph.node if n.op_type == "EmbedLayerNormalization"]
    (rows,) = [i for i in graph.initializer if i.name == node.input[3]]
    assert list(rows.dims) == [16, 32] and node.input[1] == node.input[4] == ""
    feeds = random_feeds(run.output)  # at the fixed shapes
    for want, got in zip(run_model(source, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def _constant_summand_model(path: Path, length: int | str, summand: np.ndarray) -> Path:
    """word[ids] + segment[segment_ids] + a constant summand, then a layer norm (hidden 8)."""
    rng = np.random.default_rng(0)
    nodes = [
        _n("Gather", ["word", "ids"], "words"),
        _n("Gather", ["segment", "segment_ids"], "segments"),
        _n("Add", ["words", "segments"], "sum"),
        _n("Add", ["sum", "positions"], "total"),
        _n("LayerNormalization", ["total", "gamma", "beta"], "y", axis=-1),
    ]
    inits = [
        const("word", rng.normal(size=(10, 8))),
        const("segment", rng.normal(size=(4, 8))),
        const("positions", summand),
        const("gamma", np.ones(8)),
        const("beta", np.zeros(8)),
    ]
    ids = [helper.make_tensor_value_info(n, TensorProto.INT64, [1, length]) for n in IDS]
    return save_model(path, nodes, ids, [value("y", [1, length, 8])], inits)


IDS = ("ids", "segment_ids")


def test_constant_position_rows_with_segment_ids_fed(tmp_path: Path) -> None:
    """Segment ids as a graph input keep their table; the constant rows become the position
    table (the row S-1 read at position S-1)."""
    rows = np.random.default_rng(1).normal(size=(1, 4, 8))
    model = _constant_summand_model(tmp_path / "rows.onnx", 4, rows)
    run = optimize_checked(model, tmp_path)
    assert pattern_counts(run, EMBED)["EmbedLayerNormalizationFixedLength"] == (1, 1)
    graph = onnx.load(str(run.output)).graph
    (node,) = [n for n in graph.node if n.op_type == "EmbedLayerNormalization"]
    tables = {i.name: list(i.dims) for i in graph.initializer}
    assert [tables.get(name) for name in node.input[2:5]] == [[10, 8], [4, 8], [4, 8]]


@pytest.mark.parametrize(
    ("length", "summand", "reason"),
    [
        (4, np.ones((1, 1, 8)), "the constant position term [1, 1, 8] is not [4, hidden]"),
        (
            "S",
            np.ones((1, 4, 8)),
            "the position term is a constant but the sequence length is not fixed",
        ),
    ],
    ids=["a_bias_not_rows", "length_not_fixed"],
)
def test_a_constant_summand_that_is_no_position_table_is_declined(
    length: int | str, summand: np.ndarray, reason: str, tmp_path: Path
) -> None:
    model = _constant_summand_model(tmp_path / "summand.onnx", length, summand)
    run = optimize(model, tmp_path)
    check_output(run)
    assert_declined(run, EMBED, reason, "y")
    if length == 4:
        assert_same_outputs(model, run.output)


def test_gpt2_embeddings_have_no_segment_table(tmp_path: Path) -> None:
    run = optimize_checked(fixture_path("gpt2_tiny_dynamo"), tmp_path)
    assert run.counts(EMBED) == (0, 0)


# ---------------------------------------------------------------------------------------------
# Residuals whose sizes only the ops' arithmetic proves (onnxruntime's symbolic inference).
# ---------------------------------------------------------------------------------------------


def _sliced_table_model(path: Path, rows: int) -> Path:
    """total = a + table[:, :S] with a [B, S, 8] and a [1, rows, 8] position table sliced to
    a's sequence read at run time (CLIP's position_ids[:, :seq_length]): onnx names the slice's
    length afresh; onnxruntime's inference says Min(rows, S)."""
    rng = np.random.default_rng(0)
    nodes = [
        _n("Shape", ["a"], "shape_a"),
        _n("Gather", ["shape_a", "one"], "sequence", axis=0),
        _n("Unsqueeze", ["sequence", "axis0"], "end"),
        _n("Slice", ["table", "axis0", "end", "one_1d"], "positions"),
        _n("Add", ["a", "positions"], "total"),
        *_layer_norm("total", "y"),
    ]
    inits = [
        *_norm_constants(rng),
        const("table", rng.normal(0, 1, (1, rows, 8))),
        const("one", np.array(1, np.int64), np.int64),
        const("axis0", np.array([0], np.int64), np.int64),
        const("one_1d", np.array([1], np.int64), np.int64),
    ]
    return save_model(path, nodes, [value("a", ["B", "S", 8])], [value("y", ["B", "S", 8])], inits)


def test_a_position_table_sliced_to_the_sequence_is_a_broadcast_skip(tmp_path: Path) -> None:
    """Min(16, S) rows are S rows wherever the Add runs (for S > 16 the rows neither match
    nor broadcast, and the kernel refuses the skip as the Add does): a [1, S, 8] skip."""
    model = _sliced_table_model(tmp_path / "sliced.onnx", rows=16)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (1, 1)
    skip = next(n for n in onnx.load(str(run.output)).graph.node if n.op_type == SKIP_OP)
    assert list(skip.input[:2]) == ["a", "positions"]
    for sequence in (1, 3, 16):
        feeds = random_feeds(model, dims={"B": 2, "S": sequence})
        for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_a_one_row_table_is_broadcast_not_a_skip(tmp_path: Path) -> None:
    """A one-row table sliced the same way is one row whatever S is: the Add broadcasts it
    over the sequence, which the kernel would not."""
    model = _sliced_table_model(tmp_path / "one_row.onnx", rows=1)
    run = optimize_checked(model, tmp_path)
    _declined_as_not_one_shape(run)
    feeds = random_feeds(model, dims={"B": 2, "S": 5})
    assert run_model(run.output, feeds)[0].shape == (2, 5, 8)


# TorchScript exports whose embedding norms sum values of sizes computed at run time: BART's
# positions (Range, Expand), CLIP's sliced position table (Min(rows, S)), wav2vec2's
# convolutional position embedding (Conv, then the last position sliced off), DeiT's class and
# distillation tokens joined to the patches (Concat of Expands), Swin's patches (a run of
# copied sizes, then a canonical target), DPT's class token expanded by TorchScript's
# expand(B, -1, -1) (Where(Equal(sizes, -1), 1, sizes): a -1 written in the sizes is the 1 it
# selects) and joined to the patches (the joined axis's size the sum of static parts), added
# to its position table resized at run time. Every residual norm is fused; outputs compared at
# sizes other than the export's.
ARCH_DIMS = {"batch": 3, "sequence": 5, "decoder_sequence": 4, "samples": 560}


@pytest.mark.parametrize(
    ("name", "skip"),
    [
        ("arch/bart_ts17", 12),
        ("arch/clip_text_ts17", 5),
        ("arch/wav2vec2_ts17", 5),
        ("arch/deit_ts17", 5),
        ("arch/dpt_ts17", 5),
        ("arch/swin_ts17", 3),
    ],
)
def test_residual_sizes_proven_by_their_arithmetic(name: str, skip: int, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    assert run.counts(SKIP) == (skip, skip)
    assert reasons(run, SKIP) == {}
    feeds = named_dim_feeds(fixture_path(name), ARCH_DIMS)
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


# Architectures the matrix gained (tests/fixtures/arch, TorchScript, opset 17). ConvBERT
# reshapes each attention context back with sizes read at run time from a Concat of the fused
# MultiHeadAttention's heads and its convolution heads; GPT-Neo's pre-LN residual is the sum a
# SkipLayerNormalization keeps, and its scores a FusedMatMul. The branch reaches the residual
# stream only through those contrib ops, and layer 1's only after as many ops as layer 0 has:
# the sizes are proven by where the branch copies them from (its query, its projection's
# input), which is where the residual is. ConvBERT's embedding sum adds a token-type row
# expanded to a ConstantOfShape of the ids' own shape, whose sizes are read from that shape.
# GPT-Neo's local attention, fused since its masked_fill reads as a bias, no longer
# broadcasts the scores to a length no op ties to the query's: all 5.
@pytest.mark.parametrize(("name", "skip"), [("arch/convbert_ts17", 5), ("arch/gpt_neo_ts17", 5)])
def test_residual_sizes_copied_through_contrib_ops(name: str, skip: int, tmp_path: Path) -> None:
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    assert run.counts(SKIP) == (skip, skip)
    assert run.op_counts()[SKIP_OP] == skip
    assert run.passed(SKIP)["near_misses"] == []
    feeds = named_dim_feeds(fixture_path(name), ARCH_DIMS)
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_dynamo_layer_norms_without_beta(tmp_path: Path) -> None:
    """MPT's dynamo export: LayerNormalization(x, gamma) after every residual Add."""
    name = "arch/mpt_dynamo"
    run = optimize_checked(fixture_path(name), tmp_path, compare=False)
    assert run.counts(SKIP) == (4, 4)
    assert run.op_counts()[SKIP_OP] == 4
    feeds = named_dim_feeds(fixture_path(name), ARCH_DIMS)
    for want, got in zip(
        run_model(fixture_path(name), feeds), run_model(run.output, feeds), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def _suffixed(nodes: list[onnx.NodeProto], suffix: str, keep: set[str]) -> list[onnx.NodeProto]:
    """The nodes with every value name not in ``keep`` suffixed (one norm per layer)."""
    for node in nodes:
        for names in (node.input, node.output):
            names[:] = [name if name in keep else name + suffix for name in names]
        node.name += suffix
    return nodes


def _copied_residual_model(path: Path, layers: int, extra: bool = False) -> Path:
    """``layers`` residual blocks h' = norm(h + Relu(Transpose(Transpose(h @ W)))), the inner
    Transpose declared with sizes of its own (as onnx names a contrib op's output), so that
    neither inferred nor named sizes tie the branch to h: only where the branch copies them
    from does. With ``extra`` the last branch adds an input of its own shape [X, T, 8] first,
    which may broadcast the branch (X or T may be 1, or h's may be)."""
    rng = np.random.default_rng(0)
    nodes: list[onnx.NodeProto] = []
    inits = _norm_constants(rng)
    infos, residual = [], "a"
    for layer in range(layers):
        k = f"_{layer}"
        nodes += [
            _n("MatMul", [residual, f"w{k}"], f"m{k}"),
            _n("Transpose", [f"m{k}"], f"t{k}", perm=[1, 0, 2]),
            _n("Transpose", [f"t{k}"], f"u{k}", perm=[1, 0, 2]),
        ]
        branch = f"u{k}"
        if extra and layer == layers - 1:
            nodes.append(_n("Add", ["x", branch], f"v{k}"))
            branch = f"v{k}"
        nodes += [
            _n("Relu", [branch], f"o{k}"),
            _n("Add", [f"o{k}", residual], f"total{k}"),
            *_suffixed(_layer_norm(f"total{k}", f"h{k}"), k, {f"total{k}", f"h{k}"} | _CONSTANTS),
        ]
        inits.append(const(f"w{k}", rng.normal(0, 0.3, (8, 8))))
        infos.append(value(f"t{k}", [f"s{k}", f"n{k}", 8]))
        residual = f"h{k}"
    inputs = [value("a", ["B", "S", 8])] + ([value("x", ["X", "T", 8])] if extra else [])
    outputs = [value(residual, ["X" if extra else "B", "T" if extra else "S", 8])]
    return save_model(path, nodes, inputs, outputs, inits, value_info=infos)


_CONSTANTS = {"two", "eps", "gamma", "beta"}


@pytest.fixture
def no_symbolic_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime's symbolic inference not run, as past its node budget or where it fails
    (ConvBERT's position slice, Min(32, S), broadcast against S)."""
    monkeypatch.setattr(shapes, "SYMBOLIC_NODE_LIMIT", 0)


@pytest.mark.usefixtures("no_symbolic_inference")
def test_residual_sizes_copied_through_every_layer(tmp_path: Path) -> None:
    """Each block's branch copies h's sizes (MatMul rows, two Transposes, Relu), whatever the
    declared shapes say and however deep h lies: every residual norm is fused."""
    model = _copied_residual_model(tmp_path / "copied.onnx", layers=6)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (6, 6)
    assert run.op_counts()[SKIP_OP] == 6
    for sizes in ({"B": 3, "S": 5}, {"B": 1, "S": 1}):
        feeds = random_feeds(model, dims=sizes)
        for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.usefixtures("no_symbolic_inference")
def test_a_branch_broadcast_on_the_way_is_not_copied(tmp_path: Path) -> None:
    """The last branch adds x [X, T, 8]: its sizes are no longer copies of h's (h may be
    [1, 1, 8] and x [2, 4, 8]: the residual Add then broadcasts h), so that norm is declined;
    the others are fused."""
    model = _copied_residual_model(tmp_path / "broadcast.onnx", layers=3, extra=True)
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (3, 2)
    assert reasons(run, SKIP) == {
        "the residual Add's inputs are not two 3-D tensors of one shape": 1
    }
    feeds = random_feeds(model, dims={"B": 1, "S": 1, "X": 2, "T": 4})
    assert run_model(run.output, feeds)[0].shape == (2, 4, 8)
    for want, got in zip(run_model(model, feeds), run_model(run.output, feeds), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


SAME_LENGTH = [{"pads": [1, 1]}, {"pads": [2, 2], "dilations": [2]}, {"auto_pad": "SAME_UPPER"}]


def _conformer_branch(conv: dict) -> list[onnx.NodeProto]:
    return [
        helper.make_node("Transpose", ["h"], ["channels_first"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["channels_first", "w"], ["mixed"], kernel_shape=[3], **conv),
        helper.make_node("Transpose", ["mixed"], ["branch"], perm=[0, 2, 1]),
    ]


@pytest.mark.parametrize(
    ("conv", "kept"),
    [*((conv, True) for conv in SAME_LENGTH), ({"pads": [1, 1], "strides": [2]}, False),
     ({"pads": [0, 0]}, False), ({"auto_pad": "VALID"}, False)],
)  # fmt: skip
def test_a_convolution_keeps_the_length_it_pads_for(conv: dict, kept: bool) -> None:
    """The size prover's rule for Conv: the batch always, a spatial size where the kernel
    slides by 1 over padding that makes up for its reach (dilation x (kernel - 1))."""
    graph = helper.make_graph(
        _conformer_branch(conv),
        "branch",
        [value("h", ["batch", "time", 8])],
        [value("branch", None)],
        [const("w", np.zeros((8, 8, 3)))],
    )
    model = ir.from_proto(onnx.shape_inference.infer_shapes(helper.make_model(graph)))
    spec = PassSpec(name="SizeProbe", category=Category.GRAPH, description="size prover")
    ctx = PassContext(spec=spec, target="ort", opset=17)
    h, branch = model.graph.inputs[0], model.graph.outputs[0]
    assert (h, 0) in size_sources(ctx, branch, 0)
    assert ((h, 1) in size_sources(ctx, branch, 1)) is kept


@pytest.mark.parametrize("conv", SAME_LENGTH, ids=["pads", "dilated", "same_upper"])
def test_skip_norm_proven_through_a_same_length_convolution(tmp_path: Path, conv: dict) -> None:
    """A conformer's convolution module: the residual branch goes through a Conv over time
    ([B, C, T], kernel 3, stride 1) padded to keep T. The sum is two [B, T, C] tensors of one
    shape and the norm after it a skip norm, whose output matches on onnxruntime."""
    channels = 8
    rng = np.random.default_rng(0)
    nodes = [
        *_conformer_branch(conv),
        helper.make_node("Add", ["h", "branch"], ["total"]),
        helper.make_node("LayerNormalization", ["total", "gamma", "beta"], ["y"], axis=-1),
    ]
    initializers = [
        const("w", rng.normal(size=(channels, channels, 3)) * 0.3),
        const("gamma", rng.uniform(0.5, 1.5, channels)),
        const("beta", rng.normal(size=channels)),
    ]
    model = save_model(
        tmp_path / "conformer.onnx",
        nodes,
        [value("h", ["batch", "time", channels])],
        [value("y", ["batch", "time", channels])],
        initializers,
    )
    run = optimize_checked(model, tmp_path)
    assert run.counts(SKIP) == (1, 1)
    assert run.op_counts()[SKIP_OP] == 1


def _native_rms_model(path: Path, op_type: str, opset: int, **attributes: object) -> Path:
    """a + b, then ``op_type`` (RMSNormalization or onnxruntime's SimplifiedLayerNormalization,
    both in the ONNX domain) over the last axis with a weight; the sum is an output too."""
    nodes = [
        _n("Add", ["a", "b"], "total"),
        _n(op_type, ["total", "weight"], "y", epsilon=1e-6, **attributes),
    ]
    return save_model(
        path,
        nodes,
        [value("a", SHAPE), value("b", SHAPE)],
        [value("y", SHAPE), value("total", SHAPE)],
        [const("weight", _RANDOM_WEIGHT)],
        opset=opset,
        check=op_type != "SimplifiedLayerNormalization",  # onnx has no such op; onnxruntime does
    )


@pytest.mark.parametrize(
    ("op_type", "opset"), [("RMSNormalization", 23), ("SimplifiedLayerNormalization", 17)]
)
def test_residual_add_and_native_rms_norm_become_skip_rms_norm(
    op_type: str, opset: int, tmp_path: Path
) -> None:
    """The norm op itself (the dynamo exporter writes F.rms_norm as RMSNormalization at opset
    23; onnxruntime's optimizer and onnxscript's write SimplifiedLayerNormalization) behind a
    residual Add: one SkipSimplifiedLayerNormalization, the sum from its fourth output."""
    model = _native_rms_model(tmp_path / "native.onnx", op_type, opset)
    run = optimize(model, tmp_path)
    assert run.counts(SKIP_RMS) == (1, 1)
    assert run.passed(SKIP_RMS)["patterns"][f"Add{op_type}"] == {"matched": 1, "effected": 1}
    assert run.op_counts() == Counter({"SkipSimplifiedLayerNormalization": 1})
    (node,) = onnx.load(str(run.output)).graph.node
    assert len(node.output) == 4 and node.output[3] == "total"
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["epsilon"] == (
        pytest.approx(1e-6)
    )
    assert_same_outputs(model, run.output, atol=1e-5)


@pytest.mark.parametrize(
    ("attributes", "reason"),
    [
        ({"axis": 1}, "SkipSimplifiedLayerNormalization normalises the last axis only"),
        ({"stash_type": 0}, "RMSNormalization computes in another precision (stash_type)"),
    ],
)
def test_native_rms_norm_the_skip_kernel_cannot_take(
    attributes: dict, reason: str, tmp_path: Path
) -> None:
    model = _native_rms_model(tmp_path / "native.onnx", "RMSNormalization", 23, **attributes)
    run = optimize(model, tmp_path)
    assert run.counts(SKIP_RMS) == (1, 0)
    assert reasons(run, SKIP_RMS) == {reason: 1}
    assert_same_outputs(model, run.output, atol=1e-5)


def test_dynamic_int8_bert_residual_norms(tmp_path: Path) -> None:
    """onnxruntime's quantize_dynamic BERT: a residual's projection is DynamicQuantizeLinear ->
    MatMulInteger -> Cast -> scale, and onnx names the sizes after it afresh. The size walk
    reads through them (each keeps its input's shape, MatMulInteger a MatMul's rows), so every
    residual norm fuses; the embeddings' sum, from tables dequantized at run time, is left."""
    run = optimize_checked(fixture_path("int8_bert_tiny_ts17"), tmp_path)
    assert run.counts(SKIP) == (5, 4)
    assert reasons(run, SKIP) == {
        "the residual Add's inputs are not two 3-D tensors of one shape": 1
    }
    counts = run.op_counts()
    assert counts["SkipLayerNormalization"] == 4 and counts["MatMulInteger"] == 13
