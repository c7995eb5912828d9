"""Hostile files for the memfit command line: what a careless or hostile user hands it as --config or as the model's
config.json. Each must be refused with one `error:` line and exit 2, within BUDGET_S, never a hang or a traceback.

    python bench/fuzz_hostile.py             # every case, each in a guarded child process
    python bench/fuzz.py --hostile           # the same, after the random cases

The files: a YAML "billion laughs" (nested aliases, as a list and as a mapping under `deepspeed:`), JSON / YAML
nested 100,000 levels, /dev/zero and a FIFO as --config and as the DeepSpeed file a config names, an accelerate
config whose fsdp_config / deepspeed_config is not a mapping, a config.json with 10^9 layers, one with absurd sizes
(hidden 2^40, vocabulary 10^15), one nested 100,000 levels, and a sparse 17 MiB file; and every value of the
test configs (tests/data/configs) swapped for a wrong type (run_wrong_types, in process). The cases run in one child
process (imported once), each timed in process and stopped by SIGALRM after TIMEOUT_S; a case that does not
return even then (a C call that never checks for signals) is found by the parent's deadline, recorded as a hang,
and the child restarted after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 2.0
"""A refusal takes at most this long (in process: the interpreter's start is not counted)."""
TIMEOUT_S = 20.0
"""A case still running after this long is a hang."""
ENV = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error"}
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}


def _laughs(top: str) -> str:
    """Ten lines of YAML whose last alias expands to 9^9 (387 million) strings."""
    names = "abcdefghi"
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip(names, names[1:]):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines + [top, "output_dir: out"]) + "\n"


def _mapping_laughs() -> str:
    names = "abcdefghi"
    lines = ["a: &a {" + ", ".join(f"k{j}: lol" for j in range(9)) + "}"]
    for prev, name in zip(names, names[1:]):
        lines.append(f"{name}: &{name} {{" + ", ".join(f"k{j}: *{prev}" for j in range(9)) + "}")
    return "\n".join(lines + ["deepspeed: *i", "output_dir: out"]) + "\n"


def make_files(root: Path) -> dict[str, str]:
    """Write the hostile files under `root`; {name: path relative to root}."""
    deep = "[" * 100_000 + "]" * 100_000
    texts = {
        "laughs.yaml": _laughs("per_device_train_batch_size: *i"),
        "laughs_ds.yaml": _laughs("deepspeed: *i"),
        "laughs_map.yaml": _mapping_laughs(),
        "deep.json": '{"output_dir": "o", "x": ' + deep + "}",
        "deep.yaml": "output_dir: o\nx: " + deep + "\n",
        "ds_zero.yaml": "output_dir: o\ndeepspeed: /dev/zero\n",
        "ds_fifo.yaml": "output_dir: o\ndeepspeed: fifo\n",
        "fsdp_int.yaml": "distributed_type: FSDP\nnum_processes: 2\nfsdp_config: 5\n",
        "fsdp_list.yaml": "distributed_type: FSDP\nnum_processes: 2\nfsdp_config: [1, 2]\n",
        "ds_section_list.yaml": "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config: [1]\n",
        "layers.json": json.dumps({**TINY, "num_hidden_layers": 10 ** 9}),
        "absurd.json": json.dumps({**TINY, "hidden_size": 2 ** 40, "vocab_size": 10 ** 15}),
        "deep_model.json": '{"model_type": "llama", "x": ' + deep + "}",
        "tiny.json": json.dumps(TINY),
    }
    for name, text in texts.items():
        (root / name).write_text(text)
    with open(root / "sparse.yaml", "wb") as handle:  # 17 MiB that take no disk: over the size cap
        handle.truncate(17 * 1024 * 1024)
    fifo = root / "fifo"
    if hasattr(os, "mkfifo") and not fifo.exists():
        os.mkfifo(fifo)
    return {name: name for name in [*texts, "sparse.yaml"]} | ({"fifo": "fifo"} if fifo.exists() else {})


