"""Real RL steps of TRL's trainers on CPU, measured per phase with the profiler's memory events (the same replay as
memfit._torch.measure_cpu: every allocation and free on top of the storages live before profiling). Needs torch,
transformers and trl; imported only by bench/rl.py and the tests.

A phase is a window between two marks: generation = `model.generate` (HF generate, TRL's use_vllm=False path),
reference = TRL's `_get_per_token_logps_and_entropies` under no_grad (the reference / old-policy log-probs), training
= `compute_loss` through `optimizer.step()`. Each phase's figure is the peak of live bytes inside its window, so
everything alive then counts (weights, optimizer state, buffered rollouts), as on a GPU."""

from __future__ import annotations

import contextlib
import functools

import torch

from .._torch.measure_cpu import MARK_PREFIX, _events, storage_baseline
from .._torch.replay import Mark, replay
from .._torch.threads import step_threads

WORDS = 400
"""The toy tokenizer's words: w0 .. w399 (ids 3..402 after pad/eos/unk), within the tiny vocab of 512."""


def toy_tokenizer():
    """A word-level fast tokenizer built in memory (no download): one token per word, left padding as TRL wants."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="left")


class PhaseMarks:
    """Marks in the profiler's event stream: a wrapped call opens its phase and, when it returns, reopens the phase
    it was called in ('other' outside any)."""

    def __init__(self) -> None:
        self.marks: dict[str, Mark] = {}
        self.stack: list[str] = []

    def mark(self, phase: str) -> None:
        name = f"{MARK_PREFIX}{len(self.marks)}"
        self.marks[name] = Mark(phase=phase)
        with torch.profiler.record_function(name):
            pass

    def wrap(self, function, phase: str, *, when=lambda *a, **k: True):
        @functools.wraps(function)
        def wrapped(*args, **kwargs):
            if not when(*args, **kwargs):
                return function(*args, **kwargs)
            self.stack.append(phase)
            self.mark(phase)
            try:
                return function(*args, **kwargs)
            finally:
                self.stack.pop()
                self.mark(self.stack[-1] if self.stack else "other")
        return wrapped


def phase_peaks(run_step, model, optimizer, extra_tensors, marks: PhaseMarks, *,
                detail: dict | None = None) -> dict[str, int]:
    """Profile one call of `run_step()` and return each phase's peak live bytes (the largest over its windows);
    `detail`, when given, receives each phase's live allocations at its peak (sizes, largest first)."""
    baseline = storage_baseline(model, optimizer, extra_tensors)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=False, with_stack=False) as prof:
        marks.mark("other")
        run_step()
        marks.mark("other")
    events, _ = _events(prof, marks.marks)
    result = replay(baseline, events)
    peaks: dict[str, int] = {}
    for segment in result.segments:
        peak = result.bytes_at(result.segment_peak(segment))
        if peak > peaks.get(segment.phase, -1):
            peaks[segment.phase] = peak
            if detail is not None:
                point = result.segment_peak(segment)
                detail[segment.phase] = sorted((r.size_bytes for r in result.records if r.start <= point < r.end),
                                               reverse=True)
    peaks.pop("other", None)
    return peaks


TRAINER_ARGS = dict(use_cpu=True, bf16=False, gradient_accumulation_steps=1, learning_rate=1e-4, max_steps=3,
                    logging_steps=100, save_strategy="no", report_to=[], disable_dropout=True, seed=0,
                    model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"})
"""What every measured TRL trainer runs with: CPU, fp32, sdpa, three steps (the second is measured), no saving."""


def _peft_config(lora: bool):
    """peft's LoRA on q_proj / v_proj (r 8) when `lora`, as TRL takes it; else None (a full policy)."""
    if not lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _prompts(count: int, length: int):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % WORDS}" for j in range(length))
                                         for i in range(count)]})


