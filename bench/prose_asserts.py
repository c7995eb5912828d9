"""Count the test asserts that match wording: an `in` / `not in` whose left side is a phrase (a string literal with a
space, or an f-string), or a call of `re.*`, anywhere in an assert. Some test wording on purpose (one error line,
the rendered page); the count is for finding those where a number or structured output (--json, the returned
objects) could be asserted instead.

    python bench/prose_asserts.py [tests] [--list]
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _is_wording(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
        left = node.left
        return isinstance(left, ast.JoinedStr) or (isinstance(left, ast.Constant) and isinstance(left.value, str)
                                                   and " " in left.value.strip())
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "re")


def prose_asserts(tree: ast.Module) -> list[int]:
    """Line numbers of the asserts in `tree` that match wording."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Assert) and any(_is_wording(sub) for sub in ast.walk(node.test))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=str(ROOT / "tests"))
    parser.add_argument("--list", action="store_true", help="print each assert's file and line")
    args = parser.parse_args()
    per_file: Counter[str] = Counter()
    for path in sorted(Path(args.folder).rglob("*.py")):
        text = path.read_text()
        lines = prose_asserts(ast.parse(text))
        per_file[str(path.relative_to(args.folder))] = len(lines)
        if args.list:
            source = text.splitlines()
            for line in sorted(lines):
                print(f"{path.relative_to(args.folder)}:{line}: {source[line - 1].strip()[:120]}")
    print(f"prose-matching asserts: {sum(per_file.values())}")
    for name, count in per_file.most_common(10):
        print(f"{count:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
