"""Shared test tools: the float64 reference and a gloo process-group harness."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def reference(
    logits, labels, *, temperature=1.0, label_mask=None, ignore_index=-100,
    softcap=None, logit_scale=None, sum_pi_squared=False,
):
    """float64 log-probs and entropy of ``softmax(transform(logits) / temperature)`` over the last dim.

    ``transform(z) = softcap * tanh(logit_scale * z / softcap)`` (each part
    optional), written here straight from its definition. ``logits`` must
    already be float64 (it may require grad); plain autograd gives the
    reference gradients. Masked or ignored labels get log-prob 0. With
    ``sum_pi_squared=True`` a third output, ``sum_j p_j**2``, is returned.
    """
    assert logits.dtype == torch.float64
    t = temperature
    if isinstance(t, torch.Tensor):
        t = torch.broadcast_to(t.to(torch.float64), labels.shape).unsqueeze(-1)
    z = logits if logit_scale is None else logits * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / t, dim=-1)
    valid = labels != ignore_index
    if label_mask is not None:
        valid = valid & label_mask
    lp = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    p = logp.exp()
    # p * logp with p == 0 (padded -inf columns) contributes 0, not NaN
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    if sum_pi_squared:
        return lp, ent, (p * p).sum(-1)
    return lp, ent


def require(*modules: str) -> None:
    """Skip the calling test module, with a reason naming what to install, unless ``modules`` import.

    Call it at module level before importing a framework: a framework that
    cannot be installed on some platform skips its tests instead of failing
    the collection of the whole suite.
    """
    import importlib

    import pytest

    for name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except ImportError as e:
            pytest.skip(
                f"{name} is not importable ({type(e).__name__}: {e}); the README's first command installs it "
                "(pip install -e '.[megatron,test,plot,docs,frameworks]' && pip install --no-deps verl==0.9.1 "
                "openrlhf==0.11.2 areal==1.0.4 torchtitan==0.3.0)",
                allow_module_level=True,
            )


#: What the ranks' fork server imports once a session (``forkserver`` start method): each rank forked from it
#: starts with these loaded instead of importing torch again (about 2 s of CPU a rank on a 2-core machine). The
#: last one is what ``torch._check`` imports on its first call (sympy). None of them starts a thread.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.multiprocessing", "chunked_entropy", "tests.helpers",
                      "torch.fx.experimental.symbolic_shapes")


def _worker(rank, world_size, store_file, fn, args, errfile, timeout_s=None, error_filters=(), parent=None):
    if parent is not None:  # the caller's environment, working directory and sys.path now, not the fork server's
        env, cwd, path = parent
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
    torch.set_num_threads(1)
    for _, message, category, module, lineno in error_filters:  # the parent's warnings-as-errors, here too
        warnings.filterwarnings("error", message=message, category=category, module=module, lineno=lineno)
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    # A file rendezvous: no port to pick, release and bind again, so two runs can never race for one.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size, **kw)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        dist.destroy_process_group()
        raise
    dist.barrier()  # every rank done before any tears its connections down
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: now and then a native thread still joinable at exit makes the
    # C++ runtime abort a process whose test passed (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout_s=None, deadline_s=None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh gloo processes.

    ``fn`` must be a module-level function (it is pickled). A failure on any
    rank fails the caller with that rank's traceback. ``timeout_s`` bounds
    every collective (gloo's default is 30 minutes): a test of "no hang"
    then fails in seconds instead of waiting. ``deadline_s`` bounds the whole
    run: past it the processes are terminated and the caller fails (a rank
    stuck outside a collective). The caller's "error" warning
    filters (pytest's ``-W error:...`` / ``filterwarnings``) apply on every rank.

    The ranks are forked from a fork server (Python's ``forkserver`` start method) that imported
    :data:`FORKSERVER_PRELOAD` once, instead of each importing torch anew; each rank then takes the
    caller's environment variables, working directory and ``sys.path`` as they are at this call, as a
    spawned process would (a variable read when torch or the library is imported is the fork server's).
    """
    error_filters = [(a, m.pattern if m else "", c, mod.pattern if mod else "", ln)
                     for a, m, c, mod, ln in warnings.filters if a == "error"]
    with tempfile.TemporaryDirectory() as d:
        errfile = os.path.join(d, "err")
        try:
            store = os.path.join(d, "rendezvous")  # a fresh file per run: the group's store
            parent = (dict(os.environ), os.getcwd(), list(sys.path))
            mp.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))  # before its first start
            ctx = mp.start_processes(_worker, args=(world_size, store, fn, args, errfile, timeout_s, error_filters,
                                                    parent), nprocs=world_size, join=False, start_method="forkserver")
            end = None if deadline_s is None else time.monotonic() + deadline_s
            while not ctx.join(timeout=None if end is None else max(end - time.monotonic(), 0.1)):
                if end is not None and time.monotonic() > end:
                    for p in ctx.processes:
                        p.terminate()
                    raise TimeoutError(f"the {world_size} ranks did not finish within {deadline_s} s")
        except Exception as e:
            msgs = []
            for r in range(world_size):
                if os.path.exists(f"{errfile}.{r}"):
                    msgs.append(f"--- rank {r} ---\n" + open(f"{errfile}.{r}").read())
            raise AssertionError("distributed test failed:\n" + "\n".join(msgs or [str(e)])) from None


def policy_loss_of(**settings):
    """The :class:`~chunked_entropy.PolicyLoss` of a test table written in verl's names (``loss_mode``,
    ``loss_agg_mode``, ``loss_scale_factor``, ``entropy_coeff``, ``kl_coef``, ``kl_kind``, ``entropy_of`` and
    the :class:`~chunked_entropy.losses.PolicyOptions` fields): the tables stay in the names that the
    float64 compositions (``losses.policy_loss``, verl's ``core_algos``) read."""
    from chunked_entropy import PolicyLoss
    from chunked_entropy.losses import Aggregation

    s = dict(settings)
    aggregation = Aggregation(s.pop("loss_agg_mode", "token-mean"), s.pop("loss_scale_factor", None),
                              s.pop("dp_size", 1), s.pop("batch_num_tokens", None), s.pop("global_batch_size", None))
    top = {k: s.pop(k) for k in ("entropy_coeff", "kl_coef", "kl_kind", "entropy_of") if k in s}
    return PolicyLoss(s.pop("loss_mode", "vanilla"), s, aggregation=aggregation, **top)
