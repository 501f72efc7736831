"""Every bad input ends in exit 2 with one line naming what is wrong, writes nothing, and leaves
the input as it was (docs/input-validation.md)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import FIXTURES, run_cli

SAMPLE = Path(__file__).parents[1] / "samples" / "models" / "tiny_cnn.onnx"


@dataclass
class Case:
    """A bad input: the command-line arguments after `optimize`, and what the line must say."""

    args: list[str | Path]
    expected: list[str]


Builder = Callable[[Path, Path], Case]  # (input folder, output folder) -> case


def _model(
    nodes: list[onnx.NodeProto],
    *,
    inputs: tuple[str, ...] = ("x",),
    outputs: tuple[str, ...] = ("y",),
    initializers: tuple[TensorProto, ...] = (),
    opset: int = 17,
    ir_version: int = 8,
    extra_opsets: tuple[tuple[str, int], ...] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2]) for name in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2]) for name in outputs],
        list(initializers),
    )
    opsets = [helper.make_opsetid("", opset)]
    opsets += [helper.make_opsetid(d, v) for d, v in extra_opsets]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = ir_version
    return model


def _relu() -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu")])


def _saved(folder: Path, model: onnx.ModelProto, name: str = "model.onnx") -> Path:
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def _optimize(model: Path, out: Path, *extra: str | Path) -> list[str | Path]:
    return [model, "-o", out / "out.onnx", *extra]


def model_case(model: onnx.ModelProto, *expected: str) -> Builder:
    def build(folder: Path, out: Path) -> Case:
        return Case(_optimize(_saved(folder, model), out), ["model.onnx: ", *expected])

    return build


def bytes_case(make: Callable[[bytes], bytes], *expected: str) -> Builder:
    """A file made from the sample's bytes."""

    def build(folder: Path, out: Path) -> Case:
        path = folder / "model.onnx"
        path.write_bytes(make(SAMPLE.read_bytes()))
        return Case(_optimize(path, out), ["model.onnx: ", *expected])

    return build


def _flip_magic(data: bytes) -> bytes:
    """The sample with its first field's tag replaced by an invalid wire type."""
    return b"\x0f" + data[1:]


# --- structural faults ----------------------------------------------------------------------


def _cycle() -> onnx.ModelProto:
    return _model(
        [
            helper.make_node("Add", ["x", "c"], ["a"], name="add"),
            helper.make_node("Relu", ["a"], ["b"], name="relu"),
            helper.make_node("Neg", ["b"], ["c"], name="neg"),
            helper.make_node("Identity", ["a"], ["y"], name="out"),
        ]
    )


def _self_loop() -> onnx.ModelProto:
    return _model(
        [
            helper.make_node("Add", ["x", "a"], ["a"], name="feedback"),
            helper.make_node("Identity", ["a"], ["y"], name="out"),
        ]
    )


def _undefined() -> onnx.ModelProto:
    return _model([helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")])


def _two_producers() -> onnx.ModelProto:
    return _model(
        [
            helper.make_node("Relu", ["x"], ["y"], name="first"),
            helper.make_node("Neg", ["x"], ["y"], name="second"),
        ]
    )


def _shadows_initializer() -> onnx.ModelProto:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    return _model(
        [
            helper.make_node("Relu", ["x"], ["w"], name="writer"),
            helper.make_node("Add", ["x", "w"], ["y"], name="add"),
        ],
        initializers=(weight,),
    )


def _dangling_output() -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["z"], name="relu")], outputs=("y",))


def _subgraph_undefined() -> onnx.ModelProto:
    def branch(name: str, source: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node("Identity", [source], [f"{name}_out"], name=f"{name}_id")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2])],
        )

    condition = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    return _model(
        [
            helper.make_node(
                "If",
                ["cond"],
                ["y"],
                name="branch",
                then_branch=branch("then", "x"),
                else_branch=branch("else", "missing_value"),
            )
        ],
        initializers=(condition,),
    )


