"""DistributedFusedAdam on gloo (CPU), several processes: the result must equal
one process running torch.optim.AdamW (or Adam) on the global batch, which is
what DDP + AdamW computes. The workers and the reference also run
DistributedFusedLion against a plain torch Lion (cfg optimizer="lion":
test_lion.py)."""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import queue
import socket
import time
import warnings
from multiprocessing import reduction

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from torch_lion import TorchLion

STEPS, GLOBAL_BATCH = 5, 24  # 24 splits evenly over 1, 2, 3, 4 and 8 ranks


def _model(kind: str = "sequential") -> nn.Module:
    torch.manual_seed(0)
    if kind == "tiny":  # 12 elements: with 3 ranks, rank 2's shard is padding only
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3))
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 8), nn.Tanh(), nn.Linear(8, 3))
    m = m.to(memory_format=torch.channels_last)
    return m if kind == "sequential" else {"reordered": _Reordered, "branch": _Branch}[kind](m)


class _Reordered(nn.Module):
    """The same network with its layers registered last-to-first, so forward
    (and backward) order differs from parameter order (Megatron #950)."""

    def __init__(self, seq: nn.Sequential):
        super().__init__()
        self.head, self.hidden, self.conv = seq[4], seq[2], seq[0]

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(self.conv(x).flatten(1))))


class _Branch(_Reordered):
    """With an extra layer that only some ranks use (use_extra): its
    parameters get no gradient on the others."""

    def __init__(self, seq: nn.Sequential):
        super().__init__(seq)
        self.extra = nn.Linear(3, 3)
        self.use_extra = True

    def forward(self, x):
        y = super().forward(x)
        return y + self.extra(y) if self.use_extra else y


def _frozen(model: nn.Module) -> nn.Parameter:
    return model.head.bias if isinstance(model, _Reordered) else model[-1].bias


def _groups(model: nn.Module, frozen: nn.Parameter) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not frozen]
    rest = [p for p in model.parameters() if p.dim() < 2 and p is not frozen]
    return [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0, lr=2e-2),
            dict(params=[], lr=5e-3), dict(params=[frozen])]


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 3, 6, 6, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 3, generator=g)


