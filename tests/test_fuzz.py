"""Bounded fuzzing: byte flips and protobuf field mutations of small models, semantic
mutations of transformer exports, and their intermediate values made graph outputs, fixed
seeds.

Whatever the bytes, `fusectl optimize` ends in exit 0 or 2, never 3 (an internal error); an
input that passes onnx.checker (full check) gives an output that passes it too, and an input
onnxruntime loads gives an output it loads. An export changed next to its fused layers, or
read inside them, gives an output that computes what the changed export computes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

import fusectl
from fusectl.cli import cli
from fusectl.rewrite import shapes
from tests.backend_models import DATA, checker_passes
from tests.conftest import FIXTURES

ROOT = Path(__file__).parents[1]
SEEDS = {
    "tiny_cnn": ROOT / "samples" / "models" / "tiny_cnn.onnx",
    "mlp": ROOT / "tests" / "fixtures" / "mlp_torchscript.onnx",
    "softmax": ROOT / "tests" / "fixtures" / "hand_softmax_torchscript.onnx",
    "sequences": DATA / "simple" / "test_sequence_model2" / "model.onnx",
    # Control flow: a Loop body and If branches (their names and metadata are mutated too).
    "decoder_loop_ts17": ROOT / "tests" / "fixtures" / "decoder_loop_ts17.onnx",
    "decoder_cond_dynamo": ROOT / "tests" / "fixtures" / "decoder_cond_dynamo.onnx",
}
CASES_PER_SEED = 75


def _runtime_loads(path: Path) -> bool:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


def flip_bytes(data: bytes, rng: random.Random) -> bytes:
    mutated = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
    return bytes(mutated)


def _names(graph: onnx.GraphProto) -> list[str]:
    found = [v.name for v in graph.input] + [t.name for t in graph.initializer]
    return found + [name for node in graph.node for name in node.output]


def _mutate_field(model: onnx.ModelProto, rng: random.Random) -> None:
    """One structural change a broken exporter or an editing script could make."""
    graph = model.graph
    node = rng.choice(graph.node)
    choice = rng.randrange(12)
    if choice == 0 and node.input:  # rewire an input: undefined values, cycles
        node.input[rng.randrange(len(node.input))] = rng.choice([*_names(graph), "nowhere"])
    elif choice == 1:  # a second producer, or a renamed output
        node.output[0] = rng.choice(_names(graph))
    elif choice == 2:
        graph.node.remove(node)
    elif choice == 3:
        graph.node.append(node)
    elif choice == 4:
        node.op_type = rng.choice(["Relu", "Add", "Conv", "Frob", "SequenceEmpty", "Identity"])
    elif choice == 5 and node.attribute:
        attribute = rng.choice(node.attribute)
        attribute.type = rng.choice(onnx.AttributeProto.AttributeType.values())
    elif choice == 6:
        model.ir_version = rng.choice([0, 1, 2, 3, 7, 10, 14, 15, 99])
    elif choice == 7:
        model.opset_import[0].version = rng.choice([1, 6, 11, 13, 17, 21, 28, 29, 99])
    elif choice == 8 and graph.initializer:
        tensor = rng.choice(graph.initializer)
        tensor.dims.append(rng.choice([0, 1, 2, 3]))
    elif choice == 9 and graph.initializer:
        rng.choice(graph.initializer).data_type = rng.randrange(30)
    elif choice == 10:
        value = rng.choice([*graph.input, *graph.output])
        value.type.tensor_type.elem_type = rng.randrange(30)
    else:
        graph.output[0].name = rng.choice(_names(graph))


def mutate_fields(data: bytes, rng: random.Random) -> bytes:
    model = onnx.load_from_string(data)
    for _ in range(rng.choice((1, 1, 2))):
        if model.graph.node:
            _mutate_field(model, rng)
    return model.SerializeToString()


MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "bytes": flip_bytes,
    "fields": mutate_fields,
}


@pytest.mark.parametrize("seed_name", sorted(SEEDS))
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutated_models_never_crash_or_break(seed_name: str, mutation: str, tmp_path: Path) -> None:
    original = SEEDS[seed_name].read_bytes()
    rng = random.Random(f"{seed_name}/{mutation}")
    runner = CliRunner()
    exit_codes: dict[int, int] = {}
    for case in range(CASES_PER_SEED):
        model, output = tmp_path / f"{case}.onnx", tmp_path / f"{case}_out.onnx"
        model.write_bytes(MUTATIONS[mutation](original, rng))
        result = runner.invoke(
            cli,
            ["optimize", str(model), "-o", str(output), "--export_compile_stat", "0"],
        )
        exit_codes[result.exit_code] = exit_codes.get(result.exit_code, 0) + 1
        where = f"{seed_name} {mutation} case {case}: {result.stderr}"
        assert result.exit_code in (0, 2), where
        if result.exit_code == 2:
            assert not output.exists(), where
            continue
        if checker_passes(model):
            assert checker_passes(output), f"valid input, invalid output: {where}"
        if _runtime_loads(model):
            assert _runtime_loads(output), f"onnxruntime loads the input, not the output: {where}"
        output.unlink()
    assert sum(exit_codes.values()) == CASES_PER_SEED


# Semantic mutations: what a graph computes is changed next to the fused layers (attention,
# rotary, norms, GELU) while it stays loadable: the recognizers must decline the near miss or
# fuse what the graph now computes.
SEMANTIC_SEEDS = {
    "llama_positions_ts17": FIXTURES / "arch" / "llama_positions_ts17.onnx",
    "roberta_ts17": FIXTURES / "arch" / "roberta_ts17.onnx",
    "gemma3_dynamo": FIXTURES / "arch" / "gemma3_dynamo.onnx",
    "deepseek_v3_ts17": FIXTURES / "arch" / "deepseek_v3_ts17.onnx",
    "bart_dynamo": FIXTURES / "arch" / "bart_dynamo.onnx",
}
SEMANTIC_CASES = 6
_MUTABLE = {onnx.TensorProto.FLOAT, onnx.TensorProto.INT64}
# Elementwise ops and what each may become: same arity, same types.
_SWAPS = {
    "Add": ["Sub", "Mul"],
    "Sub": ["Add", "Div"],
    "Mul": ["Add", "Div"],
    "Div": ["Mul", "Sub"],
    "Pow": ["Mul"],
    "Sqrt": ["Reciprocal", "Abs"],
    "Erf": ["Tanh", "Sigmoid"],
    "Tanh": ["Erf", "Sigmoid"],
    "Sigmoid": ["Tanh"],
}


def _small_constants(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    tensors = [*graph.initializer]
    tensors += [a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute]
    return [t for t in tensors if 0 < math.prod(t.dims) <= 64 and t.data_type in _MUTABLE]


def _mutate_semantics(model: onnx.ModelProto, rng: random.Random) -> bool:
    """One change: a small constant scaled, negated or moved by one (epsilons, scales, GELU
    coefficients, the axes a shape is read at), a one-element constant given another rank
    (a scalar, [1] or [1, 1]: what broadcasts, indexes or reshapes differently), an
    elementwise op swapped for another, a Sub / Div / Pow / Concat's operands exchanged, or an
    integer attribute moved by one or two of its entries exchanged. False when the drawn
    change does not apply."""
    graph = model.graph
    node = rng.choice(graph.node)
    choice = rng.randrange(5)
    if choice == 4:
        tensor = rng.choice(_small_constants(graph))
        array = numpy_helper.to_array(tensor)
        if array.size != 1:
            return False
        array = array.reshape([1] * rng.choice([1, 2]) if array.ndim == 0 else [])
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
        return True
    if choice == 0:
        tensor = rng.choice(_small_constants(graph))
        array = numpy_helper.to_array(tensor).copy()
        flat = array.reshape(-1)
        if array.dtype == np.float32:
            flat *= np.float32(rng.choice([0.5, 2.0, -1.0, 1.01]))
        else:
            flat[rng.randrange(flat.size)] += rng.choice([-1, 1])
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
        return True
    if choice == 1 and node.op_type in _SWAPS:
        node.op_type = rng.choice(_SWAPS[node.op_type])
        return True
    if choice == 2 and node.op_type in ("Sub", "Div", "Pow", "Concat") and len(node.input) >= 2:
        node.input[0], node.input[1] = node.input[1], node.input[0]
        return True
    if choice == 3 and node.attribute:
        attribute = rng.choice(node.attribute)
        if attribute.type == onnx.AttributeProto.INT:
            attribute.i += rng.choice([-1, 1])
            return True
        if attribute.type == onnx.AttributeProto.INTS and len(attribute.ints) >= 2:
            entries = list(attribute.ints)
            i, j = rng.sample(range(len(entries)), 2)
            entries[i], entries[j] = entries[j], entries[i]
            attribute.ints[:] = entries
            return True
    return False


def _finite_outputs(path: Path, feeds: dict[str, np.ndarray]) -> bool:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return all(np.isfinite(output).all() for output in session.run(None, feeds))


@pytest.mark.parametrize("seed_name", sorted(SEMANTIC_SEEDS))
def test_semantic_mutations_are_declined_or_fused_as_they_compute(
    seed_name: str, tmp_path: Path
) -> None:
    """Of each mutated export that onnxruntime runs, fusectl's output verifies against it."""
    original = SEMANTIC_SEEDS[seed_name]
    rng = random.Random(f"{seed_name}/semantics")
    runner = CliRunner()
    verified = 0
    for case in range(SEMANTIC_CASES * 10):
        if verified == SEMANTIC_CASES:
            break
        model = onnx.load(str(original))
        if not _mutate_semantics(model, rng):
            continue
        path, output = tmp_path / f"{case}.onnx", tmp_path / f"{case}_out.onnx"
        onnx.save(model, str(path))
        try:
            feeds = fusectl.verify(original, path).feeds
        except fusectl.FusectlError:
            continue  # the mutated export does not run: nothing to compare
        if not _finite_outputs(path, feeds):
            continue  # NaN or inf flows through it: no value to keep (fused kernels differ)
        result = runner.invoke(cli, ["optimize", str(path), "-o", str(output)])
        where = f"{seed_name} case {case}: {result.stderr}"
        assert result.exit_code in (0, 2), where
        if result.exit_code == 0:
            check = fusectl.verify(path, output)
            assert check.passed, f"{where} {[c for c in check.checks if not c.passed]}"
            verified += 1
    assert verified == SEMANTIC_CASES


