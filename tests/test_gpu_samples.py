"""Issue 34 item 2: each rank's GPU through NVML (ddp_hpc/runlogs/gpu.py), with NVML faked at its
Python boundary (a `pynvml` module object of our own), and what status makes of the samples
(ddp_hpc/judge/gpu.py, the detail view's GPU lines, the table's GPU% column)."""
from __future__ import annotations

import json
import sys
import time
import types

import pytest

from ddp_hpc.judge import gpu as judge_gpu
from ddp_hpc.judge.gpu import gpu_lines
from ddp_hpc.runlogs import gpu


class NVMLError(Exception):
    pass


def fake_nvml(util=87, ecc: int | None = 0, xids=(), power=True) -> types.ModuleType:
    """A `pynvml` with one GPU, GPU-aaaa (index 0), answering as told; what it was asked is in
    ``asked``."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_TEMPERATURE_GPU, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC = 0, 1, 0
    m.nvmlEventTypeXidCriticalError = 8
    m.asked = []
    pending = list(xids)

    def handle_by_uuid(uuid):
        m.asked.append(("uuid", uuid))
        if uuid != "GPU-aaaa":
            raise NVMLError("not found")
        return "h0"

    def ecc_errors(h, kind, counter):
        if ecc is None:
            raise NVMLError("Not Supported")
        return ecc

    def power_usage(h):
        if not power:
            raise NVMLError("Not Supported")
        return 312_500

    def wait(event_set, timeout_ms):
        if not pending:
            raise NVMLError("Timeout")
        return types.SimpleNamespace(eventData=pending.pop(0))

    m.nvmlInit = lambda: m.asked.append("init")
    m.nvmlDeviceGetHandleByUUID = handle_by_uuid
    m.nvmlDeviceGetHandleByIndex = lambda i: "h0"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util, memory=40)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=30 * 2**30, total=80 * 2**30, free=50 * 2**30)
    m.nvmlDeviceGetTemperature = lambda h, sensor: 64
    m.nvmlDeviceGetPowerUsage = power_usage
    m.nvmlDeviceGetTotalEccErrors = ecc_errors
    m.nvmlEventSetCreate = lambda: "set"
    m.nvmlDeviceRegisterEvents = lambda h, kinds, s: None
    m.nvmlEventSetWait_v2 = wait
    return m


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, name, **fields):
        self.events.append((name, fields))


def test_a_sample_holds_use_memory_temperature_power_ecc_and_new_xids():
    log = Log()
    s = gpu.GpuSampler(log, lambda: "GPU-aaaa", nvml=fake_nvml(ecc=2, xids=[79, 48]))
    first = s.once()
    assert first == {"gpu": "GPU-aaaa", "util_percent": 87, "mem_used_mb": 30720, "mem_total_mb": 81920,
                     "temp_c": 64, "power_w": 312.5, "ecc_errors": 2, "xid_errors": [79, 48]}
    assert log.events == [("gpu", first)]
    assert "xid_errors" not in s.once()          # each XID once, in the sample after it happened


def test_what_nvml_does_not_answer_is_absent():
    s = gpu.GpuSampler(Log(), lambda: 0, nvml=fake_nvml(ecc=None, power=False))
    got = s.once()
    assert "ecc_errors" not in got and "power_w" not in got and got["util_percent"] == 87


def test_no_gpu_no_sample_and_no_nvml_call():
    nvml = fake_nvml()
    log = Log()
    s = gpu.GpuSampler(log, lambda: None, nvml=nvml)
    assert s.once() is None and log.events == [] and nvml.asked == []
    assert gpu.GpuSampler(log, lambda: "GPU-bbbb", nvml=nvml).once() is None   # a GPU NVML does not know
    assert log.events == []


def test_the_thread_samples_off_the_caller_and_stops(monkeypatch):
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    log = Log()
    s = gpu.GpuSampler(log, lambda: "GPU-aaaa", every_s=0.01).start()
    deadline = time.monotonic() + 20
    while len(log.events) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    assert len(log.events) >= 2 and nvml.asked[0] == "init" and s._thread is None


def test_without_pynvml_the_thread_ends_quietly(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)      # `import pynvml` raises ImportError
    assert gpu.load_nvml() is None
    log = Log()
    s = gpu.GpuSampler(log, lambda: "GPU-aaaa", every_s=0.01).start()
    s._thread.join(timeout=20)
    assert not s._thread.is_alive() and log.events == [] and capsys.readouterr().err == ""
    s.stop()


def test_a_cpu_device_has_no_nvml_name():
    import torch
    assert gpu.nvml_id(torch.device("cpu")) is None and gpu.nvml_id(None) is None


# --------------------------------------------------------------------------- what status makes of it
T0 = 1_700_000_000.0


def rank_events(rank, util, *, seconds=90, data_s=0.3, step_s=0.5):
    out = []
    for i in range(0, seconds + 1, 10):
        out.append({"event": "gpu", "time": T0 + i, "rank": rank, "host": "n1", "gpu": f"GPU-{rank}",
                    "util_percent": util, "mem_used_mb": 2048, "mem_total_mb": 81920, "temp_c": 50,
                    "power_w": 100.0, **({"xid_errors": [79]} if i == 30 and rank == 1 else {})})
    for i in range(0, seconds + 1, 2):
        out.append({"event": "step", "time": T0 + i + 0.5, "rank": rank, "host": "n1", "step": int(i / step_s),
                    "data_s": data_s})
    return sorted(out, key=lambda e: e["time"])


def test_an_idle_gpu_while_its_rank_trains_is_named_with_its_data_wait():
    per_rank = {0: rank_events(0, 91), 1: rank_events(1, 7)}
    out = judge_gpu.gpus(per_rank, {0: "n1", 1: "n2"})
    assert list(out.idle) == ["1"]
    assert out.lines == ["rank 1 on n2: its GPU was 7% busy over the last minute while it trained; "
                            "it waits 0.3 s per step for data (60% of a step)"]
    assert out.ranks["1"]["xid_errors"] == [79] and out.ranks["0"]["util_percent"] == 91
    assert judge_gpu.gpu_percent(per_rank) == 49.0
    assert judge_gpu.gpu_percent({0: [e for e in per_rank[0] if e["event"] != "gpu"], 1: per_rank[1]}) is None


def test_an_idle_gpu_is_not_named_before_a_minute_or_when_the_rank_does_not_train():
    short = judge_gpu.gpus({0: rank_events(0, 5, seconds=50)}, {0: "n1"})
    assert short.idle == {} and short.ranks["0"]["util_percent"] == 5
    evaluating = [e for e in rank_events(0, 5) if e["event"] == "gpu"]      # no steps: not training
    assert judge_gpu.gpus({0: evaluating}, {0: "n1"}).idle == {}
    assert judge_gpu.gpus({0: [{"event": "step", "time": T0, "step": 1}]}, {0: "n1"}) is None


def test_the_detail_view_shows_each_ranks_gpu_and_the_idle_ones():
    out = judge_gpu.gpus({0: rank_events(0, 91), 1: rank_events(1, 7)}, {0: "n1", 1: "n2"})
    assert gpu_lines(out) == [
        "GPUs:",
        "  rank 0   n1           91% busy  memory 2.0/80.0 GiB  50 C  100 W",
        "  rank 1   n2            7% busy  memory 2.0/80.0 GiB  50 C  100 W  XID 79",
        "GPU idle:   rank 1 on n2: its GPU was 7% busy over the last minute while it trained; "
        "it waits 0.3 s per step for data (60% of a step)"]
    assert gpu_lines(None) == []


@pytest.mark.timeout(120)
def test_status_shows_gpus_in_the_detail_and_a_gpu_column_in_the_table(tmp_path):
    from ddp_hpc.status.collect import collect
    from ddp_hpc.status.targets import StatusTarget
    from ddp_hpc.status.view import render_detail, render_table
    from tests.test_status_timing import Squeue
    for r, util in ((0, 91), (1, 7)):
        with open(tmp_path / f"rank{r}.events.jsonl", "w") as f:
            for e in rank_events(r, util):
                f.write(json.dumps({"job_id": "88", "restart": 0, **e}) + "\n")
    st = collect([StatusTarget("88", None, str(tmp_path))], Squeue("RUNNING"), now=T0 + 95)[0]
    text = render_detail(st, now=T0 + 95)
    assert "GPU idle:   rank 1 on n1: its GPU was 7% busy" in text, text
    assert st.to_dict()["gpus"]["ranks"]["0"]["util_percent"] == 91
    row = collect([StatusTarget("88", None, str(tmp_path))], Squeue("RUNNING"), now=T0 + 95, brief=True)[0]
    head, line = render_table([row]).splitlines()
    assert "GPU%" in head and line.split()[head.split().index("GPU%")] == "49"


def test_a_failing_device_lookup_ends_the_thread_with_one_line_not_a_traceback(capsys):
    def device():
        raise AttributeError("no device here")
    s = gpu.GpuSampler(Log(), device, every_s=0.01, nvml=fake_nvml()).start()
    s._thread.join(timeout=20)
    err = capsys.readouterr().err
    assert not s._thread.is_alive() and err == "ddp_hpc: GPU sampling stopped: AttributeError: no device here\n"
    s.stop()
