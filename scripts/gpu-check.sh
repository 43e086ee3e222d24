#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one command, for a node with an NVIDIA GPU and a CUDA build of
# PyTorch already installed: tests/gpu (pytest -m gpu), bench/overhead.py --device cuda and the IO
# figure bench/io_cuda.py; writes gpu-report.md plus the raw logs into the results folder.
#
#   bash scripts/gpu-check.sh [--out DIR] [--no-bench] [--no-io] [-- PYTEST_ARGS...]
#
# Results folder: --out DIR, else $GPU_CHECK_OUT, else gpu-results/ in the repository root.
# Exit status: 0 every check passed (skips allowed), 1 a check failed, 2 a bad argument, 3 no GPU
# here (found out first, in about a second, before anything slow; nothing is run or written).
# Python: $PYTHON, else the first of python3, .venv/bin/python, python that imports torch.
# Packages the node lacks (submitit, lmdb, ...): wheels in $GPU_WHEELS, .whl/ or wheels/ (e.g. made
# by scripts/gpu-wheels.sh on a machine with internet access) are installed with --no-deps into a
# private folder on PYTHONPATH; without wheels, pip tries the index. ddp_hpc itself comes from this
# checkout through PYTHONPATH (nothing is installed into the node's environment).
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
REPO=$PWD
OUT_DIR=${GPU_CHECK_OUT:-$REPO/gpu-results}
BENCH=1 IO=1
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) BENCH=0 ;;
    --no-io) IO=0 ;;
    --out) [ $# -gt 1 ] || { echo "gpu-check: --out needs a folder" >&2; exit 2; }; OUT_DIR=$2; shift ;;
    --out=*) OUT_DIR=${1#--out=} ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$OUT_DIR" in /*) ;; *) OUT_DIR=$CALLER/$OUT_DIR ;; esac   # relative: to where it was started

no_gpu() {
  echo "gpu-check: no GPU here: $1." >&2
  echo "gpu-check: these checks need a node with an NVIDIA GPU and a CUDA build of PyTorch;" \
       "nothing was run. Run it on a GPU node (docs/gpu.md)." >&2
  exit 3
}

# --- 1. a GPU at all? (no Python yet: this answers in milliseconds where there is none)
if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(timeout 30 nvidia-smi -L 2>&1) || no_gpu "nvidia-smi -L failed: ${GPUS:-no output}"
  [ -n "$GPUS" ] || no_gpu "nvidia-smi -L lists no GPU"
elif ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  no_gpu "nvidia-smi not found and no /dev/nvidia* device"
fi

PY=
for c in "${PYTHON:-}" python3 "$REPO/.venv/bin/python" python; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then
    PY=$(command -v "$c"); break
  fi
done
[ -n "$PY" ] || no_gpu "a GPU device exists but no Python here imports torch (set PYTHON=...)"
CUDA_OK=$("$PY" -c 'import torch; print(torch.cuda.is_available(), torch.__version__, torch.version.cuda)' 2>&1)
case "$CUDA_OK" in
  True*) ;;
  *) no_gpu "torch.cuda.is_available() is not True ($PY: ${CUDA_OK//$'\n'/ })" ;;
esac

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
REPORT=$OUT_DIR/gpu-report.md
export GPU_REPORT_DIR=$OUT_DIR PYTHONUNBUFFERED=1
COMMANDS=()
note() { echo "gpu-check: $*" >&2; }

