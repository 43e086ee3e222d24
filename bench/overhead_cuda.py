"""``bench/overhead.py --device cuda``: the toolkit's loop against a good hand-written DDP loop on GPUs.

One rank per GPU (``--procs``, default: every visible GPU). The model keeps an H100 busy: a
ResNet-18-style CNN (widths 64-512, no stem downsampling) on 3x64x64 images, bf16 autocast,
channels_last, SGD with momentum, batch 256 per rank. Images are uint8 in host memory (the model
scales them on the GPU), fed by a DataLoader with ``--workers`` processes and pinned memory.

The hand-written loop is a good one, not the textbook one: non_blocking copies, bf16 autocast, the loss
summed on the device (no ``.item()`` per step), DDP only with more than one rank (as the toolkit).
The toolkit run is ``fit()`` with ``train.precision=bf16`` and its defaults otherwise (run logs,
the preemption flag check, a final checkpoint), progress output off.

Figures: steady state (samples/s between the end of step ``--warmup`` and the last step, with a
``torch.cuda.synchronize()`` at both ends; the ratio's target is >= 0.98), end to end (set-up,
DataLoader start, final checkpoint included), and the step time against the compute floor (the
same step on one batch already on the GPU, no data loading): how busy the GPU is in a plain step.

    python bench/overhead.py --device cuda              # every GPU, ~1 minute on one H100
    python bench/overhead.py --device cuda --steps 200 --reps 5
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from torch import nn


class Block(nn.Module):
    """The basic residual block: conv-bn-relu-conv-bn plus the (projected) input."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNetish(nn.Module):
    """ResNet-18's stages on small images; takes uint8 NCHW and scales it on the device."""

    def __init__(self, width: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        layers: list[nn.Module] = [nn.Conv2d(3, w[0], 3, 1, 1, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU(inplace=True)]
        cin = w[0]
        for i, cout in enumerate(w):
            layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().div_(255).contiguous(memory_format=torch.channels_last)
        return self.head(self.features(x).mean((2, 3)))


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return ResNetish(width).to(memory_format=torch.channels_last)


def make_data(size: int, image: int):
    g = torch.Generator().manual_seed(0)
    from torch.utils.data import TensorDataset
    return TensorDataset(torch.randint(0, 256, (size, 3, image, image), dtype=torch.uint8, generator=g),
                         torch.randint(0, 10, (size,), generator=g))


class Marks:
    """Wall-clock marks at two optimizer steps, the GPU drained first (two syncs per run)."""

    def __init__(self, first: int, last: int) -> None:
        self.at, self.t = (first, last), {}

    def __call__(self, step: int, epoch: int = 0) -> None:  # noqa: ARG002 - fit's on_step
        if step in self.at:
            torch.cuda.synchronize()
            self.t[step] = time.perf_counter()

    def seconds(self) -> float:
        return self.t[self.at[1]] - self.t[self.at[0]]


def _plain(model, data, a, rank: int, world: int, device, marks: Marks, tmp: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    model.to(device)
    net = DDP(model, device_ids=[device.index]) if world > 1 else model
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler, num_workers=a.workers,
                        pin_memory=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    total = torch.zeros((), device=device)
    net.train()
    for step, (x, y) in enumerate(loader, 1):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = crit(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total += loss.detach()
        marks(step)
    float(total)                         # the one sync of the run, like the toolkit's epoch loss
    if rank == 0:
        torch.save(model.state_dict(), f"{tmp}/plain_model.pt")


def _toolkit(model, data, a, marks: Marks, tmp: str) -> None:
    from ddp_hpc.train import fit
    fit(model, data, on_step=marks, overrides=[
        f"train.batch_size={a.batch_size}", "train.epochs=1", "train.precision=bf16", "optim.name=sgd",
        "optim.lr=0.05", "optim.momentum=0.9", f"data.num_workers={a.workers}", "log.progress=off",
        f"log.dir={tmp}/logs", f"checkpoint.dir={tmp}/ckpt", "checkpoint.every_epochs=0",
        "checkpoint.resume=false"])


def _floor_ms(a, device, iters: int = 20) -> float:
    """Milliseconds per step with one batch resident on the GPU (no data loading, no DDP)."""
    model = make_model(a.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randint(0, 256, (a.batch_size, 3, a.image, a.image), dtype=torch.uint8, device=device)
    y = torch.randint(0, 10, (a.batch_size,), device=device)
    crit = nn.CrossEntropyLoss()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(iters + 5):
        if i == 5:
            start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _worker(rank: int, world: int, args_d: dict, tmp: str) -> dict:
    import torch.distributed as dist

    from ddp_hpc.dist import cleanup_ddp, setup_ddp
    a = argparse.Namespace(**args_d)
    ctx = setup_ddp()
    try:
        data = make_data(a.batch_size * world * (a.warmup + a.steps), a.image)
        out = {"plain": [], "toolkit": [], "plain_e2e": [], "toolkit_e2e": [], "floor_ms": _floor_ms(a, ctx.device),
               "gpu": torch.cuda.get_device_name(ctx.device)}
        for rep in range(a.reps):
            for kind in (("plain", "toolkit") if rep % 2 == 0 else ("toolkit", "plain")):
                marks, model = Marks(a.warmup, a.warmup + a.steps), make_model(a.width)
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "plain":
                    _plain(model, data, a, rank, world, ctx.device, marks, tmp)
                else:
                    _toolkit(model, data, a, marks, f"{tmp}/toolkit{rep}")
                dist.barrier()
                out[kind].append(marks.seconds())
                out[kind + "_e2e"].append(time.perf_counter() - t0)
        return out
    finally:
        cleanup_ddp()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/overhead.py --device cuda", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda",), default="cuda")
    p.add_argument("--procs", type=int, default=None, help="ranks, one per GPU (default: every GPU)")
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--image", type=int, default=64, help="image side (pixels)")
    p.add_argument("--width", type=int, default=64, help="channels of the first stage (x2 per stage)")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed window")
    p.add_argument("--steps", type=int, default=60, help="timed steps (one epoch holds warmup + steps)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader processes per rank")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each loop, alternating; the best counts")
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench/overhead.py: error: --device cuda but torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}).\n"
              "HINT: run it on a machine with an NVIDIA GPU (scripts/gpu-check.sh, docs/gpu.md), "
              "or leave out --device for the CPU benchmark.", file=sys.stderr)
        return 2
    a.procs = a.procs or torch.cuda.device_count()
    from ddp_hpc.launch import launch_distributed
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch_distributed(_worker, a.procs, args=(vars(a), tmp), timeout=1800)
    _print(a, per_rank)
    return 0


