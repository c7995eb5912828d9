"""Fuzz the memfit command line in process: thousands of seeded random option sets, valid and invalid values mixed,
for every command. A user mistake must be one `error: ...` line and exit 2, a plan that does not fit exit 1, an
answer exit 0; never a traceback, and with --json stdout is one JSON object.

    python bench/fuzz.py                     # 3000 cases, seed 0
    python bench/fuzz.py --cases 20000 --seed 7
    python bench/fuzz.py --heavy             # also real `trace` / `measure` runs on a tiny config (needs torch)
    python bench/fuzz.py --hostile           # then the hostile files (bench/fuzz_hostile.py): alias bombs, deep
                                             # nesting, /dev/zero, FIFOs, absurd model sizes, each within 2 s

Without --heavy, `trace` and `measure` are fuzzed only with inputs refused before torch is imported (an unknown
model, a bad number, a bad --device or --png, a model too large for this machine's RAM), and `plan --verify`,
valid --report/--png paths and `launch` without --dry-run are not generated: each would import torch or run a real
step, thousands of times. `launch` always gets --dry-run (or a script that does not exist). Hub ids are resolved
with HF_HUB_OFFLINE=1, so nothing reaches the network.

Prints the tracebacks grouped by exception type and the memfit frame that raised, the hangs (a case still running
after --timeout seconds is stopped by SIGALRM and counted), malformed JSON, exit codes outside {0, 1, 2}, error
output that is not one line, and the slowest cases; exits 1 when any of these is found.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

ENV = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error"}
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}
ALLOWED_EXIT = {0, 1, 2}
WIDTHS = ["80"] * 6 + ["1", "20", "40", "200"]
"""Console widths (COLUMNS) the cases run at: mostly 80, and some narrow and wide ones."""

# ------------------------------------------------------------------------------------------------ value pools

CATALOG = ["gpt2", "gpt2-xl", "bert-base-uncased", "llama-3.1-8b", "llama-2-70b", "llama-3.2-1b", "qwen2.5-7b",
           "mistral-7b", "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B", "phi-3-mini", "gemma-2-9b", "pythia-6.9b",
           "LLAMA-3.1-8B", " gpt2 ", "llama_3.1_8b"]
ODD_MODELS = ["", " ", "-", "--", "llama-3.1-8x", "gpt", "a" * 300, "a/" * 200, "./" + "b" * 300, "x" * 5000,
              "ünïcödé-mödel", "模型", "🦙-7b", "llama\x00-7b", "llama\n7b", "~", "~nosuchuser/config.json",
              "~/no/such/config.json", "/", ".", "..", "/dev/null", "/dev/zero", "/proc/self/status", "C:\\model",
              "org/name", "no-such-org/no-such-model", "a/b/c", "a" * 97 + "/" + "b" * 97, "config.json",
              "missing/config.json", "http://example.com/config.json", "%s%n", "{}", "null", "'; rm -rf /",
              "\u202egpt2", "gpt2\u200b", "ＧＰＴ２"]
GPUS = ["A100-80GB", "A100", "H100", "T4", "L4", "a100-40gb", "24GiB", "512MiB", "0.5TB", "80", "1", "1e3GiB",
        "0", "0GiB", "-1GiB", "-24GiB", "nan", "inf", "infGiB", "nanGiB", "99999999999999TiB", "1e400GiB", "abc",
        "", " ", "24 GiB", "24gib", "24GB", "24G", "24XB", "１２GiB", "٢٤GiB", "+8GiB", ".5GiB", "1/2GiB",
        "0x10GiB", "H100" * 100, "cpu", "CPU"]
INTS = ["1", "2", "3", "4", "8", "16", "64", "0", "-1", "-8", "1.5", "1e3", "abc", "", " ", " 8 ", "+3", "1_000",
        "٣", "³", "0x10", "99999999999", "1" + "0" * 40, "nan", "inf", "--", "65536", "65537", "1024", "1025",
        "16777216", "16777217"]
SEQS = ["128", "512", "1024", "2048", "4096", "32768", "131072", "1", "0", "-128", "abc", "1e5", "16777216",
        "16777217", "9" * 30]
MARGINS = ["0", "0.05", "0.1", "0.5", "0.99", "0.999999", "1", "1.5", "-0.1", "nan", "inf", "-inf", "1e-300",
           "abc", "", "5%", "0,05"]
SIZES = ["64GiB", "1TiB", "256GiB", "0", "-1GiB", "1e400GiB", "abc", "", "8", "1PB", "nan"]
CHOICES = {
    "--precision": ["fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-master", "fp16", "BF16", "mixed", "int8", ""],
    "--optimizer": ["adamw", "adamw-foreach", "adamw-fused", "adamw-8bit", "sgd", "adafactor", "adam", "8bit",
                    "lion", "AdamW", ""],
    "--checkpointing": ["none", "full", "selective", "true", "NONE", ""],
    "--attention": ["eager", "sdpa", "flash", "flash_attention_2", "xformers", ""],
    "--zero": ["none", "zero1", "zero2", "zero3", "1", "2", "3", "stage3", "zero4", ""],
    "--offload": ["none", "optimizer", "optimizer+params", "params", "cpu", "nvme", ""],
    "--engine": ["deepspeed", "torch", "fsdp", "DeepSpeed", "megatron", ""],
}
NUMERIC = {"--batch": INTS, "-b": INTS, "--seq": SEQS, "-s": SEQS, "--accum": INTS, "--gpus": INTS,
           "--nodes": INTS}
COMMON_OPTIONS = ["--gpu", "--gpus", "--nodes", "--cpu-ram", "--margin", "--batch", "-b", "--seq", "-s", "--accum",
                  *CHOICES]
JUNK_ARGS = ["--bogus", "-z", "--json=yes", "--gpu", "extra-positional", "--", "-h"]


VALID = {
    "--gpu": ["A100-80GB", "A100", "H100", "T4", "L4", "24GiB", "512MiB", "0.5TB", "80"],
    "--margin": ["0", "0.05", "0.1", "0.5"],
    "--cpu-ram": ["64GiB", "1TiB", "256GiB"],
    "--batch": ["1", "2", "4", "8", "16"], "--seq": ["128", "512", "1024", "2048", "4096"],
    "--accum": ["1", "2", "4"], "--gpus": ["1", "2", "4", "8"], "--nodes": ["1", "2", "4"],
    "--precision": ["fp32", "amp-bf16", "amp-fp16", "bf16", "bf16-master"],
    "--optimizer": ["adamw", "adamw-foreach", "adamw-fused", "adamw-8bit", "sgd", "adafactor"],
    "--checkpointing": ["none", "full"], "--attention": ["eager", "sdpa"],
    "--zero": ["none", "zero1", "zero2", "zero3"], "--offload": ["none", "optimizer", "optimizer+params"],
    "--engine": ["deepspeed", "torch"],
}
VALID["-b"], VALID["-s"] = VALID["--batch"], VALID["--seq"]


def _value(rng: random.Random, option: str) -> str:
    if rng.random() < 0.75:  # mostly valid, so that plans, searches and emits run too
        return rng.choice(VALID[option])
    if option == "--gpu":
        return rng.choice(GPUS)
    if option == "--margin":
        return rng.choice(MARGINS)
    if option == "--cpu-ram":
        return rng.choice(SIZES)
    if option in NUMERIC:
        return rng.choice(NUMERIC[option])
    if option in CHOICES:
        return rng.choice(CHOICES[option])
    raise KeyError(option)


def _model(rng: random.Random, paths: dict[str, str]) -> str:
    roll = rng.random()
    if roll < 0.7:
        return rng.choice(CATALOG)
    if roll < 0.85:
        return rng.choice(list(paths.values()))
    return rng.choice(ODD_MODELS)


def _shared_options(rng: random.Random, *, max_options: int = 6) -> list[str]:
    args: list[str] = []
    for option in rng.sample(COMMON_OPTIONS, rng.randint(0, rng.randint(0, max_options))):
        args += [option, _value(rng, option)]
    return args


# -------------------------------------------------------------------------------------------- case generation


@dataclass
class Workspace:
    """Files the cases point at, in a temporary directory that is also the working directory of the run."""

    root: Path
    paths: dict[str, str] = field(default_factory=dict)
    emit_count: int = 0

    @classmethod
    def create(cls, root: Path) -> "Workspace":
        ws = cls(root)
        tiny = root / "tiny"
        tiny.mkdir()
        (tiny / "config.json").write_text(json.dumps(TINY_CONFIG))
        (root / "broken.json").write_text('{"model_type": "llama", "hidden_size": ')
        (root / "list.json").write_text("[1, 2, 3]")
        (root / "latin1.json").write_bytes(b'{"model_type": "\xe9"}')
        (root / "unknown_type.json").write_text(json.dumps({**TINY_CONFIG, "model_type": "no-such-family"}))
        (root / "zero_layers.json").write_text(json.dumps({**TINY_CONFIG, "num_hidden_layers": 0}))
        (root / "negative.json").write_text(json.dumps({**TINY_CONFIG, "hidden_size": -64}))
        (root / "strings.json").write_text(json.dumps({**TINY_CONFIG, "hidden_size": "64"}))
        (root / "empty_dir").mkdir()
        (root / "a_file").write_text("not a directory\n")
        ws.paths = {"tiny_dir": "tiny", "tiny_json": "tiny/config.json", "tiny_abs": str(tiny / "config.json"),
                    "broken": "broken.json", "list": "list.json", "latin1": "latin1.json",
                    "unknown_type": "unknown_type.json", "zero_layers": "zero_layers.json",
                    "negative": "negative.json", "strings": "strings.json", "empty_dir": "empty_dir",
                    "missing": "missing/config.json"}
        return ws

    def emit_dir(self, rng: random.Random) -> str:
        roll = rng.random()
        if roll < 0.1:
            return "a_file"  # a file, not a directory
        if roll < 0.13:
            return "x" * 300  # a name too long for the file system
        if roll < 0.15:
            return rng.choice(["a_file/sub", "emit/\x00", "emit/" + "y" * 300 + "/z"])
        if roll < 0.3:
            return "emit_shared"  # reused: memfit's own files are replaced, foreign ones refused
        self.emit_count += 1
        return f"emit/{self.emit_count}"


def _output_options(rng: random.Random, ws: Workspace, command: str, heavy: bool) -> list[str]:
    args: list[str] = []
    if rng.random() < 0.35:
        args.append("--json")
    if rng.random() < 0.15:
        args.append(rng.choice(["--verbose", "-v"]))
    if command == "plan":
        if rng.random() < 0.15:
            args.append("--optimize")
        if rng.random() < 0.15:
            args += ["--emit", ws.emit_dir(rng)]
            if rng.random() < 0.3:
                args.append("--force")
        if heavy and rng.random() < 0.05:
            args.append("--verify")
    if command in ("plan", "trace") and rng.random() < 0.1:
        bad = ["report.txt", "report", "r.png", "x.HTML.bak"]
        good = ["report.html", "report.htm"] if heavy else []
        args += ["--report", rng.choice(bad + good)]
    if command in ("plan", "trace") and rng.random() < 0.1:
        bad = ["x.txt", "x", "x.html", "x.PNG.gz"]
        good = ["x.png"] if heavy else []
        args += ["--png", rng.choice(bad + good)]
    return args


def _fit_options(rng: random.Random, ws: Workspace) -> list[str]:
    """`memfit fit`: --max (valid and not), the sweep's lists, outputs, and combinations it must refuse."""
    args: list[str] = []
    if rng.random() < 0.6:
        args += ["--max", rng.choice(["batch", "seq", "gpus", "gpu", "tokens", ""])]
        if rng.random() < 0.2:
            args += ["--step", rng.choice(["1", "64", "0", "-8", "x"])]
        if rng.random() < 0.15:
            args.append("--ladder")
    else:
        args.append("--sweep")
        if rng.random() < 0.5:
            args += ["--seqs", rng.choice(["512,1024", "1024", "0,64", "a,b", "", "64," * 40])]
        if rng.random() < 0.5:
            args += ["--batches", rng.choice(["1,2,4", "8", "-1", "1,,2"])]
        if rng.random() < 0.2:
            args += ["--methods", rng.choice(["full-bf16", "lora", "nope", ""])]
        if rng.random() < 0.15:
            args += [rng.choice(["--csv", "--markdown"]), rng.choice(["out.csv", "a_file/x.csv", "x" * 300])]
        if rng.random() < 0.1:
            args += ["--format", rng.choice(["csv", "markdown", "table", "xml"])]
    if rng.random() < 0.3:
        args.append("--json")
    return args


