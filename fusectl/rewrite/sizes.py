"""Sizes as products of a static coefficient and named dimensions, and their arithmetic: what
the axis proofs (``axes``, ``layout``) and the shape oracle's resolution of a Reshape's -1
(``shapes``) compute with. Dependency-free, so that every rewrite module may use it."""

from __future__ import annotations

# A size as a product: an integer coefficient and the sorted names of symbolic factors.
Size = tuple[int, tuple[str, ...]]


def of_dim(dim: object) -> Size | None:
    """A shape's dimension as a Size: a static size, or a symbol by its name (None for an
    unknown or unnamed one). Callers choose which names count (made-up ones may not)."""
    if isinstance(dim, int):
        return dim, ()
    name = getattr(dim, "value", None)
    return (1, (str(name),)) if name else None


def product(a: Size | None, b: Size | None) -> Size | None:
    if a is None or b is None:
        return None
    return a[0] * b[0], tuple(sorted(a[1] + b[1]))


def quotient(a: Size | None, b: Size | None) -> Size | None:
    """a / b when b divides a for every value of the names (its coefficient divides a's, its
    names are among a's), else None."""
    if a is None or b is None or b[0] <= 0 or a[0] % b[0]:
        return None
    names = list(a[1])
    for name in b[1]:
        if name not in names:
            return None
        names.remove(name)
    return a[0] // b[0], tuple(names)
