"""The task a text model is trained for: its own head (a causal or masked LM), or sequence classification over N
labels (BertForSequenceClassification, LlamaForSequenceClassification...). The choice lives where transformers keeps
it, in the config: `architectures` names the class and `num_labels` its classes, so a fine-tuned classifier's
config.json needs nothing more, and the graph builders, the spec and the real module built from the config
(trace, measure) all read the same two keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..errors import ConfigError
from ..graph.builders.common import SEQUENCE_CLASSIFIERS
from ..model_spec import ModelSpec
from .hf_config import from_hf_config

SEQUENCE_CLASSIFICATION = "sequence-classification"
TASKS = ("lm", SEQUENCE_CLASSIFICATION)
"""'lm': the model's own head (causal LM, BERT's masked LM); 'sequence-classification': a classifier head."""


def task_config(config: Mapping[str, Any], num_labels: int) -> dict[str, Any]:
    """`config` as the model_type's ...ForSequenceClassification over `num_labels` classes. A decoder without a
    pad_token_id gets its eos_token_id (else 0), as fine-tuning scripts set it: transformers' classifier finds each
    sequence's last non-pad token and refuses batches > 1 without one. ConfigError for a family memfit does not
    build as a classifier."""
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ConfigError(f"--num-labels must be a positive whole number, got {num_labels!r}")
    model_type = config.get("model_type")
    if model_type not in SEQUENCE_CLASSIFIERS:
        raise ConfigError(f"sequence classification is modelled for {', '.join(SEQUENCE_CLASSIFIERS)}, not "
                          f"'{model_type}': use --task lm, or trace the built classifier")
    out = {**config, "architectures": [SEQUENCE_CLASSIFIERS[model_type]], "num_labels": num_labels}
    out.pop("id2label", None)  # transformers derives num_labels from id2label when both are given
    out.pop("label2id", None)
    if model_type != "bert" and out.get("pad_token_id") is None:
        eos = out.get("eos_token_id")
        out["pad_token_id"] = eos if isinstance(eos, int) else (eos[0] if isinstance(eos, list) and eos else 0)
    return out


def with_task(spec: ModelSpec, task: str = "lm", num_labels: int = 2) -> ModelSpec:
    """`spec` rebuilt for `task` from the config its graph was built from ('lm': unchanged)."""
    if task not in TASKS:
        raise ConfigError(f"unknown task '{task}': choose from {', '.join(TASKS)}")
    if task == "lm":
        return spec
    config = getattr(spec.graph, "config", None)
    if not isinstance(config, Mapping):
        raise ConfigError(f"'{spec.name}' has no config to build a sequence classifier from: give a catalog name, "
                          "a config.json or a hub id")

    rebuilt = from_hf_config(task_config(config, num_labels), name=spec.name, source=spec.source)
    return replace(rebuilt, extra=dict(spec.extra))
