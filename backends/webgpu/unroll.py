"""Unrolling of the WGSL loops a shader marks ``// @unroll``, at build time.

WGSL has no unroll attribute, and whether the driver unrolls a loop over a private array is
its own choice: where it does not, the array is indexed at run time and lives in local memory
instead of registers. A marked loop whose bound is a module constant is written out as one
block per iteration, each binding the loop variable as a ``let`` of that iteration's value,
so every index into the lane's private arrays folds to a constant (a ``const`` would make an
index past an array's end in a dead branch a shader-creation error). Loops whose bound is not
a constant, or whose body breaks or continues, are left as they are.

The marked loop must have the form ``for (var X = 0u; X < BOUND; X++) {  // @unroll``.
"""
from __future__ import annotations

import ast
import operator
import re
from collections.abc import Mapping

MARK = "// @unroll"
# A loop whose copies would exceed this much text stays a loop (its inner loops are still
# written out): code size costs compile time, on lavapipe most of all.
MAX_CHARS = 40_000
_CONST = re.compile(r"^\s*const\s+(\w+)\s*:\s*u32\s*=\s*(.+?);", re.M)
_LOOP = re.compile(r"for \(var (\w+) = 0u; \1 < ([^;]+); \1\+\+\) \{[ \t]*// @unroll[^\n]*\n")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _eval(expr: str, names: Mapping[str, int]) -> int | None:
    """The value of a u32 constant expression over ``names`` (+ - * / %, min, max), or None."""
    text = re.sub(r"\b(\d+)u\b", r"\1", expr).replace("/", "//")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None

    def ev(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name) and n.id in names:
            return names[n.id]
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return int(_OPS[type(n.op)](ev(n.left), ev(n.right)))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                n.func.id in ("min", "max") and not n.keywords:
            return (min if n.func.id == "min" else max)(ev(a) for a in n.args)
        raise ValueError(ast.dump(n))
    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError):
        return None


def constants(wgsl: str) -> dict[str, int]:
    """Module-scope u32 constants whose values follow from earlier ones."""
    names: dict[str, int] = {}
    for m in _CONST.finditer(wgsl):
        v = _eval(m.group(2), names)
        if v is not None:
            names[m.group(1)] = v
    return names


def _body_end(text: str, start: int) -> int:
    """Index of the ``}`` closing the block whose body starts at ``start``."""
    depth, i = 1, start
    while i < len(text):
        if text.startswith("//", i):
            i = text.find("\n", i)
            if i < 0:
                break
            continue
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError("unbalanced braces after an @unroll loop")


def _own_jumps(body: str) -> bool:
    """Whether the body breaks or continues its own loop (inner loops' blocks skipped)."""
    plain = re.sub(r"//[^\n]*", "", body)
    kept, i = [], 0
    for m in re.finditer(r"\b(for|loop|while)\b", plain):
        if m.start() < i:
            continue
        kept.append(plain[i:m.start()])
        i = _body_end(plain, plain.index("{", m.end()) + 1) + 1
    kept.append(plain[i:])
    return bool(re.search(r"\b(break|continue)\b", "".join(kept)))


def unroll(wgsl: str, names: Mapping[str, int] | None = None) -> str:
    """``wgsl`` with its marked constant-bound loops written out (inner loops first)."""
    if MARK not in wgsl:
        return wgsl
    names = dict(names) if names is not None else constants(wgsl)
    out: list[str] = []
    pos = 0
    for m in _LOOP.finditer(wgsl):
        if m.start() < pos:
            continue                        # inside a loop already handled
        end = _body_end(wgsl, m.end())
        body = unroll(wgsl[m.end():end], names)
        n = _eval(m.group(2), names)
        out.append(wgsl[pos:m.start()])
        if n is None or n * len(body) > MAX_CHARS or _own_jumps(body):
            out.append(wgsl[m.start():m.end()] + body + "}")
        else:
            var = m.group(1)
            out.append("".join(f"{{ let {var} = {k}u;\n{body}}}" for k in range(n))
                       or "{}")
        pos = end + 1
    out.append(wgsl[pos:])
    return "".join(out)
