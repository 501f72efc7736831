"""``register_replacement``: a fusion pass declared as a search function and a replacement.

It is the ONNX counterpart of TorchAir's / PyTorch Inductor's ``register_replacement``: both
functions are written over the onnxscript rewriter's op builder, and the result is an ordinary
PatternPass in the one registry, so it is switched, counted, reported, dumped and bisected as
every built-in pass is (MatMulBiasAddFusionPass is declared this way).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from fusectl.rewrite.patterns import PatternPass, Rule, Site
from fusectl.rewrite.registry import ALL_TARGETS, REGISTRY, Category, Numerics, PassSpec

ExtraCheck = Callable[..., "bool | str | None"]


def register_replacement(
    name: str,
    search: Callable[..., Any] | Sequence[Callable[..., Any]],
    replacement: Callable[..., Any],
    *,
    extra_check: ExtraCheck | None = None,
    category: Category | str = Category.UB,
    aliases: Sequence[str] = (),
    default_on: bool = True,
    numerics: Numerics | str = Numerics.EXACT,
    description: str = "",
    priority: int | None = None,
    targets: Sequence[str] = ALL_TARGETS,
    min_opset: int = 1,
    emits: Sequence[str] = (),
    emits_domain: str = "",
    commute: bool = True,
    pattern_name: str | None = None,
    replace: bool = False,
    again_after_fusions: bool = False,
) -> PatternPass:
    """Register a pass that rewrites every match of ``search`` into ``replacement``.

    - ``search(op, x, w, ...)`` builds the pattern with the op builder (``op.Add(op.MatMul(x,
      w), b)``); its parameters after ``op`` are the pattern variables. A list of search
      functions matches several spellings of one computation, tried in order, with one
      replacement; each is then a pattern of its own, named after its function.
    - ``replacement(op, x, w, ...)`` builds what takes the match's place and returns its
      output value(s). It receives the variables it names; one named ``site`` receives the
      match (a ``Site``: shapes, dtypes, constant values, matched nodes).
    - ``extra_check(site, x, w, ...)``, optional, runs after the structural match: True or
      None accepts; False or a string declines (the string is the reason ``--report`` shows).
      It and the replacement may also raise ``Decline(reason)``.
    - Commutative inputs (Add, Mul, ...) match in either order unless ``commute`` is False.
    - ``numerics`` says how far the replacement may drift from the original ("exact",
      "reassociating", "approximate"): it sets ``verify``'s and ``--check_custom``'s tolerance.
    - ``pattern_name`` names a single pattern in logs and lineage (default: the pass name).
    - ``targets`` lists the ``--target`` values whose runtimes run what the replacement emits:
      ``("ort",)`` for onnxruntime contrib ops.
    - ``again_after_fusions``: the pass runs once more after the UB fusions (when enabled),
      for matches the fusions create.

    Registering a name (or alias) that is taken raises ValueError unless ``replace`` is True.
    Returns the registered pass.
    """
    searches = [search] if callable(search) else list(search)
    if not searches:
        raise ValueError(f"pass {name}: no search function given")
    for role, function in (*(("search", f) for f in searches), ("replacement", replacement)):
        if not callable(function):
            raise TypeError(
                f"pass {name}: {role} must be a function, not {type(function).__name__}"
            )
    spec = PassSpec(
        name=name,
        category=_member(Category, category, name, "category"),
        description=description or _first_line(replacement) or f"{name} (register_replacement)",
        aliases=tuple(aliases),
        default_on=default_on,
        numerics=_member(Numerics, numerics, name, "numerics"),
        priority=priority,
        targets=tuple(targets),
        min_opset=min_opset,
        emits=tuple(emits),
        emits_domain=emits_domain,
        again_after_fusions=again_after_fusions,
    )
    rewrite = _rewrite(replacement)
    check = _check(extra_check) if extra_check is not None else None
    rules = tuple(
        Rule(
            f.__name__ if len(searches) > 1 else pattern_name or name,
            f,
            rewrite,
            check,
            commute=commute,
        )
        for f in searches
    )
    pass_class = type(
        re.sub(r"\W", "_", name),
        (PatternPass,),
        {
            "spec": spec,
            "rules": rules,
            "__module__": searches[0].__module__,
            "__doc__": spec.description,
        },
    )
    fusion_pass = pass_class()
    fusion_pass.compiled_rules()  # a search function that cannot be traced fails here, not mid-run
    REGISTRY.register(fusion_pass, replace=replace)
    return fusion_pass


def _member(kind: type, value: Any, name: str, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in kind)
        raise ValueError(f"pass {name}: {what} {value!r} is not one of {allowed}") from None


def _first_line(function: Callable[..., Any]) -> str:
    doc = inspect.getdoc(function)
    return doc.strip().splitlines()[0] if doc else ""


def _forwarded(function: Callable[..., Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Which bindings a user function takes: all of them if it has **kwargs, else those it
    names. Search functions often bind variables only to constrain the match."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return lambda bindings: bindings
    names = {p.name for p in parameters}
    return lambda bindings: {k: v for k, v in bindings.items() if k in names}


def _rewrite(replacement: Callable[..., Any]) -> Callable[..., Any]:
    forwarded = _forwarded(replacement)
    wants_site = "site" in inspect.signature(replacement).parameters

    def rewrite(op: Any, site: Site, **bindings: Any) -> Any:
        arguments = forwarded(bindings)
        if wants_site:
            arguments["site"] = site
        return replacement(op, **arguments)

    return rewrite


def _check(extra_check: ExtraCheck) -> Callable[..., str | None]:
    forwarded = _forwarded(extra_check)
    label = getattr(extra_check, "__name__", "extra_check")

    def check(site: Site, **bindings: Any) -> str | None:
        verdict = extra_check(site, **forwarded(bindings))
        if isinstance(verdict, str):
            return verdict or f"{label} declined the match"
        if verdict is None or bool(verdict):  # numpy's bools are not True / False
            return None
        return f"{label} declined the match"

    return check
