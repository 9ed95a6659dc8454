"""Read the docstrings written under dataclass fields, so configs document themselves."""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Map each annotated field of `cls` (and its bases) to the string literal that follows it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs
