"""The small mismatches a new user meets first (issue 43, item 5): a crashed script's final rate,
the HTML page's goodput names, and "did you mean" for a mistyped key of a job YAML.

The stall floor and its goodput accounting: tests/test_status_timing.py and tests/test_goodput.py."""
import subprocess
import sys
import textwrap
from html.parser import HTMLParser

import pytest

from ddp_hpc.instrument.steps import StepCounter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_final_rate_after_a_crash_is_the_rate_of_training_not_of_the_crash():
    """The throttle holds the newest step back; at the script's exit (after its exception, while
    its peers tear down) the held step's fields are taken: its rate ends at its last step."""
    clock = Clock()
    c = StepCounter(clock)
    opt = object()
    c.stepped(opt)
    c.fields()                       # the first event: the start-up interval, no rate
    for _ in range(6):               # 6 steps of 0.16 s
        clock.t += 0.16
        c.stepped(opt)
    assert c.fields()["steps_per_s"] == pytest.approx(6.25)
    clock.t += 0.16
    c.stepped(opt)                   # one more step, held back by the once-a-second throttle
    clock.t += 30.0                  # the crash: a peer's exception, the collective's timeout, teardown
    assert c.fields()["steps_per_s"] == pytest.approx(6.25)


def test_the_rate_counts_from_the_last_step_of_the_previous_event():
    """Intervals stay contiguous: a pause after a step (the script's own evaluation) belongs to the
    next interval, whose steps waited for it."""
    clock = Clock()
    c = StepCounter(clock)
    opt = object()
    c.stepped(opt)
    c.fields()
    clock.t += 0.5
    c.stepped(opt)
    clock.t += 9.5                   # the event is written later (its fields taken at exit)
    assert c.fields()["steps_per_s"] == pytest.approx(2.0)
    clock.t += 0.5
    c.stepped(opt)                   # its interval began at the previous event's last step
    assert c.fields()["steps_per_s"] == pytest.approx(1 / 10.0)


class _Rows(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self._key: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and a.get("data-kind") == "goodput":
            self._key = a["data-key"]
            self.rows[self._key] = []

    def handle_endtag(self, tag):
        if tag == "tr":
            self._key = None

    def handle_data(self, data):
        if self._key is not None and data.strip():
            self.rows[self._key].append(data.strip())


def test_the_html_goodput_table_names_the_parts_as_the_detail_view_does():
    from ddp_hpc.judge.goodput import PART_NAMES, PARTS
    from ddp_hpc.status.html import _goodput
    doc = {"goodput": 0.71, "wall_s": 600.0, "useful_s": 426.0,
           "lost_s": {"restarts": 80.0, "redone": 12.0, "stalls": 150.0, "checkpoint": 1.5},
           "restart_phases": {"detect": 2.0}, "steps_redone": 3, "step_s": 0.5, "estimated": []}
    rows = _Rows()
    rows.feed(_goodput(doc))
    labels = {k: v[0] for k, v in rows.rows.items()}
    assert labels["lost_s.redone"] == "lost: steps trained twice (s)"
    assert labels["lost_s.checkpoint"] == "lost: checkpoints (s)"
    assert labels["lost_s.restarts"] == "lost: restarts (s)"
    assert labels["goodput"] == "goodput" and rows.rows["goodput"][1] == "71.0%"
    assert not any("lost_s" in v or "_s" in v.split()[-1] for v in labels.values()), labels
    assert set(PART_NAMES) == set(PARTS)


def _submit(tmp_path, yaml_text: str) -> subprocess.CompletedProcess:
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(yaml_text))
    return subprocess.run([sys.executable, "-m", "ddp_hpc", "submit", "--dry-run", str(job)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize(("yaml_text", "typo", "meant"), [
    ("train:\n  bacth_size: 8\n", "bacth_size", "batch_size"),
    ("trian:\n  batch_size: 8\n", "trian", "train"),
])
def test_a_mistyped_yaml_key_says_did_you_mean_names_the_file_and_lists_the_keys(tmp_path, yaml_text, typo, meant):
    p = _submit(tmp_path, yaml_text)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert typo in out and f"(did you mean '{meant}'?)" in out, out
    assert "job.yaml" in out, out
