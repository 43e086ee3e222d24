"""Expand and compress Slurm host lists (``gpu[001-003,010]``, ``r[1-2]n[01-02]``), pure Python.

Why hand-written: every rank derives MASTER_ADDR and its node list from SLURM_JOB_NODELIST /
SLURM_STEP_NODELIST, and a wrong expansion makes jobs hang instead of failing. The grammar below
follows Slurm's own parser (``src/common/hostlist.c``, checked against ``scontrol show hostnames``
of Slurm 22.05.8; ``tests/test_hostlist.py`` re-checks a few hundred generated expressions against
the installed ``scontrol``):

- Hosts are separated by commas (Slurm also accepts spaces and tabs) outside brackets; empty items
  are skipped, so ``""`` expands to ``[]``.
- A bracket group holds comma-separated numbers and ``lo-hi`` ranges. Each number is printed with
  the zero padding of the range's *low* bound as written: ``n[001-3]`` -> n001 n002 n003,
  ``n[8-010]`` -> n8 n9 n10. At most 65536 hosts per range, as in Slurm.
- Several groups in one name form a product in Slurm's order: the last group varies fastest,
  then the first, second, ... group: ``x[1-2]y[3-4]z[5-6]`` -> x1y3z5 x1y3z6 x2y3z5 x2y3z6 x1y4z5 ...
  (for two groups that is plain row-major order).
- Text may sit before and between groups but not after the last one (Slurm rejects
  ``n[1-2]-ib``); names without brackets may hold any other characters (dashes, dots, ...).

Anything else (``n[1-``, ``n[3-1]``, ``n[a-b]``, ``n[]``, unbalanced or nested brackets) raises
`HostlistError` whose message quotes the whole input and says what is wrong, instead of Slurm's
habit of printing garbage (``scontrol show hostnames 'n[1-'`` prints ``n]``).

`compress` is the inverse for ordered lists: it keeps the order (no sorting, duplicates kept) and
joins runs of consecutive numbers that share a prefix and zero padding, like
``scontrol show hostlist`` does: ``n1,n2,n3,n5`` -> ``n[1-3,5]``; ``expand(compress(h)) == h``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

from ddp_hpc.errors import HintError

__all__ = ["HostlistError", "expand", "compress", "natural_key", "parse_tasks_per_node"]

MAX_RANGE = 64 * 1024  # Slurm's limit on the hosts of one lo-hi range
MAX_HOSTS = 1 << 20  # our guard against a typo that would expand to billions of names
_SEPARATORS = ", \t"
_NUMBER = re.compile(r"[0-9]+\Z")
_TRAILING_DIGITS = re.compile(r"^(.*?)([0-9]+)\Z", re.S)
_FORBIDDEN = frozenset("[]" + _SEPARATORS)  # characters a host name to compress must not hold


class HostlistError(HintError, ValueError):
    """A host list or tasks-per-node expression that does not parse; the message quotes it."""


def _fail(expr: str, what: str) -> HostlistError:
    return HostlistError(f"invalid Slurm host list {expr!r}: {what}")


def _split_items(expr: str) -> list[str]:
    """Split on separators outside brackets; reject unbalanced or nested brackets."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for pos, char in enumerate(expr):
        if char == "[":
            if depth:
                raise _fail(expr, f"nested '[' at position {pos}")
            depth = 1
        elif char == "]":
            if not depth:
                raise _fail(expr, f"']' without a matching '[' at position {pos}")
            depth = 0
        elif char in _SEPARATORS and not depth:
            if current:
                items.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise _fail(expr, "'[' is never closed")
    if current:
        items.append("".join(current))
    return items


def _parse_group(expr: str, body: str) -> list[str]:
    """``001-003,010`` -> ['001', '002', '003', '010'] (padding of each range's low bound)."""
    if not body:
        raise _fail(expr, "empty brackets '[]'")
    numbers: list[str] = []
    for part in body.split(","):
        lo, dash, hi = part.partition("-")
        if not part or not _NUMBER.match(lo) or (dash and not _NUMBER.match(hi)):
            raise _fail(
                expr,
                f"bad range {part!r} in '[{body}]': expected N or LO-HI with digits only",
            )
        low, high = int(lo), int(hi) if dash else int(lo)
        if low > high:
            raise _fail(expr, f"range {part!r} in '[{body}]' runs backwards ({low} > {high})")
        if high - low + 1 > MAX_RANGE:
            raise _fail(expr, f"range {part!r} has more than {MAX_RANGE} hosts (Slurm's limit)")
        width = len(lo)  # zfill pads like "%0*d" for the non-negative numbers here
        numbers.extend([str(n).zfill(width) for n in range(low, high + 1)])
    return numbers