def cases(files: dict[str, str]) -> list[list[str]]:
    """Command lines that hand the hostile files over, through every command that reads them."""
    configs = ["laughs.yaml", "laughs_ds.yaml", "laughs_map.yaml", "deep.json", "deep.yaml", "ds_zero.yaml",
               "ds_fifo.yaml", "fsdp_int.yaml", "fsdp_list.yaml", "ds_section_list.yaml", "sparse.yaml", "fifo",
               "/dev/zero"]
    out = [["plan", "gpt2", "--config", c] for c in configs if c.startswith("/") or c in files]
    out += [["estimate", "gpt2", "--config", c] for c in ("laughs.yaml", "deep.yaml", "fifo") if c in files]
    out += [["fit", "gpt2", "--max", "batch", "--config", "laughs_map.yaml"]]
    models = ["layers.json", "absurd.json", "deep_model.json", "sparse.yaml", "fifo", "/dev/zero"]
    out += [[command, m] for m in models if m.startswith("/") or m in files for command in ("plan", "estimate")]
    out += [["trace", "layers.json"], ["measure", "absurd.json", "--device", "cpu"],
            ["plan", "tiny.json", "--config", "laughs.yaml"]]
    return out


_CHILD = r"""
import json, signal, sys, time, traceback
from typer.testing import CliRunner
from memfit.cli.app import app

class Hang(BaseException):
    pass

def alarm(signum, frame):
    raise Hang()

signal.signal(signal.SIGALRM, alarm)
runner = CliRunner(env=json.loads(sys.argv[1]))
timeout = float(sys.argv[2])
for line in sys.stdin:
    args = json.loads(line)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    begin = time.perf_counter()
    try:
        result = runner.invoke(app, args, prog_name="memfit")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    elapsed = time.perf_counter() - begin
    exc = result.exception
    problem = None
    if isinstance(exc, Hang):
        problem = "hang"
    elif exc is not None and not isinstance(exc, SystemExit):
        frames = traceback.extract_tb(result.exc_info[2])
        ours = [f for f in frames if "memfit" in f.filename] or frames
        problem = f"{type(exc).__name__} at {ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno}: {str(exc)[:120]}"
    print(json.dumps({"args": args, "code": result.exit_code, "seconds": round(elapsed, 3),
                      "stderr": result.stderr[:400], "stdout": result.stdout[:200], "problem": problem}), flush=True)
"""


@dataclass
class HostileReport:
    results: list = field(default_factory=list)
    hangs: list = field(default_factory=list)
    tracebacks: list = field(default_factory=list)
    slow: list = field(default_factory=list)
    not_refused: list = field(default_factory=list)

    @property
    def problems(self) -> int:
        return len(self.hangs) + len(self.tracebacks) + len(self.slow) + len(self.not_refused)


def _check(record: dict, report: HostileReport, budget: float) -> None:
    report.results.append(record)
    shown = "memfit " + " ".join(record["args"])
    if record["problem"] == "hang":
        report.hangs.append(shown)
    elif record["problem"]:
        report.tracebacks.append(f"{shown}: {record['problem']}")
    elif (record["code"] != 2 or record["stdout"].strip() or len(record["stderr"].splitlines()) != 1
          or not record["stderr"].startswith("error: ")):
        report.not_refused.append(f"{shown}: exit {record['code']}: {(record['stderr'] + record['stdout'])[:200]!r}")
    elif record["seconds"] > budget:
        report.slow.append(f"{shown}: {record['seconds']:.2f} s")


def run(root: Path, *, budget: float = BUDGET_S, timeout: float = TIMEOUT_S,
        only: list[list[str]] | None = None) -> HostileReport:
    """Run the cases (or `only`) in a child process in `root` (where the files are written); see the module doc."""
    files = make_files(root)
    todo = list(only if only is not None else cases(files))
    report = HostileReport()
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    while todo:
        done = _run_child(root, env, todo, timeout)
        for record in done:
            _check(record, report, budget)
        todo = todo[len(done):]
        if todo:  # the child died or was stopped on this case: a hang (or a crash) either way
            _check({"args": todo[0], "code": None, "seconds": timeout, "stderr": "", "stdout": "",
                    "problem": "hang"}, report, budget)
            todo = todo[1:]
    return report