def _refused_before_torch(rng: random.Random, ws: Workspace) -> tuple[str, list[str]]:
    """A model and options that `trace` / `measure` must refuse before importing torch."""
    roll = rng.random()
    if roll < 0.35:
        return rng.choice(ODD_MODELS[:12] + ["llama-3.1-8x", "gpt"]), []
    if roll < 0.6:
        option = rng.choice(["--gpus", "--batch", "--seq", "--margin", "--precision", "--gpu"])
        junk = {"--gpus": "0", "--batch": "-1", "--seq": "abc", "--margin": "1.5", "--precision": "int8",
                "--gpu": "abc"}
        return rng.choice(CATALOG), [option, junk[option]]
    if roll < 0.8:
        return rng.choice(CATALOG), ["--png", "x.txt"]
    return rng.choice(["llama-2-70b", "llama-3.1-70b"]), ["--device", "cpu", "-b", "64", "-s", "4096"]


def make_case(rng: random.Random, ws: Workspace, *, heavy: bool = False) -> list[str]:
    roll = rng.random()
    if roll < 0.4:
        command = "plan"
    elif roll < 0.7:
        command = "estimate"
    elif roll < 0.75:
        command = "models"
    elif roll < 0.8:
        command = "gpus"
    elif roll < 0.85:
        command = "launch"
    elif roll < 0.92:
        command = "fit"
    else:
        command = rng.choice(["trace", "measure"])
    if command in ("models", "gpus"):
        args = [command] + rng.sample(["--json", "--json", "--verbose", "-v", "--bogus"], rng.randint(0, 2))
    elif command == "launch":
        args = ["launch", rng.choice(["train.py", "no_such_script.py", "", "a" * 300])] + _shared_options(rng)
        if rng.random() < 0.9:
            args.append("--dry-run")
        else:
            args[1] = "no_such_script.py"  # the run path may only ever refuse: nothing is started
        if rng.random() < 0.4:
            args += ["--model", _model(rng, ws.paths)]
        if rng.random() < 0.2:
            args += ["--launcher", rng.choice(["torchrun", "deepspeed", "mpirun", ""])]
        if rng.random() < 0.15:
            args += ["--master-port", rng.choice(["29500", "0", "70000", "abc", "-1"])]
        if rng.random() < 0.15:
            args += ["--master-addr", rng.choice(["10.0.0.1", "node0", "", "a b"])]
        if rng.random() < 0.35:
            args.append("--json")
        if rng.random() < 0.15:
            args += ["--", "--steps", "10"]
    elif command == "fit":
        args = ["fit", _model(rng, ws.paths)] + _shared_options(rng, max_options=2) + _fit_options(rng, ws)
    elif command in ("trace", "measure") and not heavy:
        model, extra = _refused_before_torch(rng, ws)
        args = [command, model] + _shared_options(rng, max_options=2) + extra
        if rng.random() < 0.3:
            args.append("--json")
    elif command in ("trace", "measure"):
        args = [command, ws.paths["tiny_json"], "-b", rng.choice(["1", "2"]), "-s", rng.choice(["8", "16"]),
                "--steps", "1"]
        if command == "measure":
            args += ["--device", rng.choice(["cpu", "cpu", "gpu"])]
        args += _output_options(rng, ws, command, heavy)
    else:
        model, shared = _model(rng, ws.paths), _shared_options(rng)
        output = _output_options(rng, ws, command, heavy)
        if "--verify" in output:  # a trace of the final setup: the tiny model only, or one case takes minutes
            model = ws.paths["tiny_json"]
        if rng.random() < 0.3:  # options before the positional argument, too
            args = [command] + shared + [model] + output
        else:
            args = [command, model] + shared + output
    if rng.random() < 0.05:
        args.insert(rng.randint(1, len(args)), rng.choice(JUNK_ARGS))
    return args


