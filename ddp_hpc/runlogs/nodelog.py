"""One event file per node, ``node{K}.events.jsonl``, and one writer per node for it.

Why: the log directory is on the shared filesystem, whose metadata server every job of the site
shares. A file per rank is 8,192 files at 1,024 nodes x 8 GPUs: 8,192 small appends per logging
interval, and every reader (the supervisor each second, ``ddp-hpc status``) opens or stats them
all. A file per node divides both by the ranks per node, and one writer per node turns the node's
appends of an interval into one.

How: every process that writes events (a rank, the script wrapper around it, a data stager) hands
its lines to a `NodeLog` for its node's file. The first process of a node to write binds a Unix
datagram socket in Linux's abstract namespace, named after the file (so fake nodes of one machine
and jobs of one user never share one), and becomes the node's forwarder: a thread of it collects
the other processes' lines and its own and appends them in one write at most every `FLUSH_S`. The
others send their lines there. What a rank writes just before it dies -- an error, its stack, its
end, a preemption notice (`URGENT_EVENTS`) -- it appends itself, at once, before it returns, so a
killed node loses no evidence; so does every line where no forwarder can be reached (none yet, or
it exited: the next writer takes its place), where the socket is full, where a line is too big for
one datagram, and on systems without abstract sockets (macOS). A line is one ``write`` of an
``O_APPEND`` file either way, so lines never interleave. Each line keeps its rank; a rank's lines
can reach the file out of order only across a forwarder's flush and its own urgent append, and
readers order a rank's events by time (``judge.tails``).
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import os
import socket
import sys
import threading
import time

__all__ = ["NodeLog", "node_log", "FLUSH_S", "URGENT_EVENTS", "close_all"]

#: at most one append per this many seconds from a node's forwarder
FLUSH_S = 1.0
#: events appended at once by the process that writes them: the evidence of a failure or an end
URGENT_EVENTS = frozenset({"error", "stack", "end", "preempt"})
#: the largest line sent to the forwarder; a longer one is appended directly
DATAGRAM_MAX = 60 << 10
#: the message a writer sends to have the forwarder append what it holds at once, and its answer
_FLUSH = b"\0flush"
_FLUSHED = b"\0flushed"
#: how long a writer waits for that answer, seconds (a forwarder answers in milliseconds; one that
#: is stopped or killed must not hold up a rank's end: the script wrapper waits for it then)
FLUSH_WAIT_S = 0.5

_lock = threading.Lock()
_logs: dict[str, "NodeLog"] = {}


def _address(path: str) -> str:
    """The abstract socket's name for the node file ``path``: the user and the file's real path."""
    key = hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:24]
    return f"\0ddp_hpc-events-{os.getuid()}-{key}"


def _append(fd: int, data: bytes) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _answer(server: socket.socket, writer) -> None:
    """Tell a writer that its flush is done (it may have gone: nothing to do then)."""
    try:
        server.sendto(_FLUSHED, socket.MSG_DONTWAIT, writer)
    except OSError:
        pass


def _append_to(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _append(fd, data)
    finally:
        os.close(fd)


class NodeLog:
    """The node file ``path`` as one process writes it (`node_log` gives one per file and process)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._addr = _address(path)
        self._lock = threading.Lock()
        self._buf: list[bytes] = []
        self._server: socket.socket | None = None
        self._client: socket.socket | None = None
        self.closed = False
        self.appends = 0          # the appends this process made to the file (what a test counts)
        if not self._serve():
            try:
                self._client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._client.bind("")   # an abstract name of its own: the forwarder's answer to a flush
            except OSError:
                self._client = None

    @property
    def forwarder(self) -> bool:
        """Whether this process is its node's forwarder."""
        return self._server is not None

    # --- the forwarder
    def _serve(self) -> bool:
        """Become the node's forwarder if no process is (bind its name); True when this one is."""
        if self._server is not None:
            return True
        try:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return False
        try:
            server.bind(self._addr)
        except OSError:          # taken (another process forwards), or no abstract sockets here
            server.close()
            return False
        server.settimeout(FLUSH_S)
        self._server = server
        threading.Thread(target=self._forward, args=(server,), name="ddp_hpc-node-events", daemon=True).start()
        return True

    def _forward(self, server: socket.socket) -> None:
        """The forwarder's thread: collect the node's lines, append them at most every `FLUSH_S`
        (at once when a writer closes); it closes the socket itself once `close` shut it down."""
        last = time.monotonic()
        while True:
            try:
                data, sender = server.recvfrom(DATAGRAM_MAX + 1)
            except OSError:      # the timeout, or shut down
                data = sender = None
            now = time.monotonic()
            with self._lock:
                if self.closed:          # taken after `close` drained the socket and appended
                    if data == _FLUSH and sender:
                        _answer(server, sender)
                    elif data:
                        _append_to(self.path, data)
                    break
                if data == _FLUSH:
                    self._flush_locked()
                    last = now
                    if sender:
                        _answer(server, sender)
                    continue
                if data:
                    self._buf.append(data)
                if self._buf and now - last >= FLUSH_S:
                    self._flush_locked()
                    last = now
        server.close()

    def _flush_locked(self) -> None:
        data, self._buf = b"".join(self._buf), []
        if data:
            self.appends += 1
            try:
                _append(self._fd, data)
            except OSError as exc:
                print(f"ddp_hpc: could not append {len(data)} bytes of events to {self.path}: {exc}",
                      file=sys.stderr, flush=True)

    # --- every writer
    def write(self, line: str, urgent: bool = False) -> None:
        """Hand one event line (ending in a newline) to the node's file: appended at once when
        ``urgent``, else by the node's forwarder within `FLUSH_S`."""
        data = line.encode("utf-8")
        with self._lock:
            if self.closed:          # a late line (a thread at exit, a forked child): append it
                _append_to(self.path, data)
            elif self._server is not None:
                self._buf.append(data)
                if urgent:
                    self._flush_locked()
            elif urgent or self._client is None or len(data) > DATAGRAM_MAX or not self._send(data):
                self.appends += 1
                _append(self._fd, data)

    def _send(self, data: bytes) -> bool:
        try:
            self._client.sendto(data, socket.MSG_DONTWAIT, self._addr)
            return True
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.EPIPE) and self._serve():
                self._buf.append(data)   # the forwarder is gone: this process forwards from now on
                self._client.close()
                self._client = None
                return True
            return False                 # the socket is full, or no abstract sockets: append directly

    def flush(self, wait: bool = False) -> bool:
        """Append what this process holds now (a forwarder), or ask the forwarder to append what
        it holds (a writer; ``wait``: until it answers that it did, at most `FLUSH_WAIT_S`).
        True when the lines are in the file."""
        with self._lock:
            if self.closed:
                return True
            if self._server is not None:
                self._flush_locked()
                return True
            if self._client is None:
                return True           # every line was appended directly
            try:
                while True:           # an answer to an earlier flush that came late
                    self._client.recv(64, socket.MSG_DONTWAIT)
            except OSError:
                pass
            try:
                self._client.sendto(_FLUSH, socket.MSG_DONTWAIT, self._addr)
            except OSError:
                return True           # no forwarder: nothing is held
            if not wait:
                return False
            self._client.settimeout(FLUSH_WAIT_S)
            try:
                return self._client.recv(64) == _FLUSHED
            except OSError:
                return False
            finally:
                self._client.setblocking(True)

    def close(self) -> None:
        """Stop writing: a forwarder appends what it holds and what is still queued for it (another
        process of the node takes its place at its next line); a writer asks the forwarder to
        append what it holds."""
        with self._lock:
            if self.closed:
                return
            if self._server is not None:
                # Non-blocking first: a shut-down datagram socket polls readable while its queue
                # is empty and a read says EAGAIN, which a socket with a timeout retries until
                # the timeout ends; both this drain and the thread's read spun for `FLUSH_S`
                # (1.6 s of CPU and 1 s more before every forwarding rank could exit).
                self._server.setblocking(False)
                try:   # writers get EPIPE from now on (and append directly); wakes the thread
                    self._server.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
                waiting = []     # writers waiting for the answer to a flush
                while True:      # what was queued before
                    try:
                        data, sender = self._server.recvfrom(DATAGRAM_MAX + 1, socket.MSG_DONTWAIT)
                    except OSError:
                        break
                    if not data:
                        break
                    if data == _FLUSH:
                        waiting.append(sender)
                    else:
                        self._buf.append(data)
                self._flush_locked()
                for sender in waiting:
                    if sender:
                        _answer(self._server, sender)
            elif self._client is not None:
                try:
                    self._client.sendto(_FLUSH, socket.MSG_DONTWAIT, self._addr)
                except OSError:
                    pass
                self._client.close()
            self.closed = True
            try:
                os.close(self._fd)
            except OSError:
                pass