def _run_child(root: Path, env: dict, todo: list[list[str]], timeout: float) -> list[dict]:
    """The records of the cases the child finished, each within `timeout` (+ slack) of the one before."""
    import selectors
    import time

    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(ENV), str(timeout)], cwd=root, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    child.stdin.write("".join(json.dumps(a) + "\n" for a in todo).encode())
    child.stdin.close()
    records, buffer = [], b""
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 60 + timeout  # the first case also waits for the imports
    try:
        while len(records) < len(todo) and time.monotonic() < deadline:
            if not selector.select(max(0.0, deadline - time.monotonic())):
                break
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.startswith(b"{"):
                    records.append(json.loads(line))
                    deadline = time.monotonic() + timeout + 5
    finally:
        child.kill()
        child.wait()
        selector.close()
        child.stdout.close()
    return records


WRONG_TYPES = (5, [1], {"x": 1}, "x", None, True, -1, 1e308)
"""What every value of a real config is replaced by, in turn, for run_wrong_types."""


def _value_paths(data, prefix: tuple = ()):
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield prefix + (key,), value
        yield from _value_paths(value, prefix + (key,))


def run_wrong_types(configs: Path, out: Path, wrong: tuple = WRONG_TYPES) -> tuple[int, list[str]]:
    """Every value of every config in `configs` (the test configs) replaced by each of `wrong`, read with
    memfit.readers.read_config in process: (cases, problems), a problem being any exception but a MemfitError
    (a `fsdp_config: 5` once raised AttributeError)."""
    import copy
    import traceback

    import yaml

    from memfit.errors import MemfitError
    from memfit.readers import read_config
    from memfit.readers.files import load_mapping

    count, problems = 0, []
    for source in sorted(configs.iterdir()):
        if source.suffix not in (".json", ".yaml", ".yml"):
            continue
        data = load_mapping(source)
        for path, _ in list(_value_paths(data)):
            for bad in wrong:
                changed = copy.deepcopy(data)
                holder = changed
                for key in path[:-1]:
                    holder = holder[key]
                holder[path[-1]] = bad
                target = out / source.name
                target.write_text(json.dumps(changed) if source.suffix == ".json" else yaml.safe_dump(changed))
                count += 1
                try:
                    read_config(target)
                except MemfitError:
                    pass
                except Exception as error:  # noqa: BLE001 - what the fuzzer is there to find
                    frame = traceback.extract_tb(error.__traceback__)[-1]
                    problems.append(f"{source.name}: {'.'.join(map(str, path))}={bad!r}: {type(error).__name__} at "
                                    f"{Path(frame.filename).name}:{frame.lineno}: {str(error)[:100]}")
    return count, problems


def format_report(report: HostileReport) -> str:
    lines = [f"hostile files: {len(report.results)} cases, "
             f"slowest {max((r['seconds'] for r in report.results), default=0):.2f} s (budget {BUDGET_S} s)"]
    for title, items in (("hangs", report.hangs), ("tracebacks", report.tracebacks),
                         ("not one error line and exit 2", report.not_refused), (f"over {BUDGET_S} s", report.slow)):
        lines.append(f"{title}: {len(items)}")
        lines += [f"         {item}" for item in items[:10]]
    return "\n".join(lines)


def main() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    with tempfile.TemporaryDirectory(prefix="memfit-hostile-") as tmp:
        report = run(Path(tmp))
        count, wrong = run_wrong_types(ROOT / "tests" / "data" / "configs", Path(tmp))
    print(format_report(report))
    print(f"wrong-typed values in the test configs: {count} cases, {len(wrong)} not refused in one line")
    print("\n".join(f"         {problem}" for problem in wrong[:10]))
    return 1 if report.problems or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
