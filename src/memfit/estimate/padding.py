"""Padded vs packed sequences: the length that sets a run's peak (TrainingSetup.peak_seq_len).

Packed data (torchtune `dataset.packed`, axolotl `sample_packing`) and data padded to the maximum length (HF
`padding="max_length"`, axolotl `pad_to_sequence_len`) make every step seq_len tokens long. Data padded to the
longest sample of each batch (HF DataCollatorWithPadding, the Trainer's default; torchtune's padded_collate_sft for
unpacked data; HF `group_by_length` only groups similar lengths, each batch still padded to its longest) makes each
step as long as its longest sample: memory follows the batch, and the run's peak is the step whose batch holds the
data set's longest sample, L = min(seq_len, longest sample), every row of it padded to L (all B x L tokens are
computed, padding included). torch.cuda.max_memory_allocated is a running maximum and the caching allocator keeps
that step's segments reserved afterwards, so the whole run reports that step's figures; a typical step is shorter.
"""

from __future__ import annotations

from ..setup import Padding, TrainingSetup


def peak_setup(setup: TrainingSetup) -> TrainingSetup:
    """The step that sets the run's peak: seq_len = peak_seq_len, every sequence that long."""
    if setup.padding is Padding.MAX_LENGTH:
        return setup
    return setup.replace(seq_len=setup.peak_seq_len, padding=Padding.MAX_LENGTH, longest_sample_len=None)


def notes(setup: TrainingSetup) -> tuple[str, ...]:
    if setup.padding is not Padding.LONGEST:
        return ()
    if setup.longest_sample_len is None:
        return (f"padded to the longest sample of each batch, longest sample not given: sized at seq {setup.seq_len} "
                "(the truncation), an upper bound; give the data's longest sample (--longest-sample) for the peak",)
    return (f"padded to the longest sample of each batch: the run peaks at the batch holding the longest sample, "
            f"{setup.peak_seq_len} tokens (min(seq {setup.seq_len}, longest sample {setup.longest_sample_len})) x "
            f"{setup.micro_batch_size} rows; the allocator keeps that step's segments, shorter batches need less",)
