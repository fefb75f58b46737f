"""References for the FusedMuon tests: torch.optim.Muon (+ torch.optim.AdamW
for use_muon=False groups) stepped on copies of the same parameters with
the same gradients, and float64 orthogonalization."""
from __future__ import annotations

import torch

DEFAULT_NS = (3.4445, -4.775, 2.0315)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_F / ||expected||_F, in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float(torch.linalg.norm(a - e) / torch.linalg.norm(e))


def gradients(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    """A fixed gradient per parameter per step (CPU float32, moved later)."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


def run(make_opt, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Step an optimizer built by make_opt(copies) over copies of params with
    the given gradients (None: no gradient that step); returns the copies."""
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    opts = make_opt(copies)
    opts = opts if isinstance(opts, (list, tuple)) else [opts]
    for step_grads in grads:
        for p, g in zip(copies, step_grads):
            p.grad = None if g is None else g.to(p.device, p.dtype)
        for opt in opts:
            opt.step()
    return copies


def polar_factor64(g: torch.Tensor) -> torch.Tensor:
    """U V^T of each matrix of g (2-D or a batch), by float64 SVD."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return u @ vh


def newton_schulz64(g: torch.Tensor, coefficients, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz of one matrix, in float64."""
    a, b, c = coefficients
    x = g.double()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def well_conditioned(rows: int, cols: int, *, seed: int) -> torch.Tensor:
    """A rows x cols matrix with singular values in [1, 2]."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = torch.linspace(1.0, 2.0, k, dtype=torch.float64)
    return ((u * s) @ v.T).float()