def _expand_item(expr: str, item: str) -> list[str]:
    if "[" not in item:
        return [item]
    pieces = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., tail
    literals, bodies = pieces[0::2], pieces[1::2]
    if literals[-1]:
        raise _fail(
            expr,
            f"text {literals[-1]!r} after the last ']' in {item!r}; Slurm allows text only "
            "before and between bracket groups",
        )
    groups = [_parse_group(expr, body) for body in bodies]
    total = 1
    for group in groups:
        total *= len(group)
    if total > MAX_HOSTS:
        raise _fail(expr, f"{item!r} would expand to {total} hosts (more than {MAX_HOSTS})")
    if len(groups) == 1:  # the usual gpu[0001-1024]: no product to take
        return [literals[0] + number for number in groups[0]]
    # Slurm's nesting: group n-1 outermost, down to group 1, then group n innermost.
    order = list(range(len(groups) - 2, -1, -1)) + [len(groups) - 1]
    hosts = []
    numbers = [""] * len(groups)
    for combo in itertools.product(*(groups[i] for i in order)):
        for i, number in zip(order, combo):
            numbers[i] = number
        hosts.append("".join(lit + numbers[i] for i, lit in enumerate(literals[:-1])))
    return hosts


def expand(expr: str) -> list[str]:
    """Expand a Slurm host list expression into host names, in Slurm's order.

    >>> expand("gpu[001-003,010]")
    ['gpu001', 'gpu002', 'gpu003', 'gpu010']
    >>> expand("r[1-2]n[01-02],login")
    ['r1n01', 'r1n02', 'r2n01', 'r2n02', 'login']
    """
    if not isinstance(expr, str):
        raise TypeError(f"expand() wants a str host list, got {type(expr).__name__}: {expr!r}")
    hosts: list[str] = []
    for item in _split_items(expr):
        hosts.extend(_expand_item(expr, item))
        if len(hosts) > MAX_HOSTS:
            raise _fail(expr, f"expands to more than {MAX_HOSTS} hosts")
    return hosts


def _check_host(host: object, hosts: list) -> str:
    if not isinstance(host, str):
        raise TypeError(f"compress() wants host names as str, got {host!r} in {hosts!r}")
    if not host or not _FORBIDDEN.isdisjoint(host):
        raise HostlistError(
            f"cannot compress host name {host!r} (from {hosts!r}): a host name must be non-empty "
            "and must not contain brackets, commas or whitespace"
        )
    return host


def natural_key(host: str) -> tuple[str, int, str]:
    """Sort key that puts ``n2`` before ``n10`` (the trailing number compared as a number)."""
    match = _TRAILING_DIGITS.match(host)
    return (host, -1, "") if match is None else (match.group(1), int(match.group(2)), match.group(2))


def compress(hosts: Iterable[str]) -> str:
    """Write host names as a compact Slurm host list, keeping their order.

    Consecutive names that differ only in a trailing number, counting up by one with the same
    zero padding, become one range; neighbouring ranges with the same prefix share a bracket.

    >>> compress(["n1", "n2", "n3", "n5", "login", "gpu09", "gpu10"])
    'n[1-3,5],login,gpu[09-10]'
    """
    if isinstance(hosts, str):
        raise TypeError(f"compress() wants a list of host names, not the string {hosts!r}")
    hosts = list(hosts)
    # runs: [prefix, [[lo_text, hi_value, lo_value], ...]] or [name, None] for names without a number
    runs: list[list] = []
    for host in hosts:
        _check_host(host, hosts)
        match = _TRAILING_DIGITS.match(host)
        if match is None:
            runs.append([host, None])
            continue
        prefix, digits = match.groups()
        value = int(digits)
        last = runs[-1] if runs else None
        if last is not None and last[1] is not None and last[0] == prefix:
            lo_text, hi_value, lo_value = last[1][-1]
            joinable = value == hi_value + 1 and value - lo_value < MAX_RANGE
            if joinable and str(value).zfill(len(lo_text)) == digits:
                last[1][-1][1] = value
            else:
                last[1].append([digits, value, value])
        else:
            runs.append([prefix, [[digits, value, value]]])
    out = []
    for prefix, ranges in runs:
        if ranges is None:
            out.append(prefix)
            continue
        parts = [
            lo if lo_value == hi else f"{lo}-{hi:0{len(lo)}d}" for lo, hi, lo_value in ranges
        ]
        if len(ranges) == 1 and "-" not in parts[0]:
            out.append(prefix + parts[0])
        else:
            out.append(f"{prefix}[{','.join(parts)}]")
    return ",".join(out)


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's SLURM_TASKS_PER_NODE form: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Each item is ``N`` or ``N(xK)`` (N tasks on each of K nodes); N and K are positive integers.
    """
    if not isinstance(value, str):
        raise TypeError(f"parse_tasks_per_node() wants a str, got {value!r}")
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", item)
        if match is None:
            raise HostlistError(
                f"invalid tasks-per-node list {value!r}: item {item!r} is not N or N(xK), "
                "as in SLURM_TASKS_PER_NODE=2(x3),1"
            )
        tasks, repeat = int(match.group(1)), int(match.group(2) or 1)
        if tasks < 1 or repeat < 1:
            raise HostlistError(
                f"invalid tasks-per-node list {value!r}: item {item!r} has a zero count"
            )
        if len(counts) + repeat > MAX_HOSTS:
            raise HostlistError(f"invalid tasks-per-node list {value!r}: more than {MAX_HOSTS} nodes")
        counts.extend([tasks] * repeat)
    return counts