def _tiny_model(config: dict, directory: str) -> str:
    """The tiny model saved to `directory` (TRL builds the reference model from the policy's path)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoConfig.for_model(**config)
    AutoModelForCausalLM.from_config(hf, dtype=torch.float32).save_pretrained(directory)
    return directory


def _length_reward(completions, **_):
    return [float(len(c)) for c in completions]


def measure_grpo(config: dict, *, batch: int, num_generations: int, prompt_len: int, completion_len: int,
                 beta: float = 0.04, lora: bool = False, checkpointing: bool = False, output_dir: str,
                 detail: dict | None = None, trainer: str = "grpo") -> dict[str, int]:
    """One GRPO step (the second: the first creates Adam's state) of TRL's GRPOTrainer with HF generate, on CPU in
    fp32; every completion exactly `completion_len` tokens (min_new_tokens). trainer='rloo': TRL's RLOOTrainer
    (trl/trainer/rloo_trainer.py), the same rollout with a leave-one-out baseline and per-sequence loss."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config_class, trainer_class = (RLOOConfig, RLOOTrainer) if trainer == "rloo" else (GRPOConfig, GRPOTrainer)
    args = config_class(output_dir=output_dir, gradient_checkpointing=checkpointing,
                        per_device_train_batch_size=batch, num_generations=num_generations,
                        max_completion_length=completion_len, beta=beta,
                        generation_kwargs={"min_new_tokens": completion_len}, **TRAINER_ARGS)
    run = trainer_class(model=_tiny_model(config, f"{output_dir}/model"), reward_funcs=_length_reward, args=args,
                        train_dataset=_prompts(64, prompt_len), processing_class=toy_tokenizer(),
                        peft_config=_peft_config(lora))
    return _measure_trainer(run, reference_method="_get_per_token_logps_and_entropies", detail=detail)


def _measure_trainer(trainer, *, reference_method: str | None, detail: dict | None = None,
                     marks: PhaseMarks | None = None) -> dict[str, int]:
    """Wrap the trainer's phases with marks, run one warm-up step, then profile the next."""
    marks = marks or PhaseMarks()
    model = trainer.model
    model.generate = marks.wrap(model.generate, "generation")
    no_grad = lambda *a, **k: not torch.is_grad_enabled()  # noqa: E731  the log-probs outside training
    if reference_method is not None:
        setattr(trainer, reference_method, marks.wrap(getattr(trainer, reference_method), "reference",
                                                      when=no_grad))
    trainer.compute_loss = marks.wrap(trainer.compute_loss, "training")
    trainer.accelerator.backward = marks.wrap(trainer.accelerator.backward, "training")
    state = {"optimizer": None}

    class Profiled(Exception):
        pass

    from transformers import TrainerCallback

    class Once(TrainerCallback):
        def on_step_begin(self, args, train_state, control, **kwargs):
            if train_state.global_step == 1:
                state["optimizer"] = trainer.optimizer
                raise Profiled

        def on_pre_optimizer_step(self, args, train_state, control, **kwargs):
            marks.mark("training")

    trainer.add_callback(Once())
    with step_threads(), contextlib.suppress(Profiled):
        trainer.train()  # step 0 runs; step 1 begins and is stopped before its work
    extra = [list(trainer.ref_model.parameters()) + list(trainer.ref_model.buffers())] if getattr(
        trainer, "ref_model", None) is not None else []
    iterator = iter(trainer.get_train_dataloader())
    batch = next(iterator)

    def step() -> None:
        trainer.training_step(model, batch, None)
        marks.mark("training")
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    with step_threads():
        # accelerate wraps the torch optimizer; its state is what the baseline names
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        return phase_peaks(step, model, optimizer, extra, marks, detail=detail)


def _pairs(count: int, prompt_len: int, completion_len: int):
    from datasets import Dataset

    def words(seed: int, length: int) -> str:
        return " ".join(f"w{(seed * 13 + j) % WORDS}" for j in range(length))

    return Dataset.from_dict({"prompt": [words(i, prompt_len) for i in range(count)],
                              "chosen": [words(i + 1, completion_len) for i in range(count)],
                              "rejected": [words(i + 2, completion_len) for i in range(count)]})


def measure_dpo(config: dict, *, batch: int, prompt_len: int, completion_len: int, lora: bool = False,
                precompute: bool | str = False, output_dir: str, detail: dict | None = None) -> dict[str, int]:
    """One DPO step (the second) of TRL's DPOTrainer on CPU in fp32, no gradient checkpointing; every prompt and
    completion exactly the given number of tokens. The online reference forward (inside compute_loss) is the
    'reference' phase. precompute='phase': the precompute itself (one batch of `_precompute_ref_logps`, which runs
    in the trainer's constructor: measured here on a trainer built to keep its reference)."""
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=output_dir, gradient_checkpointing=False, per_device_train_batch_size=batch,
                     max_length=4 * (prompt_len + completion_len), precompute_ref_log_probs=precompute is True,
                     **TRAINER_ARGS)
    trainer = DPOTrainer(model=_tiny_model(config, f"{output_dir}/model"), args=args,
                         train_dataset=_pairs(64, prompt_len, completion_len), processing_class=toy_tokenizer(),
                         peft_config=_peft_config(lora))
    if precompute == "phase":
        return _measure_precompute(trainer)
    marks = PhaseMarks()
    no_grad = lambda *a, **k: not torch.is_grad_enabled()  # noqa: E731
    reference = trainer.ref_model if trainer.ref_model is not None else trainer.model
    reference.forward = marks.wrap(reference.forward, "reference", when=no_grad)
    return _measure_trainer(trainer, reference_method=None, detail=detail, marks=marks)