def _with_ir(version: int) -> onnx.ModelProto:
    model = _relu()
    model.ir_version = version
    return model


def _ml_opset() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], extra_opsets=(("ai.onnx.ml", 99),)
    )


def _unknown_op() -> onnx.ModelProto:
    return _model([helper.make_node("Frobnicate", ["x"], ["y"], name="weird")])


def _unimported_domain() -> onnx.ModelProto:
    return _model([helper.make_node("Thing", ["x"], ["y"], name="thing", domain="my.domain")])


def _input_without_type() -> onnx.ModelProto:
    model = _relu()
    model.graph.input[0].ClearField("type")
    return model


def _input_bad_elem_type() -> onnx.ModelProto:
    model = _relu()
    model.graph.input[0].type.tensor_type.elem_type = 999
    return model


def _short_raw_initializer() -> onnx.ModelProto:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [1], b"\0" * 4, raw=True)
    weight.dims[0] = 2
    return _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=(weight,))


def _short_typed_initializer() -> onnx.ModelProto:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    weight.dims[0] = 2
    return _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=(weight,))


def _bad_initializer_type() -> onnx.ModelProto:
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    weight.data_type = 77
    return _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=(weight,))


def _wrong_attribute_type() -> onnx.ModelProto:
    node = helper.make_node("LeakyRelu", ["x"], ["y"], name="leaky", alpha=0.1)
    node.attribute[0].type = onnx.AttributeProto.INTS
    return _model([node])


def _unknown_attribute() -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu", slope=2.0)])


def _undefined_attribute_type() -> onnx.ModelProto:
    node = helper.make_node("LeakyRelu", ["x"], ["y"], name="leaky", alpha=0.1)
    node.attribute[0].type = onnx.AttributeProto.UNDEFINED
    return _model([node])


def non_utf8_case(model: onnx.ModelProto, marker: bytes) -> Builder:
    """The model with the text ``marker`` (8 ASCII bytes) made invalid UTF-8 in the file."""
    broken = marker[:3] + b"\xff\xfe" + marker[5:]

    def build(folder: Path, out: Path) -> Case:
        path = folder / "model.onnx"
        path.write_bytes(model.SerializeToString().replace(marker, broken))
        return Case(_optimize(path, out), ["model.onnx: ", "not valid UTF-8"])

    return build


def _named_relu() -> onnx.ModelProto:
    model = _relu()
    model.graph.node[0].name = "RELUNAME"
    return model


def _versioned_relu() -> onnx.ModelProto:
    model = _relu()
    model.producer_version = "VERSION1"
    return model


def _input_metadata() -> onnx.ModelProto:
    model = _relu()
    onnx.helper.set_metadata_props(model.graph.input[0], {"METAKEY1": "value"})
    return model


def _named_branch() -> onnx.ModelProto:
    """An If whose then-branch graph has a name of its own."""
    branches = {
        name: helper.make_graph(
            [helper.make_node(op, ["x"], [f"{op}_y"])],
            name,
            [],
            [helper.make_tensor_value_info(f"{op}_y", TensorProto.FLOAT, [2])],
        )
        for name, op in (("BRANCH01", "Neg"), ("other", "Relu"))
    }
    condition = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    node = helper.make_node(
        "If", ["cond"], ["y"], then_branch=branches["BRANCH01"], else_branch=branches["other"]
    )
    return _model([node], initializers=(condition,))


def _type_conflict() -> onnx.ModelProto:
    """Structurally sound, but Add's operands disagree in type: the checker's type inference
    and onnxruntime both refuse it; the passes decline what they cannot prove."""
    bias = helper.make_tensor("b", TensorProto.INT16, [2], [1, 2])
    return _model([helper.make_node("Add", ["x", "b"], ["y"], name="add")], initializers=(bias,))


# --- external data faults -------------------------------------------------------------------