def _lr_schedule(opt):
    """Halve every learning rate every 2 steps (exact in binary floating point)."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(model, opt, rank: int, world: int, steps, clip: float | None = None, micro: int = 1,
           accumulate: str = "no_sync", scaler=None, inf_step: int | None = None, schedule=None) -> list[float]:
    """Train on this rank's part of the global batches, in `micro` equal
    micro-batches (gradients accumulated inside no_sync(), or synchronised
    after each one with accumulate="every"); the pre-clip norms when clipping.
    Equal pieces make the result DDP's: the mean over pieces of their mean loss.
    With a GradScaler the loss is scaled; at inf_step rank 1's loss is inf.
    schedule: an LR scheduler stepped after every optimizer step."""
    x, y = _data()
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    x, y = x.to(dtype), y.to(dtype)
    local = GLOBAL_BATCH // world
    piece = local // micro
    norms = []
    for s in steps:
        opt.zero_grad()
        for i in range(micro):
            part = slice(rank * local + i * piece, rank * local + (i + 1) * piece)
            quiet = accumulate == "no_sync" and i < micro - 1
            loss = F.mse_loss(model(x[s, part].to(dev)), y[s, part].to(dev)) / micro
            if s == inf_step and rank == min(1, world - 1):
                loss = loss * float("inf")
            with opt.no_sync() if quiet else contextlib.nullcontext():
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm(clip, grad_scaler=scaler)))
        _step(opt, scaler, schedule)
    return norms


def _step(opt, scaler=None, schedule=None) -> None:
    """The optimizer step, through the GradScaler when there is one, then the LR schedule."""
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if schedule is not None:
        schedule.step()


RANK_TIMEOUT_S = 100  # a spawned rank's whole body; the slowest CI case takes about 20 s


@contextlib.contextmanager
def _rank_group(rank: int, world: int, port: int, out, backend: str = "gloo"):
    """One spawned rank's process group around a worker's body; every rank
    waits for the others before tearing down, and the result queue is
    flushed. The worker then calls _exit()."""
    torch.set_num_threads(1)  # up to 8 ranks share 2 cores
    # A rank stuck in a collective (its peer failed) prints where every thread
    # is and exits, so the test fails with that trace instead of hanging.
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()  # no rank tears down while another still talks to it
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
        out.close()
        out.join_thread()  # the result is flushed before the process exits


def _two_by_two(rank: int) -> dict:
    """apex's layout on 4 ranks, as keyword arguments: shards over {0, 1} and
    {2, 3}, each repeated over {0, 2} / {1, 3} (every rank creates every group)."""
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return dict(distributed_process_group=shard_groups[rank // 2], redundant_process_group=replica_groups[rank % 2])


def _exit() -> None:
    # Skip interpreter teardown: gloo's threads sometimes abort it ("terminate
    # called without an active exception", seen with 3 ranks on 2 cores and
    # with every shardadam kernel on one thread), after all results are out.
    os._exit(0)


def _worker(rank: int, world: int, port: int, cfg: dict, out) -> None:
    """One rank: gloo on the CPU, or NCCL with one GPU per rank. cfg: see _config."""
    device = cfg["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        if device == "cuda":  # cuDNN's default convolutions are not deterministic
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        model = _model(cfg["model"]).to(device if device == "cpu" else f"cuda:{rank}", dtype=cfg["dtype"])
        original = {k: v.clone() for k, v in model.state_dict().items()}
        if rank != 0 or cfg["late_load"]:  # the optimizer broadcasts rank 0's parameters
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        if isinstance(model, _Branch):
            model.use_extra = rank == 0
        frozen = _frozen(model)
        frozen.requires_grad_(False)
        frozen_before = frozen.detach().clone()
        groups = _two_by_two(rank) if cfg["redundant"] else {}
        opt = _distributed(cfg, _groups(model, frozen), bucket_cap_mb=cfg["bucket_cap_mb"],
                           overlap_grad_sync=cfg["overlap"], grad_sync_dtype=cfg["grad_sync_dtype"],
                           pipeline_size=cfg["pipeline_size"], overlap_param_sync=cfg["overlap_param_sync"],
                           contiguous_param_buffer=cfg["contiguous_param_buffer"],
                           contiguous_grad_buffer=cfg["contiguous_grad_buffer"],
                           param_sync_dtype=cfg["param_sync_dtype"], store_param_remainders=cfg["remainders"],
                           with_scaled_states=cfg["scaled_states"], store_params=cfg["store_params"],
                           capturable=cfg["capturable"] or cfg["capture"],
                           grad_sync_copy_engine=cfg["grad_copy_engine"], param_sync_copy_engine=cfg["copy_engine"],
                           **groups)
        if cfg["late_load"]:  # weights loaded after the optimizer was built must be the ones trained
            model.load_state_dict(original)
            frozen_before = frozen.detach().clone()
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10) if cfg["scaler"] else None
        schedule = _lr_schedule(opt) if cfg["lr_schedule"] else None
        if cfg["capture"]:  # the tests of CUDA-graph capture live with their training loop
            from test_distributed_capture import train_captured
            norms = train_captured(model, opt, rank, world, cfg["clip"], scaler, cfg["inf_step"], schedule)
        else:
            norms = _train(model, opt, rank, world, range(STEPS), cfg["clip"], cfg["micro"], cfg["accumulate"],
                           scaler, cfg["inf_step"], schedule)
        opt.param_sync()  # with overlap_param_sync the last all-gathers may still be running
        steps = [int(g["step"]) for g in opt.param_groups]
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        masters = [v["param"].numpy().copy() for v in opt.state_dict()["state"].values()]  # a collective
        if rank == 0:
            # numpy arrays travel by value (tensors would pass file handles to a process that exits)
            out.put(dict(scale=None if scaler is None else float(scaler.get_scale()),
                         params=[p.detach().float().cpu().numpy().copy() for p in model.parameters()],
                         masters=masters, steps=steps,
                         same_on_all_ranks=all(torch.equal(t, flat) for t in gathered),
                         frozen_unchanged=torch.equal(frozen.detach(), frozen_before),
                         buckets=len(opt.layout.buckets), norms=norms, grads_in_buffer=opt.grads_in_buffer,
                         copy_engine=opt.transports["param_sync"].startswith("copy-engine"),
                         grad_copy_engine=opt.transports["grad_sync"].startswith("copy-engine")))
    _exit()


def _distributed(cfg: dict, groups: list, **options):
    """cfg["optimizer"]'s distributed optimizer (lr 1e-2, weight decay 0.1).
    Remainders come with store_params=False and scaled states with fp16
    state, as apex asks."""
    if options.get("store_param_remainders"):
        options["store_params"] = False
    if options.get("with_scaled_states"):
        options["dtype"] = torch.float16
    if cfg["optimizer"] == "lion":
        return shardadam.DistributedFusedLion(groups, lr=1e-2, weight_decay=0.1, **options)
    return shardadam.DistributedFusedAdam(groups, lr=1e-2, weight_decay=0.1, adam_w_mode=cfg.get("adam_w_mode", True),
                                          amsgrad=cfg.get("amsgrad", False), **options)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**kw) -> dict:
    cfg = dict(device="cpu", adam_w_mode=True, bucket_cap_mb=1e-4, clip=None, overlap=True, micro=1,
               accumulate="no_sync", model="sequential", grad_sync_dtype=None, pipeline_size=2,
               overlap_param_sync=False, contiguous_param_buffer=False, redundant=False, late_load=False,
               contiguous_grad_buffer=False, amsgrad=False, scaler=False, inf_step=None,
               param_sync_dtype=None, dtype=torch.float32, remainders=False, scaled_states=False,
               store_params=None, capturable=False, capture=False, lr_schedule=False, copy_engine=None,
               grad_copy_engine=None, optimizer="adam")
    unknown = set(kw) - set(cfg)
    assert not unknown, f"unknown config keys {unknown}"
    cfg.update(kw)
    return cfg


def _reference(world: int, adam_w_mode: bool = True, clip: float | None = None, model_kind: str = "sequential",
               amsgrad: bool = False, scaler: bool = False, inf_step: int | None = None, sync_dtype=None,
               lr_schedule: bool = False, optimizer: str = "adam"):
    """Single-process Adam/AdamW (optimizer="lion": TorchLion) on the global
    batches: (params, pre-clip norms, final loss scale or None). sync_dtype:
    the gradients are summed as 2 ranks in that dtype would (each rank's
    gradient rounded, the sum rounded)."""
    model = _model(model_kind)
    frozen = _frozen(model)
    frozen.requires_grad_(False)
    if optimizer == "lion":
        opt = TorchLion(_groups(model, frozen), lr=1e-2, weight_decay=0.1)
    else:
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        opt = cls(_groups(model, frozen), lr=1e-2, weight_decay=0.1, foreach=False, amsgrad=amsgrad)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
    schedule = _lr_schedule(opt) if lr_schedule else None
    x, y = _data()
    local = GLOBAL_BATCH // world
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        # The mean over ranks of each rank's mean loss: DDP's averaged gradient.
        losses = [_rank_loss(model, x[s, r * local:(r + 1) * local], y[s, r * local:(r + 1) * local], r)
                  for r in range(world)]
        loss = sum(losses) / world * (float("inf") if s == inf_step else 1.0)
        if sync_dtype is not None:
            _synced_grads(model, losses, world, sync_dtype)
        else:
            (amp.scale(loss) if amp is not None else loss).backward()
        if clip is not None:
            if amp is not None:
                amp.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                               clip)))
        _step(opt, amp, schedule)
    return [p.detach() for p in model.parameters()], norms, None if amp is None else float(amp.get_scale())


def _rank_loss(model, x, y, rank: int):
    """Rank's loss on its piece of a batch (a _Branch uses its extra layer on rank 0 only)."""
    if isinstance(model, _Branch):
        model.use_extra = rank == 0
    return F.mse_loss(model(x), y)


