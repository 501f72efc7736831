"""Feeds for a model: generated from its declared inputs, or read from an ``.npz`` file.

Random integers are the usual reason a comparison run crashes (a token id past the embedding
table) or compares nonsense (a mask of 7s), so integer inputs get values the model can use:

- token ids: below the first dimension of the embedding table they index, found by following
  the input through Cast / Reshape / Unsqueeze / Flatten / Squeeze / Identity to a Gather whose
  data is an initializer (the smallest table if there are several);
- masks (a name containing ``mask``, or an input whose every use is a comparison or a Cast to
  bool): all ones, i.e. nothing masked;
- position ids (a name containing ``position``): ``0 .. n-1`` along the last axis;
- any other integer input: values in ``{0, 1}``, valid as an index into any non-empty axis.

Float inputs are seeded standard normal values, bool inputs all true. A symbolic dimension takes
the size ``--input_shape`` gives it (and every other input sharing the dimension's name follows);
otherwise ``DEFAULT_DIMS`` by name, else a free size: ``DEFAULT_DIM``, or the next of
``FREE_SIZES`` when the model does not run at the one before (verify, bench, bisect). A
dimension named by arithmetic over other names (Optimum declares a KV-cache model's mask
``past_sequence_length + sequence_length``) takes the value of that arithmetic.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from fusectl.core.outside_ir import OUTSIDE_TYPE
from fusectl.errors import FusectlError
from fusectl.rewrite.shapes import arithmetic_dim, is_arithmetic

# Symbolic dimensions by name: batch 2 so batch-mixing bugs show, past keys/values 4 long and a
# "total" length equal to past + new positions, as KV-cache exports declare it.
DEFAULT_BATCH = 2
DEFAULT_PAST = 4
DEFAULT_DIM = 8
DEFAULT_DIMS = (
    (re.compile(r"batch", re.I), DEFAULT_BATCH),
    (re.compile(r"past", re.I), DEFAULT_PAST),
)
_TOTAL = re.compile(r"total", re.I)
# Free sizes in the order they are tried: what a model needs can be more than 8 (an audio
# front end's analysis window, 400 samples; a detector's stride-32 feature pyramid). An input
# that would hold more than FREE_ELEMENTS_LIMIT elements stops the trying there.
FREE_SIZES = (DEFAULT_DIM, 64, 512)
FREE_ELEMENTS_LIMIT = 2**24

# Ops a token id passes through unchanged on its way to an embedding Gather.
_TRANSPARENT = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"})
_COMPARISONS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not"})

_NUMPY_TYPES: dict[ir.DataType, type] = {
    ir.DataType.FLOAT: np.float32,
    ir.DataType.DOUBLE: np.float64,
    ir.DataType.FLOAT16: np.float16,
    ir.DataType.INT64: np.int64,
    ir.DataType.INT32: np.int32,
    ir.DataType.INT16: np.int16,
    ir.DataType.INT8: np.int8,
    ir.DataType.UINT64: np.uint64,
    ir.DataType.UINT32: np.uint32,
    ir.DataType.UINT16: np.uint16,
    ir.DataType.UINT8: np.uint8,
    ir.DataType.BOOL: np.bool_,
}


@dataclass(frozen=True)
class InputSpec:
    """One graph input as the feed generator sees it."""

    name: str
    dtype: ir.DataType | None
    dims: tuple[int | str | None, ...] | None  # int: fixed; str: symbolic name; None: unknown
    # What the input is when it is not a tensor ("map(string, tensor(float))"), else None.
    not_tensor: str | None = None


def graph_inputs(model: ir.Model) -> list[InputSpec]:
    """The inputs a caller must feed: declared graph inputs that no initializer defaults."""
    specs = []
    for value in model.graph.inputs:
        if value.const_value is not None or value.name in model.graph.initializers:
            continue
        dims = None
        if value.shape is not None:
            dims = tuple(
                d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None)
                for d in value.shape
            )
        specs.append(InputSpec(value.name or "", value.dtype, dims, _not_tensor(value)))
    return specs


def _not_tensor(value: ir.Value) -> str | None:
    if OUTSIDE_TYPE in value.meta:  # a type onnx-ir has no class for, set aside on loading
        return str(value.meta[OUTSIDE_TYPE])
    if value.type is None or isinstance(value.type, ir.TensorType):
        return None
    return str(value.type)


def tensors_only(specs: list[InputSpec]) -> None:
    """Inputs are generated, and read from .npz, as tensors; anything else is one clear line."""
    for spec in specs:
        if spec.not_tensor is not None:
            raise FusectlError(
                f"input '{spec.name}' is a {spec.not_tensor}, not a tensor; fusectl generates "
                "tensors only, and an .npz file holds tensors only"
            )


def _numpy_type(spec: InputSpec) -> type:
    found = _NUMPY_TYPES.get(spec.dtype) if spec.dtype is not None else None
    if found is None:
        raise FusectlError(
            f"input '{spec.name}' has element type {spec.dtype}, which fusectl cannot generate; "
            "supply it with --inputs FILE.npz"
        )
    return found


def resolve_dims(
    specs: list[InputSpec], shapes: Mapping[str, list[int]], free: int = DEFAULT_DIM
) -> dict[str, tuple[int, ...]]:
    """Concrete shapes for every input: --input_shape first, shared symbolic names next, and
    ``free`` for a dimension nothing names a size for."""
    by_name = {spec.name: spec for spec in specs}
    symbols: dict[str, int] = {}
    for name, dims in shapes.items():
        spec = by_name.get(name)
        if spec is None:
            known = ", ".join(by_name) or "none"
            raise FusectlError(f"--input_shape names '{name}', not an input (inputs: {known})")
        if spec.dims is not None and len(spec.dims) != len(dims):
            raise FusectlError(
                f"--input_shape gives input '{name}' {len(dims)} dimensions, "
                f"it has {len(spec.dims)}"
            )
        for axis, size in enumerate(dims):
            declared = spec.dims[axis] if spec.dims is not None else None
            if size == -1:
                continue
            if isinstance(declared, int) and declared != size:
                raise FusectlError(
                    f"--input_shape sets dimension {axis} of input '{name}' to {size}, "
                    f"the model fixes it at {declared}"
                )
            if isinstance(declared, str):
                symbols.setdefault(declared, size)

    def default(symbol: str) -> int:
        if symbol in symbols:
            return symbols[symbol]
        computed = arithmetic_dim(symbol, default)
        if computed is not None:
            return computed
        if _TOTAL.search(symbol):
            past = next((v for k, v in symbols.items() if re.search("past", k, re.I)), None)
            new = next(
                (
                    v
                    for k, v in symbols.items()
                    if re.search("seq|len", k, re.I)
                    and not re.search("past", k, re.I)
                    and not _TOTAL.search(k)
                ),
                None,
            )
            if past is not None or new is not None:
                return (past if past is not None else DEFAULT_PAST) + (
                    new if new is not None else DEFAULT_DIM
                )
            return DEFAULT_PAST + DEFAULT_DIM
        return next((v for pattern, v in DEFAULT_DIMS if pattern.search(symbol)), free)

    # Fill plain symbols first so that a total length can add up past + new.
    for spec in specs:
        for d in spec.dims or ():
            if isinstance(d, str) and not _TOTAL.search(d) and not is_arithmetic(d):
                symbols[d] = default(d)
    resolved: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        given = shapes.get(spec.name)
        if spec.dims is None:
            if given is None or -1 in given:
                raise FusectlError(
                    f"input '{spec.name}' declares no shape; give it with --input_shape"
                )
            resolved[spec.name] = tuple(given)
            continue
        dims = []
        for axis, d in enumerate(spec.dims):
            if given is not None and given[axis] != -1:
                dims.append(given[axis])
            elif isinstance(d, int):
                dims.append(d)
            elif isinstance(d, str):
                symbols[d] = default(d)
                dims.append(symbols[d])
            else:
                dims.append(free)
        resolved[spec.name] = tuple(dims)
    return resolved


def _constant_first_dim(value: ir.Value | None) -> int | None:
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None and value.producer() is not None and value.producer().op_type == "Constant":
        attr = value.producer().attributes.get("value")
        tensor = attr.value if attr is not None else None
    if tensor is None or not tensor.shape or len(tensor.shape) == 0:
        return None
    first = tensor.shape[0]
    return first if isinstance(first, int) else None


def embedding_size(value: ir.Value) -> int | None:
    """The smallest embedding table (first dimension) this value indexes, if any."""
    sizes: list[int] = []
    seen: set[int] = set()
    pending = [value]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for node, index in current.uses():
            if node.op_type == "Gather" and index == 1 and node.domain in ("", "ai.onnx"):
                axis = node.attributes.get("axis")
                if axis is None or axis.as_int() == 0:
                    size = _constant_first_dim(node.inputs[0])
                    if size is not None:
                        sizes.append(size)
            elif node.op_type in _TRANSPARENT and index == 0:
                pending.extend(node.outputs)
    return min(sizes) if sizes else None


def _is_mask(name: str, value: ir.Value) -> bool:
    if "mask" in name.lower():
        return True
    uses = list(value.uses())
    if not uses:
        return False
    for node, _ in uses:
        if node.op_type in _COMPARISONS:
            continue
        to = node.attributes.get("to") if node.op_type == "Cast" else None
        if to is None or to.as_int() != ir.DataType.BOOL:
            return False
    return True


@dataclass(frozen=True)
class FeedPlan:
    """How each input's values were chosen, for the report (and the tests)."""

    kind: str  # "ids", "mask", "positions", "integer", "float", "bool"
    high: int | None = None  # ids / integer: values lie in [0, high)


