"""Which configuration Slurm's commands read, checked before one is started: a configuration
that cannot work fails at once, with the variable, the path and the fix, instead of after the
client's own retries.

Seen with Slurm 22.05.8: ``SLURM_CONF`` naming a missing file makes every command print
"s_p_parse_file: cannot stat file ..., retrying in 1sec up to 60sec" and fail a minute later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["config_problem", "CONF_HINT", "NO_CONFIG", "NO_CONFIG_HINT"]

NO_CONFIG = "Could not establish a configuration source"
CONF_HINT = ("set SLURM_CONF to the path of the cluster's slurm.conf (`scontrol show config` on a "
             "login node shows it as SLURM_CONF), or unset it to use Slurm's built-in path; "
             "without a cluster, use the local backend")
#: what a command says when SLURM_CONF is unset and there is no slurm.conf to find
NO_CONFIG_HINT = ("Slurm found no slurm.conf at its built-in path (/etc/slurm/slurm.conf on Debian) "
                  "and no configless source: set SLURM_CONF to the path of the cluster's "
                  "slurm.conf; without a cluster, use the local backend")


def config_problem(environ: Mapping[str, str]) -> str | None:
    """Why Slurm's commands cannot read their configuration, or None. SLURM_CONF naming no
    readable file would make every command retry the file for 60 s before it fails, so it is
    refused here at once. Without SLURM_CONF, Slurm reads its built-in path (/etc/slurm/slurm.conf
    on Debian), else a configless source (slurmd's cache, a DNS SRV record), and fails at once
    when there is none: nothing to check ahead."""
    conf = environ.get("SLURM_CONF")
    if conf is None:
        return None
    if not conf:
        return "SLURM_CONF is set but empty"
    if not os.path.isfile(conf):
        what = "a directory" if os.path.isdir(conf) else "no file"
        return f"SLURM_CONF={conf} names {what} (Slurm would retry it for 60 s)"
    if not os.access(conf, os.R_OK):
        return f"SLURM_CONF={conf} is not readable by this user"
    return None