# Intermediate values made graph outputs too: a second reader every fusion must keep computing
# (a value inside a match stays, or the site is declined with the reason), whatever it is.
EXPOSED_SEEDS = {**SEMANTIC_SEEDS, "bloom_ts17": FIXTURES / "arch" / "bloom_ts17.onnx"}
EXPOSED_CASES = 3


@pytest.mark.parametrize("seed_name", sorted(EXPOSED_SEEDS))
def test_intermediates_made_outputs_stay_computed(seed_name: str, tmp_path: Path) -> None:
    """One to three intermediate tensors of the export made graph outputs: fusectl's output
    computes every output, the new ones included, as the changed export does."""
    original = onnx.load(str(EXPOSED_SEEDS[seed_name]))
    types = {
        info.name: info.type
        for info in onnx.shape_inference.infer_shapes(original).graph.value_info
        if info.type.tensor_type.elem_type in _MUTABLE | {onnx.TensorProto.BOOL}
    }
    outputs = {output.name for output in original.graph.output}
    candidates = [
        name
        for node in original.graph.node
        if node.op_type != "Constant"
        for name in node.output
        if name in types and name not in outputs
    ]
    rng = random.Random(f"{seed_name}/outputs")
    runner = CliRunner()
    for case in range(EXPOSED_CASES):
        model = onnx.ModelProto()
        model.CopyFrom(original)
        for name in rng.sample(candidates, rng.randint(1, 3)):
            output = model.graph.output.add()
            output.name = name
            output.type.tensor_type.elem_type = types[name].tensor_type.elem_type
        path, optimized = tmp_path / f"{case}.onnx", tmp_path / f"{case}_out.onnx"
        onnx.save(model, str(path))
        result = runner.invoke(cli, ["optimize", str(path), "-o", str(optimized)])
        where = f"{seed_name} case {case}: {result.stderr}"
        assert result.exit_code == 0, where
        check = fusectl.verify(path, optimized)
        assert check.passed, f"{where} {[c for c in check.checks if not c.passed]}"