def generate_feeds(
    model: ir.Model,
    shapes: Mapping[str, list[int]] | None = None,
    seed: int = 0,
    free: int = DEFAULT_DIM,
    names: Mapping[str, str] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, FeedPlan]]:
    """Seeded feeds for every input the model declares, with valid integer ranges; ``free``
    sizes the dimensions nothing else sizes. ``names``: what an input was called in the model
    a piece was cut from, which says what it holds (a cut's ``v4`` was ``attention_mask``:
    ones, as the whole model is fed, not random keys dropped)."""
    specs = graph_inputs(model)
    tensors_only(specs)
    dims = resolve_dims(specs, shapes or {}, free)
    values = {value.name: value for value in model.graph.inputs}
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    plans: dict[str, FeedPlan] = {}
    for spec in specs:
        dtype = _numpy_type(spec)
        shape = dims[spec.name]
        value = values[spec.name]
        label = (names or {}).get(spec.name) or spec.name
        if dtype is np.bool_:
            feeds[spec.name], plans[spec.name] = np.ones(shape, np.bool_), FeedPlan("bool")
        elif np.issubdtype(dtype, np.floating):
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
            plans[spec.name] = FeedPlan("float")
        elif "position" in label.lower():
            last = shape[-1] if shape else 1
            feeds[spec.name] = np.broadcast_to(np.arange(last, dtype=dtype), shape).copy()
            plans[spec.name] = FeedPlan("positions", last)
        elif _is_mask(label, value):
            feeds[spec.name], plans[spec.name] = np.ones(shape, dtype), FeedPlan("mask", 2)
        else:
            vocab = embedding_size(value)
            high = max(vocab, 1) if vocab is not None else 2
            feeds[spec.name] = rng.integers(0, high, shape).astype(dtype)
            plans[spec.name] = FeedPlan("ids" if vocab is not None else "integer", high)
    return feeds, plans


