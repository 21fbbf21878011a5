"""Checks of the OpenCL C sources as text. What NVIDIA's OpenCL C 1.2 compiler refuses and PoCL's
clang accepts, caught on CI's machine: the H100's tensor-core builds failed (and the planner fell
back to the sub-group kernels, 5x slower) when a shared macro became variadic. And the house
rule's length of a function (at most 80 lines), kept by every kernel and helper."""

from __future__ import annotations

import re
from importlib import resources


def _sources() -> dict[str, str]:
    root = resources.files("attnreg.kernels_cl")
    return {p.name: p.read_text(encoding="utf-8") for p in root.iterdir() if p.name.endswith(".cl")}


def test_sources_are_found() -> None:
    assert {"common.cl", "flash_core.cl", "mma_tile.cl"} <= set(_sources())


def test_no_variadic_macros() -> None:
    """NVIDIA: "variadic macros not supported in OpenCL"."""
    bad = [f"{name}:{text[:m.start()].count(chr(10)) + 1}"
           for name, text in _sources().items()
           for m in re.finditer(r"^\s*#\s*define\s+\w+\([^)]*\.\.\.\s*\)", text, re.M)]
    assert not bad, f"variadic macros (NVIDIA's OpenCL refuses them): {bad}"
    assert not [n for n, t in _sources().items() if "__VA_ARGS__" in t]


# The house rule for functions: at most this many lines, the declaration to the closing brace.
MAX_FUNCTION_LINES = 80
# name( ... ) closing a declaration: its parameter list may nest one level (attributes).
_HEADER = re.compile(r"(\w+)\s*\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)\s*$")
_CONDITIONAL = re.compile(r"#\s*(if|ifdef|ifndef|elif|else|endif)\b")


def _code(text: str) -> list[str]:
    """The lines of OpenCL C text with comments blanked (line numbers kept)."""
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    return [re.sub(r"//.*", "", line) for line in text.split("\n")]


def functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of each function definition in OpenCL C text: from the
    first line of its declaration (`__kernel __attribute__(...)` included) to its closing
    brace. Macros are not functions; the branches of #if / #else are each read as written,
    with the brace depth of the first branch kept after #endif (a function may open a block
    differently per branch, as decode_mma.cl's `if (!full) {` / `{`)."""
    out: list[tuple[str, int, int]] = []
    depth, continued = 0, False
    stack: list[list[int | None]] = []          # per open #if: its depth, its first branch's end
    head: list[tuple[str, int]] = []            # top-level text since the last statement
    start: tuple[str, int] | None = None
    for no, line in enumerate(_code(text), 1):
        s = line.strip()
        if continued or s.startswith("#"):
            cond = None if continued else _CONDITIONAL.match(s)
            continued = s.endswith("\\")
            word = cond.group(1) if cond else ""
            if word.startswith("if"):
                stack.append([depth, None])
            elif word in ("elif", "else"):
                if stack[-1][1] is None:
                    stack[-1][1] = depth
                depth = int(stack[-1][0] or 0)
            elif word == "endif":
                first_end = stack.pop()[1]
                depth = depth if first_end is None else first_end
            continue
        for ch in line + "\n":
            if depth == 0 and ch == "{":
                h = "".join(c for c, _ in head)
                m = _HEADER.search(h)
                start = None
                if m and "=" not in h:
                    first = next(n for c, n in head if not c.isspace())
                    start = (m.group(1), first)
                head = []
            elif depth == 0 and ch in ";}":
                head = []
            elif depth == 0:
                head.append((ch, no))
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0 and start is not None:
                    out.append((start[0], start[1], no))
                    start = None
    return out


def test_no_function_over_80_lines() -> None:
    """Every kernel and helper of the OpenCL C sources is at most 80 lines (#34): a long
    kernel is split into named phases (stage, scores, softmax, P.V, write)."""
    found = {name: functions(text) for name, text in _sources().items()}
    assert sum(len(f) for f in found.values()) > 100, found     # the sources were read
    long = [f"{name}:{a} {fn} ({b - a + 1} lines)" for name, fs in sorted(found.items())
            for fn, a, b in fs if b - a + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_function_lengths_are_measured() -> None:
    """The measure sees a kernel's declaration and body across #if branches, and not macros,
    struct typedefs or initializers."""
    body = "\n".join(f"  x[{i}] = {i};" for i in range(76))
    text = (
        "#define LONG(a) \\\n" + "".join(f"  a += {i}; \\\n" for i in range(90)) + "\n"
        "typedef struct {\n  int a;\n} S;\n"
        "const int t[2] = {1, 2};\n"
        "// inline void commented(int a) {\n"
        "__kernel __attribute__((reqd_work_group_size(64, 1, 1)))\n"
        "void k(__global float* x) {\n"
        "#if A\n  if (x[0] > 0) {\n#else\n  {\n#endif\n" + body + "\n  }\n}\n"
        "inline float h(float a) { return a; }\n")
    got = functions(text)
    assert [(n, b - a + 1) for n, a, b in got] == [("k", 85), ("h", 1)], got
