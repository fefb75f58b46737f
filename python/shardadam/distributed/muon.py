"""DistributedFusedMuon: Muon sharded by whole matrices, AdamW groups on the
ZeRO-2 engine."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .._groups import run_closure
from .._muon_groups import MUON_KEYS, add_group, check_group, check_muon_hyper, uses_muon
from . import _amp, _muon_dcp
from ._agreement import check_same, validate_then_agree
from ._iteration import Grads
from ._muon_owned import OwnedMuon
from ._shard_groups import shard_groups
from .adam import DistributedFusedAdam

__all__ = ["DistributedFusedMuon"]

_REFUSED_OPTIONS = ("capturable", "state_device", "host_step_in_backward", "contiguous_grad_buffer", "nccl_ub",
                    "grad_sync_copy_engine")


class DistributedFusedMuon(torch.optim.Optimizer):
    """Muon with ZeRO's memory and 1/N of the Newton-Schulz work per rank, on
    NCCL (GPU) or gloo (CPU).

    The constructor and every hyperparameter are FusedMuon's (and so
    torch.optim.Muon's), ``use_muon=False`` groups included. Each Muon
    matrix (a 2-D parameter, or one ``p[i]`` of a 3-D one) is owned whole by
    one rank, chosen to balance the Newton-Schulz cost: its gradient is
    reduced to the owner, its momentum lives only there, only the owner
    orthogonalizes it, and the updated matrices are all-gathered ([Note:
    matrix-atomic ownership] in _muon_owners.py). The ``use_muon=False``
    groups are stepped by an inner DistributedFusedAdam (AdamW sharded
    element-wise), which takes the keyword options in ``adamw_options``
    (dtype, grad_sync_dtype, param_sync_dtype, storage kinds,
    pipeline_size, ...). ``distributed_process_group`` x
    ``redundant_process_group`` is DistributedFusedAdam's layout, for both
    parts: the owners are spread over each distributed group, every
    distributed group holds the same owners, and the replicas of an owner
    (its redundant group) step identically ([Note: redundant replicas] in
    _shard_groups.py). ``momentum_dtype`` stores the Muon momentum in
    another dtype than the parameter's (None: torch's choice); bf16 halves
    it for fp32 parameters, and checkpoints hold it in the parameter's dtype.

    Every rank builds the same model and passes the same parameters; they are
    broadcast from rank 0 of ``process_group``. With average_grad_sync=True
    (the default) the result equals FusedMuon (or torch.optim.Muon + AdamW)
    on the global batch. With overlap_grad_sync=True a Muon parameter's
    ``.grad`` is handed to the optimizer as backward produces it and is then
    None; inside no_sync() gradients accumulate in ``.grad``, and without it
    each backward's gradients are reduced and the reductions add up. A trainable
    Muon parameter that got no gradient on any rank is stepped with a zero
    gradient (its momentum still acts), as DistributedFusedAdam steps its
    parameters.

    Checkpoints: state_dict() gives FusedMuon's dict (torch's keys: Muon's
    ``momentum_buffer``, the AdamW groups' ``exp_avg``, ``exp_avg_sq`` and
    steps, plus their fp32 ``param`` masters) with whole tensors on every
    rank, so it loads at any world size; sharded_state_dict() holds only the
    rank's own pieces, for torch.distributed.checkpoint, and loads at any
    world size too (_muon_dcp.py). grad_norm() and clip_grad_norm() span both
    parts.

    torch.amp.GradScaler works as with DistributedFusedAdam (``scaler.step(opt)``;
    ``opt.unscale_grads(grad_scaler=scaler)`` before clipping, or
    ``clip_grad_norm(max_norm, grad_scaler=scaler)`` alone): 1/scale joins
    both parts' gradient scales, and one found-inf flag, agreed over every
    rank and both parts, skips the whole step (nothing is written) and tells
    the scaler.

    overlap_param_sync=True (DistributedFusedAdam's option, for both parts)
    leaves the all-gathers of the updated parameters, the Muon matrices' and
    the AdamW groups', running when step() returns: each module's forward
    waits for the buckets of its own parameters (a forward-pre hook), and
    any other read of a parameter waits on its first use (the first-use
    guard, [Note: first-use guard] in _first_use.py: p.sum(),
    model.state_dict(), an evaluation through a functional call...).
    param_sync() lands every all-gather, as do state_dict(),
    sharded_state_dict() and the next step(); zero_grad() leaves them
    running. Call param_sync() before handing a parameter to a C++ extension
    outside a forward (the guard sees only torch's Python dispatch). Not
    offered yet: capturable steps and CUDA-graph capture, and the options
    named in ``_REFUSED_OPTIONS``.
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 process_group=None, distributed_process_group=None, redundant_process_group=None,
                 overlap_grad_sync=True, overlap_param_sync=False, average_grad_sync=True, bucket_cap_mb=100,
                 ns_dtype=torch.bfloat16, momentum_dtype=None, skip_nonfinite_grads=False, **adamw_options):
        name = type(self).__name__
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._adamw_given: list[dict] = []

        def arguments() -> None:
            refused = [k for k in _REFUSED_OPTIONS if adamw_options.get(k)]
            if refused:
                raise ValueError(f"{name} does not offer {refused} yet: leave them out (the AdamW groups' "
                                 "DistributedFusedAdam takes its other options)")
            if ns_dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32, got {ns_dtype}")
            if momentum_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"momentum_dtype must be None (the parameter's dtype, as torch), torch.float32, "
                                 f"torch.bfloat16 or torch.float16, got {momentum_dtype}")
            if not bucket_cap_mb > 0:
                raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
            if not isinstance(overlap_param_sync, bool):
                raise ValueError(f"overlap_param_sync must be True or False, got {overlap_param_sync!r}: pass a bool "
                                 "(one option for the Muon matrices and the AdamW groups)")
            check_muon_hyper(name, defaults)
            torch.optim.Optimizer.__init__(self, params, defaults)

        # [Note: validate, then mutate] (../_validate.py): a rank that refuses
        # its arguments tells its peers, so every rank raises the same error
        # before any collective that would leave the others waiting.
        if dist.is_initialized():
            validate_then_agree(f"{name}(...)", arguments, process_group, None,
                                outcome="no rank built the optimizer")
        else:
            arguments()  # no peers to tell (the missing process group is refused below)
        self.process_group = process_group
        self.redundant_group = redundant_process_group
        self.ns_dtype = ns_dtype
        self.skip_nonfinite_grads = bool(skip_nonfinite_grads)
        muon_params = [p for g in self.param_groups if uses_muon(g) for p in g["params"]]
        group_of = [gi for gi, g in enumerate(self.param_groups) if uses_muon(g) for _ in g["params"]]
        device = muon_params[0].device if muon_params else torch.device("cpu")
        if any(p.device != device for p in muon_params):
            raise ValueError(f"{name}: the Muon parameters lie on {sorted({str(p.device) for p in muon_params})}; "
                             "each rank's must share one device (the rank's GPU, or the CPU with gloo)")
        groups = shard_groups(process_group, distributed_process_group, redundant_process_group)
        check_same(f"{name}: the {{ranks}} ranks of process_group were not given the same Muon parameters, "
                   "hyperparameters and options: {difference}. Every rank must build the same model and optimizer",
                   self._muon_setup(overlap_param_sync), process_group, device)
        # The AdamW groups' engine: its own groups replace the placeholders, so
        # schedulers and users see one list of groups.
        self._adamw = None
        if self._adamw_given:
            self._adamw = DistributedFusedAdam(
                [dict(g) for g in self._adamw_given], process_group=process_group,
                distributed_process_group=distributed_process_group, redundant_process_group=redundant_process_group,
                overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync,
                average_grad_sync=average_grad_sync, bucket_cap_mb=bucket_cap_mb, **adamw_options)
            inner = iter(self._adamw.param_groups)
            self.param_groups = [g if uses_muon(g) else next(inner) for g in self.param_groups]
        self._device = device if muon_params else self._adamw.device
        self._grad_scaler = None  # the GradScaler met last: grad_norm() unscales with it
        self._inv_scale = None    # unscale_grads()'s factor, folded into this iteration's step
        self._muon = None
        if muon_params:
            src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
            with torch.no_grad():
                for p in muon_params:
                    dist.broadcast(p.data, src=src, group=process_group)
            elem = muon_params[0].element_size()
            self._muon = OwnedMuon(muon_params, group_of, groups,
                                   cap=max(1, int(bucket_cap_mb * (1 << 20)) // elem),
                                   overlap_grad_sync=overlap_grad_sync, overlap_param_sync=overlap_param_sync,
                                   average_grad_sync=average_grad_sync, ns_dtype=ns_dtype,
                                   momentum_dtype=momentum_dtype)
        self._built = True

    # ------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(f"{type(self).__name__}: parameter groups are fixed at construction (the matrices' "
                               "owners and the buckets are laid out for them); build a new optimizer")
        group = add_group(self, param_group)
        if not uses_muon(group):
            self._adamw_given.append(group)

    def _muon_setup(self, overlap_param_sync: bool) -> list:
        items = [("option overlap_param_sync", overlap_param_sync),
                 ("the number of parameter groups", len(self.param_groups))]
        for gi, g in enumerate(self.param_groups):
            items.append((f"param_groups[{gi}]: use_muon", uses_muon(g)))
            if uses_muon(g):
                items += [(f"param_groups[{gi}]['{k}']", repr(g[k])) for k in MUON_KEYS]
                items += [(f"param_groups[{gi}]['params'][{pi}]", (tuple(p.shape), str(p.dtype)))
                          for pi, p in enumerate(g["params"])]
        return items

    # ------------------------------------------------------------ iteration

    # torch.amp.GradScaler hands itself to step(): the gradients live in the
    # buckets, out of its reach ([Note: GradScaler protocols] in _amp.py).
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Reduce the Muon gradients to their owners, step the owned matrices
        and all-gather them; then the AdamW groups' ZeRO step. With a
        GradScaler (``scaler.step(opt)``), 1/scale joins both parts'
        gradient scales unless unscale_grads() ran, and a non-finite
        gradient on any rank, in either part, skips the whole step on every
        rank (momentum, parameters, AdamW states and steps unchanged) and is
        reported to the scaler so that ``scaler.update()`` backs off; with
        skip_nonfinite_grads=True (DistributedFusedAdam's option), such a
        step is skipped the same way without a scaler."""
        grad_scaler = _amp.stepping_scaler(self, kwargs)
        if grad_scaler is not None and not grad_scaler.is_enabled():
            grad_scaler = None
        loss = run_closure(closure)
        for i, group in enumerate(self.param_groups):
            if uses_muon(group):
                check_group(f"param_groups[{i}]", group)
        inv_loss_scale = _amp.check_stage(grad_scaler, self, self._inv_scale is not None, self._device)
        if grad_scaler is not None or self.skip_nonfinite_grads:
            if inv_loss_scale is not None:
                self._fold_inv_scale(inv_loss_scale)
            found_inf = self._nonfinite_on_any_rank()
            if grad_scaler is not None:
                self._grad_scaler = grad_scaler
                _amp.report(grad_scaler, self, found_inf, self._device)
            if found_inf.item():
                self._end_iteration(skipped=True)
                return loss
        if self._muon is not None:
            self._muon.step(self.param_groups, self._inv_scale)
        if self._adamw is not None:
            self._adamw.step()
        self._inv_scale = None
        return loss

    def _end_iteration(self, skipped: bool = False) -> None:
        """Forget this iteration's gradients, unscaling and clipping (a step
        skipped for inf/NaN, or zero_grad())."""
        if self._muon is not None:
            self._muon.end_iteration()
        if self._adamw is not None and skipped:
            self._adamw._end_iteration(stepped=True)  # as its own step() ends a skipped step
        self._inv_scale = None

    @torch.no_grad()
    def unscale_grads(self, *args, inv_scale=None, grad_scaler=None) -> dict:
        """DistributedFusedAdam's deferred unscale, over both parts: divide
        this iteration's gradients by the loss scale inside the next step
        (gradients are not rewritten): inv_scale (a number or a 0-d tensor;
        also the first positional argument), or 1 / grad_scaler's current
        scale. Synchronises the gradients and returns {device: found_inf}
        (1.0 where any rank's gradients, in either part, hold inf/NaN); with
        grad_scaler, as scaler.unscale_(optimizer) would, the scaler records
        it and moves to its unscaled stage, so that clip_grad_norm() and then
        scaler.step(optimizer) / scaler.update() follow."""
        inv = _amp.requested_inv_scale(args, inv_scale, grad_scaler, self, self._inv_scale is not None, self._device)
        return _amp.fold_and_report(self, inv, grad_scaler, self._device)

    def _fold_inv_scale(self, inv: torch.Tensor) -> None:
        """Both parts unscale this iteration's gradients by inv in the step."""
        if self._adamw is not None:
            self._adamw._fold_inv_scale(inv.to(self._adamw.device))
        self._inv_scale = inv

    def _nonfinite_on_any_rank(self) -> torch.Tensor:
        """1.0 (float32 [1]) when the synchronised gradients of any rank, in
        either part, hold inf/NaN, else 0.0: one all-reduce for both parts,
        so every rank and both parts skip together; synchronises the
        gradients first."""
        found = torch.zeros(1, dtype=torch.float32, device=self._device)
        if self._muon is not None:
            found = torch.maximum(found, self._muon.nonfinite_here())
        if self._adamw is not None:
            if self._adamw.iteration.grads is not Grads.REDUCED:
                self._adamw.grad_sync()
            found = torch.maximum(found, self._adamw._nonfinite_here().to(self._device))
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        return found

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients; the all-gathers overlap_param_sync left
        running go on (gradients only: the parameters stay armed)."""
        with torch._C.DisableTorchFunctionSubclass():
            for g in self.param_groups:
                if uses_muon(g):
                    for p in g["params"]:
                        if set_to_none:
                            p.grad = None
                        elif p.grad is not None:
                            p.grad.zero_()
        if self._adamw is not None:
            self._adamw.zero_grad(set_to_none=set_to_none)
        self._end_iteration()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside this context add into
        ``p.grad`` with no communication; the first backward outside it (or
        step()) synchronises the sum."""
        inner = self._adamw.no_sync() if self._adamw is not None else contextlib.nullcontext()
        before = self._muon.no_sync if self._muon is not None else False
        with inner:
            if self._muon is not None:
                self._muon.no_sync = True
            try:
                yield
            finally:
                if self._muon is not None:
                    self._muon.no_sync = before

    def param_sync(self) -> None:
        """Bring every parameter up to date: finish the all-gathers that
        overlap_param_sync left running, in both parts (call this before
        reading parameters where the first-use guard cannot see it, e.g. a
        C++ extension given a parameter outside a forward)."""
        if self._muon is not None:
            self._muon.land_params()
        if self._adamw is not None:
            self._adamw.param_sync()

    def _land_params(self) -> None:
        """Let every all-gather of the last step land, in both parts; nothing new starts."""
        if self._muon is not None:
            self._muon.land_params()
        if self._adamw is not None:
            self._adamw._land_param_sync()

    @torch.no_grad()
    def grad_norm(self, *, grad_scaler=None) -> torch.Tensor:
        """The L2 norm of the synchronised (averaged, if average_grad_sync)
        gradients of every parameter, Muon and AdamW groups together, as a
        0-d tensor on every rank; synchronises the gradients now. Read
        gradients this way: with overlap_grad_sync, ``.grad`` is None after
        backward. Under AMP the norm is unscaled, as DistributedFusedAdam's,
        by unscale_grads()' factor or the GradScaler passed here or before
        (to step(), unscale_grads() or clip_grad_norm())."""
        self._grad_scaler = _amp.met(grad_scaler, self._grad_scaler)
        return _amp.unscaled_norm(self._scaled_grad_norm(), self._inv_scale, self._grad_scaler, self._device)

    def _scaled_grad_norm(self) -> torch.Tensor:
        """grad_norm() of the gradients as they are (loss-scaled under AMP)."""
        sq = None
        if self._muon is not None:
            sq = self._muon.grad_sq_norm()
        if self._adamw is not None:
            adamw = self._adamw._scaled_grad_norm(None, 2.0).square()
            sq = adamw if sq is None else sq + adamw.to(sq.device)
        return sq.sqrt()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, *, grad_scaler=None) -> torch.Tensor:
        """Scale every gradient so their global L2 norm (grad_norm()) is at
        most max_norm, as torch.nn.utils.clip_grad_norm_ does over all the
        parameters, inside the next step (gradients are not rewritten);
        under a GradScaler the norm is compared unscaled, in step(). Returns
        the norm before clipping, unscaled as grad_norm()'s."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._grad_scaler = _amp.met(grad_scaler, self._grad_scaler)
        scaled = self._scaled_grad_norm()
        if self._muon is not None:
            self._muon.clip = (float(max_norm), scaled)
        if self._adamw is not None:  # the engine's clip, given the whole model's norm (_grad_scaling.py)
            self._adamw.iteration.clip = (float(max_norm), scaled.to(self._adamw.device))
        return _amp.unscaled_norm(scaled, self._inv_scale, self._grad_scaler, self._device)

    def orthogonalized_matrices(self) -> list[tuple[int, int | None]]:
        """(Muon parameter index, matrix index or None) of each matrix this
        rank owns and orthogonalizes."""
        return [] if self._muon is None else [(m.param, m.index) for m in self._muon.owned()]

    # ------------------------------------------------------------ checkpoints

    def _indices(self) -> tuple[list[int], list[int]]:
        """Global parameter indices (param_groups order) of the Muon and AdamW parameters."""
        muon, adamw, i = [], [], 0
        for g in self.param_groups:
            for _ in g["params"]:
                (muon if uses_muon(g) else adamw).append(i)
                i += 1
        return muon, adamw

    def state_dict(self) -> dict:
        """FusedMuon's state dict with whole tensors, on every rank (every
        rank must call it). The last step's all-gathers land first (as in
        sharded_state_dict()): no collective of the step is left in flight
        while the caller saves, and the model's parameters, read next for
        its own state dict, are current."""
        self._land_params()
        muon_idx, adamw_idx = self._indices()
        state, groups = {}, []
        momenta = self._muon.momentum_buffers() if self._muon is not None else {}
        for k, t in momenta.items():
            state[muon_idx[k]] = {"momentum_buffer": t}
        inner = self._adamw.state_dict() if self._adamw is not None else None
        if inner is not None:
            for j, s in inner["state"].items():
                state[adamw_idx[j]] = s
        inner_groups = iter(inner["param_groups"] if inner is not None else [])
        start = 0
        for g in self.param_groups:
            ids = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            if uses_muon(g):
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
            else:
                groups.append(_adamw_group_as_fused_muon(next(inner_groups), ids, state))
        return {"state": state, "param_groups": groups}

    def sharded_state_dict(self) -> dict:
        """Only this rank's pieces (its matrices' momentum, its shards of the
        AdamW groups' state), for torch.distributed.checkpoint: see
        distributed/_muon_dcp.py (a checkpoint of N ranks loads on M).
        Refused with a redundant_process_group, as DistributedFusedAdam
        refuses it (every replica would write the same pieces). The last
        step's all-gathers land first, as in state_dict()."""
        self._land_params()
        return _muon_dcp.sharded_state_dict(self)

    def check_sharded_checkpoint(self, checkpoint_id, key: str = "optim") -> None:
        """Before dcp.load: refuse a DCP checkpoint whose sharded_state_dict()
        (under `key`) was written for other parameters or groups, naming the
        first that differs, on every rank, with nothing read into the
        optimizer. A collective: every rank of process_group calls it."""
        _muon_dcp.check_checkpoint(self, checkpoint_id, key)

    def load_sharded_state_dict(self, sharded: dict) -> None:
        """Take a sharded_state_dict() structure that dcp.load has filled."""
        _muon_dcp.load_sharded_state_dict(self, sharded)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state_dict() of any world size (each rank keeps its own
        matrices' momentum). Everything is checked before anything is written."""
        name = type(self).__name__
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise ValueError(f"{name}.load_state_dict: expected a dict with 'state' and 'param_groups'")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: the checkpoint has {len(groups)} parameter groups, this optimizer "
                   f"{len(self.param_groups)}")
        start, momenta, inner_state, inner_groups = 0, {}, {}, []
        muon_k = adamw_k = 0
        for gi, (saved, g) in enumerate(zip(groups, self.param_groups)):
            n = len(g["params"])
            if len(saved.get("params", ())) != n or bool(saved.get("use_muon", True)) != uses_muon(g):
                raise ValueError(f"{name}.load_state_dict: param_groups[{gi}] has {len(saved.get('params', ()))} parameters "
                       f"(use_muon={saved.get('use_muon', True)}), this optimizer's {n} "
                       f"(use_muon={uses_muon(g)})")
            for pi, (idx, p) in enumerate(zip(saved["params"], g["params"])):
                s = state.get(idx, {})
                if uses_muon(g):
                    t = s.get("momentum_buffer")
                    if t is not None:
                        if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                            raise ValueError(f"{name}.load_state_dict: the momentum_buffer of param_groups[{gi}]['params']"
                                   f"[{pi}] has shape {tuple(getattr(t, 'shape', ()))}, the parameter "
                                   f"{tuple(p.shape)}")
                        momenta[muon_k] = t.to(p.device, p.dtype)
                    muon_k += 1
                else:
                    if s:
                        inner_state[adamw_k] = s
                    adamw_k += 1
            if not uses_muon(g):
                inner_groups.append({**saved, "params": list(range(adamw_k - n, adamw_k))})
            start += n
        for gi, (saved, g) in enumerate(zip(groups, self.param_groups)):
            if uses_muon(g):
                check_muon_hyper(f"{name}.load_state_dict: param_groups[{gi}]",
                                 {**g, **{k: saved[k] for k in MUON_KEYS if k in saved}})
        if momenta and len(momenta) != muon_k:
            raise ValueError(f"{name}.load_state_dict: the checkpoint holds momentum for {len(momenta)} of the "
                   f"{muon_k} Muon parameters; a partial load would leave state behind")
        if self._adamw is not None:
            self._adamw.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for saved, g in zip(groups, self.param_groups):
            if uses_muon(g):
                g.update({k: saved[k] for k in MUON_KEYS if k in saved})
        if self._muon is not None:
            self._muon.load_momentum(momenta)


def _adamw_group_as_fused_muon(group: dict, ids: list[int], state: dict) -> dict:
    """An AdamW group of the inner engine's portable dict in FusedMuon's (and
    torch.optim.AdamW's) schema: the step per parameter, bias_correction
    only where it is False ([Note: torch.optim's checkpoint schema] in
    .._rules.py). The inner engine loads either."""
    group = {k: v for k, v in group.items() if k != "params"}
    step = group.pop("step")
    if group.get("bias_correction", True):
        group.pop("bias_correction", None)
    for i in ids:
        if i in state:
            state[i]["step"] = torch.tensor(float(step), dtype=torch.float32)
    return {**group, "params": ids}
