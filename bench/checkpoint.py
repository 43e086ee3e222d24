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
Each is run ``--reps`` times after one untimed warm-up (first allocations, DCP's first plan); the
figure is the median blocking time, with the median time the background write took.  Ratios
compare with the sync save and with DCP measured in the same run.  Target (issue 31): async
blocking <= 5% of sync, and not more than async_save's.

Adding a row (e.g. a memory snapshot): write ``def measure_x(case: Case) -> Row`` that times what
blocks the training thread for ``case.state()`` (``case.reps`` times after a warm-up, `timed`
helps) and append ``("label", measure_x)`` to `MEASUREMENTS`; the table prints every row and its
ratio to the sync save.

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


def timed(case: Case, save: Callable[[int], None], settle: Callable[[], float | None]) -> Row:
    """``save(step)`` timed (the blocking part) ``case.reps`` times after one warm-up; ``settle``
    waits for its background work and returns how long that work took (None: none)."""
    blocking, writes = [], []
    for step in range(case.reps + 1):
        with torch.no_grad():                    # training moved the weights since the last save
            for p in case.model.parameters():
                p.add_(1e-3)
        t0 = time.perf_counter()
        save(step)
        took = time.perf_counter() - t0
        write = settle()
        if step:
            blocking.append(took)
            if write is not None:
                writes.append(write)
    return Row("", statistics.median(blocking), statistics.median(writes) if writes else None,
               blocking)


def measure_sync(case: Case) -> Row:
    d = case.directory / "sync"
    return timed(case, lambda step: save_checkpoint(d, step, case.state(), keep_last=2), lambda: None)


def measure_async(case: Case) -> Row:
    d, saver = case.directory / "async", AsyncSaver()
    last: list = []

    def settle() -> float:
        saver.wait()
        return last[-1].write_s
    return timed(case, lambda step: last.append(saver.save(d, step, case.state(), 2)), settle)


def measure_dcp(case: Case) -> Row:
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
    return timed(case, save, settle)


MEASUREMENTS: list[tuple[str, Callable[[Case], Row]]] = [
    ("sync save", measure_sync),
    ("ddp_hpc async save", measure_async),
    ("dcp async_save", measure_dcp),
]


def run_case(case: Case) -> list[Row]:
    rows = []
    for label, measure in MEASUREMENTS:
        row = measure(case)
        row.what = label
        rows.append(row)
        shutil.rmtree(case.directory, ignore_errors=True)
    return rows


def report(case: Case, rows: list[Row]) -> dict:
    by = {r.what: r for r in rows}
    sync = by["sync save"].blocking_s
    print(f"\n{case.name}: state {case.nbytes / 1e6:.0f} MB, {case.reps} saves each after a warm-up "
          f"(median; the machine may be loaded by other work)")
    print(f"  {'what':<26} {'blocking s':>11} {'write s':>9} {'/ sync':>8}")
    for r in rows:
        write = f"{r.write_s:9.3f}" if r.write_s is not None else f"{'-':>9}"
        print(f"  {r.what:<26} {r.blocking_s:11.4f} {write} {r.blocking_s / sync:8.4f}")
    ours, ref = by["ddp_hpc async save"].blocking_s, by["dcp async_save"].blocking_s
    ratios = {"async / sync": ours / sync, "async / dcp async_save": ours / ref}
    ok = ratios["async / sync"] <= TARGET_SYNC and ratios["async / dcp async_save"] <= TARGET_DCP
    print(f"  async / sync = {ratios['async / sync']:.4f} (target <= {TARGET_SYNC}), "
          f"async / dcp async_save = {ratios['async / dcp async_save']:.3f} (target <= {TARGET_DCP}): "
          f"{'met' if ok else 'MISSED'}")
    return {"size": case.name, "bytes": case.nbytes, "rows": [asdict(r) for r in rows],
            "ratios": ratios, "target_met": ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--reps", type=int, default=3, help="timed saves per row (after one warm-up)")
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