def _external(folder: Path, location: str, **entries: str) -> Path:
    """A model whose weight 'w' (2 floats, 8 bytes) is stored at `location`."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    model = _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=(weight,))
    tensor = model.graph.initializer[0]
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, **entries}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return _saved(folder, model)


def _outside_file(folder: Path) -> Path:
    """A weight file beside (not inside) the model's folder."""
    path = folder.parent / "outside.bin"
    path.write_bytes(b"\0" * 64)
    return path


def external_case(location: Callable[[Path], str], *expected: str, **entries: str) -> Builder:
    def build(folder: Path, out: Path) -> Case:
        return Case(
            _optimize(_external(folder, location(folder), **entries), out),
            ["model.onnx: ", *expected],
        )

    return build


def _link_out(folder: Path) -> str:
    (folder / "weights.bin").symlink_to(_outside_file(folder))
    return "weights.bin"


def _directory_link_out(folder: Path) -> str:
    _outside_file(folder)
    (folder / "shared").symlink_to(folder.parent)
    return "shared/outside.bin"


def _relative_link_out(folder: Path) -> str:
    _outside_file(folder)
    (folder / "sub").mkdir()
    (folder / "sub" / "w.bin").symlink_to(Path("..") / ".." / "outside.bin")
    return "sub/w.bin"


def _dotdot(folder: Path) -> str:
    _outside_file(folder)
    return "../outside.bin"


def _directory(folder: Path) -> str:
    (folder / "weights").mkdir()
    return "weights"


def _inside_file(size: int) -> Callable[[Path], str]:
    def make(folder: Path) -> str:
        (folder / "weights.bin").write_bytes(b"\0" * size)
        return "weights.bin"

    return make


OUTSIDE = "points outside the model's folder"
_EXTERNAL_CASES: dict[str, Builder] = {
    "external_absolute": external_case(lambda f: str(_outside_file(f)), "'w'", OUTSIDE),
    "external_dotdot": external_case(_dotdot, OUTSIDE),
    "external_inner_dotdot": external_case(lambda f: "sub/../../outside.bin", OUTSIDE),
    "external_symlink_out": external_case(_link_out, "'w'", OUTSIDE),
    "external_directory_symlink_out": external_case(_directory_link_out, OUTSIDE),
    "external_relative_symlink_out": external_case(_relative_link_out, OUTSIDE),
    "external_missing": external_case(lambda f: "absent.bin", "'absent.bin'", "is missing"),
    "external_is_directory": external_case(_directory, "is missing"),
    "external_short_file": external_case(_inside_file(4), "is shorter than", "'w'"),
    "external_offset_beyond": external_case(_inside_file(16), "is shorter", offset="12"),
    "external_length_beyond": external_case(_inside_file(16), "is shorter", length="64"),
    "external_malformed_offset": external_case(_inside_file(16), "malformed", offset="abc"),
    "external_negative_offset": external_case(_inside_file(16), "negative", offset="-8"),
}


# --- switch file, plugin and option faults --------------------------------------------------


def switch_case(content: str, *expected: str) -> Builder:
    def build(folder: Path, out: Path) -> Case:
        switch = folder / "switch.cfg"
        switch.write_text(content)
        model = _saved(folder, _relu())
        return Case(
            _optimize(model, out, "--fusion_switch_file", switch), ["switch.cfg", *expected]
        )

    return build


def plugin_case(content: str | None, *expected: str) -> Builder:
    def build(folder: Path, out: Path) -> Case:
        plugin = folder / "plugin.py"
        if content is not None:
            plugin.write_text(content)
        model = _saved(folder, _relu())
        return Case(_optimize(model, out, "--plugin", plugin), ["plugin.py", *expected])

    return build


def _missing_switch_file(folder: Path, out: Path) -> Case:
    model = _saved(folder, _relu())
    return Case(
        _optimize(model, out, "--fusion_switch_file", folder / "absent.cfg"),
        ["absent.cfg", "does not exist"],
    )