def read_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    """Arrays by name from an .npz file, with a one-line error for a missing or bad file."""
    if not path.is_file():
        raise FusectlError("no such file" if not path.exists() else "not a file", path=path)
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise FusectlError(f"not a readable .npz file of {what} ({error})", path=path) from None


def load_feeds(path: Path, model: ir.Model) -> dict[str, np.ndarray]:
    """Feeds from an .npz: exactly the model's input names, with matching dtypes and ranks."""
    arrays = read_npz(path, "inputs")
    declared = graph_inputs(model)
    tensors_only(declared)
    specs = {spec.name: spec for spec in declared}
    missing = [name for name in specs if name not in arrays]
    extra = [name for name in arrays if name not in specs]
    if missing:
        raise FusectlError(
            f"no array for input(s) {', '.join(map(repr, missing))} "
            f"(file has: {', '.join(arrays) or 'nothing'})",
            path=path,
        )
    if extra:
        raise FusectlError(
            f"array(s) {', '.join(map(repr, extra))} name no model input "
            f"(inputs: {', '.join(specs)})",
            path=path,
        )
    for name, spec in specs.items():
        array = arrays[name]
        if spec.dtype == ir.DataType.STRING:
            if array.dtype.kind not in "US":  # numpy's text arrays; onnxruntime takes both
                raise FusectlError(
                    f"input '{name}' is {array.dtype}, the model declares strings", path=path
                )
        elif array.dtype != np.dtype(want := _numpy_type(spec)):
            raise FusectlError(
                f"input '{name}' is {array.dtype}, the model declares {np.dtype(want)}", path=path
            )
        if spec.dims is not None:
            if array.ndim != len(spec.dims):
                raise FusectlError(
                    f"input '{name}' has rank {array.ndim}, the model declares {len(spec.dims)}",
                    path=path,
                )
            for axis, (size, declared) in enumerate(zip(array.shape, spec.dims, strict=True)):
                if isinstance(declared, int) and declared != size:
                    raise FusectlError(
                        f"input '{name}' has size {size} on axis {axis}, the model fixes "
                        f"{declared}",
                        path=path,
                    )
    return arrays


