"""ddp_hpc.slurm.hostlist: tables of expressions, error messages, and a differential test against the
real ``scontrol show hostnames`` / ``scontrol show hostlist`` of the installed Slurm."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from ddp_hpc.errors import HintError
from ddp_hpc.slurm.hostlist import HostlistError, compress, expand, parse_tasks_per_node

EXPAND_CASES = [
    ("n1", ["n1"]),
    ("login-01.cluster.org", ["login-01.cluster.org"]),
    ("n1,n2,n3", ["n1", "n2", "n3"]),
    ("gpu[001-003,010]", ["gpu001", "gpu002", "gpu003", "gpu010"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    # padding comes from the low bound as written, exactly as Slurm does it
    ("n[001-3]", ["n001", "n002", "n003"]),
    ("n[8-010]", ["n8", "n9", "n10"]),
    ("n[1,01,001]", ["n1", "n01", "n001"]),
    ("n[0]", ["n0"]),
    ("n[5]", ["n5"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
    # three groups: Slurm nests group 2 outermost, then group 1, then group 3 innermost
    (
        "x[1-2]y[3-4]z[5-6]",
        ["x1y3z5", "x1y3z6", "x2y3z5", "x2y3z6", "x1y4z5", "x1y4z6", "x2y4z5", "x2y4z6"],
    ),
    ("c[1-2].d[1-2]", ["c1.d1", "c1.d2", "c2.d1", "c2.d2"]),
    ("node-[1-3]", ["node-1", "node-2", "node-3"]),
    ("a-1.b[1-2]", ["a-1.b1", "a-1.b2"]),
    ("n[1]-[2]", ["n1-2"]),
    ("a[1-2],b07,c[3-4]", ["a1", "a2", "b07", "c3", "c4"]),
    ("n[1-2],n[2-3]", ["n1", "n2", "n2", "n3"]),  # duplicates kept, as Slurm does
    ("[1-2]", ["1", "2"]),
    ("007", ["007"]),
    ("n7x", ["n7x"]),
    # separators: empty items skipped; Slurm also splits on spaces and tabs
    ("", []),
    (",", []),
    ("a,,b,", ["a", "b"]),
    ("n[1-2] n3\tn4", ["n1", "n2", "n3", "n4"]),
]


@pytest.mark.parametrize("expr, hosts", EXPAND_CASES)
def test_expand_table(expr, hosts):
    assert expand(expr) == hosts


def test_expand_large_range_and_limit():
    hosts = expand("n[00001-65536]")
    assert len(hosts) == 65536 and hosts[0] == "n00001" and hosts[-1] == "n65536"


ERROR_CASES = [
    ("n[1-", "never closed"),
    ("n[1-2", "never closed"),
    ("n[3-1]", "runs backwards (3 > 1)"),
    ("n[a-b]", "bad range 'a-b'"),
    ("n[a]", "bad range 'a'"),
    ("n[]", "empty brackets"),
    ("n]", "without a matching '['"),
    ("n[1-2]]", "without a matching '['"),
    ("n[[1]]", "nested '['"),
    ("n[1,]", "bad range ''"),
    ("n[,1]", "bad range ''"),
    ("n[-1]", "bad range '-1'"),
    ("n[1--2]", "bad range '1--2'"),
    ("n[1-3:2]", "bad range '1-3:2'"),
    ("n[ 1]", "bad range ' 1'"),
    ("n[1-2]-ib", "text '-ib' after the last ']'"),
    ("c[1-2]d1", "text 'd1' after the last ']'"),
    ("n[1-70000]", "more than 65536 hosts"),
    ("ok1,n[2-1],ok3", "runs backwards"),
]


@pytest.mark.parametrize("expr, reason", ERROR_CASES)
def test_expand_errors_quote_input_and_reason(expr, reason):
    with pytest.raises(HostlistError) as info:
        expand(expr)
    message = str(info.value)
    assert repr(expr) in message
    assert reason in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, HintError)


def test_expand_refuses_non_string():
    with pytest.raises(TypeError, match="wants a str"):
        expand(["n1"])


COMPRESS_CASES = [
    ([], ""),
    (["n1"], "n1"),
    (["n1", "n2", "n3", "n5"], "n[1-3,5]"),
    (["n9", "n10", "n11"], "n[9-11]"),
    (["n09", "n10"], "n[09-10]"),
    (["n8", "n9", "n010"], "n[8-9,010]"),
    (["n1", "n02"], "n[1,02]"),
    (["n00", "n01", "n2"], "n[00-01,2]"),
    (["n3", "n1", "n2", "n4"], "n[3,1-2,4]"),  # order kept: no sorting
    (["n10", "n9"], "n[10,9]"),
    (["n1", "n1", "n2"], "n[1,1-2]"),
    (["a1", "b1", "a2"], "a1,b1,a2"),
    (["a1", "a2", "b1", "b2", "a3"], "a[1-2],b[1-2],a3"),
    (["login", "gpu001", "gpu002", "gpu003", "gpu010"], "login,gpu[001-003,010]"),
    (["007", "008"], "[007-008]"),
    (["n1x", "n2x"], "n1x,n2x"),
    (["r1n01", "r1n02", "r2n01"], "r1n[01-02],r2n01"),
    (["n1-1", "n1-2"], "n1-[1-2]"),
    (["n98", "n99", "n100", "n101"], "n[98-101]"),
]


@pytest.mark.parametrize("hosts, expr", COMPRESS_CASES)
def test_compress_table_and_round_trip(hosts, expr):
    assert compress(hosts) == expr
    assert expand(expr) == hosts


def test_compress_accepts_any_iterable_and_round_trips_random_lists():
    rng = random.Random(1234)
    for _ in range(500):
        hosts = expand(_random_expression(rng))
        rng.shuffle(hosts) if rng.random() < 0.3 else None
        unique = list(dict.fromkeys(hosts))
        assert expand(compress(iter(unique))) == unique


def test_compress_splits_ranges_at_slurms_limit():
    hosts = [f"n{i}" for i in range(70000)]
    text = compress(hosts)
    assert text == "n[0-65535,65536-69999]"
    assert expand(text) == hosts


@pytest.mark.parametrize("bad", ["", "a,b", "n[1]", "a b", "x]"])
def test_compress_rejects_names_it_cannot_write(bad):
    with pytest.raises(HostlistError, match="cannot compress host name " + repr(bad).replace("[", r"\[")):
        compress(["ok1", bad])


def test_compress_refuses_a_plain_string():
    with pytest.raises(TypeError, match="not the string 'n1,n2'"):
        compress("n1,n2")


@pytest.mark.parametrize(
    "value, counts",
    [("1", [1]), ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("3,1", [3, 1]), ("2(x2)", [2, 2]),
     ("1,2(x2),3(x1)", [1, 2, 2, 3])],
)
def test_parse_tasks_per_node(value, counts):
    assert parse_tasks_per_node(value) == counts


@pytest.mark.parametrize(
    "value, reason",
    [("", "item '' is not N or N(xK)"), ("2(x", "item '2(x' is not N or N(xK)"),
     ("2(3)", "item '2(3)' is not"), ("a", "item 'a' is not"), ("2,,1", "item '' is not"),
     ("0", "zero count"), ("2(x0)", "zero count"), ("-1", "item '-1' is not")],
)
def test_parse_tasks_per_node_errors(value, reason):
    with pytest.raises(HostlistError) as info:
        parse_tasks_per_node(value)
    assert repr(value) in str(info.value) and reason in str(info.value)


# ---------------------------------------------------------------------------------------------
# Differential test against the installed Slurm.


def _random_number_text(rng: random.Random, value: int) -> str:
    width = rng.choice([0, 0, 2, 3, 4])
    return str(value).zfill(width)


def _random_group(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        lo = rng.choice([0, 1, 2, 7, 8, 9, 10, 31, 98, 99, 100, rng.randrange(0, 1200)])
        lo_text = _random_number_text(rng, lo)
        if rng.random() < 0.35:
            parts.append(lo_text)
            continue
        hi = lo + rng.randrange(0, 12)
        hi_text = rng.choice([str(hi), str(hi).zfill(len(lo_text)), str(hi).zfill(4)])
        parts.append(f"{lo_text}-{hi_text}")
    return "[" + ",".join(parts) + "]"


def _random_name(rng: random.Random) -> str:
    first = rng.choice(["n", "gpu", "node", "a", "r", "compute", "x"])
    rest = rng.choice(["", "", "-", ".", "-a", "1-", "0.", "_b", "-ib.c"])
    return first + rest


def _random_item(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.2:  # a plain host, maybe numbered with padding
        name = _random_name(rng)
        return name + (_random_number_text(rng, rng.randrange(0, 200)) if rng.random() < 0.7 else "")
    groups = rng.choice([1, 1, 1, 2, 2, 3])
    text = _random_name(rng)
    for index in range(groups):
        text += _random_group(rng)
        if index < groups - 1:
            text += rng.choice(["", "n", "-", ".", "-x.", "s"])
    return text


def _random_expression(rng: random.Random) -> str:
    return ",".join(_random_item(rng) for _ in range(rng.choice([1, 1, 2, 3, 4])))


@pytest.fixture(scope="module")
def scontrol_env(tmp_path_factory):
    """Environment under which ``scontrol show hostnames`` works without any Slurm daemon."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (apt-get install slurm-wlm): no Slurm to compare with")
    conf = tmp_path_factory.mktemp("slurmconf") / "slurm.conf"
    conf.write_text(
        "ClusterName=hostlisttest\nSlurmctldHost=localhost\n"
        "NodeName=n1 CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=n1 Default=YES\n"
    )
    return {**os.environ, "SLURM_CONF": str(conf)}