def _unknown_input_shape(folder: Path, out: Path) -> Case:
    model = _saved(folder, _relu())
    return Case(_optimize(model, out, "--input_shape", "nope:1,2"), ["nope"])


def _input_shape_past_the_positions(folder: Path, out: Path) -> Case:
    """The tiny BERT has 32 positions: a sequence of 128 cannot run (its position ids, folded
    at that length, no longer broadcast), which shows only once the shape arithmetic folds."""
    model = folder / "bert.onnx"
    model.write_bytes((FIXTURES / "bert_tiny_ts17.onnx").read_bytes())
    sizes = "input_ids:1,128;attention_mask:1,128"
    return Case(
        _optimize(model, out, "--input_shape", sizes),
        ["bert.onnx", "gives sizes the model cannot take", "Incompatible dimensions"],
    )


# --- output path faults ---------------------------------------------------------------------


def _output_is_directory(folder: Path, out: Path) -> Case:
    model = _saved(folder, _relu())
    (out / "taken.onnx").mkdir()
    return Case([model, "-o", out / "taken.onnx"], ["taken.onnx", "is a directory"])


def _output_directory_missing(folder: Path, out: Path) -> Case:
    model = _saved(folder, _relu())
    return Case([model, "-o", out / "no" / "o.onnx"], ["output directory does not exist"])


def _output_is_input(folder: Path, out: Path) -> Case:
    model = _saved(folder, _relu())
    return Case([model, "-o", model], ["output path is the input model"])


def _output_data_is_input_weights(folder: Path, out: Path) -> Case:
    model = _external(folder, "o.onnx.data")
    (folder / "o.onnx.data").write_bytes(b"\0" * 8)
    return Case([model, "-o", folder / "o.onnx"], ["is the input model's external data file"])


def _output_in_unwritable_directory(folder: Path, out: Path) -> Case:
    model = _saved(folder, _relu())
    return Case([model, "-o", "/proc/fusectl_out.onnx"], ["/proc"])


def _model_is_directory(folder: Path, out: Path) -> Case:
    return Case(_optimize(folder, out), ["is a directory"])


def _missing_model(folder: Path, out: Path) -> Case:
    return Case(_optimize(folder / "absent.onnx", out), ["absent.onnx: no such file"])


def _message_file(message: onnx.ModelProto | TensorProto | onnx.GraphProto) -> Builder:
    def build(folder: Path, out: Path) -> Case:
        path = folder / "model.onnx"
        path.write_bytes(message.SerializeToString())
        return Case(_optimize(path, out), ["model.onnx: ", "not an ONNX model"])

    return build


