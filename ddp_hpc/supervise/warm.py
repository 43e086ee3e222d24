"""The warm standby: a second srun step, beside the running one, whose ranks have already started
Python and imported torch (``supervise.standby``), so that a restart does not pay for it.

Once the running step's first training step is seen, the supervisor starts the standby on every
healthy node of the allocation (the active ones and the spares), one standby rank per task slot,
with ``--overlap`` (it shares the running step's CPUs, memory and GPUs; an idle standby rank uses
none of them, but holds the memory of an imported torch: about 0.3-0.4 GB per rank). Each standby
rank connects back to the supervisor and waits. At a restart, after the health check, the
supervisor hands the standby the new step (`Warm.take`): every standby rank on a node of the new
step gets its rank, the new step's Slurm variables and its output file, and starts the command;
the others exit. The standby's srun then is the new step. A new standby starts once that step
trains.

A cold start (a new ``srun`` of the command) is used instead when the standby cannot serve: a
command it cannot run (`standby.eligible`: only ``python -m MODULE`` and ``python SCRIPT.py``),
a standby not yet ready on the new step's nodes (a rank there still importing after `READY_WAIT_S`;
one still importing on a node the new step does not use is told "no rank" when it calls, and
exits), one that ended (its ranks end it when one of them steps back: a node without room in
memory for a standby, ``supervise.standroom``; ``standby.out`` and status say why), a new step
on a node it does not cover, or a lost node among its own (srun would wait for that node's tasks:
the standby is dropped). It is off unless asked for:
``--warm-standby`` (``slurm.warm_standby: true``).

Each standby rank and the supervisor prove to each other that they know the job's secret before
either takes anything from the other (the hand-shake in ``supervise.standby``): a port that
another user's process holds, or a process that connects to ours, gets no go and gives none.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time

from ddp_hpc.judge.restarts import stepped_back
from ddp_hpc.runlogs.schema import STANDBY_MARK, STANDBY_OUT, rank_out
from ddp_hpc.slurm.hostlist import compress
from ddp_hpc.supervise.standby import GO_ENV_KEYS, LOGS_VAR, TOKEN_VAR, eligible, proof, receive, send
from ddp_hpc.supervise.watch import stop_step

__all__ = ["Warm", "Relay", "step_variables", "STANDBY_OUT"]

#: how long the supervisor waits for each line of a standby rank's hand-shake once it connected, seconds
HELLO_S = 2.0
#: how long a restart waits for standby ranks still importing (they are ahead of a cold start)
READY_WAIT_S = 30.0
#: the task ids in srun's messages: "srun: error: n3: tasks 4-5: Exited with exit code 1"
_TASK_IDS = re.compile(r"\b(tasks?) ([\d,\-]+)(?=:)")


def _ids(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def _ranges(ids: list[int]) -> str:
    """``[2, 3, 5]`` -> ``2-3,5`` (srun's own form)."""
    parts, ids = [], sorted(ids)
    for i in ids:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


class Relay(threading.Thread):
    """srun's own messages about the standby step. While it stands by they go to `STANDBY_OUT`;
    once it was handed a step, to the batch output (where ``ddp-hpc status`` reads srun's report
    of each task), with the standby's task ids turned into the ranks those tasks became
    (``ranks``), as a cold step's srun would number them; a message about a standby task that
    became no rank stays in `STANDBY_OUT`."""

    def __init__(self, stream, standby_out: str, out=None):
        super().__init__(daemon=True, name="ddp_hpc-standby-relay")
        self.stream, self.standby_out, self.out = stream, standby_out, out
        self.ranks: dict[int, int] | None = None

    def line(self, text: str) -> tuple[str, str]:
        """(where: ``standby`` or ``step``, the text) for one of srun's lines."""
        ranks = self.ranks
        if ranks is None:
            return "standby", text
        found = list(_TASK_IDS.finditer(text))
        if any(t not in ranks for m in found for t in _ids(m.group(2))):
            return "standby", text
        return "step", _TASK_IDS.sub(lambda m: self._renumber(m, ranks), text)

    @staticmethod
    def _renumber(m: re.Match, ranks: dict[int, int]) -> str:
        new = sorted(ranks[t] for t in _ids(m.group(2)))
        return f"{'tasks' if len(new) > 1 else 'task'} {_ranges(new)}"

    def run(self) -> None:
        for text in self.stream:
            where, text = self.line(text)
            try:
                if where == "step":
                    out = self.out or sys.stderr
                    out.write(text)
                    out.flush()
                else:
                    with open(self.standby_out, "a", encoding="utf-8") as f:
                        f.write(text)
            except OSError:
                pass      # a full disk: srun's words are lost, the step goes on


def step_variables(nodes: list[str], tasks_per_node: int, node_index: int, local: int) -> dict[str, str]:
    """Slurm's task and step variables of task ``local`` on node ``node_index`` of a step of
    ``tasks_per_node`` tasks on each of ``nodes`` (block distribution, as srun places them)."""
    n, g = len(nodes), tasks_per_node
    return {"SLURM_PROCID": str(node_index * g + local), "SLURM_NODEID": str(node_index),
            "SLURM_LOCALID": str(local), "SLURM_NTASKS": str(n * g), "SLURM_STEP_NUM_TASKS": str(n * g),
            "SLURM_NPROCS": str(n * g), "SLURM_NNODES": str(n), "SLURM_STEP_NUM_NODES": str(n),
            "SLURM_STEP_NODELIST": compress(nodes), "SLURM_NODELIST": compress(nodes),
            "SLURM_STEP_TASKS_PER_NODE": f"{g}(x{n})" if n > 1 else str(g),
            "SLURM_TASKS_PER_NODE": f"{g}(x{n})" if n > 1 else str(g),
            "SLURM_GTIDS": ",".join(str(node_index * g + t) for t in range(g))}


class Warm:
    """The supervisor's standby step: at most one at a time (`start`, `take`, `drop`)."""

    def __init__(self, cli, command, log_dir: str, tasks_per_node: int, srun_args=(), say=print):
        self.cli, self.command, self.log_dir = cli, [str(c) for c in command], log_dir
        self.g, self.srun_args, self.say = tasks_per_node, tuple(srun_args), say
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.nodes: list[str] = []
        self.server: socket.socket | None = None
        # (node, local) -> connection, task, the hand-shake's nonces (the standby's, ours): they sign its go
        self.ranks: dict[tuple[str, str], tuple[socket.socket, int, tuple[str, str]]] = {}
        self.relay: Relay | None = None

    @staticmethod
    def serves(command) -> bool:
        return eligible(command)

    def start(self, nodes: list[str], env: dict) -> None:
        """Start a standby on ``nodes`` (none when one runs)."""
        if self.proc is not None or not nodes:
            return
        self.server = socket.create_server(("", 0), backlog=max(128, 2 * len(nodes) * self.g))
        host = env.get("SLURMD_NODENAME") or socket.gethostname()
        go = f"{host}:{self.server.getsockname()[1]}"
        args = ["--no-kill", "--overlap", "--kill-on-bad-exit=1", "--open-mode=append",
                f"--output={self.log_dir}/{STANDBY_OUT}", f"--nodes={len(nodes)}",
                f"--ntasks={len(nodes) * self.g}", f"--ntasks-per-node={self.g}", f"--nodelist={compress(nodes)}",
                *self.srun_args, self.command[0], "-m", "ddp_hpc.supervise.standby", "--go", go, "--",
                *self.command]
        self.nodes, self.ranks = list(nodes), {}
        try:   # what a reader of standby.out takes as the newest standby's start
            with open(os.path.join(self.log_dir, STANDBY_OUT), "a", encoding="utf-8") as f:
                f.write(STANDBY_MARK + "\n")
        except OSError:
            pass      # a full disk: the standby still serves
        self.proc = self.cli.start_step(args, {**env, TOKEN_VAR: self.token, LOGS_VAR: self.log_dir},
                                        stderr=subprocess.PIPE)
        self.relay = Relay(self.proc.stderr, os.path.join(self.log_dir, STANDBY_OUT))
        self.relay.start()

    def _accept(self) -> None:
        """Take the standby ranks that connected and proved they know the token."""
        self.server.setblocking(False)
        while True:
            try:
                conn, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.settimeout(HELLO_S)
            try:
                shaken = self._handshake(conn)
            except (OSError, ValueError):
                shaken = None
            if shaken is None:
                conn.close()
                continue
            hello, nonces = shaken
            conn.settimeout(None)
            place = _place(hello)
            if place in self.ranks:
                self.ranks[place][0].close()
            self.ranks[place] = (conn, int(hello.get("task", -1)), nonces)

    def _handshake(self, conn: socket.socket) -> tuple[dict, tuple[str, str]] | None:
        """Steps 1-3 of the hand-shake (``supervise.standby``): its hello and the nonces, or None
        for a peer that did not prove it knows the token."""
        with conn.makefile("rb") as f:
            hello = receive(f)
            theirs = hello.get("nonce") if hello else None
            if not isinstance(theirs, str):
                return None
            ours = secrets.token_hex(16)
            send(conn, {"nonce": ours, "proof": proof(self.token, "supervisor", theirs, ours)})
            answer = receive(f)
        if answer is None or not secrets.compare_digest(str(answer.get("proof")),
                                                        proof(self.token, "standby", theirs, ours)):
            return None
        return hello, (theirs, ours)

    def take(self, nodes: list[str], env: dict, lost=()) -> subprocess.Popen | None:
        """Hand the standby the new step on ``nodes`` (with the variables ``env``): its srun, now
        the step's; None (and the standby dropped) when it cannot serve (the module docstring)."""
        if self.proc is None:
            return None
        why, extra = None, sorted(set(env) - GO_ENV_KEYS)
        if extra:
            why = (f"it cannot carry {', '.join(extra)} (a standby takes only the step's Slurm variables and "
                   f"{', '.join(sorted(GO_ENV_KEYS - set(step_variables(['n'], 1, 0, 0))))})")
        elif self.proc.poll() is not None:
            why = self._ended()
        elif set(lost) & set(self.nodes):
            why = f"a node of it was lost ({', '.join(sorted(set(lost) & set(self.nodes)))})"
        elif not set(nodes) <= set(self.nodes):
            why = f"it does not cover {', '.join(sorted(set(nodes) - set(self.nodes)))}"
        else:
            missing = self._wait_ready(nodes)
            if self.proc.poll() is not None:
                why = self._ended()
            elif missing:
                why = f"{len(missing)} of its ranks not ready after {READY_WAIT_S:g} s (e.g. {missing[0]})"
        if why:
            self.say(f"warm standby not used: {why}; starting the ranks cold")
            self.drop(wait=False)
            return None
        keep = {n: i for i, n in enumerate(nodes)}
        gos = []   # (connection, the standby's task id, its go)
        for (node, local), (conn, task, nonces) in self.ranks.items():
            go = {"rank": None}
            if node in keep:
                rank = keep[node] * self.g + int(local)
                go = {"rank": rank, "env": {**env, **step_variables(nodes, self.g, keep[node], int(local))},
                      "out": os.path.join(self.log_dir, rank_out(rank))}
            gos.append((conn, task, go, nonces))
        self.relay.ranks = {task: go["rank"] for _, task, go, _ in gos if go["rank"] is not None}
        for conn, _, go, nonces in gos:
            try:
                self._send_go(conn, go, nonces)
            except OSError:
                pass          # that rank is gone: the step's own watch sees it
            conn.close()
        late = set(self._places(self.nodes)) - set(self.ranks)
        proc, server = self.proc, self.server
        self.proc, self.ranks, self.relay, self.server = None, {}, None, None
        if late:
            threading.Thread(target=self._answer_late, args=(server, late, proc), daemon=True,
                             name="ddp_hpc-standby-late").start()
        else:
            server.close()
        return proc

    def _ended(self) -> str:
        """Why a standby ended before a restart: its ranks stepped back (``standby.out`` says why:
        no room in a node's memory, ``supervise.standroom``), or it just ended."""
        back = stepped_back(self.log_dir)
        return f"it ended: {back[0]}" if back else "it ended"

    def _wait_ready(self, nodes: list[str]) -> list[str]:
        """Wait (at most `READY_WAIT_S`) until every standby rank on ``nodes`` (the new step's)
        said hello; the ranks still missing. The standby's other ranks are not waited for: one
        still importing on another node gets its "no rank" when it calls (`_answer_late`)."""
        deadline = time.monotonic() + READY_WAIT_S
        while True:
            self._accept()
            missing = [f"{n}:{t}" for n, t in self._places(nodes) if (n, t) not in self.ranks]
            if not missing or time.monotonic() > deadline or self.proc.poll() is not None:
                return missing
            time.sleep(0.05)

    def _answer_late(self, server: socket.socket, late: set[tuple[str, str]], proc: subprocess.Popen) -> None:
        """After a hand-over: tell each standby rank that was still importing then (on a node the
        new step does not use) that it gets no rank, as soon as it calls, so that it exits at once
        instead of trying to reach a closed port for `standby.CONNECT_S` and holding the step's
        srun open that long after the training ended. Ends when all of them were answered or the
        step ended."""
        server.settimeout(0.5)
        try:
            while late and proc.poll() is None:
                try:
                    conn, _ = server.accept()
                except (TimeoutError, BlockingIOError, InterruptedError):
                    continue
                conn.settimeout(HELLO_S)
                try:
                    shaken = self._handshake(conn)
                    if shaken is not None:
                        hello, nonces = shaken
                        late.discard(_place(hello))
                        self._send_go(conn, {"rank": None}, nonces)
                except (OSError, ValueError):
                    pass
                finally:
                    conn.close()
        except OSError:
            pass
        finally:
            server.close()

    def _places(self, nodes: list[str]) -> list[tuple[str, str]]:
        """The (node, local task) places of a step's ranks on ``nodes``, as the hellos name them."""
        return [(n, str(t)) for n in nodes for t in range(self.g)]

    def _send_go(self, conn: socket.socket, go: dict, nonces: tuple[str, str]) -> None:
        """Step 4 of the hand-shake: the go (a rank, or none), signed for this connection."""
        text = json.dumps(go)
        send(conn, {"go": text, "mac": proof(self.token, "go", *nonces, text)})

    def drop(self, wait: bool = True) -> None:
        """End the standby: its ranks see their connection close and exit 0; srun gets a moment,
        then the abort (a lost node's tasks never end by themselves). ``wait=False`` (a restart
        is waiting): that happens in the background."""
        for conn, *_ in self.ranks.values():
            conn.close()
        self.ranks, self.relay = {}, None
        self._close_server()
        if self.proc is not None:
            proc, self.proc = self.proc, None
            if wait:
                _end(proc)
            else:
                threading.Thread(target=_end, args=(proc,), daemon=True).start()

    def _close_server(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def _place(hello: dict) -> tuple[str, str]:
    """(node, local task) of a standby rank, from its hello."""
    return str(hello.get("node")), str(hello.get("local"))


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.wait(2.0)
    except subprocess.TimeoutExpired:
        stop_step(proc, 2.0)