# --------------------------------------------------------------------------------------------------- running


@dataclass
class Report:
    cases: int = 0
    seconds: float = 0.0
    exit_codes: collections.Counter = field(default_factory=collections.Counter)
    by_command: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    tracebacks: collections.Counter = field(default_factory=collections.Counter)
    traceback_examples: dict = field(default_factory=dict)
    bad_json: list = field(default_factory=list)
    bad_exit: list = field(default_factory=list)
    bad_error_output: list = field(default_factory=list)
    hangs: list = field(default_factory=list)
    slowest: list = field(default_factory=list)

    @property
    def problems(self) -> int:
        return (sum(self.tracebacks.values()) + len(self.bad_json) + len(self.bad_exit) + len(self.bad_error_output)
                + len(self.hangs))


class Hang(BaseException):
    """Raised by SIGALRM in a case that runs past the per-case timeout (a BaseException: no `except Exception`
    in the command swallows it)."""


def _alarm(signum, frame) -> None:
    raise Hang()


def _where(exc_info) -> str:
    """The innermost memfit frame of a traceback (else the innermost frame): 'memfit/x.py:12 in f'."""
    frames = traceback.extract_tb(exc_info[2])
    ours = [f for f in frames if "memfit" in Path(f.filename).parts]
    frame = (ours or frames)[-1]
    parts = Path(frame.filename).parts
    short = "/".join(parts[parts.index("memfit"):]) if "memfit" in parts else Path(frame.filename).name
    return f"{short}:{frame.lineno} in {frame.name}"


