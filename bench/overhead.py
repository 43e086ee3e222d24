"""Overhead of the toolkit's training loop against a plain hand-written DDP loop, in pairs.

What it measures: the same processes (one local launch), model, data, batch size and optimizer run
a plain loop and the toolkit's ``fit()`` one after the other, as one *pair*; pairs repeat, the
side that goes first alternating, until each side has trained at least ``--seconds`` (default
20 s) and at least ``--min-pairs`` pairs ran, after one untimed run of each (imports, first
allocations).  The plain loop is the textbook one: DistributedSampler + DataLoader, DDP (with
more than one rank, as the toolkit), zero_grad / forward / backward / step, ``loss.item()`` every
step, rank 0 saves the weights at the end.  The toolkit run is ``fit()`` with its defaults (run logs
with a step event every 10 steps, the preemption flag check, a final checkpoint), only the
progress output off; its console lines are swallowed (``--verbose`` shows them).

Per pair, per side:
- steady state: seconds between the end of optimizer step ``--warmup`` and the end of the last
  step (the slowest rank's), i.e. the per-step cost including the log intervals, the preemption
  checks and the epoch boundary, but not the start or the final checkpoint;
- end to end: the whole call, barrier to barrier (set-up, run-log files, final checkpoint);
- CPU time: the CPU seconds all ranks' processes (every thread) spent in the steady-state window:
  the work each loop does, much less disturbed by other load on the machine than the wall clock.
Each pair gives a ratio toolkit/plain of samples/s (= plain seconds / toolkit seconds, the same
samples); the machine may be shared and noisy, so the figures are the MEDIAN of the per-pair
ratios, their min-max, and a bootstrap 95% interval of the median (numpy, fixed seed).

Verdict (steady state, wall clock; the same rule is applied to CPU time): target >= 0.98.  Met
when the interval lies above 0.98, missed when it lies below; when it straddles 0.98 the median
decides if the interval is narrower than ``--max-width`` (default 0.04), else the spread is too
wide to judge: rerun on an idle machine or with a larger ``--seconds``.

    python bench/overhead.py                     # 2 processes, 1-3 minutes
    python bench/overhead.py --seconds 60 --json runs/overhead.json
    python bench/overhead.py --procs 4 --epochs 1
    python bench/overhead.py --device cuda       # GPUs: a ResNet-style CNN in bf16 (bench/overhead_cuda.py)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TARGET = 0.98


class Marks:
    """Wall clock and this process's CPU time (all its threads) at the end of optimizer step
    `first` and of the newest step (fit's on_step)."""

    def __init__(self, first: int) -> None:
        self.first, self.t0, self.t1 = first, (0.0, 0.0), (0.0, 0.0)

    def __call__(self, step: int, epoch: int = 0) -> None:  # noqa: ARG002 - fit's on_step
        now = (time.perf_counter(), time.process_time())
        if step == self.first:
            self.t0 = now
        self.t1 = now

    def seconds(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds) between the two marks."""
        return self.t1[0] - self.t0[0], self.t1[1] - self.t0[1]


def _plain(model, data, a, rank: int, world: int, marks: Marks, tmp: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    ddp = DDP(model) if world > 1 else model      # the toolkit wraps only with several ranks
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        epoch_loss = 0.0
        for x, y in loader:
            opt.zero_grad()
            loss = crit(ddp(x), y)
            loss.backward()
            opt.step()
            epoch_loss += loss.item()
            step += 1
            marks(step)
    if rank == 0:                        # as a plain script does: rank 0 saves the weights
        torch.save(model.state_dict(), f"{tmp}/plain_model.pt")


def _toolkit(model, data, a, marks: Marks, tmp: str) -> None:
    from ddp_hpc.train import fit
    overrides = [f"train.batch_size={a.batch_size}", f"train.epochs={a.epochs}", "optim.lr=0.05",
                 "optim.momentum=0.9", "log.progress=off", f"log.dir={tmp}/logs",
                 f"checkpoint.dir={tmp}/ckpt", "checkpoint.every_epochs=0", "checkpoint.resume=false"]
    console = io.StringIO()
    try:
        with contextlib.redirect_stderr(sys.stderr if a.verbose else console):
            fit(model, data, overrides=overrides, on_step=marks)
    except BaseException:
        sys.stderr.write(console.getvalue())
        raise


def _timed(kind: str, a, data, rank: int, world: int, tmp: str) -> tuple[float, float, float]:
    """One run of one side, this rank's (steady-state seconds, end-to-end seconds, steady-state
    CPU seconds)."""
    import torch.distributed as dist

    from ddp_hpc.examples.models import MLP
    torch.manual_seed(0)
    model = MLP(in_dim=a.in_dim, hidden=a.hidden, num_classes=10, depth=a.depth)
    marks = Marks(a.warmup)
    dist.barrier()
    t0 = time.perf_counter()
    if kind == "plain":
        _plain(model, data, a, rank, world, marks, tmp)
    else:
        _toolkit(model, data, a, marks, tmp)
    dist.barrier()
    wall, cpu = marks.seconds()
    return wall, time.perf_counter() - t0, cpu


def _worker(rank: int, world: int, args_d: dict, tmp: str) -> list[dict]:
    """Pairs until both sides trained `seconds` (steady state) and `min_pairs` ran; every rank
    takes the slowest rank's wall times (an all_reduce MAX) and the ranks' total CPU time (SUM),
    so all ranks stop after the same pair."""
    import torch.distributed as dist

    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    from ddp_hpc.examples.synthetic import SyntheticClassification
    a = argparse.Namespace(**args_d)
    setup_ddp()
    try:
        data = SyntheticClassification(size=a.size, in_dim=a.in_dim, num_classes=10, seed=0)
        (Path(tmp) / "warm").mkdir(exist_ok=True)
        for kind in ("plain", "toolkit"):     # untimed: first-call imports and allocations
            _timed(kind, a, data, rank, world, f"{tmp}/warm")
        pairs, total = [], {"plain": 0.0, "toolkit": 0.0}
        while len(pairs) < a.max_pairs:
            order = ("plain", "toolkit") if len(pairs) % 2 == 0 else ("toolkit", "plain")
            run_dir = Path(tmp) / f"pair{len(pairs)}"
            run_dir.mkdir(exist_ok=True)
            mine = {kind: _timed(kind, a, data, rank, world, str(run_dir)) for kind in order}
            wall = torch.tensor([*mine["plain"][:2], *mine["toolkit"][:2]], dtype=torch.float64)
            cpu = torch.tensor([mine["plain"][2], mine["toolkit"][2]], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            p_steady, p_e2e, k_steady, k_e2e = wall.tolist()
            pairs.append({"first": order[0], "plain_s": p_steady, "toolkit_s": k_steady,
                          "plain_e2e_s": p_e2e, "toolkit_e2e_s": k_e2e,
                          "plain_cpu_s": cpu[0].item(), "toolkit_cpu_s": cpu[1].item()})
            total["plain"] += p_steady
            total["toolkit"] += k_steady
            dist.barrier()
            if rank == 0:                       # keep the disk use of a long run flat
                shutil.rmtree(run_dir, ignore_errors=True)
            if len(pairs) >= a.min_pairs and min(total.values()) >= a.seconds:
                break
        return pairs
    finally:
        cleanup_ddp()


def steps_per_run(a) -> int:
    """Optimizer steps of one run: DistributedSampler pads each rank to ceil(size / procs)."""
    return a.epochs * math.ceil(math.ceil(a.size / a.procs) / a.batch_size)


def median_ci(values, resamples: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the bootstrap 95% percentile interval of the median."""
    x = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, len(x), size=(resamples, len(x)))], axis=1)
    return float(np.median(x)), float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def verdict(med: float, lo: float, hi: float, target: float = TARGET, max_width: float = 0.04) -> str:
    """One line: target met / missed, or the interval too wide to tell."""
    head = f"median {med:.3f} [{lo:.3f}, {hi:.3f}]"
    if lo >= target:
        return f"{head} -- target >= {target} met"
    if hi < target:
        return f"{head} -- target >= {target} missed"
    if hi - lo > max_width:
        return (f"{head} -- spread too wide to judge (interval width {hi - lo:.3f} > {max_width}); "
                f"rerun on an idle machine or with a larger --seconds")
    word = "met" if med >= target else "missed"
    return f"{head} -- target >= {target} {word} by the median (the interval includes {target})"