# Spellings of the same graph: its nodes in another topological order, and Identity nodes on
# random edges (what some exporters and hand edits leave). Fusion reads what the graph
# computes, so each fuses what the export fuses.
FORM_SEEDS = ("arch/gpt_bigcode_ts17", "arch/xglm_ts17", "arch/roberta_dynamo", "arch/qwen2_ts17")


def _in_another_order(model: onnx.ModelProto, rng: random.Random) -> None:
    """The main graph's nodes in a random topological order (subgraph reads count)."""
    nodes = list(model.graph.node)
    producer = {name: index for index, node in enumerate(nodes) for name in node.output if name}

    def reads(node: onnx.NodeProto) -> set[int]:
        names = list(node.input)
        for attribute in node.attribute:
            for body in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                names += [name for inner in body.node for name in inner.input]
        return {producer[name] for name in names if name in producer} - {nodes.index(node)}

    waiting = [reads(node) for node in nodes]
    readers: dict[int, list[int]] = {index: [] for index in range(len(nodes))}
    for index, sources in enumerate(waiting):
        for source in sources:
            readers[source].append(index)
    ready = [index for index, sources in enumerate(waiting) if not sources]
    order = []
    while ready:
        index = ready.pop(rng.randrange(len(ready)))
        order.append(index)
        for reader in readers[index]:
            waiting[reader].discard(index)
            if not waiting[reader]:
                ready.append(reader)
    del model.graph.node[:]
    model.graph.node.extend(nodes[index] for index in order)