def _show(args: list[str], limit: int = 160) -> str:
    text = "memfit " + " ".join(repr(a) if (not a or any(c.isspace() or not c.isprintable() for c in a)) else a
                                for a in args)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check(args: list[str], result, report: Report) -> None:
    """Record what is wrong with one case's result."""
    command = args[0]
    code = result.exit_code
    report.exit_codes[code] += 1
    report.by_command[command][code] += 1
    if isinstance(result.exception, Hang):
        report.hangs.append(_show(args))
        return
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        key = f"{type(result.exception).__name__} at {_where(result.exc_info)}"
        report.tracebacks[key] += 1
        report.traceback_examples.setdefault(key, (_show(args), str(result.exception)[:200]))
        return
    if code not in ALLOWED_EXIT:
        report.bad_exit.append((_show(args), code))
    wants_help = any(a in ("-h", "--help") for a in args)
    if code == 2 and not wants_help:
        lines = result.stderr.splitlines()
        if len(lines) != 1 or not lines[0].startswith("error: ") or result.stdout.strip():
            report.bad_error_output.append((_show(args), (result.stderr + result.stdout)[:200]))
    if "--json" in args and code in (0, 1) and not wants_help and "--" not in args[:args.index("--json")]:
        try:
            data = json.loads(result.stdout)
            if not isinstance(data, dict):
                raise ValueError(f"a {type(data).__name__}, not an object")
        except ValueError as error:
            report.bad_json.append((_show(args), f"{error}: {result.stdout[:120]!r}"))