def _synced_grads(model, losses, world: int, dtype) -> None:
    """p.grad = round(round(g_0) + round(g_1)) / world: a 2-rank reduction in dtype."""
    assert world == 2
    trainable = [p for p in model.parameters() if p.requires_grad]
    per_rank = [torch.autograd.grad(loss, trainable, retain_graph=True) for loss in losses]
    for p, g0, g1 in zip(trainable, *per_rank):
        p.grad = (g0.to(dtype) + g1.to(dtype)).float() / world


# [Note: rank processes] On a machine without a GPU (CI), ranks start from a
# fork server that has imported torch once: a fresh interpreter spends about
# 5 s of CPU importing torch and shardadam on the 2-core CI machine, which an
# 8-rank world paid eight times. A child forked from the server does not see
# what the test process changed since the server started, so _in_rank gives
# it the test's current environment, stdout and stderr (where its tracebacks
# and faulthandler dumps belong). Where a GPU is present, ranks are spawned
# fresh as before, so that CUDA starts clean in each.
@functools.cache
def _rank_context():
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
    return ctx


class _TestFd:
    """One of the test process's file descriptors, pickled as a duplicate the child receives."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _TestFd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _in_rank(env: dict, stdout: int, stderr: int, target, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    dist.set_debug_level_from_env()  # read when the server imported torch.distributed
    for fd, inherited in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, inherited)
        os.close(fd)
    target(*args)


def _rank_process(ctx, target, args: tuple):
    if ctx.get_start_method() != "forkserver":
        return ctx.Process(target=target, args=args)
    return ctx.Process(target=_in_rank, args=(dict(os.environ), _TestFd(1), _TestFd(2), target, *args))


def _run_ranks(target, world: int, args: tuple, expected: int) -> list:
    """Run target(rank, world, port, *args, queue) on `world` processes and
    collect `expected` results from the queue; fails the test (naming the exit
    codes) if fewer come or a rank exits non-zero. The timeouts only end a
    hang: they never decide a passing run."""
    ctx = _rank_context()
    out = ctx.Queue()
    port = _free_port()
    procs = [_rank_process(ctx, target, (r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + RANK_TIMEOUT_S + 20
    while len(results) < expected and time.monotonic() < deadline:
        # A rank that failed ends the wait (its traceback is above); so do
        # ranks that all ended, once what they put is read (they flush first).
        failed = any(p.exitcode for p in procs)
        ended = all(p.exitcode is not None for p in procs)
        try:
            results.append(out.get(timeout=0.2 if failed or ended else 1.0))
        except queue.Empty:
            if failed or ended:
                break
    for p in procs:
        p.join(timeout=30 if len(results) == expected else 5)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if len(results) != expected or any(code != 0 for code in codes):
        pytest.fail(f"ranks' exit codes {codes} (None: still running, killed); {len(results)} of {expected} "
                    "results; their stderr is above")
    return results


def _spawn(target, world: int, *args):
    """Run target on `world` processes (see _run_ranks); rank 0's result."""
    return _run_ranks(target, world, args, 1)[0]


def _spawn_all(target, world: int, *args) -> list:
    """Run target on `world` processes, each rank putting (rank, result); the results in rank order."""
    return [value for _, value in sorted(_run_ranks(target, world, args, world), key=lambda item: item[0])]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("bucket_cap_mb", [1e-4, 100.0], ids=["tiny-buckets", "one-bucket"])
def test_matches_single_process_adam_on_the_global_batch(world, adam_w_mode, bucket_cap_mb):
    result = _spawn(_worker, world, _config(adam_w_mode=adam_w_mode, bucket_cap_mb=bucket_cap_mb))
    assert result["same_on_all_ranks"], "ranks disagree on the parameters"
    assert result["frozen_unchanged"], "a frozen parameter was modified"
    assert result["steps"] == [STEPS] * 4, f"step counters {result['steps']} (the empty group must count too)"
    if bucket_cap_mb < 1:
        assert result["buckets"] > 3, "tiny buckets must split the parameters over several buckets"
    for i, (got, want) in enumerate(zip(result["params"], _reference(world, adam_w_mode)[0])):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