def summarize(a, pairs: list[dict]) -> dict:
    """The per-pair ratios and their statistics (steady state, end to end, CPU time), and the
    toolkit's extra time per step."""
    out: dict = {"pairs": pairs}
    for key, suffix in (("steady", "_s"), ("end_to_end", "_e2e_s"), ("cpu", "_cpu_s")):
        ratios = [p["plain" + suffix] / p["toolkit" + suffix] for p in pairs]
        med, lo, hi = median_ci(ratios)
        out[key] = {"ratios": ratios, "median": med, "ci95": [lo, hi], "min": min(ratios),
                    "max": max(ratios)}
    steps = steps_per_run(a)
    timed = (steps - a.warmup) * a.batch_size * a.procs
    out["samples_per_s"] = {k: float(np.median([timed / p[k + "_s"] for p in pairs]))
                            for k in ("plain", "toolkit")}
    out["ms_per_step"] = {k: float(np.median([1e3 * p[k + "_s"] for p in pairs])) / (steps - a.warmup)
                          for k in ("plain", "toolkit")}
    extra = [1e6 * (p["toolkit_s"] - p["plain_s"]) / (steps - a.warmup) for p in pairs]
    out["extra_us_per_step"] = dict(zip(("median", "low", "high"), median_ci(extra)))
    out["fixed_cost_s"] = float(np.median([(p["toolkit_e2e_s"] - p["toolkit_s"])
                                           - (p["plain_e2e_s"] - p["plain_s"]) for p in pairs]))
    out["verdict"] = verdict(out["steady"]["median"], *out["steady"]["ci95"], max_width=a.max_width)
    out["verdict_cpu"] = verdict(out["cpu"]["median"], *out["cpu"]["ci95"], max_width=a.max_width)
    out["steps_per_run"], out["timed_steps"] = steps, steps - a.warmup
    return out