def _unpaired(count: int, prompt_len: int, completion_len: int):
    from datasets import Dataset

    def words(seed: int, length: int) -> str:
        return " ".join(f"w{(seed * 13 + j) % WORDS}" for j in range(length))

    return Dataset.from_dict({"prompt": [words(i, prompt_len) for i in range(count)],
                              "completion": [" " + words(i + 1, completion_len) for i in range(count)],
                              "label": [i % 2 == 0 for i in range(count)]})


def measure_kto(config: dict, *, batch: int, prompt_len: int, completion_len: int, lora: bool = False,
                output_dir: str, detail: dict | None = None) -> dict[str, int]:
    """One KTO step (the second) of TRL's KTOTrainer (trl/trainer/kto_trainer.py) on CPU in fp32: unpaired
    (prompt, completion, label) rows, the KL term's mismatched completions on (calculate_kl, loss_type 'kto').
    The reference's forwards (KL rows and completions, inside compute_loss after the policy's forward) are the
    'reference' phase; the policy's own no-grad KL forward runs before its grad forward and is a 'kl' phase."""
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=output_dir, gradient_checkpointing=False, per_device_train_batch_size=batch,
                     max_length=4 * (prompt_len + completion_len), **TRAINER_ARGS)
    trainer = KTOTrainer(model=_tiny_model(config, f"{output_dir}/model"), args=args,
                         train_dataset=_unpaired(64, prompt_len, completion_len), processing_class=toy_tokenizer(),
                         peft_config=_peft_config(lora))
    marks = PhaseMarks()
    original, calls = trainer._compute_kl_logps, {"n": 0}

    def kl_logps(model, batch):
        # compute_loss calls it twice: the policy's KL rows first (no grad, before the policy's grad forward), then
        # the reference's, which opens the reference phase until backward (the reference's completions forward
        # follows it)
        calls["n"] += 1
        if calls["n"] % 2:
            return marks.wrap(original, "kl")(model, batch)
        marks.mark("reference")
        return original(model, batch)

    trainer._compute_kl_logps = kl_logps
    return _measure_trainer(trainer, reference_method=None, detail=detail, marks=marks)


def _measure_precompute(trainer) -> dict[str, int]:
    """`compute_ref_log_probs` on one padded batch, as `_precompute_ref_logps` runs it: the policy and the reference
    (none for LoRA: the adapters are disabled) alive, no optimizer state yet."""
    marks = PhaseMarks()
    batch = next(iter(trainer.get_train_dataloader()))
    reference = trainer.ref_model if trainer.ref_model is not None else trainer.model
    extra = [list(trainer.ref_model.parameters()) + list(trainer.ref_model.buffers())] if \
        trainer.ref_model is not None else []

    def step() -> None:
        marks.mark("precompute")
        trainer.compute_ref_log_probs(reference, batch)
        marks.mark("other")

    with step_threads():
        return phase_peaks(step, trainer.model, torch.optim.SGD([torch.zeros(1)]), extra + [batch], marks)