@pytest.mark.parametrize("world,kw", [
    (1, {}),
    (4, {}),
    (2, dict(overlap=False)),
    (2, dict(micro=3)),                            # no_sync accumulation
    (3, dict(micro=2, accumulate="every")),       # a reduce-scatter round per micro-batch
    (4, dict(micro=3, accumulate="every", pipeline_size=1)),
    (2, dict(model="reordered")),                  # backward order differs from parameter order
    (2, dict(contiguous_param_buffer=True)),       # all-gathers land in the parameters
    (4, dict(redundant=True, overlap_param_sync=True)),  # 2 shards x 2 replicas
    (4, dict(redundant=True, contiguous_grad_buffer=True, contiguous_param_buffer=True)),  # shards in the buffers
    (2, dict(late_load=True, contiguous_param_buffer=True)),
    (3, dict(contiguous_grad_buffer=True, micro=2)),          # autograd accumulates into the buckets
    (2, dict(contiguous_grad_buffer=True, overlap=False, contiguous_param_buffer=True)),
    (2, dict(amsgrad=True)),
    (3, dict(model="tiny", bucket_cap_mb=100.0)),          # ranks 1 and 2 own (almost) nothing
    (2, dict(model="branch")),                              # rank 1's gradient of a layer counts as zeros
    (3, dict(scaler=True, inf_step=2)),                     # GradScaler: rank 1's inf skips the step everywhere
    (2, dict(scaler=True, clip=0.02, overlap_param_sync=True)),  # clipping deferred to the unscaled norm
    (3, dict(overlap_param_sync=True, model="reordered")),
    (2, dict(overlap_param_sync=True, contiguous_param_buffer=True, model="reordered", pipeline_size=1)),
    pytest.param(2, dict(device="cuda", overlap_param_sync=True, contiguous_param_buffer=True, model="reordered",
                         micro=2, accumulate="every"), marks=pytest.mark.multigpu),
    pytest.param(2, dict(device="cuda", contiguous_grad_buffer=True, contiguous_param_buffer=True, micro=2,
                         redundant=False), marks=pytest.mark.multigpu),
    pytest.param(2, dict(device="cuda", overlap_param_sync=True, contiguous_param_buffer=True, copy_engine=False,
                         grad_copy_engine=False), marks=pytest.mark.multigpu),
    pytest.param(2, dict(device="cuda", grad_copy_engine=True, micro=3, accumulate="every", pipeline_size=1),
                 marks=pytest.mark.multigpu),
    pytest.param(2, dict(device="cuda", contiguous_param_buffer=True, copy_engine=True, scaler=True, inf_step=2,
                         model="reordered"), marks=pytest.mark.multigpu),
], ids=["world-1", "world-4", "no-overlap", "no_sync-3", "sync-every-2", "sync-every-3-pipeline-1", "reordered",
        "contiguous-params", "redundant-2x2", "redundant-2x2-contiguous-both", "weights-loaded-after-construction",
        "contiguous-grads-no_sync", "contiguous-both-no-overlap", "amsgrad", "tiny-model-3-ranks", "gradients-absent-on-rank-1", "grad-scaler-inf-skips",
        "grad-scaler-clip", "overlap-params-3", "overlap-contiguous-params", "nccl-2-overlap-everything",
        "nccl-2-contiguous-buffers", "nccl-2-nccl-collectives", "nccl-2-copy-engine-reduce-rounds",
        "nccl-2-copy-engine-no-overlap-inf-skip"])
def test_sync_variants_match_single_process_adamw(world, kw):
    cfg = _config(**kw)
    result = _spawn(_worker, world, cfg)
    assert result["same_on_all_ranks"], "ranks disagree on the parameters"
    assert result["frozen_unchanged"], "a frozen parameter was modified"
    want_params, _, want_scale = _reference(world, model_kind=cfg["model"], amsgrad=cfg["amsgrad"],
                                            scaler=cfg["scaler"], inf_step=cfg["inf_step"], clip=cfg["clip"])
    assert result["scale"] == want_scale, "the loss scale must back off exactly as torch's"
    if cfg["clip"] is not None:  # pre-clip norms, unscaled under AMP (the scaler is passed to clip_grad_norm)
        want_norms = _reference(world, clip=cfg["clip"], scaler=cfg["scaler"])[1]
        np.testing.assert_allclose(result["norms"], want_norms, rtol=1e-5)
    steps_done = STEPS - (cfg["inf_step"] is not None)
    assert result["steps"] == [steps_done] * 4, "a skipped step must not count, on any rank"
    # Two H200s of one host: gradients are reduce-scattered, and a contiguous
    # parameter buffer is all-gathered, on the copy engines unless asked not to.
    copy_engine = cfg["device"] == "cuda" and cfg["contiguous_param_buffer"] and cfg["copy_engine"] is not False
    assert result["copy_engine"] == copy_engine, "the parameter all-gather took the wrong path"
    grad_copy_engine = cfg["device"] == "cuda" and cfg["grad_copy_engine"] is not False
    assert result["grad_copy_engine"] == grad_copy_engine, "the gradient reduce-scatter took the wrong path"
    for i, (got, want) in enumerate(zip(result["params"], want_params)):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


def _overlap_worker(rank: int, world: int, port: int, contiguous_grads: bool, out) -> None:
    """When buckets are reduce-scattered during backward (second iteration:
    the first teaches the layout the backward order), and which ones are still
    gathering after a step once one module has run its forward."""
    with _rank_group(rank, world, port, out):
        model = _model()
        holder = []
        started_before_first_layer = []
        # Registered before the optimizer's hook: runs when the first layer's
        # weight gradient (the last of backward) is ready, before it is handed over.
        model[0].weight.register_post_accumulate_grad_hook(
            lambda p: started_before_first_layer.append(holder[0]._grad_sync.next_bucket))
        # Decay / no-decay groups: parameter order is not backward order; the
        # first iteration teaches the layout the order gradients arrive in.
        frozen = _frozen(model)
        frozen.requires_grad_(False)
        opt = shardadam.DistributedFusedAdam(_groups(model, frozen), lr=1e-2, bucket_cap_mb=1e-4,
                                             overlap_param_sync=True, contiguous_param_buffer=True,
                                             contiguous_grad_buffer=contiguous_grads)
        holder.append(opt)
        x, y = _data()
        F.mse_loss(model(x[0, :2]), y[0, :2]).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(model(x[1, :2]), y[1, :2]).backward()
        started_in_backward = opt._grad_sync.next_bucket
        opt.step()
        sync = opt._param_sync
        n_buckets = len(opt.layout.buckets)
        all_buckets = set(range(n_buckets))
        after_step = set(sync.pending)
        conv = model[0]
        conv_buckets = {b for p in conv.parameters() for b in sync.buckets_of[id(p)]}
        conv(x[0, :2])
        after_conv = set(sync.pending)
        opt.param_sync()
        if rank == 0:
            out.put(dict(all_started_in_backward=started_in_backward == n_buckets,
                         some_started_early=started_before_first_layer[-1] >= len(opt.layout.buckets) // 2,
                         after_step=after_step == all_buckets, conv_waited=not (after_conv & conv_buckets),
                         others_pending=after_conv == all_buckets - conv_buckets, drained=not sync.pending))
    _exit()