def _print(a, s: dict) -> None:
    n = len(s["pairs"])
    plain_s = sum(p["plain_s"] for p in s["pairs"])
    print(f"processes {a.procs}, model MLP({a.in_dim}->{a.hidden}x{a.depth}->10), batch "
          f"{a.batch_size}/rank, {a.size} samples x {a.epochs} epochs = {s['steps_per_run']} steps "
          f"per run, timed after step {a.warmup}; {n} pairs, {plain_s:.1f} s of timed plain training")
    for k, label in (("plain", "plain DDP loop"), ("toolkit", "ddp_hpc fit() ")):
        print(f"{label} : {s['samples_per_s'][k]:10.1f} samples/s, {s['ms_per_step'][k]:.3f} ms/step "
              f"(medians)")
    x = s["extra_us_per_step"]
    print(f"toolkit extra per step: {x['median']:.0f} us, 95% CI [{x['low']:.0f}, {x['high']:.0f}] "
          f"(median of the per-pair differences)")
    for key, label in (("steady", "steady state"), ("end_to_end", "end to end  "),
                       ("cpu", "CPU time    ")):
        r = s[key]
        print(f"ratio toolkit/plain, {label}: median {r['median']:.3f}, 95% CI "
              f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}], min-max [{r['min']:.3f}, {r['max']:.3f}]")
    print(f"toolkit fixed cost per run (set-up, run logs, final checkpoint) over the plain loop's: "
          f"{s['fixed_cost_s']:.3f} s (median)")
    print(f"verdict (steady state): {s['verdict']}")
    print(f"verdict (CPU time, steady state): {s['verdict_cpu']}")


def _device(argv) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return pre.parse_known_args(argv)[0].device


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: this MLP benchmark; cuda: bench/overhead_cuda.py (one rank per GPU)")
    p.add_argument("--procs", type=int, default=2, help="local processes (ranks)")
    p.add_argument("--size", type=int, default=16384, help="samples")
    p.add_argument("--in-dim", type=int, default=128, help="MLP input width")
    p.add_argument("--hidden", type=int, default=512, help="MLP hidden width")
    p.add_argument("--depth", type=int, default=2, help="MLP hidden layers")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run")
    p.add_argument("--warmup", type=int, default=10, help="optimizer steps before the timed window")
    p.add_argument("--seconds", type=float, default=20.0,
                   help="timed training per side, in total over the pairs (steady state)")
    p.add_argument("--min-pairs", type=int, default=8, help="pairs at least")
    p.add_argument("--max-pairs", type=int, default=200, help="pairs at most")
    p.add_argument("--max-width", type=float, default=0.04,
                   help="widest 95%% interval that still gives a verdict when it includes the target")
    p.add_argument("--json", metavar="PATH", help="also write the pairs and figures as JSON here")
    p.add_argument("--verbose", action="store_true", help="show the toolkit runs' console lines")
    return p


def main(argv=None) -> int:
    if _device(argv) == "cuda":      # its own model and options: bench/overhead_cuda.py --help
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from overhead_cuda import main as cuda_main
        return cuda_main(argv)
    p = _parser()
    a = p.parse_args(argv)
    steps = steps_per_run(a)
    if not 0 < a.warmup < steps:
        p.error(f"--warmup {a.warmup} must be between 1 and the steps per run - 1 ({steps - 1})")
    from ddp_hpc.launch import launch_distributed
    with tempfile.TemporaryDirectory() as tmp:
        pairs = launch_distributed(_worker, a.procs, args=(vars(a), tmp), timeout=3600)[0]
    s = summarize(a, pairs)
    _print(a, s)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"config": vars(a), **s}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