# --- 2. packages: wheels first, then the index; ddp_hpc from this checkout
SITE=${TMPDIR:-/tmp}/ddp_hpc-gpu-site
PKG_NOTE=
WHEELS=${GPU_WHEELS:-}
case "$WHEELS" in ""|/*) ;; *) WHEELS=$CALLER/$WHEELS ;; esac
for d in "$WHEELS" .whl wheels; do
  if [ -n "$d" ] && compgen -G "$d/*.whl" >/dev/null; then
    cmd="$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $d/*.whl"
    COMMANDS+=("$cmd")
    # shellcheck disable=SC2086
    $cmd && PKG_NOTE="installed from $d/: $(cd "$d" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')" \
      || PKG_NOTE="pip could not install the wheels in $d/"
    break
  fi
done
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
MISSING=$("$PY" - <<'EOF'
import importlib.util
pip = {"yaml": "pyyaml", "PIL": "pillow"}
mods = ["submitit", "lmdb", "tqdm", "yaml", "psutil", "xxhash", "PIL", "numpy", "pytest", "pytest_timeout"]
print(" ".join(pip.get(m, m.replace("_", "-")) for m in mods if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$MISSING" ]; then
  cmd="$PY -m pip install -q --no-deps --target $SITE --timeout 10 --retries 0 $MISSING"
  COMMANDS+=("$cmd")
  # shellcheck disable=SC2086
  if $cmd >/dev/null 2>&1; then PKG_NOTE="$PKG_NOTE; from the index: $MISSING"
  else PKG_NOTE="$PKG_NOTE; MISSING (no wheels, index unreachable): $MISSING"; note "missing: $MISSING"; fi
fi

# --- 3. what this node is
FACTS=$("$PY" - <<'EOF'
import platform, subprocess, torch, torch.distributed
q = "name,driver_version,memory.total,pci.bus_id"
try:
    smi = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout.strip().splitlines()
except (OSError, subprocess.SubprocessError) as e:
    smi = [f"nvidia-smi: {e}"]
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "not built"
props = torch.cuda.get_device_properties(0)
print(f"| GPUs (nvidia-smi: {q}) | {'<br>'.join(smi)} |")
print(f"| torch.cuda | {torch.cuda.device_count()} device(s); cuda:0 {props.name}, capability "
      f"{props.major}.{props.minor}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB |")
print(f"| torch / CUDA / cuDNN / NCCL | {torch.__version__} / {torch.version.cuda} / "
      f"{torch.backends.cudnn.version()} / {nccl} |")
print(f"| Python / OS | {platform.python_version()} / {platform.platform()} |")
EOF
)
if REV=$(git rev-parse --short HEAD 2>/dev/null); then
  DIRTY=$(git status --porcelain 2>/dev/null | wc -l | tr -d ' ')
else
  REV="(no git here: a copy of the tree)" DIRTY="?"
fi

# --- 4. the checks
cmd="$PY -m pytest tests/gpu -m gpu -rA -p no:cacheprovider --junitxml=$OUT_DIR/gpu-junit.xml ${PYTEST_ARGS[*]}"
COMMANDS+=("$cmd")
note "$cmd"
# shellcheck disable=SC2086
$cmd 2>&1 | tee "$OUT_DIR/gpu-pytest.log"
PYTEST_RC=${PIPESTATUS[0]}

BENCH_RC=skipped IO_RC=skipped
if [ "$BENCH" = 1 ]; then
  cmd="$PY bench/overhead.py --device cuda"
  COMMANDS+=("$cmd"); note "$cmd"
  $cmd 2>&1 | tee "$OUT_DIR/gpu-bench.txt"; BENCH_RC=${PIPESTATUS[0]}
fi
if [ "$IO" = 1 ]; then
  cmd="$PY bench/io_cuda.py --out $OUT_DIR/gpu-io.txt"
  COMMANDS+=("$cmd"); note "$cmd"
  $cmd 2>&1 | tee "$OUT_DIR/gpu-io.log"; IO_RC=${PIPESTATUS[0]}
fi

# --- 5. the report
export FACTS REV DIRTY PKG_NOTE PYTEST_RC BENCH_RC IO_RC OUT_DIR
printf '%s\n' "${COMMANDS[@]}" > "$OUT_DIR/.gpu-commands"
"$PY" - "$REPORT" <<'EOF'
import os, re, sys, time, xml.etree.ElementTree as ET
from pathlib import Path
out, env = Path(os.environ["OUT_DIR"]), os.environ
rows, counts = [], {}
junit = out / "gpu-junit.xml"
for case in (ET.parse(junit).iter("testcase") if junit.exists() else []):
    kids = [k for k in case if k.tag in ("failure", "error", "skipped")]
    what = kids[0].tag if kids else "passed"
    what = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}.get(what, what)
    counts[what] = counts.get(what, 0) + 1
    msg = (kids[0].get("message") or "").splitlines()[0][:160].replace("|", "/") if kids else ""
    rows.append(f"| {case.get('classname', '').split('.')[-1]}::{case.get('name')} | {what} | "
                f"{float(case.get('time', 0)):.1f} | {msg} |")
def text(name, keep=lambda s: True):
    p = out / name
    if not p.exists():
        return "(not run)"
    return "\n".join(ln for ln in p.read_text(errors="replace").splitlines() if keep(ln)).strip() or "(empty)"
fig = lambda ln: not re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[rank", ln)
ok = env["PYTEST_RC"] == "0" and env["BENCH_RC"] in ("0", "skipped") and env["IO_RC"] in ("0", "skipped")
lines = [
    "# GPU check report (scripts/gpu-check.sh)", "",
    f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, ddp_hpc {env['REV']} ({env['DIRTY']} uncommitted paths): "
    f"**{'PASSED' if ok else 'FAILED'}** (pytest exit {env['PYTEST_RC']}, bench {env['BENCH_RC']}, io {env['IO_RC']})", "",
    "| | |", "| --- | --- |", env["FACTS"], f"| packages | {env['PKG_NOTE'].strip('; ') or 'all present'} |", "",
    "## tests/gpu: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), "",
    "| test | result | s | message |", "| --- | --- | --- | --- |", *rows, "",
    "## bench/overhead.py --device cuda", "", "```", text("gpu-bench.txt", fig), "```", "",
    "## bench/io_cuda.py: the images job's samples/s per data.io, the GPU as consumer", "", "```", text("gpu-io.txt"), "```", "",
    "## NCCL_DEBUG=INFO with and without ddp_hpc's NCCL_SOCKET_IFNAME (tests/gpu/test_gpu_nccl.py)", "",
    "```", text("nccl-ifname.txt"), "```", "",
    "## Commands", "", "```", "bash scripts/gpu-check.sh", text(".gpu-commands"), "```", "",
    "Raw logs beside this file: gpu-pytest.log, gpu-junit.xml, gpu-bench.txt, gpu-io.log, nccl-ifname.txt.",
]
Path(sys.argv[1]).write_text("\n".join(lines) + "\n")
sys.exit(0 if ok else 1)
EOF
RC=$?
rm -f "$OUT_DIR/.gpu-commands"
note "report: $REPORT ($([ $RC = 0 ] && echo passed || echo FAILED))"
exit $RC