@pytest.mark.parametrize("contiguous_grads", [False, True], ids=["grad-buckets", "contiguous-grads"])
def test_overlap_starts_buckets_in_backward_and_waits_per_module(contiguous_grads):
    result = _spawn(_overlap_worker, 2, contiguous_grads)
    assert all(result.values()), result


def test_bf16_grad_sync_matches_a_bf16_reduction():
    """Gradients reduced in bf16 on 2 ranks: the same as fp32 AdamW on
    gradients summed the way a bf16 reduction sums them (each rank's gradient
    rounded to bf16, their sum rounded), within fp32 rounding; and measurably
    different from the fp32 reduction."""
    result = _spawn(_worker, 2, _config(grad_sync_dtype=torch.bfloat16))
    assert result["same_on_all_ranks"]
    want = _reference(2, sync_dtype=torch.bfloat16)[0]
    fp32 = _reference(2)[0]
    assert any(not torch.equal(a, b) for a, b in zip(want, fp32)), "bf16 rounding must change something"
    for i, (got, w) in enumerate(zip(result["params"], want)):
        torch.testing.assert_close(torch.from_numpy(got), w.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


def test_remainders_track_fp32_masters():
    """bf16 parameters with int16 remainders (2 bytes per parameter less)
    against the same run with fp32 masters. The two agree bit for bit until a
    master lands exactly halfway between two bf16 values: remainders round that
    tie up (the low half must say which way), the fp32 run's bf16 copy rounds
    it to even, and the runs then differ by a bf16 rounding. So: parameters
    within one bf16 ulp, masters within a few fp32-scale updates."""
    kw = dict(dtype=torch.bfloat16, bucket_cap_mb=1e-4, overlap_param_sync=True)
    with_masters = _spawn(_worker, 3, _config(**kw))
    with_remainders = _spawn(_worker, 3, _config(remainders=True, **kw))
    assert with_remainders["same_on_all_ranks"]
    for i, (a, b) in enumerate(zip(with_remainders["params"], with_masters["params"])):
        np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=0, err_msg=f"param {i}")
    for i, (a, b) in enumerate(zip(with_remainders["masters"], with_masters["masters"])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3, err_msg=f"master {i}")
    rounded = [torch.from_numpy(m).bfloat16().float().numpy() for m in with_remainders["masters"]]
    assert any(not np.array_equal(m, r) for m, r in zip(with_remainders["masters"], rounded)), \
        "the remainders must carry more than the bf16 parameters"


def test_scaled_fp16_states_stay_close_to_fp32():
    """fp16 master, exp_avg and exp_avg_sq with per-fragment scales: each
    stored value carries a relative error of at most 2^-11, so after 5 steps of
    lr 1e-2 the parameters stay within ~1e-3 of the fp32-state run, without
    being equal to it (which would mean fp32 was used)."""
    fp32 = _spawn(_worker, 2, _config(overlap_param_sync=True))
    scaled = _spawn(_worker, 2, _config(overlap_param_sync=True, scaled_states=True))
    assert scaled["same_on_all_ranks"]
    assert any(not np.array_equal(a, b) for a, b in zip(scaled["params"], fp32["params"]))
    for i, (a, b) in enumerate(zip(scaled["params"], fp32["params"])):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3, err_msg=f"param {i}")
    for i, m in enumerate(scaled["masters"]):  # saved unscaled, and each an fp16 value over a power of two
        assert np.all(np.isfinite(m)), f"master {i}"


def test_store_params_false_updates_the_parameter_shard():
    """Without a stored master, Adam updates the parameter shard itself: for
    fp32 parameters bit-identical to the run with masters; for bf16 ones the
    saved masters are the bf16 parameters."""
    with_masters = _spawn(_worker, 2, _config(store_params=True))
    without = _spawn(_worker, 2, _config(store_params=False))
    for i, (a, b) in enumerate(zip(without["params"], with_masters["params"])):
        np.testing.assert_array_equal(a, b, err_msg=f"param {i}")
    bf16 = _spawn(_worker, 2, _config(store_params=False, dtype=torch.bfloat16))
    assert bf16["same_on_all_ranks"]
    for i, m in enumerate(bf16["masters"]):
        np.testing.assert_array_equal(m, torch.from_numpy(m).bfloat16().float().numpy(), err_msg=f"master {i}")


def test_bf16_param_sync_rounds_parameters_only():
    """Parameters all-gathered in bf16: the model holds bf16-rounded values
    (exactly representable in bf16) while the fp32 masters keep training, so
    the result stays within bf16 rounding of the fp32 run."""
    result = _spawn(_worker, 2, _config(param_sync_dtype=torch.bfloat16))
    assert result["same_on_all_ranks"]
    for i, (got, want) in enumerate(zip(result["params"], _reference(2)[0])):
        got = torch.from_numpy(got)
        if i == len(result["params"]) - 1:  # the frozen bias is never synchronised
            continue
        assert torch.equal(got, got.bfloat16().float()), f"param {i} is not bf16-rounded"
        torch.testing.assert_close(got, want.contiguous(), rtol=0, atol=1e-2, msg=lambda m: f"param {i}: {m}")


@pytest.mark.parametrize("world,device", [(2, "cpu"), (3, "cpu"), pytest.param(2, "cuda", marks=pytest.mark.multigpu)],
                         ids=["gloo-2", "gloo-3", "nccl-2"])