def run(cases: int = 3000, seed: int = 0, *, heavy: bool = False, progress: bool = False,
        timeout: float = 60.0) -> Report:
    """Generate and run `cases` seeded cases in a temporary working directory; return what was found. A case still
    running after `timeout` seconds is stopped (SIGALRM, in the main thread) and counted as a hang; one stuck in
    a C call that never checks for signals is not: bench/fuzz_hostile.py runs its cases in a guarded child."""
    import signal

    from typer.testing import CliRunner

    from memfit.cli.app import app

    runner = CliRunner(env=ENV)
    rng = random.Random(seed)
    report = Report()
    started = time.perf_counter()
    alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _alarm) if alarm else None
    with tempfile.TemporaryDirectory(prefix="memfit-fuzz-") as tmp:
        ws = Workspace.create(Path(tmp))
        here = os.getcwd()
        os.chdir(tmp)
        try:
            for index in range(cases):
                args = make_case(rng, ws, heavy=heavy)
                columns = rng.choice(WIDTHS)
                begin = time.perf_counter()
                if alarm:
                    signal.setitimer(signal.ITIMER_REAL, timeout)
                try:
                    result = runner.invoke(app, args, prog_name="memfit", env={"COLUMNS": columns})
                finally:
                    if alarm:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                elapsed = time.perf_counter() - begin
                check(args, result, report)
                report.slowest = sorted(report.slowest + [(elapsed, _show(args))], reverse=True)[:5]
                report.cases += 1
                if progress and (index + 1) % 500 == 0:
                    print(f"  {index + 1} cases, {report.problems} problems", file=sys.stderr)
        finally:
            os.chdir(here)
            if alarm:
                signal.signal(signal.SIGALRM, previous)
    report.seconds = time.perf_counter() - started
    return report