def _scontrol(env: dict, what: str, arg: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["scontrol", "show", what, arg], env=env, capture_output=True, text=True, timeout=30
    )


def test_expand_matches_scontrol_on_generated_expressions(scontrol_env):
    # ~300 expressions, one scontrol call each (a few ms per call: about a second in all).
    rng = random.Random(20260522)
    expressions = [_random_expression(rng) for _ in range(300)]
    assert len({e for e in expressions if "][" in e or "]n[" in e}) > 10  # multi-group covered
    mismatches = []
    for expr in expressions:
        ours = expand(expr)
        done = _scontrol(scontrol_env, "hostnames", expr)
        theirs = done.stdout.split()
        if done.returncode != 0 or done.stderr.strip() or ours != theirs:
            mismatches.append((expr, ours[:8], theirs[:8], done.stderr.strip()))
    assert not mismatches, f"{len(mismatches)} differ from scontrol, first: {mismatches[:3]}"


def test_garbage_is_refused_by_both_scontrol_and_us(scontrol_env):
    # Slurm prints "Invalid hostlist" (exit status 0!) where we raise. We are stricter on
    # unbalanced brackets and blanks inside brackets, where scontrol prints nonsense hosts:
    stricter_than_slurm = {"n[1-": ["n]"], "n[1-2": ["n]"], "n]": ["n]"], "n[ 1]": ["n01"]}
    for expr, _ in ERROR_CASES:
        if expr in stricter_than_slurm:
            done = _scontrol(scontrol_env, "hostnames", expr)
            assert done.stdout.split() == stricter_than_slurm[expr], (expr, done.stdout)
            continue
        done = _scontrol(scontrol_env, "hostnames", expr)
        assert "Invalid hostlist" in done.stderr + done.stdout, (expr, done.stdout, done.stderr)
        with pytest.raises(HostlistError):
            expand(expr)


def test_compress_matches_scontrol_show_hostlist(scontrol_env):
    rng = random.Random(77)
    mismatches = []
    for _ in range(150):
        hosts = expand(_random_expression(rng))
        if rng.random() < 0.3:
            rng.shuffle(hosts)
        hosts = list(dict.fromkeys(hosts))
        done = _scontrol(scontrol_env, "hostlist", ",".join(hosts))
        if compress(hosts) != done.stdout.strip():
            mismatches.append((hosts[:6], compress(hosts), done.stdout.strip()))
        # and Slurm reads our compressed form back into the same list
        back = _scontrol(scontrol_env, "hostnames", compress(hosts)).stdout.split()
        if back != hosts:
            mismatches.append((hosts[:6], compress(hosts), back[:6]))
    assert not mismatches, f"{len(mismatches)} differ from scontrol, first: {mismatches[:3]}"