def test_clip_grad_norm_matches_torch(world, device):
    """A max_norm below the gradient norms, so every step clips. On NCCL too
    (one GPU per rank), against the same single-process CPU reference."""
    result = _spawn(_worker, world, _config(clip=0.02, device=device))
    want_params, want_norms, _ = _reference(world, True, clip=0.02)
    assert min(want_norms) > 0.02, "the test must clip"
    np.testing.assert_allclose(result["norms"], want_norms, rtol=1e-5)
    for i, (got, want) in enumerate(zip(result["params"], want_params)):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


def _numpy(obj):
    """Tensors to numpy arrays, recursively (they cross process boundaries by value)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_numpy(v) for v in obj)
    return obj


def _torch(obj):
    if type(obj).__module__ == "numpy":
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_torch(v) for v in obj)
    return obj


def _checkpoint_worker(rank: int, world: int, port: int, bucket_cap_mb: float, saved, out) -> None:
    """Without `saved`: train steps 0-2 and return model and optimizer state.
    With it: load both, train steps 3-4, return the parameters."""
    with _rank_group(rank, world, port, out):
        model = _model()
        frozen = model[-1].bias
        frozen.requires_grad_(False)
        if saved is not None:
            model.load_state_dict(_torch(saved["model"]))
        opt = shardadam.DistributedFusedAdam(_groups(model, frozen), lr=1e-2, weight_decay=0.1,
                                             bucket_cap_mb=bucket_cap_mb)
        if saved is None:
            _train(model, opt, rank, world, range(3))
            sd = opt.state_dict(gather_on_root=True)
            if (sd is None) != (rank != 0):
                raise AssertionError("gather_on_root: rank 0, and only rank 0, gets the state dict")
            result = dict(model=_numpy(model.state_dict()), opt=_numpy(sd))
        else:
            sd = _torch(saved["opt"])
            before = _numpy(sd)
            opt.load_state_dict(sd)
            unchanged = all(bool(np.all(a == b)) for a, b in zip(_leaves(before), _leaves(_numpy(sd))))
            _train(model, opt, rank, world, range(3, STEPS))
            result = dict(params=[p.detach().numpy().copy() for p in model.parameters()], dict_unchanged=unchanged)
        if rank == 0:
            out.put(result)
    _exit()


def _leaves(obj):
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


@pytest.mark.parametrize("save_world,load_world,load_cap",
                         [(2, 2, 1e-4), (2, 3, 1e-4), (3, 2, 100.0), (8, 2, 1e-4), (8, 1, 100.0)],
                         ids=["2-to-2", "2-to-3", "3-to-2-other-buckets", "8-to-2", "8-to-1"])
def test_checkpoint_loads_on_another_world_size(save_world, load_world, load_cap, tmp_path):
    saved = _spawn(_checkpoint_worker, save_world, 1e-4, None)
    # Through a checkpoint file (atomic write, verified read).
    shardadam.checkpoint.save(_torch(saved), tmp_path / "ckpt.pt")
    saved = _numpy(shardadam.checkpoint.load(tmp_path / "ckpt.pt"))
    result = _spawn(_checkpoint_worker, load_world, load_cap, saved)
    assert result["dict_unchanged"], "load_state_dict modified the dict it was given"
    # The reference trains all steps on the same global batches, so the split
    # over ranks does not matter up to fp32 reduction order.
    for i, (got, want) in enumerate(zip(result["params"], _reference(save_world)[0])):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")
    if load_world == save_world:  # the same run without the checkpoint, bit for bit
        uninterrupted = _spawn(_worker, save_world, _config())["params"]
        for i, (got, want) in enumerate(zip(result["params"], uninterrupted)):
            np.testing.assert_array_equal(got, want, err_msg=f"param {i}")


@pytest.mark.multigpu
@pytest.mark.parametrize("option,kw", [
    ("copy_engine", dict()),
    ("copy_engine", dict(dtype=torch.bfloat16, remainders=True)),
    ("grad_copy_engine", dict()),
    ("grad_copy_engine", dict(grad_sync_dtype=torch.bfloat16, micro=2, accumulate="every")),
    ("grad_copy_engine", dict(model="branch")),
], ids=["all-gather-fp32", "all-gather-bf16-remainders", "reduce-scatter-fp32", "reduce-scatter-bf16-rounds",
        "reduce-scatter-gradients-absent-on-rank-1"])
def test_copy_engines_equal_nccl_bit_for_bit(option, kw):
    """On two ranks the copy engines compute what NCCL does: the all-gather
    moves the same bytes, and the reduce-scatter's one addition per element
    (commutative) rounds as NCCL's. The whole run, parameters and masters,
    is bit-identical to the one with that direction on NCCL."""
    cfg = dict(dict(device="cuda", contiguous_param_buffer=True, overlap_param_sync=True, model="reordered"), **kw)
    engines = _spawn(_worker, 2, _config(**{option: True}, **cfg))
    nccl = _spawn(_worker, 2, _config(**{option: False}, **cfg))
    assert engines[option] and not nccl[option], "each run must take the path it asked for"
    assert engines["same_on_all_ranks"], "ranks disagree on the parameters"
    for name in ("params", "masters"):
        for i, (a, b) in enumerate(zip(engines[name], nccl[name])):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} {i}")


@pytest.mark.multigpu
def test_copy_engines_fall_back_to_nccl_where_memory_cannot_be_shared(monkeypatch):
    """torch's expandable segments are mapped memory that CUDA IPC cannot
    export: left None, both directions fall back to NCCL, on every rank alike,
    and training still equals the single-process reference."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the spawned ranks inherit it
    result = _spawn(_worker, 2, _config(device="cuda", contiguous_param_buffer=True, overlap_param_sync=True))
    assert not result["copy_engine"] and not result["grad_copy_engine"], "expandable segments cannot be exported"
    assert result["same_on_all_ranks"], "ranks disagree on the parameters"
    for i, (got, want) in enumerate(zip(result["params"], _reference(2)[0])):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


