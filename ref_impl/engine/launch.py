"""Launch the ranks of MLX's ring backend on one host, relay what they print, and leave none behind.

This is what MLX's own launcher does for `mlx.launch --backend ring -n N` (mlx/_distributed_utils/launch.py):
a JSON hostfile with one "ip:port" address per rank (`Ring.hostfile`), and in each rank's environment
MLX_HOSTFILE (that file) and MLX_RANK; `mx.distributed.init(backend="ring")` reads both. Here each rank is a
`subprocess.Popen` of this Python, so the caller sees every rank as a process and can keep a promise the
launcher makes: a rank that dies, a port that is taken, or a ring that stops talking becomes one clear
error, and the other ranks are killed rather than left behind. They would not leave by themselves: the
ring's socket threads retry non-blocking reads in a loop (mlx/distributed/ring/ring.cpp), so a rank whose
neighbour is alive but stuck waits, at a full core, forever.

Ranks talk to the launcher in JSON lines on stdout (one event per line, `emit`); whatever else they print
on stderr is kept, and its last line names the cause when a rank fails.

References: MLX documentation, "Launching Distributed Programs":
https://ml-explore.github.io/mlx/build/html/usage/launching_distributed.html

See chapter: pipeline
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ref_impl.platform.timing import clock

POLL_S = 0.05            # how often the launcher looks at its ranks between events
GRACE_S = 1.0            # after a rank fails, how long the others get to fail on their own (naming their cause)
STDERR_LINES = 20        # lines of each rank's stderr kept for the error message


@dataclass(frozen=True)
class Ring:
    """The ranks' addresses on one host: rank r listens on host:ports[r]."""
    host: str
    ports: tuple[int, ...]

    def hostfile(self) -> str:
        """The ring backend's hostfile: one list of "ip:port" addresses per rank (one connection each)."""
        return json.dumps([[f"{self.host}:{p}"] for p in self.ports])


def free_ports(host: str, n: int) -> tuple[int, ...]:
    """n ports the OS reports free on host (bound to port 0 together, so they differ, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


def check_ports(host: str, ports: Sequence[int]) -> None:
    """Refuse, before any rank starts, a port another program holds: an OSError naming it."""
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as the ring binds: TIME_WAIT is no owner
            try:
                s.bind((host, p))
            except OSError as e:
                why = "is in use by another program" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e})"
                raise OSError(f"port {p} on {host} {why}: the pipeline's ranks listen on ports "
                              f"{ports[0]}-{ports[-1]}; choose another first port") from None


def emit(event: dict) -> None:
    """A rank's side: one event to the launcher, as one JSON line on stdout."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def describe_exit(code: int) -> str:
    """A process's return code in words: 'exited with code 2', 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Ranks:
    """N processes of `python -m module args`, rank r with MLX_RANK=r and the ring's hostfile; a context
    manager that kills whatever is still running when it exits, however it exits."""

    def __init__(self, module: str, args: Sequence[str], ring: Ring, names: Sequence[str],
                 env: dict[str, str] | None = None):
        self.names = list(names)                   # how an error names each rank ("stage 1 (layers 3-5)")
        self.events_q: queue.Queue = queue.Queue()
        self.stderr = [deque(maxlen=STDERR_LINES) for _ in ring.ports]
        self.exited_at: dict[int, float] = {}
        self.workdir = tempfile.mkdtemp(prefix="ref_impl-ring-")
        hostfile = Path(self.workdir) / "hostfile.json"
        hostfile.write_text(ring.hostfile())
        root = str(Path(__file__).resolve().parents[2])              # this ref_impl, whatever the cwd
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        try:
            for rank in range(len(ring.ports)):
                rank_env = {**os.environ, **(env or {}), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                            "PYTHONPATH": path}
                p = subprocess.Popen([sys.executable, "-m", module, *args], env=rank_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)        # a Ctrl-C reaches the launcher, which stops all
                self.procs.append(p)
                self.read(rank, p)
        except BaseException:
            self.stop()
            raise

    def read(self, rank: int, p: subprocess.Popen) -> None:
        """Threads that drain a rank's stdout (events) and stderr (kept lines), so no pipe ever fills."""
        def out():
            for line in p.stdout:
                try:
                    self.events_q.put((rank, json.loads(line)))
                except json.JSONDecodeError:
                    self.stderr[rank].append(line.rstrip())
        def err():
            for line in p.stderr:
                if line.strip():
                    self.stderr[rank].append(line.rstrip())
        for fn in (out, err):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self.threads.append(t)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        """Whatever happened, no rank outlives the block."""
        self.stop()

    def stop(self) -> None:
        """Kill every rank still running, wait for each, and remove the hostfile."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        for t in self.threads:
            t.join(timeout=1.0)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def poll(self) -> list[int]:
        """Ranks that have failed (a non-zero exit), each stamped with the clock when first seen (ranks seen
        in one look share a stamp: `fail` then names one killed by a signal first, the likelier cause)."""
        now = clock()
        for rank, p in enumerate(self.procs):
            if p.poll() is not None and rank not in self.exited_at:
                self.exited_at[rank] = now
        return [r for r in self.exited_at if self.procs[r].returncode != 0]

    def events(self, timeout_s: float) -> Iterator[tuple[int, dict]]:
        """(rank, event) as the ranks emit them, until every rank has exited cleanly. A rank that fails
        raises RuntimeError, and a ring silent for timeout_s TimeoutError; either way every rank is killed."""
        last = clock()
        while True:
            try:
                yield self.events_q.get(timeout=POLL_S)
                last = clock()
                continue
            except queue.Empty:
                pass
            if self.poll():
                self.fail()
            if len(self.exited_at) == len(self.procs) and self.events_q.empty():
                for t in self.threads:
                    t.join(timeout=1.0)
                if self.events_q.empty():
                    return
            if clock() - last > timeout_s:
                self.stop()
                raise TimeoutError(f"the pipeline printed nothing for {timeout_s:g} s (a stage is stuck or the "
                                   f"ranks could not connect); all {len(self.procs)} ranks were stopped")

    def fail(self) -> None:
        """Give the other ranks GRACE_S to fail on their own, stop them all, and raise one RuntimeError that
        names the first rank to fail, how, and its last line on stderr, then what the others did."""
        end = clock() + GRACE_S
        while clock() < end and len(self.exited_at) < len(self.procs):
            self.poll()
            time.sleep(POLL_S)
        failed = sorted(self.poll(), key=lambda r: (self.exited_at[r], self.procs[r].returncode >= 0))
        running = [r for r in range(len(self.procs)) if r not in self.exited_at]
        self.stop()                                 # also lets the reader threads take the last stderr lines
        parts = []
        for r in failed:
            last = self.stderr[r][-1] if self.stderr[r] else "no message"
            if "error: 98" in last:
                last += " (errno 98: the port is in use)"
            parts.append(f"{self.names[r]} {describe_exit(self.procs[r].returncode)}: {last}")
        stopped = f"; stopped the others: {', '.join(self.names[r] for r in running)}" if running else ""
        raise RuntimeError("pipeline failed: " + "; then ".join(parts) + stopped)
