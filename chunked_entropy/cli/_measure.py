"""One benchmark case, measured in the process that runs it (a fresh one, started by
:mod:`chunked_entropy.cli._process`).

:func:`measure` builds the inputs of a case (:mod:`chunked_entropy.cli._methods`), then runs one
forward+backward and reports

* ``peak_bytes``: the peak memory *over the inputs*: on CPU the peak resident
  set size during the run minus the resident size once the inputs exist (the
  kernel's high-water mark is reset right before the run through
  ``/proc/self/clear_refs``); on CUDA ``torch.cuda.max_memory_allocated()``
  minus the memory allocated once the inputs exist. It includes the gradients
  (of the logits, or of the hidden states and the weight).
* ``time_s``: the wall time of that forward+backward (after a warm-up on a tiny
  input, so that one-time library initialisation is not counted).

The memory meters (:class:`CpuMemory`, :class:`CudaMemory`; ``--allocations`` reads the allocation log of
:mod:`chunked_entropy.testing`, :class:`~chunked_entropy.testing.AllocationLog`), the clock and the case's
physical floor (:func:`floor_seconds`) are here too.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import resource
import sys
import time

import torch

from ..testing import AllocationLog
from ._methods import Case, Inputs, loss_of


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _honest_malloc() -> None:
    """Make glibc give freed memory back, so that resident memory follows live memory.

    By default glibc keeps freed blocks of up to 32 MiB for reuse: memory freed
    by the warm-up (or by forward) would then be reused unseen by the peak.
    With a fixed mmap threshold every block of 64 KiB or more is its own
    mapping, returned on free; ``malloc_trim`` returns what is already kept.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass


class CpuMemory:
    """Peak resident memory of this process, measured from a baseline."""

    def __init__(self):
        self.proc = os.path.exists("/proc/self/clear_refs")
        _honest_malloc()

    def reset(self):
        _honest_malloc()
        if self.proc:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the resident high-water mark (Linux >= 4.0)
            except OSError:
                self.proc = False
        self.base = self._rss()

    def _rss(self):
        if self.proc:
            return _status_kib("VmRSS") * 1024
        return 0  # no baseline without /proc: peak below is the whole process's

    def peak(self):
        if self.proc:
            return _status_kib("VmHWM") * 1024 - self.base
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale - self.base


class CudaMemory:
    def __init__(self, device):
        self.device = device

    def reset(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak(self):
        return torch.cuda.max_memory_allocated(self.device) - self.base


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Wall time on CPU; CUDA events on a GPU."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize(self.device)
            self.seconds = self.start.elapsed_time(self.end) / 1000
        else:
            self.seconds = time.perf_counter() - self.t0


def floor_seconds(case: Case, inp: "Inputs") -> float:
    """The physical floor of the case, timed on the same tensors after the measurement.

    Logits path: one read of the logits (forward) plus one read and one write
    (backward: the gradient), timed as a sum and a copy of the same tensor.
    Fused head: its matmul passes alone, chunk by chunk into one buffer, four
    of them (logits, recomputed logits, ``g @ W``, ``g.T @ h``), three for the
    fused policy loss of a token-local objective, or of a row-local one whose
    sequences fit a chunk; otherwise four, an upper bound (the fused loss
    computes each group's last chunk of logits once).
    """
    device = torch.device(case.device)
    with torch.no_grad():
        if case.path == "logits":
            x = inp.logits.detach()
            grad = torch.empty_like(x)
            with _Clock(device) as clock:
                x.sum()
                grad.copy_(x)
            return clock.seconds
        h, w = inp.hidden.detach(), inp.weight.detach()
        c = max(case.chunk, 1)
        buf = h.new_empty(min(c, h.shape[0]), w.shape[0])
        gh = h.new_empty(buf.shape[0], h.shape[1])
        gw = torch.zeros_like(w)
        from chunked_entropy.losses import TOKEN_LOCAL_MODES, row_local

        # the bench's options are the defaults
        one_fill = case.loss_mode in TOKEN_LOCAL_MODES or (row_local(case.loss_mode) and inp.rows[1] <= c)
        passes = 3 if case.method == "fusedloss" and one_fill else 4
        with _Clock(device) as clock:
            for a in range(0, h.shape[0], c):
                hc = h[a:a + c]
                out = buf[: hc.shape[0]]
                torch.mm(hc, w.t(), out=out)
                if passes == 4:
                    torch.mm(hc, w.t(), out=out)
                torch.mm(out, w, out=gh[: hc.shape[0]])
                gw.addmm_(out.t(), hc)
        return clock.seconds


def measure(case: Case, group=None, rank: int = 0, world: int = 1) -> dict:
    """Warm up on one chunk's worth of tokens, build the inputs, then measure one forward+backward.

    The warm-up lets the libraries underneath set up what they keep for the
    life of the process (thread pools, the matmul library's packing
    workspace: about 10 MiB with MKL), which a training step would find
    already there.
    """
    device = torch.device(case.device)
    n = min(case.tokens, max(case.chunk, 64))
    if case.read:  # enough rows that the rows read fill a chunk: the measured call's matmul shapes are warm
        n = min(case.tokens, -(-n * 100 // case.read))
    tiny = dataclasses.replace(case, tokens=n, seq_len=case.seq_len if case.seq_len and n % case.seq_len == 0 else 0)
    inp = Inputs(tiny, rank, world)
    loss_of(tiny, inp, group).backward()
    del inp
    mem = CudaMemory(device) if device.type == "cuda" else CpuMemory()
    inp = Inputs(case, rank, world)
    gc.collect()
    mem.reset()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    with _Clock(device) as clock:
        loss_of(case, inp, group).backward()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = mem.peak()
    res = {"peak_bytes": int(peak), "time_s": clock.seconds,
           # CPU time of all threads, user and kernel (the kernel's share is mostly page faults on fresh memory)
           "cpu_user_s": r1.ru_utime - r0.ru_utime, "cpu_sys_s": r1.ru_stime - r0.ru_stime}
    if case.warm:  # a training loop's later steps: the time of a second forward+backward in this process
        inp.clear_grads()
        with _Clock(device) as clock:
            loss_of(case, inp, group).backward()
        res.update(time_first_s=res["time_s"], time_s=clock.seconds)
    if case.allocations:
        if device.type == "cuda":
            res["alloc_peak_bytes"] = res["peak_bytes"]
        else:  # logged apart from the timed run (the log slows it down), from the same state: no gradients yet
            inp.clear_grads()
            gc.collect()
            with AllocationLog() as log:
                loss_of(case, inp, group).backward()
            res["alloc_peak_bytes"] = log.peak
    if case.spec.floor and group is None:
        inp.clear_grads()
        res["floor_s"] = floor_seconds(case, inp)
    return res
