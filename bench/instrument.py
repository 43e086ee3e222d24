"""What ddp_hpc.exec's zero-code instrumentation costs a plain DDP script, against torchrun.

1. In-loop throughput: the same plain script (a small MLP, a DataLoader, SGD, DDP over gloo; no
   ddp_hpc in it) under ``ddp-hpc submit --backend local -N 1 -G P --wait`` (instrumented: step
   hook, data-wait hook, loss hook, hang watchdog, step events) and under ``torchrun
   --nproc-per-node P``, as alternating pairs (the side that goes first alternates). Each run's
   rank 0 times steps ``--warmup`` to the end; the ratio per pair is submit's steps/s over
   torchrun's. Printed: every pair, the MEDIAN ratio (target >= 0.99) and its min-max.
2. The hooks' own cost: the three operations they wrap (``optimizer.step()``, a DataLoader's
   ``next()``, ``loss.backward()``) timed in this process before and after installing them
   (timeit, the minimum of 9 rounds: robust to a busy machine, unlike 1), in microseconds per
   step.
   Of those, the compute timing's own cost (``compute_s``: a clock read when a batch is ready
   and at ``backward()``, `ddp_hpc.instrument.compute`): the same operations with the timer
   replaced by one that does nothing, the difference printed apart.
3. Start-up: seconds from starting ``ddp-hpc submit ... --wait`` of a 2 x 2 local job to the end
   of the script's first optimizer step on rank 0, against ``torchrun --nproc-per-node 4`` of the
   same script; pairs alternate, the median ratio is printed.

    python bench/instrument.py                        # 5 + 3 pairs, 2-4 minutes on 2 cores
    python bench/instrument.py --pairs 7 --steps 600 --json runs/instrument.json
    python bench/instrument.py --off-pairs 7          # also instrumented vs DDP_HPC_INSTRUMENT=0
    python bench/instrument.py --spans-only           # the compute spans compared (below)

4. The compute spans compared (``--spans``, 2 x 2 local ranks, rank 2's forward busy 20 ms more
   than the others'): per rank, the median of three candidate spans a step, timed in the script
   itself: "forward" (the batch ready -> ``backward()`` called: what ``compute_s`` measures),
   "forward+backward" (the batch ready -> the optimizer step done: holds the all-reduce) and
   "step" (one optimizer step's end to the next). Printed: rank 2's over the median of the
   others, for each. Only a span without a collective tells rank 2 apart.

Both sides get OMP_NUM_THREADS=1 (torchrun's default with several processes). The wall-clock
figures depend on the machine's load: the local backend starts each rank in a session of its own,
and with the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) each
session gets its own share of a busy CPU, torchrun's workers one share together; so on a shared,
busy machine read the second ratio, steps per CPU second of rank 0's process (what the
instrumentation costs in work), and the wall-clock one on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TARGET = 0.99


def worker(out: str, steps: int, warmup: int) -> None:
    """The plain script both launchers run (no ddp_hpc import)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64 * steps, 256), torch.randint(0, 10, (64 * steps,)))
    marks = {}
    for step, (x, y) in enumerate(DataLoader(data, batch_size=64), start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1:
            marks["first_step"] = time.time()
        if step == warmup:
            marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()
    marks["t1"], marks["c1"] = time.perf_counter(), time.process_time()
    if rank == 0:
        n = steps - warmup
        Path(out).write_text(json.dumps({"steps_per_s": n / (marks["t1"] - marks["t0"]),
                                         "steps_per_cpu_s": n / (marks["c1"] - marks["c0"]),
                                         "first_step": marks["first_step"]}))
    del model, opt
    dist.destroy_process_group()


def spans_worker(out: str, steps: int, slow_rank: int, slow_s: float) -> None:
    """The plain script of the span comparison: its own clock around three candidate spans."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64 * steps, 256), torch.randint(0, 10, (64 * steps,)))
    spans: dict[str, list[float]] = {"forward": [], "forward+backward": [], "step": []}
    last = None
    clock = time.perf_counter
    for x, y in DataLoader(data, batch_size=64):
        ready = clock()
        if rank == slow_rank:
            end = ready + slow_s
            while clock() < end:
                pass
        loss = torch.nn.functional.cross_entropy(model(x), y)
        spans["forward"].append(clock() - ready)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done = clock()
        spans["forward+backward"].append(done - ready)
        if last is not None:
            spans["step"].append(done - last)
        last = done
    Path(f"{out}.{rank}").write_text(json.dumps({k: statistics.median(v[5:]) for k, v in spans.items()}))
    del model, opt
    dist.destroy_process_group()


def compare_spans(work: Path, steps: int = 150, slow_s: float = 0.02) -> dict:
    """Run `spans_worker` as a 2 x 2 local job; rank 2's ratio to the others' median per span."""
    out = work / f"spans-{time.monotonic_ns()}"
    env = _env(work / "home")
    cmd = [str(BIN / "ddp-hpc"), "submit", "--backend", "local", "-N", "2", "-G", "2", "--wait", "--log-dir",
           str(work / "runs"), str(Path(__file__).resolve()), "--spans-worker", str(out), "--steps", str(steps),
           "--slow-s", str(slow_s)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"the span comparison failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    per = {r: json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)}
    ratios = {k: per[2][k] / statistics.median(per[r][k] for r in (0, 1, 3)) for k in per[0]}
    print(f"compute spans, 2 x 2 ranks, rank 2's forward {1000 * slow_s:.0f} ms longer; rank 2 / median of "
          "the others: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()), flush=True)
    return {"per_rank_s": per, "rank2_ratio": ratios, "slow_s": slow_s, "steps": steps}


def hook_cost(work: Path, number: int = 3000, repeat: int = 9) -> dict:
    """Microseconds the hooks add to one training step, in this process: the three operations
    they wrap (``optimizer.step()``, a DataLoader's ``next()``, ``loss.backward()``) timed with
    timeit (the minimum of ``repeat`` rounds: robust to a busy machine) before and after
    ``ddp_hpc.instrument.steps.install``, with a run log in ``work`` as in a job."""
    import timeit

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    os.environ.update(RANK="0", WORLD_SIZE="1", DDP_HPC_LOG_DIR=str(work / "hooklog"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's ddp_hpc
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=8)
    ops = {"optimizer.step()": opt.step,
           "DataLoader next()": lambda: next(iter(batches)),
           "loss.backward()": lambda: model(torch.ones(1, 4)).sum().backward()}

    def timed() -> dict[str, float]:
        return {k: 1e6 * min(timeit.repeat(f, number=number, repeat=repeat)) / number for k, f in ops.items()}

    before = timed()
    from ddp_hpc.instrument.steps import install
    counter = install(torch)
    after = timed()
    timer, counter.compute = counter.compute, _NoTimer()
    untimed = timed()
    counter.compute = timer
    extra = {k: after[k] - before[k] for k in ops}
    compute = {k: after[k] - untimed[k] for k in ops}
    print("hooks' own cost per step: " + ", ".join(f"{k} +{v:.2f} us" for k, v in extra.items())
          + f"; in all {sum(extra.values()):.2f} us", flush=True)
    print("  of which the compute timing (compute_s): " + ", ".join(f"{k} +{v:.2f} us" for k, v in compute.items())
          + f"; in all {sum(compute.values()):.2f} us", flush=True)
    alone = timer_cost(number, repeat)
    print(f"  the compute timer alone (one span a step: ready(), backward(), its share of take()): {alone:.2f} us "
          "per step (these differences are within the noise of a busy machine; this one is not)", flush=True)
    return {"before_us": before, "after_us": after, "extra_us": extra, "total_us": sum(extra.values()),
            "compute_timer_us": compute, "compute_timer_total_us": sum(compute.values()), "timer_alone_us": alone}


def timer_cost(number: int = 3000, repeat: int = 9) -> float:
    """Microseconds of one step's compute timing on the CPU, the timer's own calls alone (a take
    every 100 steps, as one step event a second does at 100 steps/s), the minimum of ``repeat``."""
    import timeit

    from ddp_hpc.instrument.compute import ComputeTimer
    timer, loss = ComputeTimer(), object()

    def step() -> None:
        for _ in range(100):
            timer.ready()
            timer.backward(loss)
        timer.take(100)
    return 1e6 * min(timeit.repeat(step, number=number // 100, repeat=repeat)) / number


class _NoTimer:
    """A `ComputeTimer` that does nothing: the hooks' cost without the compute timing."""
    device = None

    def ready(self) -> None:
        pass

    def backward(self, tensor) -> None:  # noqa: ANN001
        pass

    def take(self, steps: int) -> None:
        return None


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "DDP_HPC_"))}
    env.update(OMP_NUM_THREADS="1", DDP_HPC_HOME=str(home), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return env


def run_one(side: str, work: Path, procs: int, nodes: int, steps: int, warmup: int) -> dict:
    out = work / f"{side}-{time.monotonic_ns()}.json"
    args = ["--worker", str(out), "--steps", str(steps), "--warmup", str(warmup)]
    me = str(Path(__file__).resolve())
    env = _env(work / "home")
    if side == "off":   # the same submit, the instrumentation turned off
        env["DDP_HPC_INSTRUMENT"] = "0"
    if side == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(procs * nodes), me, *args]
    else:
        cmd = [str(BIN / "ddp-hpc"), "submit", "--backend", "local", "-N", str(nodes), "-G", str(procs),
               "--wait", "--log-dir", str(work / "runs"), me, *args]
    started = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work, timeout=600)
    if p.returncode != 0 or not out.exists():
        raise SystemExit(f"{side} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    res = json.loads(out.read_text())
    res["to_first_step_s"] = res["first_step"] - started
    return res


def pairs(n: int, work: Path, other: str = "torchrun", **kw) -> list[tuple[dict, dict]]:
    """n pairs (submit, other); the side that goes first alternates."""
    out = []
    for i in range(n):
        order = ("submit", other) if i % 2 == 0 else (other, "submit")
        got = {side: run_one(side, work, **kw) for side in order}
        out.append((got["submit"], got[other]))
    return out


def report_pairs(thr: list[tuple[dict, dict]], other: str) -> dict:
    """Print each pair and the medians of submit / other (wall clock, and per CPU second)."""
    ratios = [s["steps_per_s"] / t["steps_per_s"] for s, t in thr]
    cpu = [s["steps_per_cpu_s"] / t["steps_per_cpu_s"] for s, t in thr]
    for (s, t), r, c in zip(thr, ratios, cpu):
        print(f"  submit {s['steps_per_s']:8.1f} steps/s  {other} {t['steps_per_s']:8.1f} steps/s  "
              f"ratio {r:.3f}   per CPU second: ratio {c:.3f}")
    med, cmed = statistics.median(ratios), statistics.median(cpu)
    for what, m, rs in (("in-loop steps/s", med, ratios), ("in-loop steps per CPU second", cmed, cpu)):
        print(f"{what}, submit (instrumented) / {other}: median {m:.3f} (min {min(rs):.3f}, "
              f"max {max(rs):.3f}), target >= {TARGET}: {'met' if m >= TARGET else 'MISSED'}", flush=True)
    return {"pairs": [[s["steps_per_s"], t["steps_per_s"]] for s, t in thr], "ratios": ratios,
            "median": med, "target": TARGET, "cpu_ratios": cpu, "cpu_median": cmed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--spans-worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--slow-s", type=float, default=0.02, help=argparse.SUPPRESS)
    ap.add_argument("--no-hooks", action="store_true", help="skip the measure of the hooks' own cost")
    ap.add_argument("--spans", action="store_true", help="also compare the compute spans (item 4)")
    ap.add_argument("--spans-only", action="store_true", help="only the hooks' cost and the span comparison")
    ap.add_argument("--pairs", type=int, default=5, help="throughput pairs (default 5)")
    ap.add_argument("--start-pairs", type=int, default=3, help="start-up pairs (default 3)")
    ap.add_argument("--off-pairs", type=int, default=0,
                    help="also pairs of instrumented / uninstrumented submit runs (the instrumentation's "
                         "own cost, both sides started alike; default 0)")
    ap.add_argument("--procs", type=int, default=2, help="processes of the throughput runs (default 2)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.steps, a.warmup)
        return 0
    if a.spans_worker:
        spans_worker(a.spans_worker, a.steps, 2, a.slow_s)
        return 0
    if a.spans_only:
        a.spans, a.pairs, a.start_pairs = True, 0, 0
    work = Path(tempfile.mkdtemp(prefix="ddp_hpc_instrument_bench-"))
    figures: dict = {}
    if not a.no_hooks:
        figures["hooks"] = hook_cost(work)
    if a.spans:
        figures["spans"] = compare_spans(work, slow_s=a.slow_s)
    if a.pairs:
        print(f"throughput: {a.pairs} pairs, {a.procs} processes, steps {a.warmup}-{a.steps} timed", flush=True)
        thr = pairs(a.pairs, work, procs=a.procs, nodes=1, steps=a.steps, warmup=a.warmup)
        figures["throughput"] = report_pairs(thr, "torchrun")
    if a.off_pairs:
        print(f"the same under submit with DDP_HPC_INSTRUMENT=0: {a.off_pairs} pairs", flush=True)
        off = pairs(a.off_pairs, work, other="off", procs=a.procs, nodes=1, steps=a.steps, warmup=a.warmup)
        figures["vs_uninstrumented"] = report_pairs(off, "off")
    if a.start_pairs:
        print(f"start-up: {a.start_pairs} pairs, 2 x 2 local job vs torchrun --nproc-per-node 4", flush=True)
        st = pairs(a.start_pairs, work, procs=2, nodes=2, steps=a.warmup + 10, warmup=a.warmup)
        starts = [s["to_first_step_s"] / t["to_first_step_s"] for s, t in st]
        for (s, t), r in zip(st, starts):
            print(f"  submit {s['to_first_step_s']:6.2f} s  torchrun {t['to_first_step_s']:6.2f} s  ratio {r:.3f}")
        print(f"time to the first step, submit --wait / torchrun: median {statistics.median(starts):.3f}")
        figures["startup"] = {"pairs": [[s["to_first_step_s"], t["to_first_step_s"]] for s, t in st],
                              "ratios": starts, "median": statistics.median(starts)}
    if a.json:
        Path(a.json).write_text(json.dumps({"command": "python bench/instrument.py " + " ".join(sys.argv[1:]),
                                            **figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
