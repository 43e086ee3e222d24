"""Reading a job config: a YAML file plus dotted ``key=value`` overrides -> a validated
``JobConfig``."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from ddp_hpc.config.sections import JobConfig
from ddp_hpc.config.typed import ConfigError, build, to_dict

__all__ = ["load_config", "config_from_dict", "config_to_dict", "apply_overrides"]

def config_from_dict(raw: Mapping, source: str = "a dict") -> JobConfig:
    """Build a JobConfig from plain data; `source` is named in error messages."""
    return build(JobConfig, raw, "", source)


def config_to_dict(cfg: Any) -> dict:
    """Plain dict/list/str/number form (YAML- and torch.load(weights_only)-safe)."""
    return to_dict(cfg)


def _parse_value(text: str) -> Any:
    """YAML scalar/list/dict syntax, except YAML 1.1's yes/no/on/off, which stay words here."""
    if text.strip().lower() in {"yes", "no", "on", "off", "y", "n"}:
        return text.strip()
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` strings (value parsed as YAML) to a nested dict, returning a copy."""
    out = copy.deepcopy(raw) if raw else {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value",
                              "write e.g. train.batch_size=64 or optim.lr=0.01")
        key, _, text = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r} has an empty key part",
                              "use dotted keys such as train.epochs=3")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section (it is {nxt!r})",
                                  f"override a key inside a section, or {p} itself")
            node = nxt
        node[parts[-1]] = _parse_value(text)
    return out


def load_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> JobConfig:
    """Read a YAML job file (safe_load), apply dotted overrides, validate. `path=None`: defaults."""
    raw: Any = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist",
                              "pass a YAML job file such as jobs/demo.yaml")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        source = str(p)
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {source!r} must hold a mapping at the top, got {raw!r}")
    overrides = list(overrides)
    if overrides:
        raw = apply_overrides(raw, overrides)
        source = f"{source} + overrides {overrides}"
    return config_from_dict(raw, source)



def run_key(cfg: JobConfig) -> str:
    """``<name>-<hash of the resolved config>``: the run directory of a launch without a job id
    (``<log.dir>/<run key>``), so the same config and overrides find the same run again."""
    text = json.dumps(config_to_dict(cfg), sort_keys=True, default=str)
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(cfg.name)).strip("_.") or "run"
    return f"{name[:64]}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
