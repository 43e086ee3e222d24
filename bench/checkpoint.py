"""How long a checkpoint blocks the training thread: a synchronous save, ddp_hpc's async save and
``torch.distributed.checkpoint.async_save`` (the reference), in one run, on this machine.

What it measures, for each state size (``--sizes``; an MLP with Adam, its state = weights + the
two Adam moments, 12 bytes per parameter): ~150 MB (12.5M parameters) and ~1.5 GB (125M):
- **sync**: ``train.checkpoint.save_checkpoint`` on the training thread (serialise, fsync, atomic
  rename, prune): all of it blocks;
- **async**: ``train.asyncsave.AsyncSaver.save`` (what ``checkpoint.async: true`` does in the loop
  and ``checkpoint.save(..., blocking=False)`` in a script): the copy into the kept CPU buffers
  blocks; the write runs on a thread, and is waited for (not counted) before the next save;
- **dcp async_save**: ``torch.distributed.checkpoint.async_save`` in a one-process gloo group,
  its default stager (a CPU copy), its writer thread; the call blocks, ``.result()`` is waited for
  (not counted) before the next save.
Each is run ``--reps`` times after one untimed warm-up (first allocations, DCP's first plan), in
rounds that run each once (the order rotating), so load from other work on the machine reaches
all alike; the figure is the median blocking time, with the median time the background write
took.  Ratios
compare with the sync save and with DCP measured in the same run.  Target (issue 31): async
blocking <= 5% of sync, and not more than async_save's.

Adding a row (e.g. a memory snapshot or a restore): write ``def x(case: Case) -> (op, settle)``:
``op(step)`` is what blocks the training thread (e.g. a snapshot of ``case.state()``), timed;
``settle()`` waits for its background work, untimed, and returns that work's seconds or None;
then append ``("label", x)`` to `MEASUREMENTS`.  Every row runs ``case.reps`` times after one
warm-up, interleaved with the others; the table prints each row's median and its ratio to the
sync save.

    python bench/checkpoint.py                      # both sizes, ~3-6 minutes on 2 CPU cores
    python bench/checkpoint.py --sizes 150mb --reps 5 --json runs/checkpoint.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_hpc.train.asyncsave import AsyncSaver  # noqa: E402
from ddp_hpc.train.checkpoint import save_checkpoint  # noqa: E402

#: name -> parameters (weights + Adam's two moments: 12 bytes each in fp32)
SIZES = {"150mb": 12_500_000, "1.5gb": 125_000_000}
DEPTH = 4
TARGET_SYNC, TARGET_DCP = 0.05, 1.0


@dataclass
class Case:
    """One state to save: an MLP with Adam's moments filled in, and where its files go."""
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    directory: Path
    reps: int

    def state(self) -> dict:
        """What the training loop hands to a save (the loop adds small things: RNG, position)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "epoch": 0, "batch_in_epoch": 0}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state()))


@dataclass
class Row:
    what: str
    blocking_s: float                      # median over the reps
    write_s: float | None = None           # the background write (None: it all blocked)
    reps: list[float] = field(default_factory=list)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def make_case(name: str, params: int, root: Path, reps: int) -> Case:
    width = int((params / DEPTH) ** 0.5)
    torch.manual_seed(0)
    layers = [nn.Linear(width, width, bias=False) for _ in range(DEPTH)]
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():                 # one step fills in exp_avg / exp_avg_sq
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return Case(name, model, opt, root / name, reps)


#: what a measurement gives for one case: ``op(step)``, timed on the training thread, and
#: ``settle()``, which waits for the op's background work (not timed) and says how long that work
#: took (None: there was none)
Op = Callable[[int], None]
Settle = Callable[[], "float | None"]


def sync_save(case: Case) -> tuple[Op, Settle]:
    d = case.directory / "sync"
    return (lambda step: save_checkpoint(d, step, case.state(), keep_last=2)), (lambda: None)


def async_save(case: Case) -> tuple[Op, Settle]:
    d, saver, last = case.directory / "async", AsyncSaver(), []

    def settle() -> float:
        saver.wait()
        return last[-1].write_s
    return (lambda step: last.append(saver.save(d, step, case.state(), 2))), settle


def dcp_async_save(case: Case) -> tuple[Op, Settle]:
    import torch.distributed.checkpoint as dcp
    d, futures, started = case.directory / "dcp", [], []

    def save(step: int) -> None:
        futures.append(dcp.async_save(case.state(), checkpoint_id=str(d / f"step-{step}")))
        started.append(time.perf_counter())

    def settle() -> float:
        futures[-1].result()
        took = time.perf_counter() - started[-1]
        shutil.rmtree(d / f"step-{len(futures) - 3}", ignore_errors=True)   # keep the last 2
        return took
    return save, settle


MEASUREMENTS: list[tuple[str, Callable[[Case], tuple[Op, Settle]]]] = [
    ("sync save", sync_save),
    ("ddp_hpc async save", async_save),
    ("dcp async_save", dcp_async_save),
]


def run_case(case: Case) -> list[Row]:
    """Round ``r`` (0: the untimed warm-up) runs every measurement once, the order rotated by one
    each round, so a change in the machine's load reaches every row alike; before each op the
    weights move (as a training step would)."""
    made = [(label, *make(case)) for label, make in MEASUREMENTS]
    rows = {label: Row(label, 0.0) for label, _, _ in made}
    writes: dict[str, list[float]] = {label: [] for label, _, _ in made}
    for r in range(case.reps + 1):
        k = r % len(made)
        for label, op, settle in made[k:] + made[:k]:
            with torch.no_grad():
                for p in case.model.parameters():
                    p.add_(1e-3)
            t0 = time.perf_counter()
            op(r)
            took = time.perf_counter() - t0
            write = settle()
            if r:
                rows[label].reps.append(took)
                if write is not None:
                    writes[label].append(write)
    for label, row in rows.items():
        row.blocking_s = statistics.median(row.reps)
        row.write_s = statistics.median(writes[label]) if writes[label] else None
    shutil.rmtree(case.directory, ignore_errors=True)
    return list(rows.values())


def report(case: Case, rows: list[Row]) -> dict:
    """The table, and the ratios of the medians (the verdict) and of the minima (the cost least
    disturbed by other work on the machine)."""
    by = {r.what: r for r in rows}
    sync, sync_min = by["sync save"].blocking_s, min(by["sync save"].reps)
    print(f"\n{case.name}: state {case.nbytes / 1e6:.0f} MB, {case.reps} rounds after a warm-up "
          f"(seconds; the machine may be loaded by other work)")
    print(f"  {'what':<26} {'blocking':>9} {'min':>8} {'write':>7} {'/ sync':>8} {'min/min':>8}")
    for r in rows:
        write = f"{r.write_s:7.3f}" if r.write_s is not None else f"{'-':>7}"
        print(f"  {r.what:<26} {r.blocking_s:9.4f} {min(r.reps):8.4f} {write} "
              f"{r.blocking_s / sync:8.4f} {min(r.reps) / sync_min:8.4f}")
    ours, ref = by["ddp_hpc async save"], by["dcp async_save"]
    ratios = {"async / sync": ours.blocking_s / sync, "async / dcp async_save": ours.blocking_s / ref.blocking_s,
              "min: async / sync": min(ours.reps) / sync_min,
              "min: async / dcp async_save": min(ours.reps) / min(ref.reps)}
    ok = ratios["async / sync"] <= TARGET_SYNC and ratios["async / dcp async_save"] <= TARGET_DCP
    print(f"  medians: async / sync = {ratios['async / sync']:.4f} (target <= {TARGET_SYNC}), "
          f"async / dcp async_save = {ratios['async / dcp async_save']:.3f} (target <= {TARGET_DCP}): "
          f"{'met' if ok else 'MISSED'}")
    print(f"  minima:  async / sync = {ratios['min: async / sync']:.4f}, "
          f"async / dcp async_save = {ratios['min: async / dcp async_save']:.3f}")
    return {"size": case.name, "bytes": case.nbytes, "rows": [asdict(r) for r in rows],
            "ratios": ratios, "target_met": ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--reps", type=int, default=5, help="timed saves per row (after one warm-up)")
    p.add_argument("--dir", help="where the files go (default: a temporary folder under $TMPDIR)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    a = p.parse_args(argv)
    sizes = [s.strip().lower() for s in a.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        p.error(f"--sizes {','.join(bad)}: not a size here; choose from {', '.join(SIZES)}")
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="ddp_hpc-bench-ckpt-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)   # dcp's group; ours need none
    results = []
    try:
        for name in sizes:
            case = make_case(name, SIZES[name], root, a.reps)
            results.append(report(case, run_case(case)))
            del case
    finally:
        dist.destroy_process_group()
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"torch": torch.__version__, "cases": results}, indent=2) + "\n")
    return 0 if all(r["target_met"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