def _refusal_worker(rank: int, world: int, port: int, options: dict, out) -> None:
    """DistributedFusedAdam(Linear(4, 4) on the CPU, **options) over gloo: the
    ValueError's message (None if none), whether the parameters stayed as
    they were (values, and not turned into views of a buffer), and the
    optimizer's repr (None if it raised)."""
    with _rank_group(rank, world, port, out):
        model = nn.Linear(4, 4)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            text = repr(shardadam.DistributedFusedAdam(model.parameters(), **options))
            message = None
        except ValueError as e:
            text, message = None, str(e)
        out.put(dict(message=message, repr=text, untouched=all(torch.equal(p, b) and p._base is None
                                                               for p, b in zip(model.parameters(), before))))
    _exit()


@pytest.mark.parametrize("option,needs", [
    ("param_sync_copy_engine", ("CUDA parameters", "NCCL", "contiguous_param_buffer=True")),
    ("grad_sync_copy_engine", ("CUDA parameters", "NCCL")),
])
def test_copy_engines_refuse_what_cannot_use_them(option, needs):
    """Asked for on CPU parameters over gloo without a contiguous buffer: one
    error naming the option and each missing piece (and nothing else),
    before the parameters are touched."""
    result = _spawn(_refusal_worker, 1, {option: True})
    assert result["message"] is not None, f"{option}=True on gloo/CPU must raise"
    assert result["message"].startswith(f"{option}=True needs"), result["message"]
    for needed in needs:
        assert needed in result["message"], f"the error must name {needed!r}: {result['message']}"
    assert ("contiguous_param_buffer" in result["message"]) == ("contiguous_param_buffer=True" in needs)
    assert result["untouched"], "the parameters changed before the error"
    result = _spawn(_refusal_worker, 1, {option: "yes"})
    assert result["message"] is not None and option in result["message"] and "'yes'" in result["message"]
    # Left None, the same setup falls back to the collectives, and says so.
    result = _spawn(_refusal_worker, 1, {option: None, "contiguous_param_buffer": True})
    assert result["message"] is None
    assert "grad_sync=gloo reduce-scatter, param_sync=gloo all-gather" in result["repr"], result["repr"]


def _train_global(model, opt, steps) -> None:
    """One process on the whole global batches, as _reference does."""
    x, y = _data()
    for s in steps:
        opt.zero_grad()
        F.mse_loss(model(x[s]), y[s]).backward()
        opt.step()


@pytest.mark.parametrize("direction", ["distributed-to-fused", "fused-to-distributed"])
def test_checkpoints_move_between_fused_and_distributed(direction):
    """A portable DistributedFusedAdam checkpoint (2 ranks) continues in
    FusedAdam, and a FusedAdam checkpoint continues on 2 ranks: both end where
    an uninterrupted run ends."""
    model = _model()
    frozen = _frozen(model)
    frozen.requires_grad_(False)
    if direction == "distributed-to-fused":
        saved = _torch(_spawn(_checkpoint_worker, 2, 1e-4, None))
        model.load_state_dict(saved["model"])
        opt = shardadam.FusedAdam(_groups(model, frozen), lr=1e-2, weight_decay=0.1)
        opt.load_state_dict(saved["opt"])
        _train_global(model, opt, range(3, STEPS))
        params = [p.detach() for p in model.parameters()]
    else:
        opt = shardadam.FusedAdam(_groups(model, frozen), lr=1e-2, weight_decay=0.1)
        _train_global(model, opt, range(3))
        saved = dict(model=_numpy(model.state_dict()), opt=_numpy(opt.state_dict()))
        params = [torch.from_numpy(p) for p in _spawn(_checkpoint_worker, 2, 1e-4, saved)["params"]]
    for i, (got, want) in enumerate(zip(params, _reference(2)[0])):
        torch.testing.assert_close(got.contiguous(), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


CHECKPOINT_FORMATS = ("dcp", "portable")


def _dcp_worker(rank: int, world: int, port: int, path: str, cfg: dict, out) -> None:
    """With nothing at `path`: train steps 0-2 and save model + optimizer in
    both formats: with DCP (under path/dcp) and as one portable file written
    by rank 0 (path/portable). Otherwise, per format: a fresh model and
    optimizer load from it, train steps 3-4; returns each format's params and
    step counters. cfg["device"] "cuda": NCCL with one GPU per rank
    (capturable optimizers need it). "warned": the deprecation warnings of
    dcp.save/load (none: the pieces are DTensors)."""
    import torch.distributed.checkpoint as dcp
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)

    def build():
        model = _model().to(f"cuda:{rank}" if cuda else "cpu", dtype=cfg["dtype"])
        frozen = _frozen(model)
        frozen.requires_grad_(False)
        return model, _distributed(cfg, _groups(model, frozen), bucket_cap_mb=cfg["bucket_cap_mb"],
                                   store_param_remainders=cfg["remainders"],
                                   with_scaled_states=cfg["scaled_states"], capturable=cfg["capturable"])

    with _rank_group(rank, world, port, out, "nccl" if cuda else "gloo"):
        warned = []
        if not os.path.exists(path):
            model, opt = build()
            _train(model, opt, rank, world, range(3))
            with _deprecations() as warned:
                dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()},
                         checkpoint_id=os.path.join(path, "dcp"))
            sd = opt.state_dict(gather_on_root=True)
            if rank == 0:
                shardadam.checkpoint.save({"model": model.state_dict(), "optim": sd}, os.path.join(path, "portable"))
            result = dict(saved=True, warned=warned)
        else:
            result = dict(params={}, steps={}, warned=[])
            for fmt in CHECKPOINT_FORMATS:
                model, opt = build()
                with torch.no_grad():  # start from different values: everything must come from the checkpoint
                    for p in model.parameters():
                        p.add_(1.0)
                if fmt == "dcp":
                    with _deprecations() as warned:
                        state = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
                        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
                        model.load_state_dict(state["model"])
                        opt.load_sharded_state_dict(state["optim"])
                    result["warned"] += warned
                else:
                    ckpt = shardadam.checkpoint.load(os.path.join(path, "portable"))
                    model.load_state_dict(ckpt["model"])
                    opt.load_state_dict(ckpt["optim"])
                _train(model, opt, rank, world, range(3, STEPS))
                result["params"][fmt] = [p.detach().float().cpu().numpy().copy() for p in model.parameters()]
                result["steps"][fmt] = [int(g["step"]) for g in opt.param_groups]
        if rank == 0:
            out.put(result)
    _exit()