def _through_identities(model: onnx.ModelProto, rng: random.Random) -> None:
    """Six random edges between nodes made to pass through an Identity, then reordered."""
    outputs = {output.name for output in model.graph.output}
    produced = {name for node in model.graph.node for name in node.output}
    edges = [
        (node, index)
        for node in model.graph.node
        for index, name in enumerate(node.input)
        if name in produced and name not in outputs
    ]
    for number, (node, index) in enumerate(rng.sample(edges, 6)):
        copy = f"fuzz_identity_{number}"
        model.graph.node.append(helper.make_node("Identity", [node.input[index]], [copy]))
        node.input[index] = copy
    _in_another_order(model, rng)


def _fuses_and_computes_as(original: Path, changed: Path, tmp_path: Path) -> None:
    """fusectl fuses each op class of ``changed`` as it does ``original``'s, and its output
    computes what ``changed`` computes."""
    expected = fusectl.optimize(original).report["coverage"]
    result = fusectl.optimize(changed, tmp_path / "out.onnx")
    fused = {name: (c["fused"], c["total"]) for name, c in result.report["coverage"].items()}
    assert fused == {name: (c["fused"], c["total"]) for name, c in expected.items()}
    check = fusectl.verify(changed, tmp_path / "out.onnx")
    assert check.passed, [c for c in check.checks if not c.passed]


