"""OOM-safe fit (memfit.fit): out-of-memory errors injected in forward, backward, the optimizer step and the second
micro-step of an accumulation, and a simulated device budget, leave exactly the weights and optimizer state of a run
that never ran out of memory; every sample of a global batch is counted once per optimizer step; a budget nothing
fits under ends in one clear error.

The references are plain hand-written loops (no memfit code): split the global batch, weight each micro-loss by its
share of the samples, backward, optimizer.step(), zero_grad.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memfit import MemfitError, TrainingSetup
from tiny_configs import TINY_LLAMA

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from memfit._torch.budget import DeviceBudget, Injection, OOMInjector  # noqa: E402
from memfit._torch.step import build_hf_model, make_optimizer  # noqa: E402
from memfit.api import as_spec  # noqa: E402
from memfit.fit import FitLoop, FitOutOfMemoryError, fit_steps, is_out_of_memory  # noqa: E402
from memfit.hardware import cpu_device, make_hardware  # noqa: E402
from memfit.plan import plan  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(torch_cpu):
    """One intra-op thread: reproducible sums and fast tiny steps."""


GLOBAL_BATCH = 8
NUM_STEPS = 3
A = TrainingSetup(micro_batch_size=4, grad_accum_steps=2, seq_len=16, precision="fp32", optimizer="adamw")
LADDER = [A, A.replace(checkpointing="full"), A.replace(checkpointing="full", micro_batch_size=2, grad_accum_steps=4)]


class MLP(nn.Module):
    """Residual MLP blocks in an nn.ModuleList (so apply_ can checkpoint them), with dropout (so a replay must
    restore the RNG to repeat the masks)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(2 * width, width)) for _ in range(3))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.inp(x.to(self.inp.weight.dtype))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def mlp_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]).float(), batch["y"])


def llama_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def mlp_batches(num_steps: int = NUM_STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(GLOBAL_BATCH, 16, generator=g), "y": torch.randint(0, 4, (GLOBAL_BATCH,), generator=g),
             "sample_id": torch.arange(GLOBAL_BATCH) + GLOBAL_BATCH * i} for i in range(num_steps)]


def llama_batches(num_steps: int = NUM_STEPS, seq_len: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(num_steps):
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (GLOBAL_BATCH, seq_len), generator=g)
        ids_of_samples = torch.arange(GLOBAL_BATCH) + GLOBAL_BATCH * i
        out.append({"input_ids": ids, "labels": ids.clone(), "sample_id": ids_of_samples})
    return out