@contextlib.contextmanager
def _deprecations():
    """The messages of the FutureWarnings and DeprecationWarnings raised inside."""
    messages = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield messages
    messages.extend(str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning)))


@pytest.mark.parametrize("save_world,load_world,kw", [
    (2, 3, {}),
    (3, 2, dict(load_cap=100.0)),
    (4, 1, {}),
    (2, 3, dict(dtype=torch.bfloat16, remainders=True)),
    (3, 2, dict(dtype=torch.bfloat16, scaled_states=True)),
    (2, 2, dict(dtype=torch.bfloat16, remainders=True)),
    pytest.param(2, 1, dict(device="cuda", capturable=True), marks=pytest.mark.multigpu),
    pytest.param(1, 2, dict(device="cuda", capturable=True, load_cap=100.0), marks=pytest.mark.multigpu),
], ids=["2-to-3", "3-to-2-other-buckets", "4-to-1", "bf16-remainders-2-to-3", "scaled-states-3-to-2",
        "bf16-remainders-2-to-2", "nccl-capturable-2-to-1", "nccl-capturable-1-to-2-other-buckets"])
def test_checkpoint_formats_reshard_every_storage_mode(save_world, load_world, kw, tmp_path):
    """Saved on N ranks in both formats (DCP: each rank writes only its
    pieces; portable: one file from rank 0), each loaded on M ranks with
    another layout: the continued run ends where the run without a checkpoint
    ends (same world size as the save, fp32 rounding apart). bf16 runs
    compare with their own uninterrupted run."""
    kw = dict(kw)
    load_cap = kw.pop("load_cap", 1e-4)
    cfg = dict(dtype=torch.float32, remainders=False, scaled_states=False, bucket_cap_mb=1e-4,
               optimizer="adam", device="cpu", capturable=False)
    cfg.update(kw)
    path = str(tmp_path / "ckpt")
    saved = _spawn(_dcp_worker, save_world, path, cfg)
    assert saved["saved"]
    result = _spawn(_dcp_worker, load_world, path, dict(cfg, bucket_cap_mb=load_cap))
    assert result["steps"] == {fmt: [STEPS] * 4 for fmt in CHECKPOINT_FORMATS}
    assert saved["warned"] == [] and result["warned"] == [], "dcp.save/load must not warn"
    if cfg["dtype"] == torch.float32:
        want = [p.contiguous() for p in _reference(save_world)[0]]
        tol = dict(rtol=1e-5, atol=1e-6)
    else:  # the same storage mode without the checkpoint, on the save's world size
        want = [torch.from_numpy(p) for p in _spawn(_worker, save_world, _config(
            dtype=cfg["dtype"], remainders=cfg["remainders"], scaled_states=cfg["scaled_states"]))["params"]]
        # bf16 parameters: reduction order moves them by bf16 ulps; on the
        # same world size the continued run is the uninterrupted one, bit for
        # bit. (Not with scaled states: their fp16 master is lossy, and a
        # reloaded parameter is that master rounded, where the uninterrupted
        # run's came from the unrounded fp32 value inside the kernel.)
        tol = dict(rtol=0, atol=0) if load_world == save_world else dict(rtol=0, atol=1e-2)
    for fmt in CHECKPOINT_FORMATS:
        for i, (got, w) in enumerate(zip(result["params"][fmt], want)):
            torch.testing.assert_close(torch.from_numpy(got), w, **tol, msg=lambda m: f"{fmt}, param {i}: {m}")


def _tiny_dcp_worker(rank: int, world: int, port: int, path: str, out) -> None:
    """Linear(1, 1) (two elements): on 3 ranks the last holds no piece. Without
    a checkpoint at `path`: one step, then dcp.save; with one: dcp.load and
    load_sharded_state_dict. Rank 0 returns the portable state, every rank
    the deprecation warnings it saw."""
    import torch.distributed.checkpoint as dcp
    with _rank_group(rank, world, port, out):
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=0.1, overlap_grad_sync=False)
        with _deprecations() as warned:
            if not os.path.exists(path):
                model(torch.full((1, 1), 2.0)).sum().backward()
                opt.step()
                dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path)
            else:
                state = {"optim": opt.sharded_state_dict()}
                dcp.load(state, checkpoint_id=path)
                opt.load_sharded_state_dict(state["optim"])
        portable = _numpy(opt.state_dict()["state"])
        out.put((rank, dict(state=portable if rank == 0 else None, warned=warned)))
    _exit()


def test_dcp_ranks_without_pieces(tmp_path):
    """A rank whose shards hold only padding takes part in dcp.save and
    dcp.load with an empty piece, and the state comes back unchanged (the
    loading optimizer never stepped: all of it comes from the checkpoint)."""
    path = str(tmp_path / "ckpt")
    saved = _spawn_all(_tiny_dcp_worker, 3, path)
    loaded = _spawn_all(_tiny_dcp_worker, 3, path)
    assert all(r["warned"] == [] for r in saved + loaded), "dcp.save/load must not warn"
    assert loaded[0]["state"].keys() == saved[0]["state"].keys() == {0, 1}
    for i, entry in saved[0]["state"].items():
        for name, value in entry.items():
            np.testing.assert_array_equal(loaded[0]["state"][i][name], value, err_msg=f"{i} {name}")