@pytest.mark.parametrize("form", ["order", "identities"])
@pytest.mark.parametrize("seed_name", FORM_SEEDS)
def test_another_spelling_fuses_as_the_export(seed_name: str, form: str, tmp_path: Path) -> None:
    original = FIXTURES / f"{seed_name}.onnx"
    model = onnx.load(str(original))
    change = _in_another_order if form == "order" else _through_identities
    change(model, random.Random(f"{seed_name}/{form}"))
    path = tmp_path / "changed.onnx"
    onnx.save(model, str(path))
    _fuses_and_computes_as(original, path, tmp_path)


# Every fixture whose fusion another tool's shape inference once cut: onnx's infer_shapes
# (LeViT 4/5 attention, RoFormer 0/4 rotary, ModernBERT 1/2 attention, the three hand-written
# decoders' rotary or attention), and onnxruntime's symbolic inference, as its quantization
# preprocessing runs it (tf2onnx's Keras attention 0/1; a second run of linear_bn and Swin
# fused more than the first).
INFERRED = [
    *[
        ("onnx", seed)
        for seed in (
            "arch/levit_ts17",
            "arch/roformer_ts17",
            "arch/modernbert_ts17",
            "litgpt_ts17",
            "lucidrains_ts17",
            "torchtune_ts17",
        )
    ],
    *[
        ("onnxruntime", seed)
        for seed in (
            "keras_encoder_tf2onnx",
            "keras_attention_dynamic_tf2onnx",
            "linear_bn_ts17",
            "arch/swin_ts17",
        )
    ],
]


def _inferred_by(tool: str, model: onnx.ModelProto) -> onnx.ModelProto:
    if tool == "onnx":
        return onnx.shape_inference.infer_shapes(model)
    return shapes._symbolic_inference().infer_shapes(model, auto_merge=True)


# Exports whose view of heads or pairs ends in a -1 over symbolic sizes: the exporter's
# value_info declared what onnx's inference leaves unresolved.
STRIPPED = ["arch/modernbert_dynamo", "arch/roformer_dynamo", "rotary/cohere_dynamo"]


@pytest.mark.parametrize("seed_name", STRIPPED)
def test_exports_stripped_of_value_info_fuse_as_the_export(seed_name: str, tmp_path: Path) -> None:
    """Graph surgery and other tools drop value_info. A Reshape's -1 the exporter resolved is
    then resolved from the sizes that cancel (attention or rotary fused none before)."""
    original = FIXTURES / f"{seed_name}.onnx"
    model = onnx.load(str(original))
    assert model.graph.value_info
    del model.graph.value_info[:]
    path = tmp_path / "stripped.onnx"
    onnx.save(model, str(path))
    _fuses_and_computes_as(original, path, tmp_path)


@pytest.mark.parametrize(("tool", "seed_name"), INFERRED)
def test_shapes_another_tool_inferred_first_fuse_as_the_export(
    tool: str, seed_name: str, tmp_path: Path
) -> None:
    """The export after another tool's shape inference, as users often run one before handing
    a model over: its value_info then names sizes that inference could not follow (onnx's
    ``unk__N``, onnxruntime's ``Reshape_43_o0__d1``), where fusectl's inference (with data
    propagation) finds them. fusectl derives those again and fuses as it fuses the export; a
    second run gives the same bytes."""
    original = FIXTURES / f"{seed_name}.onnx"
    inferred = _inferred_by(tool, onnx.load(str(original)))
    assert any(
        not shapes.named(ir.SymbolicDim(dim.dim_param))
        for info in inferred.graph.value_info
        for dim in info.type.tensor_type.shape.dim
        if dim.dim_param
    )
    path = tmp_path / "inferred.onnx"
    onnx.save(inferred, str(path))
    _fuses_and_computes_as(original, path, tmp_path)
    fusectl.optimize(tmp_path / "out.onnx", tmp_path / "again.onnx")
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "out.onnx").read_bytes()
