"""verl's trainer config and OpenRLHF's command line as RLSetup fields (issue 23).

- verl: the Hydra YAML of `python -m verl.trainer.main_ppo` (verl/trainer/config/ppo_trainer.yaml: `data.*`,
  `actor_rollout_ref.{model,actor,ref,rollout}.*`, `critic.*`, `reward_model.*`, `algorithm.*`, `trainer.*`), or a
  launch script's `key=value` overrides of it. Simple `${a.b}` interpolations are resolved.
- OpenRLHF: the arguments of `openrlhf.cli.train_ppo_ray` (openrlhf/cli/train_ppo_ray.py), from a launch script
  or a file holding the command line.

Every key is recorded with what it set (`mapped`) or why it sizes nothing (`ignored`, memfit.readers' Reader): a
key memfit does not model is never an error, a value of the wrong type is one ConfigError line naming the key."""

from __future__ import annotations

from .common import OPENRLHF, VERL, Reading, detect, flatten
from .openrlhf import OPENRLHF_FLAGS, OPENRLHF_SOURCE, openrlhf_settings, read_openrlhf
from .verl import ESTIMATORS, VERL_SOURCE, read_verl, verl_settings

__all__ = ["ESTIMATORS", "OPENRLHF", "OPENRLHF_FLAGS", "OPENRLHF_SOURCE", "VERL", "VERL_SOURCE", "Reading", "detect",
           "flatten", "openrlhf_settings", "read_openrlhf", "read_verl", "verl_settings"]