def format_report(report: Report, *, seed: int, heavy: bool) -> str:
    mode = ("heavy: real trace/measure runs on a tiny config" if heavy else
            "trace/measure only on inputs refused before torch; no --verify, no valid --report/--png")
    lines = [f"memfit CLI fuzz: {report.cases} cases, seed {seed}, {report.seconds:.1f} s ({mode})",
             "exit codes: " + ", ".join(f"{code}: {n}" for code, n in sorted(report.exit_codes.items())),
             "by command: " + "; ".join(f"{name} " + "/".join(f"{c}:{n}" for c, n in sorted(codes.items()))
                                        for name, codes in sorted(report.by_command.items()))]
    lines.append(f"hangs (over the per-case timeout): {len(report.hangs)}")
    lines += [f"         {example}" for example in report.hangs[:5]]
    lines.append(f"tracebacks: {sum(report.tracebacks.values())}")
    for key, count in report.tracebacks.most_common():
        example, message = report.traceback_examples[key]
        lines += [f"  {count:5d}  {key}", f"         {message}", f"         e.g. {example}"]
    for title, items in (("malformed JSON (--json)", report.bad_json),
                         ("exit codes outside {0,1,2}", report.bad_exit),
                         ("exit 2 without exactly one 'error:' line on stderr (or with stdout)",
                          report.bad_error_output)):
        lines.append(f"{title}: {len(items)}")
        lines += [f"         {example}  ->  {detail}" for example, detail in items[:5]]
    lines.append("slowest: " + "; ".join(f"{seconds:.2f} s {example}" for seconds, example in report.slowest[:3]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heavy", action="store_true", help="also run real trace/measure steps on a tiny config")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds after which a case is a hang")
    parser.add_argument("--hostile", action="store_true", help="then the hostile files (bench/fuzz_hostile.py)")
    options = parser.parse_args(argv)
    report = run(options.cases, options.seed, heavy=options.heavy, progress=True, timeout=options.timeout)
    print(format_report(report, seed=options.seed, heavy=options.heavy))
    problems = report.problems
    if options.hostile:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import fuzz_hostile

        with tempfile.TemporaryDirectory(prefix="memfit-hostile-") as tmp:
            hostile = fuzz_hostile.run(Path(tmp))
            count, wrong = fuzz_hostile.run_wrong_types(ROOT / "tests" / "data" / "configs", Path(tmp))
        print(fuzz_hostile.format_report(hostile))
        print(f"wrong-typed values in the test configs: {count} cases, {len(wrong)} not refused in one line")
        problems += hostile.problems + len(wrong)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