def _print(a, per_rank: list[dict]) -> None:
    best = {k: min(max(r[k][i] for r in per_rank) for i in range(a.reps))
            for k in ("plain", "toolkit", "plain_e2e", "toolkit_e2e")}
    timed = a.steps * a.batch_size * a.procs
    whole = (a.warmup + a.steps) * a.batch_size * a.procs
    sps = {k: timed / best[k] for k in ("plain", "toolkit")}
    e2e = {k: whole / best[k + "_e2e"] for k in ("plain", "toolkit")}
    ms = {k: 1000 * best[k] / a.steps for k in ("plain", "toolkit")}
    floor = max(r["floor_ms"] for r in per_rank)
    print(f"device {per_rank[0]['gpu']} x {a.procs} process(es), model ResNetish(width {a.width}) bf16 "
          f"channels_last, batch {a.batch_size}/rank, uint8 images 3x{a.image}x{a.image}, {a.workers} "
          f"workers/rank, {a.steps} timed steps after {a.warmup}, best of {a.reps}")
    print(f"plain DDP loop : {sps['plain']:10.1f} samples/s ({ms['plain']:.2f} ms/step); "
          f"end to end {e2e['plain']:.1f} samples/s ({best['plain_e2e']:.2f} s)")
    print(f"ddp_hpc fit()  : {sps['toolkit']:10.1f} samples/s ({ms['toolkit']:.2f} ms/step); "
          f"end to end {e2e['toolkit']:.1f} samples/s ({best['toolkit_e2e']:.2f} s)")
    print(f"ratio toolkit/plain: {sps['toolkit'] / sps['plain']:.3f} steady state (target >= 0.98); "
          f"{e2e['toolkit'] / e2e['plain']:.3f} end to end (set-up, run logs, final checkpoint)")
    print(f"compute floor (one resident batch, no loading, no DDP): {floor:.2f} ms/step -> the GPU is "
          f"busy ~{100 * floor / ms['plain']:.0f}% of a plain step, ~{100 * floor / ms['toolkit']:.0f}% "
          f"of a toolkit step")


if __name__ == "__main__":
    raise SystemExit(main())