def free_sizes(model: ir.Model, shapes: Mapping[str, list[int]]) -> list[int]:
    """The FREE_SIZES that give the model's generated inputs other shapes, in order, up to
    the first that would make an input too large: just DEFAULT_DIM where no dimension is free."""
    specs = graph_inputs(model)
    tensors_only(specs)
    sizes, seen = [], set()
    for free in FREE_SIZES:
        dims = resolve_dims(specs, shapes, free)
        if any(np.prod(shape, dtype=np.float64) > FREE_ELEMENTS_LIMIT for shape in dims.values()):
            break
        key = tuple(sorted(dims.items()))
        if key not in seen:
            seen.add(key)
            sizes.append(free)
    return sizes or [DEFAULT_DIM]


def model_feeds(
    model: ir.Model,
    shapes: Mapping[str, list[int]],
    inputs: Path | None,
    seed: int,
    free: int = DEFAULT_DIM,
) -> tuple[dict[str, np.ndarray], dict[str, FeedPlan]]:
    """The feeds every command runs a model on: ``--inputs`` data, else generated ones.

    Shared by verify and bench so both run a model on the same values for the same options.
    File feeds have no plan: the caller reports them as "from file".
    """
    if inputs is not None:
        if shapes:
            raise FusectlError("--inputs gives the data itself; drop --input_shape")
        return load_feeds(inputs, model), {}
    return generate_feeds(model, shapes, seed, free)


def describe_feeds(feeds: Mapping[str, np.ndarray], plans: Mapping[str, FeedPlan]) -> str:
    """One line naming each feed's dtype, shape and how its values were chosen."""
    described = []
    for name, array in feeds.items():
        plan = plans.get(name)
        how = "from file" if plan is None else plan.kind
        if plan is not None and plan.kind in ("ids", "integer") and plan.high is not None:
            how += f" in [0, {plan.high})"
        shape = ",".join(map(str, array.shape))
        described.append(f"{name} {array.dtype}[{shape}] {how}")
    return "inputs: " + "; ".join(described)