MODELS = {
    # name: (build model, loss, batches, optimizer over params)
    "mlp": (lambda: MLP(), mlp_loss, mlp_batches, lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
    "llama": (lambda: build_hf_model(TINY_LLAMA, A), llama_loss, llama_batches,
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
}


def fit_run(kind: str, injections=(), setups=LADDER, events=None):
    build, loss_fn, batches, make_opt = MODELS[kind]
    torch.manual_seed(0)
    model = build()
    optimizer = make_opt(model.parameters())
    injector = OOMInjector(*injections)
    torch.manual_seed(1234)
    with injector:
        loop = FitLoop(model, optimizer, setups, loss_fn=loss_fn, phase_callback=injector.on_phase,
                       on_change=(events.append if events is not None else None))
        for batch in batches():
            loop.step(batch)
    assert len(injector.fired) == len(injections), "every injected error was raised"
    return model, optimizer, loop.report()


def reference_run(kind: str, schedule: list[int]):
    """A plain loop: per optimizer step i, micro-batches of schedule[i] samples, loss weighted by size / global."""
    build, loss_fn, batches, make_opt = MODELS[kind]
    torch.manual_seed(0)
    model = build()
    optimizer = make_opt(model.parameters())
    torch.manual_seed(1234)
    for batch, micro in zip(batches(), schedule):
        for start in range(0, GLOBAL_BATCH, micro):
            part = {k: v[start:start + micro] for k, v in batch.items()}
            (loss_fn(model, part) * (len(part["sample_id"]) / GLOBAL_BATCH)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def assert_same_training_state(model_a, opt_a, model_b, opt_b, *, exact: bool = True) -> None:
    """Bit for bit, or (exact=False, for runs whose micro-batch splits differ) within lr / 100: the gradients then
    differ by float32 summation order (test_the_gradient_does_not_depend_on_the_split bounds that at 1e-5 relative),
    and Adam's update, about lr x sign(g) where g is tiny, can turn such a difference into up to ~lr per step."""
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-4))
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert same(a, b), f"parameter {name} differs by {(a - b).abs().max().item():.3g}"
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys() and state_a
    for index in state_a:
        for key, value in state_a[index].items():
            other = state_b[index][key]
            assert same(value, other) if isinstance(value, torch.Tensor) else value == other, (index, key)


# ------------------------------------------------------------------------------------- injected out-of-memory errors

CASES = {
    # injections, micro-batch size per optimizer step of the run that survives them, final setup
    "forward": ([Injection("forward", step=1, micro_step=0, nth_op=5)], [4, 4, 4], LADDER[1]),
    "backward": ([Injection("backward", step=1, micro_step=0, nth_op=5)], [4, 4, 4], LADDER[1]),
    # the second micro-step, after the first one's gradients were accumulated; its replay runs out again and the
    # loop goes one rung further, to micro-batches of 2
    "second-micro-step": ([Injection("backward", step=1, micro_step=1, nth_op=3),
                           Injection("forward", step=1, micro_step=1, nth_op=2)], [4, 2, 2], LADDER[2]),
    # in AdamW's update of the third parameter, after it wrote the parameter and both moments in place
    "optimizer-step": ([Injection("optimizer", step=1, micro_step=None, nth_op=3, op="sqrt")], [4, 4, 4], A),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("case", list(CASES))
def test_injected_oom_leaves_the_weights_and_optimizer_state_of_a_run_without_it(kind, case):
    injections, schedule, final = CASES[case]
    events = []
    model, optimizer, report = fit_run(kind, injections, events=events)
    assert report.setup == final
    assert [r.micro_batch_sizes for r in report.steps] == [(m,) * (GLOBAL_BATCH // m) for m in schedule]
    assert [r.num_samples for r in report.steps] == [GLOBAL_BATCH] * NUM_STEPS
    assert len(events) == len(injections) and all(e.step == 1 for e in events)
    assert list(report.events) == events
    # Exact: the same micro-batch split per step, so the same sums in the same order.
    assert_same_training_state(model, optimizer, *reference_run(kind, schedule))
    if schedule != [4] * NUM_STEPS and kind == "llama":
        # Against the split the run started with: equal up to the order of the micro-batch sums. (Not for the MLP:
        # its dropout masks are drawn per micro-batch, so another split is another, equally valid, draw of masks.)
        assert_same_training_state(model, optimizer, *reference_run(kind, [4] * NUM_STEPS), exact=False)


def test_the_gradient_does_not_depend_on_the_split():
    """Each micro-loss weighted by its share of the samples: the accumulated gradient is the global batch's, also for
    an uneven split (3 + 3 + 2)."""
    batch = llama_batches(1)[0]
    grads = {}
    for micro in (8, 4, 3, 2, 1):
        torch.manual_seed(0)
        model = build_hf_model(TINY_LLAMA, A)
        params = list(model.parameters())

        def capture(phase, step, micro_step):
            if phase == "optimizer":
                grads[micro] = [p.grad.clone() for p in params]

        loop = FitLoop(model, torch.optim.SGD(params, lr=0.0), A.replace(micro_batch_size=micro, grad_accum_steps=1),
                       loss_fn=llama_loss, phase_callback=capture, on_change=None)
        record = loop.step(batch)
        assert sum(record.micro_batch_sizes) == GLOBAL_BATCH and len(record.micro_batch_sizes) == -(-8 // micro)
    for micro in (4, 3, 2, 1):
        for a, b in zip(grads[micro], grads[8]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_events_say_where_what_and_why():
    events = []
    fit_run("mlp", CASES["second-micro-step"][0], events=events)
    first, second = events
    assert (first.step, first.phase, first.micro_step) == (1, "forward", 1)
    assert (second.step, second.phase, second.micro_step) == (1, "backward", 1)
    assert first.old_setup == LADDER[0] and first.new_setup == LADDER[1] and second.new_setup == LADDER[2]
    assert first.action == "checkpointing none -> full"
    assert second.action == "micro-batch 4 -> 2 (accumulation 2 -> 4)"
    assert "OutOfMemoryError" in first.error and "replayed the global batch" in first.reason
    assert str(first).startswith("step 1, forward (micro-step 1): out of memory -> checkpointing none -> full "
                                 "[setup 1; replayed the global batch]")


@pytest.mark.parametrize("step_undo", ["device", "host"])
def test_an_oom_inside_optimizer_step_never_leaves_a_half_updated_parameter(step_undo):
    """When the error is reported (after memory is freed, before the step resumes), the parameters before the failed
    one have taken the step and released their gradients; the failed one and all after it are exactly as before the
    step, optimizer state included, and still hold their gradients."""
    build, loss_fn, batches, make_opt = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    optimizer = make_opt(model.parameters())
    params = list(model.parameters())
    before = {}

    def on_phase(phase, step, micro_step):
        injector.on_phase(phase, step, micro_step)
        if phase == "optimizer" and step == 1 and not before:
            before["params"] = [p.detach().clone() for p in params]
            before["state"] = copy.deepcopy(optimizer.state_dict()["state"])

    seen = {}

    def on_change(event):
        seen["params"] = [p.detach().clone() for p in params]
        seen["grads"] = [p.grad is not None for p in params]
        seen["state"] = copy.deepcopy(optimizer.state_dict()["state"])
        seen["event"] = event

    injector = OOMInjector(Injection("optimizer", step=1, micro_step=None, nth_op=3, op="sqrt"))
    torch.manual_seed(1234)  # as in reference_run: the same dropout masks
    with injector:
        loop = FitLoop(model, optimizer, A, loss_fn=loss_fn, phase_callback=on_phase, on_change=on_change,
                       step_undo=step_undo)
        for batch in batches():
            loop.step(batch)
    assert_same_training_state(model, optimizer, *reference_run("mlp", [4] * NUM_STEPS))
    assert seen["event"].action == f"resumed optimizer.step() at parameter 3 of {len(params)}"
    assert seen["grads"] == [False, False] + [True] * (len(params) - 2)
    for i in range(len(params)):
        assert torch.equal(seen["params"][i], before["params"][i]) == (i >= 2), i
        for key, value in before["state"][i].items():
            assert torch.equal(seen["state"][i][key], value) == (i >= 2), (i, key)


def test_amp_fp16_trains_through_the_one_loop_with_its_grad_scaler():
    """amp-fp16 (FitLoop refused it before: it had no GradScaler) runs memfit's one loop, which scales each
    micro-loss, unscales before the transactional step and lets the scaler take or skip it. With out-of-memory
    errors injected in a backward and inside AdamW's update, the weights, the AdamW state and the loss scale equal a
    hand-written autocast(float16) + torch.amp.GradScaler loop's, bit for bit."""
    fp16 = [setup.replace(precision="amp-fp16") for setup in LADDER]
    build, loss_fn, batches, make_opt = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    optimizer = make_opt(model.parameters())
    injector = OOMInjector(Injection("backward", step=1, micro_step=0, nth_op=5),
                           Injection("optimizer", step=2, micro_step=None, nth_op=3, op="sqrt"))
    scaled = {}

    def on_phase(phase, step, micro_step):
        injector.on_phase(phase, step, micro_step)
        if phase == "optimizer" and step == 0:  # before unscaling: the gradients of the scaled loss
            scaled["loop"] = [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(1234)
    with injector:
        loop = FitLoop(model, optimizer, fp16, loss_fn=loss_fn, phase_callback=on_phase, on_change=None)
        for batch in batches():
            loop.step(batch)
    assert len(injector.fired) == 2 and loop.setup == fp16[1]

    torch.manual_seed(0)
    reference = build()
    reference_optimizer = make_opt(reference.parameters())
    scaler = torch.amp.GradScaler("cpu")
    torch.manual_seed(1234)
    for batch in batches():
        for start in range(0, GLOBAL_BATCH, 4):
            part = {k: v[start:start + 4] for k, v in batch.items()}
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(reference, part)
            scaler.scale(loss * (4 / GLOBAL_BATCH)).backward()
        scaled.setdefault("reference", [p.grad.clone() for p in reference.parameters()])
        scaler.step(reference_optimizer)
        scaler.update()
        reference_optimizer.zero_grad(set_to_none=True)
    assert_same_training_state(model, optimizer, reference, reference_optimizer)
    assert optimizer._memfit_grad_scaler.get_scale() == scaler.get_scale() == 2.0**16
    # The loss really was scaled by 2^16 before backward (unscaled gradients would be 65536x smaller).
    assert all(torch.equal(a, b) for a, b in zip(scaled["loop"], scaled["reference"]))
    assert max(g.abs().max().item() for g in scaled["loop"]) > 100


def test_without_an_undo_record_an_oom_inside_optimizer_step_stops_the_loop():
    injector = OOMInjector(Injection("optimizer", step=0, micro_step=None, nth_op=3, op="sqrt"))
    with injector:
        loop = FitLoop(MLP(), None, A, loss_fn=mlp_loss, phase_callback=injector.on_phase, on_change=None,
                       step_undo="none")
        with pytest.raises(FitOutOfMemoryError, match="with step_undo='none': the model may be half-updated"):
            loop.step(mlp_batches(1)[0])
        with pytest.raises(FitOutOfMemoryError):  # and it stays stopped
            loop.step(mlp_batches(1)[0])


def test_bf16_master_weights_optimizer_is_stepped_transactionally_too():
    setup = A.replace(precision="bf16-master")
    injector = OOMInjector(Injection("optimizer", step=1, micro_step=None, nth_op=3, op="sqrt"))
    torch.manual_seed(0)
    model = MLP()
    torch.manual_seed(1234)
    with injector:
        loop = FitLoop(model, None, setup, loss_fn=mlp_loss, phase_callback=injector.on_phase, on_change=None, lr=1e-2)
        for batch in mlp_batches():
            loop.step(batch)
    assert injector.fired and loop.report().events[0].phase == "optimizer"
    torch.manual_seed(0)
    reference = MLP().to(torch.bfloat16)
    ref_opt = make_optimizer(reference, setup, lr=1e-2)
    torch.manual_seed(1234)
    for batch in mlp_batches():
        for start in (0, 4):
            part = {k: v[start:start + 4] for k, v in batch.items()}
            (mlp_loss(reference, part) * 0.5).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert_same_training_state(model, loop.optimizer, reference, ref_opt)
    for a, b in zip(loop.optimizer.master_params, ref_opt.master_params):
        assert torch.equal(a, b)


def test_plan_steps_that_would_touch_the_optimizer_are_skipped_and_said_so():
    setups = [A, A.replace(optimizer="adamw-8bit"), A.replace(optimizer="adamw-8bit", precision="bf16"),
              A.replace(optimizer="adamw-8bit", precision="bf16", checkpointing="full")]
    events = []
    model, optimizer, report = fit_run("mlp", [Injection("forward", step=0, micro_step=0)], setups, events)
    (event,) = events
    assert event.new_setup == LADDER[1]  # only the live part: checkpointing; optimizer and precision unchanged
    assert event.skipped == (
        "setup 1 (not made: optimizer adamw -> adamw-8bit (a new optimizer would start with empty state))",
        "setup 2 (not made: precision fp32 -> bf16 (casting parameters under existing optimizer state breaks it))")
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW) and report.setup.optimizer == A.optimizer


def test_non_memory_errors_pass_through_untouched():
    def broken_loss(model, batch):
        raise ValueError("a bug in the loss")

    with pytest.raises(ValueError, match="a bug in the loss"):
        FitLoop(MLP(), None, A, loss_fn=broken_loss, on_change=None).step(mlp_batches(1)[0])
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"))
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


# ------------------------------------------------------------------------------------------ the simulated budget


def _peak_of_one_step(setup: TrainingSetup) -> int:
    torch.manual_seed(0)
    model = build_hf_model(TINY_LLAMA, setup)
    batch = llama_batches(1, seq_len=64)[0]
    with DeviceBudget(None) as budget:
        budget.track(model, batch)
        loop = FitLoop(model, None, setup, loss_fn=llama_loss, on_change=None)
        loop.step(batch)
        loop.step(batch)  # the second step has the optimizer state from the start
    return budget.peak_bytes


def test_under_a_device_budget_the_loop_moves_down_the_plan_and_trains_every_sample_once():
    setup = TrainingSetup(micro_batch_size=8, seq_len=64, precision="fp32", optimizer="adamw")
    full_peak = _peak_of_one_step(setup)
    limit = int(0.4 * full_peak)
    the_plan = plan(as_spec(dict(TINY_LLAMA)), setup, make_hardware(cpu_device(limit)))
    assert the_plan.steps, "the analytic plan itself says the unmodified step does not fit"

    torch.manual_seed(0)
    model = build_hf_model(TINY_LLAMA, setup)
    data = llama_batches(2, seq_len=64)
    consumed: list[int] = []
    per_step: list[list[int]] = []
    events = []

    def loss_fn(model, batch):
        consumed.extend(batch["sample_id"].tolist())
        return llama_loss(model, batch)

    live_at_start: dict[int, int] = {}

    def on_phase(phase, step, micro_step):
        live_at_start.setdefault(step, budget.live_bytes)

    def on_change(event):
        events.append(event)
        if event.phase != "optimizer":
            consumed.clear()  # the failed attempt's micro-batches: replayed, not counted
            # Everything the failed attempt allocated (activations, graph, partial gradients) is gone.
            assert budget.live_bytes == live_at_start[event.step]

    with DeviceBudget(limit) as budget:
        budget.track(model, data)
        loop = FitLoop(model, None, the_plan, loss_fn=loss_fn, on_change=on_change, phase_callback=on_phase)
        for i in range(8):
            record = loop.step(data[i % 2])
            per_step.append(sorted(consumed))
            consumed.clear()
            assert record.num_samples == GLOBAL_BATCH == sum(record.micro_batch_sizes)
    report = loop.report()
    assert events and budget.num_ooms >= len(events) and budget.peak_bytes <= limit
    assert report.setup.micro_batch_size < setup.micro_batch_size or report.setup.checkpointing != setup.checkpointing
    assert report.setup.precision == setup.precision and report.setup.optimizer == setup.optimizer
    titles = {step.title for step in the_plan.steps}
    assert all(event.reason.removesuffix("; replayed the global batch") in titles for event in events)
    for i, ids in enumerate(per_step):  # every sample of the global batch once, none dropped, none twice
        assert ids == sorted(data[i % 2]["sample_id"].tolist()), i
    assert report.losses[6] < report.losses[0] - 0.1  # the same global batch, six steps later


def test_when_every_setup_runs_out_it_raises_one_clear_line_and_keeps_the_last_step():
    torch.manual_seed(0)
    model = MLP(width=64)
    data = mlp_batches(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    loop = FitLoop(model, optimizer, LADDER, loss_fn=mlp_loss, on_change=None)
    loop.step(data[0])  # optimizer state exists
    after_first = [p.detach().clone() for p in model.parameters()]
    with DeviceBudget(None) as meter:
        meter.track(model, optimizer, data)
        static = meter.live_bytes
    events = []
    loop.on_change = events.append
    with DeviceBudget(static + 4096) as budget:  # room for the weights and state, not for a step
        budget.track(model, optimizer, data)
        with pytest.raises(FitOutOfMemoryError) as raised:
            loop.step(data[1])
    message = str(raised.value)
    assert isinstance(raised.value, MemfitError) and "\n" not in message
    assert re.match(r"out of memory in (forward|backward) of step 1 \(micro-step 0\) with every setup tried: as given "
                    r"\(micro-batch 4 x 2, checkpointing none\) -> setup 1 -> setup 2 -> halved micro-batch "
                    r"\(beyond the plan\) \(OutOfMemoryError: simulated device out of memory", message), message
    assert [e.new_setup.micro_batch_size for e in events] == [4, 2, 1]  # the ladder ran out instead of looping
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(after_first, model.parameters()))


def test_fit_steps_runs_a_whole_list_and_returns_the_report():
    torch.manual_seed(0)
    report = fit_steps(MLP(), None, mlp_batches(), A, loss_fn=mlp_loss, on_change=None, lr=1e-2)
    assert len(report.steps) == NUM_STEPS and not report.events
    assert report.summary().startswith(f"{NUM_STEPS} optimizer steps, 0 out-of-memory errors handled")


@pytest.mark.processes
def test_the_example_trains_through_its_out_of_memory_errors():
    """A fresh process, as a user runs it (about 1 s of work after importing torch and transformers; no wall-clock
    assertion, as elsewhere in the suite: the import alone varies with the runner's load)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    script = Path(__file__).resolve().parents[2] / "examples" / "oom_safe_loop.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    line = re.search(r"^memfit example: 6 steps of 8 sequences under 4.00 MiB, (\d+) out-of-memory errors handled, "
                     r"now micro-batch (\d+) x (\d+) checkpointing full, loss on the first batch ([\d.]+) -> ([\d.]+)$",
                     done.stdout, re.M)
    assert line, done.stdout
    num_errors, micro, accum, first, later = line.groups()
    assert int(num_errors) >= 1 and int(micro) * int(accum) == 8 and float(later) < float(first)
