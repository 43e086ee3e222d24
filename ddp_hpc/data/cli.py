"""``ddp-hpc data pack|verify|make-images|stage|sbcast ...``: prepare a dataset for a shared filesystem.

    ddp-hpc data make-images /shared/imgs --count 20000
    ddp-hpc data pack /shared/imgs /shared/imgs.lmdb
    ddp-hpc data verify /shared/imgs.lmdb
    ddp-hpc data stage /shared/imgs.lmdb --to tmpdir     # copy once per node, print the path
    ddp-hpc data sbcast /shared/imgs.lmdb --to tmpdir    # in a batch script: Slurm's sbcast to
                                                         # every node; stage adopts the copies

Errors print one message with a HINT and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ddp_hpc.data.errors import PackError, StageError, VerifyError
from ddp_hpc.data.sbcast import sbcast_stage
from ddp_hpc.data.stage import resolve_stage_dir, stage
from ddp_hpc.env import job_facts
from ddp_hpc.errors import report
from ddp_hpc.text import ArgumentParser, HelpFormatter, prog

_DESCRIPTION = """Prepare a dataset for a shared filesystem: pack many small files into one LMDB, check it,
copy it once per node (stage), or let Slurm's sbcast fan it out.

  make-images /shared/imgs --count 20000
  pack /shared/imgs /shared/imgs.lmdb
  verify /shared/imgs.lmdb
  stage /shared/imgs.lmdb --to tmpdir      copy once per node, print the path
  sbcast /shared/imgs.lmdb --to tmpdir     in a batch script: to every node; stage adopts the copies"""
_TO_HELP = "where to copy: auto ($SLURM_TMPDIR, then $TMPDIR, then /tmp), slurm_tmpdir, tmpdir, shm or an absolute path"


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number of bytes like 64M or 2G") from None


def _add_pack(sub) -> argparse.ArgumentParser:
    a = sub.add_parser("pack", formatter_class=HelpFormatter,
                       help="pack a folder of files (or class-per-folder images, WebDataset shards or a Hugging Face "
                            "save_to_disk folder) into one LMDB",
                       description="Pack every file below SRC into one LMDB at OUT (atomically: OUT "
                                   "appears only once complete).")
    a.add_argument("src", metavar="SRC", help="folder of files, a class-per-folder tree SRC/<class>/<file>, or "
                   "WebDataset shards (a .tar file or a folder of them; KEY.png + KEY.cls per sample), or a "
                   "Hugging Face datasets folder written by save_to_disk (one split; needs `pip install datasets`)")
    a.add_argument("out", metavar="OUT", help="the LMDB folder to create, e.g. /shared/imgs.lmdb")
    a.add_argument("--map-size", type=_size, default="64M", metavar="BYTES",
                   help="initial LMDB map size like 64M or 2G; it doubles on demand")
    a.add_argument("--txn-size", type=_size, default="64M", metavar="BYTES",
                   help="bytes of records per write transaction")
    a.add_argument("--no-check", action="store_true", help="do not decode images before packing")
    a.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes that read and check the files (default: the CPUs of the allocation, "
                        "$SLURM_CPUS_PER_TASK or this process's CPU affinity); the LMDB is the same for any N")
    a.add_argument("--overwrite", action="store_true", help="replace an existing OUT (only after a complete pack)")
    return a


def _add_make_images(sub) -> argparse.ArgumentParser:
    m = sub.add_parser("make-images", formatter_class=HelpFormatter,
                       help="write a demo class-per-folder dataset of small PNG files")
    m.add_argument("root", metavar="ROOT", help="folder to create (ROOT/class_XX/NNNNNNN.png)")
    m.add_argument("--count", type=int, default=2000, help="number of images")
    m.add_argument("--classes", type=int, default=10, help="number of classes (sub-folders)")
    m.add_argument("--size", type=int, default=16, help="width and height of each image in pixels")
    m.add_argument("--seed", type=int, default=0, help="random seed (use another one for an evaluation set)")
    return m


def _add_stage(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("stage", formatter_class=HelpFormatter,
                       help="copy a file, LMDB or folder to node-local storage (single process; in a Slurm job "
                            "keyed by its job id, so training ranks reuse it)")
    s.add_argument("src", metavar="SRC", help="file, LMDB folder or folder on the shared filesystem")
    s.add_argument("--to", default="auto", help=_TO_HELP)
    return s


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog("data"), formatter_class=HelpFormatter, description=_DESCRIPTION)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    pack = _add_pack(sub)
    v = sub.add_parser("verify", formatter_class=HelpFormatter, help="check every record of an LMDB made by pack")
    v.add_argument("path", metavar="PATH", help="the LMDB folder to check")
    images, stage_ = _add_make_images(sub), _add_stage(sub)
    b = sub.add_parser("sbcast", formatter_class=HelpFormatter,
                       help="in a batch script: sbcast a file, LMDB or folder (as one archive) to every node "
                            "of the job")
    b.add_argument("src", metavar="SRC", help="file, LMDB folder or folder on the shared filesystem")
    b.add_argument("--to", default="auto", help=_TO_HELP + " (the same path on every node)")
    for q in (pack, v, images, stage_, b):
        q.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _run(args: argparse.Namespace) -> tuple[dict, str]:
    """Run one subcommand; -> (result, the line to print)."""
    if args.cmd == "pack":
        from ddp_hpc.data.pack import pack  # lmdb, torch: loaded only for the commands that use them

        out = pack(args.src, args.out, map_size=args.map_size, txn_bytes=args.txn_size,
                   check_images=not args.no_check, overwrite=args.overwrite, workers=args.workers)
        return out, f"packed {out['count']} files ({out['bytes']} bytes, {out['kind']}) into {out['path']}"
    if args.cmd == "verify":
        from ddp_hpc.data.lmdb import verify

        out = verify(args.path)
        return out, f"ok: {out['count']} records, {out['verified_bytes']} bytes, checksums match in {out['path']}"
    if args.cmd == "make-images":
        from ddp_hpc.examples.images import make_images

        root = make_images(args.root, args.count, args.classes, args.size, args.seed)
        return {"root": root}, f"images in {root}"
    if args.cmd == "sbcast":
        out = sbcast_stage(args.src, resolve_stage_dir(args.to))
        return out, (f"sbcast {out['bytes']} bytes to {out['data']} on every node in {out['seconds']:.1f} s; "
                     "data.io=stage (or `ddp-hpc data stage`) adopts it")
    facts = job_facts()
    path = stage(args.src, resolve_stage_dir(args.to), job_id=facts.key, restart_count=facts.restart_count)
    return {"path": path}, f"staged at {path}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out, text = _run(args)
    except (PackError, VerifyError, StageError, FileExistsError, FileNotFoundError, ValueError) as e:
        report(parser.prog, e)
        return 2
    print(json.dumps(out) if args.json else text)
    return 0