def node_log(path: str) -> NodeLog:
    """This process's `NodeLog` of the node file ``path`` (one per file: several run logs of one
    process share it)."""
    _exit_hooks()
    with _lock:
        log = _logs.get(path)
        if log is None or log.closed:
            log = _logs[path] = NodeLog(path)
        return log


def close_all() -> None:
    """Close every node file of this process (at its exit: what it holds is appended)."""
    with _lock:
        logs = list(_logs.values())
        _logs.clear()
    for log in logs:
        log.close()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) neither forwards nor holds its parent's lines: its
    copies of the sockets and files are closed, and a line it still writes is appended directly."""
    global _lock
    _lock = threading.Lock()
    for log in _logs.values():
        log._lock = threading.Lock()
        for s in (log._server, log._client):
            if s is not None:
                s.close()
        log._server = log._client = None
        log._buf = []
        log.closed = True
        try:
            os.close(log._fd)
        except OSError:
            pass
    _logs.clear()


_hooked: list[int] = []


def _exit_hooks() -> None:
    """`close_all` when this process ends: at the interpreter's exit (``atexit``), and at the exit
    of a multiprocessing child (forkserver, spawn, a launcher's rank), which ends with ``os._exit``
    after its own finalizers and runs no ``atexit`` handler. Registered once per process, when it
    first writes (a forkserver child's finalizers are cleared when it starts)."""
    if _hooked == [os.getpid()]:
        return
    _hooked[:] = [os.getpid()]
    atexit.register(close_all)
    try:
        from multiprocessing import util
        util.Finalize(None, close_all, exitpriority=100)
    except Exception:  # noqa: BLE001 - atexit still runs in a plain process
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
