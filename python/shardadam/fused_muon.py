"""FusedMuon: torch.optim.Muon with fused element-wise passes and batched
Newton-Schulz, plus AdamW groups on the fused Adam kernel."""
from __future__ import annotations

import functools
from collections import defaultdict

import torch

from . import kernels
from ._dtensor import check_grad, is_dtensor, local
from ._groups import run_closure
from ._muon_adamw import (AdamWLayout, Entry as AdamWEntry, layout_key as adamw_key, merge_equal_counters,
                          new_step_counter, split_shared_counters)
from ._muon_groups import add_group, check_group, check_muon_hyper, uses_muon
from ._muon_dtensor import ShardedMatrices
from ._muon_layout import Entry as MuonEntry, LocalMatrices, MuonLayout, layout_key as muon_key

__all__ = ["FusedMuon"]

NS_DTYPES = (torch.bfloat16, torch.float32)


class FusedMuon(torch.optim.Optimizer):
    """Muon (momentum orthogonalized by Newton-Schulz), a drop-in for
    torch.optim.Muon on CPU and CUDA.

    The constructor and every hyperparameter are torch.optim.Muon's: ``lr``,
    ``weight_decay`` (decoupled: ``p *= 1 - lr * weight_decay``),
    ``momentum`` (``buf = lerp(buf, grad, 1 - momentum)``), ``nesterov``
    (orthogonalize ``lerp(grad, buf, momentum)`` instead of ``buf``),
    ``ns_coefficients``, ``eps``, ``ns_steps`` and ``adjust_lr_fn`` (None or
    "original": ``lr * sqrt(max(1, rows / cols))``; "match_rms_adamw":
    ``lr * 0.2 * sqrt(max(rows, cols))``). The state is torch's
    (``momentum_buffer``), and state dicts load from and into
    torch.optim.Muon.

    Beyond torch.optim.Muon:

    - a 3-D parameter in a Muon group is a batch of matrices (mixture-of-
      experts weights): each ``p[i]`` is orthogonalized, and its lr adjusted,
      on its own;
    - a param group with ``use_muon=False`` is stepped by AdamW (its own lr,
      betas, eps, weight_decay; missing ones take torch.optim.AdamW's
      defaults) with torch.optim.AdamW's state (``exp_avg``, ``exp_avg_sq``,
      ``step``), so one optimizer trains a whole model ([Note: Muon and AdamW
      groups] in _muon_groups.py);
    - Newton-Schulz runs once per matrix shape over all matrices of that
      shape (batched matmuls, in ``ns_dtype``: bf16 as torch, or
      torch.float32), and the element-wise parts run as two fused launches
      per device ([Note: batched Newton-Schulz] in _newton_schulz.py);
    - capturable=True (CUDA): lr and the AdamW step counters live on the
      device and a step reads nothing back to the host, so it can be
      captured in a CUDA graph; GradScaler then hands the step its scale and
      found-inf flag, and the kernels write the gradients back unscaled
      (as FusedAdam). Without capturable, GradScaler unscales the gradients
      itself;
    - DTensor parameters (FSDP2's fully_shard): Muon-group matrices sharded
      by rows (Shard(0) on a 1-D mesh, or HSDP's (Replicate(), Shard(0)) on a
      2-D mesh) are each orthogonalized whole on one owner rank, every rank
      of the mesh sharing the work, and everything element-wise
      runs on the local shards; the states are DTensors of the parameters'
      placements, so DCP reshards them ([Note: Muon on sharded matrices] in
      _muon_dtensor.py). AdamW groups take DTensors as FusedAdam does.

    Bad input raises ValueError naming the argument, before anything is
    written: a Muon-group parameter that is not 2-D or 3-D, or not a float
    tensor, or a DTensor laid out otherwise than those two; ns_steps
    outside [0, 100); ns_coefficients that are not three finite numbers;
    momentum outside [0, 1); a gradient that does not match its parameter.
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 capturable=False, ns_dtype=torch.bfloat16):
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {[str(d) for d in NS_DTYPES]}, got {ns_dtype}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        check_muon_hyper("FusedMuon", defaults)
        self.capturable = bool(capturable)
        self.ns_dtype = ns_dtype
        self._layouts: dict = {}
        super().__init__(params, defaults)
        # GradScaler hands its scale and found-inf to the step (no host sync)
        # when the step counters live on the device.
        self._step_supports_amp_scaling = self.capturable

    # ------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        def on_capturable_devices(where: str, group: dict) -> None:
            devices = {p.device for p in group["params"]}
            if self.capturable and any(d.type != "cuda" for d in devices):
                raise ValueError(f"{where}: capturable=True needs CUDA parameters (a CPU step cannot be captured)")
            if self.capturable and devices:
                group["lr"] = _device_scalar(group["lr"], next(iter(devices)))

        add_group(self, param_group, on_capturable_devices)
        self._layouts.clear()

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        # Validate, then mutate: every check before the first write.
        for i, group in enumerate(self.param_groups):
            check_group(f"param_groups[{i}]", group)
        stepping = self._stepping()
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not self.capturable and found_inf.item():
            return loss  # host step counters: a skipped step must not advance them
        self._init_state(stepping)
        muon, adamw = self._entries(stepping)
        muon_layouts = {place: self._layout(("muon",) + place, muon_key(es, self.param_groups, self.ns_dtype),
                                            functools.partial(self._muon_layout, es, place))
                        for place, es in muon.items()}
        adamw_layouts = {dev: self._layout(("adamw", dev), adamw_key(es), lambda key, es=es: AdamWLayout(es, key))
                         for dev, es in adamw.items()}
        grads = {id(local(p)): local(g) for _, p, g in stepping}
        for layout in adamw_layouts.values():
            for counter in layout.counters():
                if found_inf is not None:  # capturable: a skipped step leaves the counters
                    counter += 1 - found_inf.to(counter.device, torch.float32).reshape(())
                else:
                    counter += 1
        layouts = [(place[0], layout) for place, layout in muon_layouts.items()] + list(adamw_layouts.items())
        for dev, layout in layouts:
            inv_scale = 1.0 if scale is None else torch.reciprocal(scale.to(dev, torch.float32))
            flag = None if found_inf is None else found_inf.to(dev, torch.float32)
            layout.step(grads, self.param_groups, grad_scale=inv_scale, found_inf=flag,
                        unscale_grads=scale is not None)
        return loss

    def _stepping(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(group, param, grad) of every parameter with a gradient, each
        gradient checked against its parameter."""
        out = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                where = f"the gradient of param_groups[{gi}]['params'][{pi}]"
                if is_dtensor(p):
                    check_grad(where, p, g)
                if g.is_sparse or g.layout != torch.strided:
                    raise ValueError(f"{where} is sparse; FusedMuon takes dense gradients")
                if g.shape != p.shape or g.device != p.device:
                    raise ValueError(f"{where} has shape {tuple(g.shape)} on {g.device}, the parameter "
                                     f"{tuple(p.shape)} on {p.device}")
                contiguous = local(g).is_contiguous()
                if g.dtype not in kernels.FLOATS or not contiguous:
                    raise ValueError(f"{where} is a {'' if contiguous else 'non-contiguous '}{g.dtype} "
                                     "tensor; the fused kernels take contiguous float32, bfloat16 or float16 ones")
                out.append((gi, p, g))
        return out

    def _init_state(self, stepping) -> None:
        """torch's state for parameters stepping for the first time, and the
        AdamW counters' split ([Note: shared step counters] in _muon_adamw.py)."""
        fresh: dict[tuple, torch.Tensor] = {}  # one new counter per (group, device)
        for gi, p, g in stepping:
            state = self.state[p]
            if uses_muon(self.param_groups[gi]):
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            elif "step" not in state:
                if (gi, p.device) not in fresh:
                    fresh[(gi, p.device)] = new_step_counter(p.device if self.capturable else None)
                state["step"] = fresh[(gi, p.device)]
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        ids = {id(self.state[p]) for _, p, _ in stepping}
        for group in self.param_groups:
            if not uses_muon(group):
                split_shared_counters([self.state[p] for p in group["params"] if "step" in self.state.get(p, {})],
                                      ids)

    def _entries(self, stepping) -> tuple[dict, dict]:
        """The stepping parameters' local tensors: Muon's per (device,) or
        (device, mesh) of DTensors, AdamW's (element-wise) per device."""
        muon, adamw = defaultdict(list), defaultdict(list)
        for gi, p, g in stepping:
            state = self.state[p]
            if uses_muon(self.param_groups[gi]):
                place = (p.device, p.device_mesh) if is_dtensor(p) else (p.device,)
                muon[place].append(MuonEntry(gi, local(p), local(g), local(state["momentum_buffer"]), tuple(p.shape)))
            else:
                adamw[p.device].append(AdamWEntry(gi, local(p), local(g), state))
        return muon, adamw

    def _muon_layout(self, entries: list, place: tuple, key: tuple) -> MuonLayout:
        """Plain matrices are orthogonalized here, a mesh's shards on their owners."""
        matrices = functools.partial(ShardedMatrices, mesh=place[1]) if len(place) > 1 else LocalMatrices
        return MuonLayout(entries, self.param_groups, self.ns_dtype, key, matrices)

    def _layout(self, slot: tuple, key: tuple, build):
        """The cached layout of a slot, rebuilt when its key changed."""
        cached = self._layouts.get(slot)
        if cached is None or cached.key != key:
            cached = self._layouts[slot] = build(key)
        return cached

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """torch.optim's state dict (torch.optim.Muon's and AdamW's keys); the
        AdamW groups' step counters as one tensor per parameter."""
        sd = super().state_dict()
        sd["state"] = {i: dict(state, step=state["step"].detach().to("cpu", copy=True)) if "step" in state else state
                       for i, state in sd["state"].items()}  # new dicts: the live states keep their counters
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a FusedMuon or torch.optim.Muon state dict (a torch.optim.AdamW
        one for use_muon=False groups merged in by the caller)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if not uses_muon(group):
                for device in {p.device for p in group["params"]}:
                    merge_equal_counters([self.state[p] for p in group["params"]
                                          if p.device == device and "step" in self.state.get(p, {})],
                                         device if self.capturable else None)
            if self.capturable and group["params"]:
                group["lr"] = _device_scalar(group["lr"], group["params"][0].device)
        self._layouts.clear()


def _device_scalar(value, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=device)
