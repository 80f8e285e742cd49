"""The bench's process plumbing: each case measured in a fresh process.

:func:`run_fresh` runs one case: with ``tp == 1`` in a child forked from a server that imported torch once
(``python -m chunked_entropy _serve``, :func:`serve_main`); with ``tp > 1`` in a new
``python -m chunked_entropy _case '<json>'`` (:func:`run_case_main`), which spawns that many gloo processes and
reports the largest peak and time over the ranks, and each rank's peak (``peak_bytes_ranks``). The measurement
itself is :func:`chunked_entropy.cli._measure.measure`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from ._measure import measure
from ._methods import Case


def _worker(rank, world, port, case_json, out_file):
    case = Case.from_json(case_json)
    if case.device.startswith("cuda"):
        case = dataclasses.replace(case, device=f"cuda:{rank}")
    spawned_rank(rank, world, port, case.device, lambda: _measured_ranks(case, rank, world), out_file)


def _measured_ranks(case: Case, rank: int, world: int):
    """Every rank measures the case; rank 0 gets the largest peak and time (and each rank's peak), the others
    None."""
    res = measure(case, dist.group.WORLD, rank, world)
    every = [None] * world
    dist.all_gather_object(every, res)
    if rank != 0:
        return None
    out = {
        "peak_bytes": max(r["peak_bytes"] for r in every),
        "time_s": max(r["time_s"] for r in every),
        "peak_bytes_ranks": [r["peak_bytes"] for r in every],
    }
    if case.allocations:
        out["alloc_peak_bytes"] = max(r["alloc_peak_bytes"] for r in every)
    return out


def spawned_rank(rank: int, world: int, port: int, device: str, work, out_file: str) -> None:
    """One rank spawned by ``mp.spawn`` (bench's ``--tp``, demo's ranks): joins the group of ``world`` ranks at
    ``port`` (nccl on CUDA, after setting ``device``; gloo elsewhere), runs ``work()``, rank 0 writes its result
    to ``out_file`` as JSON, and leaves (:func:`leave_spawned_rank`) once every rank is done."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        res = work()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_spawned_rank()


def leave_spawned_rank() -> None:
    """End a spawned rank that finished well without the interpreter's teardown: now and then a native thread
    of the process group still joinable at exit makes the C++ runtime abort the process (SIGABRT, "terminate
    called without an active exception"), which ``mp.spawn`` reports as a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case_main(argv) -> int:
    """``_case <json>``: measure and print one JSON line (internal; used by bench and demo)."""
    case = Case.from_json(argv[0])
    if case.tp == 1:
        res = measure(case)
    else:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "result.json")
            mp.spawn(_worker, args=(case.tp, free_port(), argv[0], out), nprocs=case.tp)
            with open(out) as f:
                res = json.load(f)
    print(json.dumps(res), flush=True)
    return 0


def _measure_in_child(line: str) -> dict:
    try:
        return {"status": "ok", **measure(Case.from_json(line))}
    except BaseException as e:  # reported to the client, which decides what to show
        return {"status": "error", "error": f"{type(e).__name__}: {e}".splitlines()[0]}


def serve_main() -> int:
    """``_serve``: for each JSON case read on stdin, fork a fresh child that measures it.

    This process imports torch and the library once and never computes, so
    every child starts from the same clean state (no thread pool, no cached
    memory) without paying for ``import torch``. For each case it writes a line
    ``{"pid": ...}`` when the child starts, then the child's result.
    """
    import chunked_entropy  # noqa: F401  (preloaded for the children)

    for line in sys.stdin:
        if not line.strip():
            continue
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the fresh process
            os.close(r)
            data = json.dumps(_measure_in_child(line)).encode()
            os.write(w, data)
            os._exit(0)
        os.close(w)
        print(json.dumps({"pid": pid}), flush=True)
        chunks = []
        while True:
            b = os.read(r, 1 << 16)
            if not b:
                break
            chunks.append(b)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if chunks:
            res = json.loads(b"".join(chunks))
        elif os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9:
            res = {"status": "oom"}  # SIGKILL: the out-of-memory killer, or our timeout
        else:
            res = {"status": "error", "error": f"the case's process ended with status {status}"}
        print(json.dumps(res), flush=True)
    return 0


class _Server:
    """Client of ``_serve``: one server process for the life of this one."""

    def __init__(self):
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunked_entropy", "_serve"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )

    def _readline(self, timeout):
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the benchmark's server process ended unexpectedly")
        return json.loads(line)

    def run(self, case: Case, timeout: float) -> dict:
        self.proc.stdin.write(case.to_json() + "\n")
        self.proc.stdin.flush()
        pid = self._readline(120)["pid"]
        res = self._readline(timeout)
        if res is None:
            import signal

            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._readline(60)
            res = {"status": "timeout"}
        return res

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()


_SERVER = None


def run_fresh(case: Case, timeout: float = 1800) -> dict:
    """Measure ``case`` in a fresh process; returns the result dict plus ``status``.

    ``status`` is ``"ok"``, ``"oom"`` (killed, most likely by the kernel's
    out-of-memory killer), ``"timeout"`` or ``"error"`` (with ``error``, a
    one-line reason). With ``tp == 1`` the process is forked from a server
    that imported torch once (``_serve``); with ``tp > 1`` it is a new
    ``python -m chunked_entropy _case`` that spawns the ranks.
    """
    global _SERVER
    if case.tp > 1:
        return _run_subprocess(case, timeout)
    if _SERVER is None or _SERVER.proc.poll() is not None:
        import atexit

        _SERVER = _Server()
        atexit.register(_SERVER.close)
    return _SERVER.run(case, timeout)


def _run_subprocess(case: Case, timeout: float) -> dict:
    import subprocess

    cmd = [sys.executable, "-m", "chunked_entropy", "_case", case.to_json()]
    # a clean slate: not the rendezvous of a torchrun job we may be running under
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "ROLE_NAME")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: the ranks go with it
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"status": "timeout"}
    p = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if p.returncode == 0:
        for line in reversed(p.stdout.splitlines()):
            if line.startswith("{"):
                return {"status": "ok", **json.loads(line)}
    if p.returncode in (-9, 137):
        return {"status": "oom"}
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return {"status": "error", "error": lines[-1] if lines else f"exit code {p.returncode}"}
