"""Lion written with plain torch ops, as lion-pytorch computes it (Chen et al.
2023): the independent reference the Lion optimizers are compared with."""
from __future__ import annotations

import torch


class TorchLion(torch.optim.Optimizer):
    """lion-pytorch's ``Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.clone().mul_(beta1).add_(grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss
