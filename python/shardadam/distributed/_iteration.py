"""One training iteration of the ZeRO engine, as explicit state.

[Note: iteration phases] Gradients and parameters each move through an
iteration on a track of their own; every move names the phases it may come
from, so a call out of order raises (naming both phases) instead of reading
half-reduced gradients or stale parameters.

    gradients   accumulating | consumed --backward hands one over--> reducing
                accumulating | reducing | reduced --grad_sync()--> reduced
                any --step() / zero_grad()--> accumulating
                reduced --step(), reduced shards in the gradient buffer--> consumed
    parameters  current | gathering --step(), overlap_param_sync--> gathering
                current | deferred --step(), overlap + capturable--> deferred
                deferred --the next forward / param_sync()--> gathering
                current | gathering --every bucket landed--> current

A backward after the gradients were reduced (grad_sync(), grad_norm(), unscale_grads() or
clip_grad_norm()) and before step() would start a reduction that the step
no longer waits for: the reduced -> reducing move is refused. "consumed":
the contiguous gradient buffer holds this rank's reduced shard ([Note:
reduced shards in the gradient buffer] in _layout_build.py) until zero_grad();
a gradient that autograd added into it before then is refused by the
engine (it would add last step's sums), one that replaced it is taken. "deferred" is
the capturable variant: the all-gathers after a captured step are started by
the next forward, so that one captured iteration holds both ends of them.

With host_step_in_backward, the first hand-over of an iteration also decides
whether the host steps its buckets during backward ([Note: host step in
backward] in _host_shards.py): ``host_step`` is None until then, False when
the step waits for step(), else the hyperparameters the host steps with.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Grads(enum.Enum):
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"
    REDUCED = "reduced"
    CONSUMED = "consumed"


class Params(enum.Enum):
    CURRENT = "current"
    GATHERING = "gathering"
    DEFERRED = "deferred"


_GRAD_MOVES = {
    Grads.ACCUMULATING: set(Grads),
    Grads.REDUCING: {Grads.ACCUMULATING, Grads.REDUCING, Grads.CONSUMED},
    Grads.REDUCED: set(Grads),
    Grads.CONSUMED: {Grads.REDUCED},
}
_PARAM_MOVES = {
    Params.CURRENT: {Params.CURRENT, Params.GATHERING},
    Params.GATHERING: {Params.CURRENT, Params.GATHERING, Params.DEFERRED},
    Params.DEFERRED: {Params.CURRENT, Params.DEFERRED},
}
BACKWARD_AFTER_REDUCTION = (
    "a backward after the gradients were reduced (grad_sync(), grad_norm(), clip_grad_norm() or unscale_grads()) "
    "and before step(): its gradients would miss this step. Call step() (or zero_grad()) first, or take norms "
    "after the last backward")
_WHY = {(Grads.REDUCED, Grads.REDUCING): BACKWARD_AFTER_REDUCTION}


@dataclass
class Iteration:
    """Where this iteration is, and what step() will fold into its gradient
    scale: clip_grad_norm's (max_norm, loss-scaled norm) and unscale_grads'
    factor. no_sync: inside no_sync(), backward leaves gradients in .grad.
    host_step: see [Note: iteration phases]."""

    grads: Grads = Grads.ACCUMULATING
    params: Params = Params.CURRENT
    no_sync: bool = False
    clip: tuple | None = None
    inv_scale: torch.Tensor | None = None
    host_step: dict | bool | None = None

    def move_grads(self, to: Grads) -> None:
        if self.grads not in _GRAD_MOVES[to]:
            raise RuntimeError(_WHY.get((self.grads, to), f"gradient phase {self.grads.value} -> {to.value}: "
                                                          "not a legal move (a bug in the engine)"))
        self.grads = to

    def move_params(self, to: Params) -> None:
        if self.params not in _PARAM_MOVES[to]:
            raise RuntimeError(f"parameter phase {self.params.value} -> {to.value}: not a legal move (a bug in "
                               "the engine)")
        self.params = to

    def end(self, consumed: bool = False) -> None:
        """After step() or zero_grad(): the next iteration accumulates anew
        (consumed: after a step whose reduced shards stay in the gradient buffer)."""
        self.move_grads(Grads.CONSUMED if consumed else Grads.ACCUMULATING)
        self.clip = self.inv_scale = self.host_step = None


@dataclass
class BackwardOrderProbe:
    """One shot: the order in which the first backward hands gradients over
    (parameter indices), for a layout whose buckets then start while backward
    goes on. Inactive without overlap_grad_sync. repeated: a parameter's
    gradient came twice outside no_sync() (a backward per micro-batch, each
    synchronised)."""

    active: bool
    arrivals: list = field(default_factory=list)
    repeated: bool = False
    held: dict = field(default_factory=dict)  # id(parameter) -> its synchronised gradient, in host memory
    _synchronised: set = field(default_factory=set)

    def record(self, k: int, synchronised: bool = True) -> None:
        self.arrivals.append(k)
        if synchronised:
            self.repeated = self.repeated or k in self._synchronised
            self._synchronised.add(k)

    def hold(self, param: torch.Tensor) -> None:
        """[Note: the first backward's gradients in host memory] Until the
        first backward has shown its order there is no layout whose buckets
        could start during it, so its gradients wait for step(). Left in
        .grad, every gradient of the model is alive on the device at the end
        of that backward, where later iterations hold about one bucket (they
        let go of each gradient as it is staged): with separate buffers the
        first iteration peaked 0.94 GiB (GPT-1.4B, fp32) above the later ones.
        So a synchronised gradient moves to host memory as it arrives and
        .grad becomes None, as after a hand-over; the first step reduces the
        held gradients one by one (held_in_order) once the layout follows
        backward's order. Costs one copy down and up of each gradient, once.
        A second synchronised backward adds into what is held. On a CPU
        device the tensor just changes hands."""
        grad = param.grad.detach().to("cpu")
        earlier = self.held.get(id(param))
        self.held[id(param)] = grad if earlier is None else earlier + grad
        param.grad = None

    def held_in_order(self, params: list):
        """(k, gradient) for each held gradient, in the order of params (the
        layout's), each let go once taken."""
        for k, p in enumerate(params):
            grad = self.held.pop(id(p), None)
            if grad is not None:
                yield k, grad

    def take(self, count: int) -> list[int]:
        """The order seen (first arrival of each), then the parameters that never
        arrived; the probe is off from now on."""
        seen = list(dict.fromkeys(self.arrivals))
        known = set(seen)
        self.active, self.arrivals, self._synchronised = False, [], set()
        return seen + [k for k in range(count) if k not in known]
