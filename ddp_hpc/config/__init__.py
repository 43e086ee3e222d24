"""Job configuration: YAML -> frozen, validated dataclasses, plus dotted ``key=value`` overrides.

Why this shape: a job definition is read on the login node (submit) and again on every task
(``python -m ddp_hpc.run``); both must agree and both must refuse a typo before any compute is
spent. Every section is a frozen kw-only dataclass whose fields are the only valid keys, so an
unknown key is refused with the list of valid ones, a wrong type names the key, the value, where
it came from and the fix, and nothing downstream has to re-check.

    cfg = load_config("jobs/demo.yaml", ["train.batch_size=64", "optim.lr=0.1"])

Modules: ``sections`` (the dataclasses), ``slurm_options`` (``SlurmOptions``, the one home of the
Slurm options: YAML keys, ``submit`` flags and what the renderer passes on), ``checks`` (single
Slurm values), ``typed`` (plain data -> dataclasses), ``load`` (YAML files and overrides), ``factory``
(``pkg.module:factory`` strings -> callables), ``validate`` (a whole job, before it queues).
"""

from ddp_hpc.config.checks import parse_signal, time_to_seconds
from ddp_hpc.config.factory import resolve_factory
from ddp_hpc.config.load import apply_overrides, config_from_dict, config_to_dict, load_config, run_key
from ddp_hpc.config.sections import (
                                     CheckpointConfig,
                                     DataConfig,
                                     JobConfig,
                                     LogConfig,
                                     ModelConfig,
                                     OptimConfig,
                                     PreemptConfig,
                                     ScheduleConfig,
                                     TrainConfig,
)
from ddp_hpc.config.slurm_options import MANAGED_SBATCH_KEYS, PASSTHROUGH, SlurmOptions
from ddp_hpc.config.typed import ConfigError

__all__ = [
    "ConfigError", "JobConfig", "ModelConfig", "DataConfig", "OptimConfig", "ScheduleConfig",
    "TrainConfig", "CheckpointConfig", "PreemptConfig", "LogConfig", "SlurmOptions",
    "PASSTHROUGH", "MANAGED_SBATCH_KEYS", "time_to_seconds", "parse_signal",
    "load_config", "run_key", "config_from_dict", "config_to_dict", "apply_overrides", "resolve_factory",
]
