"""How the code is wired, measured: the figures the "one shape" review asked to watch, printed side by side for the
working tree and another revision (default: the first commit of this file's era, given with --against).

    python bench/structure.py                    # the working tree
    python bench/structure.py --against HEAD~10  # and that revision, in a column beside it

Figures (all from the source's AST, except the import time):
- files naming each technique (a regular expression per technique over src/memfit);
- comparisons against the setup's enums (`x is Precision.BF16`, `== Offload.NONE`) outside techniques/;
- function-local memfit imports (the lazy imports that hold the layering together) and import cycles among memfit's
  modules counting them (strongly connected components of more than one module);
- the largest function and the largest file, in lines;
- `import memfit` wall time (median of 5 fresh interpreters, less an empty interpreter's);
- CLI options and arguments written by hand (`typer.Option(` / `typer.Argument(` / `_option(` calls under cli/);
- term lookups by string: term names written as string literals (`"activations/head"`, an f-string
  `f"activations/{...}"`, a prefix `"optimizer/"`) outside memfit.estimate.terms, whose TermKey names them all.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TECHNIQUES = {
    "LoRA / QLoRA": r"\blora\b|\bLoRA\b|\bqlora\b|Method\.(Q?LORA)",
    "CPU offload": r"Offload\.|\boffload\b",
    "float8": r"float8|Float8",
    "activation offload": r"activation_offload",
    "selective checkpointing": r"SELECTIVE|selective",
    "8-bit Adam": r"ADAMW_8BIT|adamw-8bit|8bit",
}
TERM_NAME = re.compile(r"(activations|temporaries|optimizer|parameters|gradients|overhead)/[a-z0-9_/]*")
ENUMS = ("Precision", "Optimizer", "Checkpointing", "Attention", "Loss", "Padding", "Sharding", "Offload", "Engine",
         "PipelineSchedule", "CpRotate", "Float8", "Method", "BaseWeights", "LoraRecipe")


def _modules(src: Path) -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted((src / "memfit").rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = (path, ast.parse(path.read_text(), filename=str(path)))
    return out


def _resolve(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("memfit")]
    if node.level == 0:
        base = node.module or ""
        return [base] if base.startswith("memfit") else []
    parts = module.split(".")
    parts = parts if is_package else parts[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    base = ".".join(parts + ([node.module] if node.module else []))
    if node.module:
        return [base]
    return [f"{base}.{a.name}" for a in node.names]


def _imports(modules: dict[str, tuple[Path, ast.Module]]) -> tuple[dict[str, set[str]], int]:
    """memfit module -> the memfit modules it imports (module level and inside functions), and how many imports sit
    inside functions."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    local = 0
    for name, (path, tree) in modules.items():
        is_package = path.name == "__init__.py"
        in_function: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = [t for t in _resolve(name, node, is_package) if t]
            targets = [t if t in modules else t.rsplit(".", 1)[0] for t in targets]
            targets = [t for t in targets if t in modules and t != name]
            if targets and id(node) in in_function:
                local += 1
            graph[name].update(targets)
    return graph, local


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _enum_comparisons(modules: dict[str, tuple[Path, ast.Module]]) -> int:
    count = 0
    for name, (_, tree) in modules.items():
        if name.startswith("memfit.techniques"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                for sub in ast.walk(side):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in ENUMS:
                        count += 1
                        break
                else:
                    continue
                break
    return count


def term_name_strings(tree: ast.Module) -> int:
    """String literals that spell a term name or its category prefix (an f-string's leading text too: its parts are
    constants of their own)."""
    return sum(1 for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and TERM_NAME.fullmatch(node.value))


def _largest_function(modules: dict[str, tuple[Path, ast.Module]]) -> tuple[int, str]:
    best = (0, "")
    for name, (_, tree) in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > best[0]:
                    best = (lines, f"{name}.{node.name}")
    return best


def _import_time(src: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}

    def once(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        return time.perf_counter() - start

    empty = statistics.median(once("pass") for _ in range(5))
    return statistics.median(once("import memfit") for _ in range(5)) - empty


def measure(root: Path, *, timing: bool = True) -> dict[str, object]:
    src = root / "src"
    modules = _modules(src)
    texts = {name: path.read_text() for name, (path, _) in modules.items()}
    graph, local = _imports(modules)
    cycles = _cycles(graph)
    biggest_file = max(((len(t.splitlines()), n) for n, t in texts.items()))
    function = _largest_function(modules)
    cli_options = sum(len(re.findall(r"\btyper\.(Option|Argument)\(|(?<![\w.])_?option\(", t))
                      - len(re.findall(r"def _?option\(", t))
                      for n, t in texts.items() if n.startswith("memfit.cli"))
    out: dict[str, object] = {"modules": len(modules), "lines": sum(len(t.splitlines()) for t in texts.values())}
    for technique, pattern in TECHNIQUES.items():
        out[f"files naming {technique}"] = sum(1 for t in texts.values() if re.search(pattern, t))
    out.update({
        "enum comparisons outside techniques/": _enum_comparisons(modules),
        "function-local memfit imports": local,
        "import cycles (modules in them)": f"{len(cycles)} ({sum(len(c) for c in cycles)})",
        "largest function (lines)": f"{function[0]} {function[1]}",
        "largest file (lines)": f"{biggest_file[0]} {biggest_file[1]}",
        "CLI options written by hand": cli_options,
        "term lookups by string": sum(term_name_strings(tree) for name, (_, tree) in modules.items()
                                      if name != "memfit.estimate.terms"),
    })
    if timing:
        out["import memfit (s)"] = f"{_import_time(src):.2f}"
    return out


GOALS = {"enum comparisons outside techniques/": "~0", "function-local memfit imports": "< 40",
         "import cycles (modules in them)": "0", "largest function (lines)": "<= 60", "largest file (lines)": "<= 500",
         "import memfit (s)": "< 0.3", "CLI options written by hand": "generated",
         "term lookups by string": "0"}


def _checkout(revision: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", revision, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a git revision to measure beside the working tree")
    parser.add_argument("--no-timing", action="store_true", help="skip the import time (fresh interpreters)")
    args = parser.parse_args()
    now = measure(ROOT, timing=not args.no_timing)
    columns = [("working tree", now)]
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            columns.insert(0, (args.against, measure(_checkout(args.against, Path(tmp)), timing=not args.no_timing)))
    head = ["figure"] + [name for name, _ in columns] + ["goal"]
    rows = [[key] + [str(values.get(key, "")) for _, values in columns] + [GOALS.get(key, "")] for key in now]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
