"""``ddp-hpc status JOB --html`` in a real browser (Debian's Chromium, driven by Selenium through
its chromedriver; nothing downloaded): a real job on the test cluster, a plain script whose rank
1 dies of SIGSEGV at its third step, restarted once inside the allocation (`--max-restarts 1`)
and dying again, so the job FAILED. Its page opens from file:// without a console error, and the
restart and the failing rank are drawn where the events say: the restart's line at the second
run's first event, rank 1's ending in rank 1's lane at its time. The same browser session then
opens the page of a hand-written run with restart phases and a goodput object (tests/picture_events.py).

Without Chromium, chromedriver or Selenium the test is skipped with the reason (`.ci/run` installs
Chromium; `selenium` is pinned in requirements-ci.txt)."""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import picture_events as pe  # tests/ is on sys.path (pytest's rootdir insertion: tests/cluster is a package)
import pytest

from ddp_hpc import records
from ddp_hpc.judge.goodput import Goodput
from ddp_hpc.judge.nodefiles import rank_events
from ddp_hpc.status.collect import collect
from ddp_hpc.status.html import render_html
from ddp_hpc.status.targets import StatusTarget

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "tests" / "scripts" / "plain_ddp.py")
PY = sys.executable
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
DRIVER = shutil.which("chromedriver")
#: where an element's x must fall against its time on the axis, in px of the page
SLACK_PX = 1.5


def _browser():
    """One headless Chromium session (its console log kept), or a skip naming what is missing."""
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no chromium / chromedriver on PATH: apt-get install chromium chromium-driver (.ci/run does)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                    "(pip install -r requirements-ci.txt)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1200"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))


#: an element's box, its lane's box and where its data-time falls on its svg, in page px
GEOMETRY = """
var el = arguments[0], svg = el.ownerSVGElement, r = el.getBoundingClientRect(), s = svg.getBoundingClientRect();
var k = s.width / svg.viewBox.baseVal.width, d = svg.dataset, lane = el.closest('g.lane');
var t = +el.dataset.time, x = s.left + k * (+d.left + (t - +d.t0) / (+d.t1 - +d.t0) * +d.width);
var lr = lane ? lane.getBoundingClientRect() : null;
return {cx: r.left + r.width / 2, x1: r.left, want: x, top: r.top, bottom: r.bottom,
        lane: lane ? lane.dataset.ranks : null, lane_top: lr ? lr.top : null, lane_bottom: lr ? lr.bottom : null};
"""


def _open(driver, page: Path) -> list[dict]:
    driver.get(page.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def _failed_job(c, d: Path) -> tuple[str, Path, Path]:
    """(job id, its log directory, its page): submitted, waited for, and drawn by ``status --html``."""
    env = dict(c.env, DDP_HPC_HOME=str(d / "home"), PYTHONPATH=str(REPO))
    p = c.run([PY, "-m", "ddp_hpc.submit", "--backend", "sbatch", "-N", "2", "-G", "1", "-t", "10",
               "--max-restarts", "1", "-J", "picture", "--log-dir", str(d / "runs"), SCRIPT,
               "--segv-rank", "1", "--stuck-at", "3", "--steps", "40", "--step-sleep", "0.3"], cwd=str(d), env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[-1]
    assert c.wait(job, timeout=300) == "FAILED"
    page = d / "report.html"
    out = c.run([PY, "-m", "ddp_hpc.status", job, "--html", str(page)], cwd="/", env=env, timeout=120)
    assert out.returncode == 0 and page.is_file(), out.stdout + out.stderr
    (rec,) = records.list_records({"DDP_HPC_HOME": str(d / "home")})
    return job, Path(rec.log_dir), page


def test_the_page_of_a_failed_restarted_job_draws_the_restart_and_the_failing_rank(slurm_cluster, tmp_path):
    c = slurm_cluster
    d = c.shared_dir / f"picture-{time.monotonic_ns()}"
    d.mkdir()
    driver = _browser()   # before the job: a missing browser skips at once
    try:
        started = time.monotonic()
        job, log_dir, page = _failed_job(c, d)
        print(f"job {job} failed and was drawn {time.monotonic() - started:.1f} s after its submission")
        last = max(e["restart"] for r in (0, 1) for e in rank_events(log_dir, r).events)
        second = min(e["time"] for r in (0, 1) for e in rank_events(log_dir, r).events
                     if e["restart"] == last)
        ending = [e for e in rank_events(log_dir, 1).events
                  if e["restart"] == last and e["event"] in ("error", "end")]
        assert ending, "rank 1 wrote neither an error nor an end event in its last run"

        assert _open(driver, page) == []
        shown = json.loads(driver.find_element("id", "job").get_attribute("textContent"))
        assert shown["failure_rank"] == 1 and shown["state"] == "FAILED" and last >= 1, (shown, last)
        By = pytest.importorskip("selenium.webdriver.common.by").By  # noqa: N806 (Selenium's name)
        lanes = [g.get_attribute("data-ranks") for g in driver.find_elements(By.CSS_SELECTOR, "g.lane")]
        assert lanes == ["0", "1"]
        restarts = driver.find_elements(By.CSS_SELECTOR, f'svg line[data-kind="restart"][data-restart="{last}"]')
        assert restarts, "no restart line"
        for line in restarts:   # on each chart and on the timeline, at the second run's first event
            assert abs(float(line.get_attribute("data-time")) - second) < 1e-3
            geo = driver.execute_script(GEOMETRY, line)
            assert abs(geo["cx"] - geo["want"]) <= SLACK_PX, geo
        marks = driver.find_elements(By.CSS_SELECTOR, f'g.lane rect[data-rank="1"][data-restart="{last}"]')
        drawn = {(m.get_attribute("data-kind"), round(float(m.get_attribute("data-time")), 3)): m for m in marks}
        for e in ending:
            m = drawn.get((e["event"], round(e["time"], 3)))
            assert m is not None, (e, sorted(drawn))
            geo = driver.execute_script(GEOMETRY, m)
            assert geo["lane"] == "1" and abs(geo["cx"] - geo["want"]) <= SLACK_PX, geo
            assert geo["lane_top"] - 1 <= geo["top"] and geo["bottom"] <= geo["lane_bottom"] + 1, geo
        assert "First failure: rank 1" in driver.find_element(By.CSS_SELECTOR, '[data-kind="diagnosis"]').text

        # the same session: a hand-written run with restart phases and a goodput object
        st = collect([StatusTarget(pe.JOB, None, str(pe.write_run(tmp_path / "logs")))], None, None,
                     history=True, lanes=True)[0]
        st.goodput = Goodput.from_dict(pe.GOODPUT)
        other = tmp_path / "phases.html"
        other.write_text(render_html(st), encoding="utf-8")
        assert _open(driver, other) == []
        widths = {r.get_attribute("data-phase"): r.rect["width"] for r in
                  driver.find_elements(By.CSS_SELECTOR, 'rect[data-kind="phase"]')}
        assert list(widths) == list(pe.PHASES) and all(w > 0 for w in widths.values())
        # drawn in proportion to the seconds: start (50.5 s) to the first step (16 s)
        want = pe.PHASES["start"] / pe.PHASES["first_step"]
        assert abs(widths["start"] / widths["first_step"] - want) < 0.05 * want
        assert driver.find_element(By.CSS_SELECTOR, 'tr[data-key="goodput"]').text.endswith("71.0%")
    finally:
        driver.quit()
