"""Zoo CNNs from the onnx wheel (onnx/backend/test/data/light), made runnable.

The 'light' models carry every weight as ConstantOfShape(shape) of a constant 0.02 and, being
IR version 3, list their initializers as graph inputs. To get models the way users have them,
each ConstantOfShape becomes a seeded random initializer (BatchNormalization variances and
scales positive), initializers leave the graph inputs, and the IR version becomes 4 (the
first that allows that). Built in a temporary directory per test session, never committed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
ZOO = (
    "resnet50",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
    "bvlc_alexnet",
)


def _weights(name: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    lowered = name.lower()
    if any(k in lowered for k in ("_riv", "var", "_s_0", "scale")):
        return rng.uniform(0.5, 1.5, shape)
    if any(k in lowered for k in ("_rm", "mean")):
        return rng.normal(0.0, 0.1, shape)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return rng.normal(0.0, 1.0 / np.sqrt(max(fan_in, 1)), shape)


def materialize(name: str, destination: Path, seed: int = 0) -> Path:
    """Write a runnable copy of zoo model ``name`` to ``destination`` and return its path."""
    model = onnx.load(str(LIGHT_DIR / f"light_{name}.onnx"))
    graph = model.graph
    rng = np.random.default_rng(seed)
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    kept_nodes = []
    new_initializers = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in constants:
            shape = [int(d) for d in constants[node.input[0]]]
            array = _weights(node.output[0], shape, rng).astype(np.float32)
            new_initializers.append(numpy_helper.from_array(array, node.output[0]))
        else:
            kept_nodes.append(node)
    used = {name for node in kept_nodes for name in node.input}
    initializers = [i for i in list(graph.initializer) + new_initializers if i.name in used]
    init_names = {i.name for i in initializers}
    inputs = [i for i in graph.input if i.name in used and i.name not in init_names]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.input[:]
    graph.input.extend(inputs)
    model.ir_version = max(model.ir_version, 4)
    onnx.checker.check_model(model)
    path = destination / f"{name}.onnx"
    onnx.save(model, str(path))
    return path