def measure_logits_head(config: dict, *, batch: int, prompt_len: int, completion_len: int, kind: str,
                        train: bool) -> int:
    """TRL 0.x's per-token log-probs (`_get_per_token_logps`: logits for completion + 1 positions, the last
    dropped, divided by the temperature, then `selective_log_softmax`, or the naive `log_softmax(...).gather`
    for kind='full') on a tiny model in fp32: the peak of live bytes of one no-grad pass, or of a forward +
    backward of `-logps.mean()` with train=True. Nothing but the model's weights lives before."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import selective_log_softmax

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32,
                                             attn_implementation="sdpa")
    model.train(train)
    ids = torch.randint(3, WORDS, (batch, prompt_len + completion_len))
    marks = PhaseMarks()

    def step() -> None:
        marks.mark("logprobs")
        with torch.set_grad_enabled(train):
            logits = model(input_ids=ids, logits_to_keep=completion_len + 1).logits[:, :-1]
            logits = logits[:, -completion_len:] / 1.0
            index = ids[:, -completion_len:]
            if kind == "selective":
                logps = selective_log_softmax(logits, index)
            else:
                logps = torch.gather(logits.float().log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)
            if train:
                (-logps.mean()).backward()
        del logits, logps
        marks.mark("other")

    with step_threads():
        return phase_peaks(step, model, torch.optim.SGD([torch.zeros(1)]), [ids], marks)["logprobs"]


def measure_critic(config: dict, *, batch: int, prompt_len: int, completion_len: int) -> int:
    """PPO's critic update as verl runs it (verl/workers/critic/dp_critic.py): a value model
    (AutoModelForTokenClassification, num_labels=1) over prompt + completion, the values of the completion
    positions, a clipped squared error against returns, backward and a fused AdamW step, in fp32 on CPU; the second
    step's peak of live bytes (the first creates Adam's state). trl 1.16 has no PPOTrainer to measure."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(AutoConfig.for_model(**config, num_labels=1),
                                                        dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(3, WORDS, (batch, prompt_len + completion_len))
    old_values = torch.zeros(batch, completion_len)
    returns = torch.ones(batch, completion_len)
    marks = PhaseMarks()

    def update() -> None:
        values = model(input_ids=ids).logits[:, -completion_len - 1:-1].squeeze(-1)
        clipped = old_values + (values - old_values).clamp(-0.5, 0.5)
        loss = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        marks.mark("critic")
        update()
        marks.mark("other")

    with step_threads():
        update()
        return phase_peaks(step, model, optimizer, [ids, old_values, returns], marks)["critic"]


def measure_preference(config: dict, *, batch: int, prompt_len: int, completion_len: int, trainer: str = "orpo",
                       lora: bool = False, checkpointing: bool = False, output_dir: str,
                       detail: dict | None = None) -> dict[str, int]:
    """One step (the second) of TRL's reference-free preference trainers on CPU in fp32 (trl.experimental):
    ORPOTrainer (trainer='orpo'), CPOTrainer ('cpo': loss_type 'sigmoid', cpo_alpha 1) and SimPO ('simpo':
    CPOTrainer with loss_type 'simpo', cpo_alpha 0). Chosen and rejected run concatenated through the policy alone;
    the one phase is 'training'. Each completion gets TRL's EOS (`add_eos_token_if_needed`: + 1 token)."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    common = dict(output_dir=output_dir, gradient_checkpointing=checkpointing, per_device_train_batch_size=batch,
                  max_length=4 * (prompt_len + completion_len), **TRAINER_ARGS)
    common.pop("model_init_kwargs")
    if trainer == "orpo":
        config_class, trainer_class, extra = ORPOConfig, ORPOTrainer, {}
    else:
        config_class, trainer_class = CPOConfig, CPOTrainer
        extra = {"loss_type": "simpo", "cpo_alpha": 0.0} if trainer == "simpo" else {}
    from transformers import AutoModelForCausalLM

    path = _tiny_model(config, f"{output_dir}/model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    pairs = _pairs(64, prompt_len, completion_len)
    # the prompt and each answer are tokenized as one string (`build_tokenized_answer`): a space keeps words apart
    pairs = pairs.map(lambda row: {"chosen": " " + row["chosen"], "rejected": " " + row["rejected"]})
    run = trainer_class(model=model, args=config_class(**common, **extra), train_dataset=pairs,
                        processing_class=toy_tokenizer(), peft_config=_peft_config(lora))
    return _measure_trainer(run, reference_method=None, detail=detail)