CASES: dict[str, Builder] = {
    # unreadable or not a model
    "missing_model": _missing_model,
    "model_is_directory": _model_is_directory,
    "empty_file": bytes_case(lambda d: b"", "not an ONNX model"),
    "text_file": bytes_case(lambda d: b"this is not a model\n", "not an ONNX model"),
    "random_bytes": bytes_case(lambda d: bytes(range(256)) * 4, "not an ONNX model"),
    "truncated_to_1_byte": bytes_case(lambda d: d[:1], "not an ONNX model"),
    "truncated_to_10_percent": bytes_case(lambda d: d[: len(d) // 10], "not an ONNX model"),
    "truncated_to_half": bytes_case(lambda d: d[: len(d) // 2], "truncated"),
    "truncated_by_one_byte": bytes_case(lambda d: d[:-1], "truncated"),
    "invalid_wire_type": bytes_case(_flip_magic, "not an ONNX model"),
    "doubled_file": bytes_case(lambda d: d + d[: len(d) // 3], "not an ONNX model"),
    "tensor_proto_file": _message_file(helper.make_tensor("t", TensorProto.FLOAT, [2], [1, 2])),
    "graph_proto_file": _message_file(_relu().graph),
    "node_proto_file": _message_file(helper.make_node("Relu", ["x"], ["y"])),
    # structural faults
    "cycle": model_case(_cycle(), "has a cycle", "'relu' -> 'neg' -> 'add' -> 'relu'"),
    "self_loop": model_case(_self_loop(), "has a cycle", "'feedback'"),
    "undefined_value": model_case(_undefined(), "node 'adder' reads 'ghost'", "nothing defines"),
    "two_producers": model_case(_two_producers(), "'y' has two producers", "'first'", "'second'"),
    "shadows_initializer": model_case(_shadows_initializer(), "'w' has two producers"),
    "dangling_output": model_case(_dangling_output(), "output 'y' is produced by nothing"),
    "subgraph_undefined": model_case(
        _subgraph_undefined(), "subgraph 'else'", "reads 'missing_value'"
    ),
    "ir_version_99": model_case(_with_ir(99), "unsupported IR version 99", "3 to"),
    "ir_version_2": model_case(_with_ir(2), "unsupported IR version 2"),
    "opset_99": model_case(_model([], outputs=("x",), opset=99), "unsupported opset 99", "1 to"),
    "ml_opset_99": model_case(_ml_opset(), "opset 99 of domain 'ai.onnx.ml'"),
    "unknown_op": model_case(_unknown_op(), "op 'Frobnicate'", "at opset 17"),
    "unimported_domain": model_case(_unimported_domain(), "domain 'my.domain'", "not import"),
    "input_without_type": model_case(_input_without_type(), "input 'x' has no type"),
    "input_bad_elem_type": model_case(_input_bad_elem_type(), "unknown element type 999"),
    "short_raw_initializer": model_case(_short_raw_initializer(), "'w' holds 4 bytes", "needs 8"),
    "short_typed_initializer": model_case(_short_typed_initializer(), "'w' holds 1 values"),
    "bad_initializer_type": model_case(_bad_initializer_type(), "'w' has unknown element type"),
    "wrong_attribute_type": model_case(_wrong_attribute_type(), "'alpha' is INTS", "FLOAT"),
    "unknown_attribute": model_case(_unknown_attribute(), "has no attribute 'slope'"),
    "undefined_attribute_type": model_case(_undefined_attribute_type(), "no valid type"),
    "non_utf8_name": non_utf8_case(_named_relu(), b"RELUNAME"),
    "non_utf8_producer_version": non_utf8_case(_versioned_relu(), b"VERSION1"),
    "non_utf8_value_metadata": non_utf8_case(_input_metadata(), b"METAKEY1"),
    "non_utf8_branch_name": non_utf8_case(_named_branch(), b"BRANCH01"),
    **_EXTERNAL_CASES,
    # switch files, plugins, options
    "switch_bad_json": switch_case('{"Switch": {"GraphFusion": {"A": "on",}}}', "invalid JSON"),
    "switch_bad_value": switch_case(
        '{"Switch": {"GraphFusion": {"ConvBatchnormFusionPass": "no"}}}', 'must be "on"'
    ),
    "switch_bad_key": switch_case('{"Switch": {"Graph": {}}}', "'Switch.Graph' is not valid"),
    "switch_missing": _missing_switch_file,
    "plugin_missing": plugin_case(None, "plugin.py"),
    "plugin_raises": plugin_case("raise RuntimeError('plugin broke')\n", "plugin broke"),
    "plugin_syntax_error": plugin_case("def broken(:\n", "plugin.py"),
    "unknown_input_shape": _unknown_input_shape,
    "input_shape_past_the_positions": _input_shape_past_the_positions,
    # output paths
    "output_is_directory": _output_is_directory,
    "output_directory_missing": _output_directory_missing,
    "output_is_input": _output_is_input,
    "output_data_is_input_weights": _output_data_is_input_weights,
    "output_unwritable": _output_in_unwritable_directory,
}


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and link under root with a digest of its bytes (links by their target)."""
    found = {}
    for directory, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(directory) / name
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[str(path)] = "dir"
    return found


def test_there_are_at_least_40_cases() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(name: str, tmp_path: Path) -> None:
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    out.mkdir()
    case = CASES[name](folder, out)
    fusion_result = out / "fusion_result.json"
    before = _snapshot(tmp_path)
    result = run_cli("optimize", *case.args, "--fusion_result", fusion_result)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("fusectl: error: "), result.stderr
    for fragment in case.expected:
        assert fragment in lines[0], lines[0]
    assert _snapshot(tmp_path) == before, "a failed run wrote or changed files"
    assert result.stdout == ""


def test_no_known_bad_input_reaches_internal_error(tmp_path: Path) -> None:
    """The whole catalogue, with the other commands that load models: never exit 3."""
    for name, build in sorted(CASES.items()):
        folder, out = tmp_path / name / "in", tmp_path / name / "out"
        folder.mkdir(parents=True)
        out.mkdir()
        case = build(folder, out)
        model = case.args[0]
        for args in (["optimize", *case.args], ["verify", model, model], ["bench", model, model]):
            result = run_cli(*args, "--json") if args[0] != "optimize" else run_cli(*args)
            assert result.exit_code != 3, f"{name} {args[0]}: {result.stderr}"


def test_what_only_the_checker_minds_passes_with_a_warning(tmp_path: Path) -> None:
    """Nodes out of topological order: onnx.checker refuses, onnxruntime sorts them. fusectl
    warns, and writes a sorted output that passes the checker."""
    model = _saved(
        tmp_path,
        _model(
            [
                helper.make_node("Relu", ["a"], ["y"], name="second"),
                helper.make_node("Neg", ["x"], ["a"], name="first"),
            ]
        ),
    )
    output = tmp_path / "out.onnx"
    result = run_cli("optimize", model, "-o", output, "--export_compile_stat", "0")
    assert result.exit_code == 0, result.stderr
    assert "not in topological order" in result.stderr
    onnx.checker.check_model(str(output), full_check=True)
    assert [n.name for n in onnx.load(str(output)).graph.node] == ["first", "second"]


def test_one_name_for_two_axes_of_an_input_is_warned_of(tmp_path: Path) -> None:
    """ImageGPT's export with every dynamic axis named '?' (a script that makes a model dynamic
    so): equal names are one size, which the fusions prove on, and fusectl's output fails where
    batch and sequence differ. The run warns and goes on; the export as named does not warn."""
    model = onnx.load(str(FIXTURES / "arch" / "imagegpt_ts17.onnx"))
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = "?"
    path = tmp_path / "one_name.onnx"
    onnx.save(model, str(path))
    output = tmp_path / "out.onnx"
    result = run_cli("optimize", path, "-o", output, "--export_compile_stat", "0")
    assert result.exit_code == 0, result.stderr
    warning = (
        "graph input 'input_ids' names axes 0 and 1 both '?': equal names are one size to "
        "fusectl, as to onnxruntime, so the output may not run where they differ; name them "
        "apart"
    )
    assert warning in " ".join(result.stderr.split())
    named = run_cli("optimize", FIXTURES / "arch" / "imagegpt_ts17.onnx", "-o", output)
    assert named.exit_code == 0 and "names axes" not in named.stderr


def test_an_onnxruntime_op_in_the_onnx_domain_is_no_fault(tmp_path: Path) -> None:
    """onnxruntime's SimplifiedLayerNormalization in the ONNX domain (onnxruntime's optimizer
    and onnxscript's write it): onnxruntime runs it, so fusectl optimizes the model with the
    checker's objection as a warning, where an op no runtime knows (Frobnicate) is refused."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    norm = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], name="rms")
    model = _saved(tmp_path, _model([norm], initializers=(weight,)))
    output = tmp_path / "out.onnx"
    result = run_cli("optimize", model, "-o", output, "--export_compile_stat", "0")
    assert result.exit_code == 0, result.stderr
    assert "onnx.checker rejects it (onnxruntime loads it)" in result.stderr
    assert [n.op_type for n in onnx.load(str(output)).graph.node] == [
        "SimplifiedLayerNormalization"
    ]


def test_a_type_conflict_is_optimized_with_a_warning(tmp_path: Path) -> None:
    """What only inference finds (operand types that disagree) is the passes' business: they
    decline such sites (tests/test_pass_conv.py). fusectl says what both tools think of it."""
    model = _saved(tmp_path, _type_conflict())
    output = tmp_path / "out.onnx"
    result = run_cli("optimize", model, "-o", output, "--export_compile_stat", "0")
    assert result.exit_code == 0, result.stderr
    assert "onnx.checker rejects it (onnxruntime refuses it too)" in result.stderr
    assert "B has inconsistent type tensor(int16)" in result.stderr
    assert [n.op_type for n in onnx.load(str(output)).graph.node] == ["Add"]


# A plugin defining one pass, whose class follows.
_PLUGIN = """
import onnx_ir as ir
from fusectl import Category, FusionPass, PassSpec, register_pass


@register_pass
"""

BREAKING_PLUGIN = (
    _PLUGIN
    + """class RenameToNothingPass(FusionPass):
    spec = PassSpec(name="RenameToNothingPass", category=Category.GRAPH,
                    description="a broken pass: renames every Relu to an op that does not exist")

    def run(self, model: ir.Model, ctx) -> None:
        for node in model.graph:
            if node.op_type == "Relu":
                node.op_type = "NoSuchOperator"
"""
)


MISTYPING_PLUGIN = (
    _PLUGIN
    + """class MistypedBiasGeluPass(FusionPass):
    spec = PassSpec(name="MistypedBiasGeluPass", category=Category.GRAPH,
                    description="a broken pass: BiasGelu on x and x cast to float16")

    def run(self, model: ir.Model, ctx) -> None:
        for node in list(model.graph):
            if node.op_type == "Relu":
                x = node.inputs[0]
                half = ir.node("Cast", [x], attributes={"to": ir.DataType.FLOAT16})
                half.outputs[0].dtype = ir.DataType.FLOAT16
                gelu = ir.node("BiasGelu", [x, half.outputs[0]], domain="com.microsoft")
                ir.convenience.replace_nodes_and_values(
                    model.graph, node, [node], [half, gelu], node.outputs, gelu.outputs
                )
"""
)


def _refused_by_a_broken_pass(tmp_path: Path, plugin_text: str) -> str:
    """Optimize a Relu model with a plugin pass that breaks it: exit 3 (a bug), nothing
    written; the one line of stderr."""
    plugin = tmp_path / "broken.py"
    plugin.write_text(plugin_text)
    model = _saved(tmp_path, _relu())
    before = _snapshot(tmp_path)
    result = run_cli(
        "optimize", model, "-o", tmp_path / "out.onnx", "--plugin", plugin,
        "--export_compile_stat", "0",
    )  # fmt: skip
    assert result.exit_code == 3, result.stderr
    assert _snapshot(tmp_path) == before
    return result.stderr


@pytest.mark.usefixtures("restore_registry")
def test_a_contrib_op_mistyped_by_a_pass_is_caught(tmp_path: Path) -> None:
    """onnx.checker does not know onnxruntime's contrib ops: their types are checked against
    onnxruntime's schemas, and onnxruntime itself decides where they break them: exit 3, one
    line naming the node and the constraint, nothing written."""
    stderr = _refused_by_a_broken_pass(tmp_path, MISTYPING_PLUGIN)
    assert "does not load in onnxruntime though the input does" in stderr
    assert "T is tensor(float) for A and tensor(float16) for B" in stderr


@pytest.mark.usefixtures("restore_registry")
def test_a_valid_input_never_yields_an_invalid_output(tmp_path: Path) -> None:
    """A pass that breaks a valid model is caught before the output lands: exit 3 (a bug),
    one line, nothing written."""
    stderr = _refused_by_a_broken_pass(tmp_path, BREAKING_PLUGIN)
    assert "fails onnx.checker though the input passes" in stderr
    assert "NoSuchOperator" in stderr
