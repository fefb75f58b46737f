"""The engine's guard on gradients changed after backward handed them over.

[Note: gradients set after the hand-over] With overlap_grad_sync,
backward hands each gradient to the buckets as it is produced (the hook
leaves p.grad None, or the parameter's view of the contiguous gradient
buffer), and the reduce-scatters read the buckets, not p.grad. A gradient
set after that (p.grad = t; model.zero_grad() with the contiguous
buffer) would be dropped silently: grad_sync() refuses it before anything
of the step is written, naming the parameter; a host step in backward,
done by then, reports it once step() has finished. So is an in-place
change of a view of the contiguous buffer after the hand-over
(torch.nn.utils.clip_grad_norm_, zero_grad(set_to_none=False)): the
views share the buffer's version counter, which every hand-over records
after its own writes (autograd's accumulation and the reduce-scatter's
launch bump it before that), and so does grad_sync() once it is done; a
counter moved since then is someone else's write. Both are refused by
grad_sync() or, when grad_norm(), clip_grad_norm() or unscale_grads()
synchronised earlier, by step(). Which parameter a write in place
touched the counter cannot tell.
A host step in backward copies the reduced shards down while the caller
goes on, so there a change in place races with those copies: step()
reports it after the fact, saying that part of it may have been used.
Not seen: set_to_none where p.grad is None already.

The guard reads the engine (ShardedOptimizer in optimizer.py) it is given:
its parameters, gradient views and buffer, the gradient sync's arrivals,
the backward-order probe and the iteration's phase.
"""
from __future__ import annotations

import itertools
import operator

from .._groups import param_names
from .._tracked import GRAD, VERSION
from ._iteration import Grads

__all__ = ["HandOverGuard"]

# What the refusals say.
_CHANGE_BEFORE_HAND_OVER = ("change gradients before the hand-over, with a tensor hook (p.register_hook), or build "
                            "the optimizer with overlap_grad_sync=False")
_BUFFER_WRITTEN = ("the contiguous gradient buffer was written in place after backward handed the gradients over "
                   "(torch.nn.utils.clip_grad_norm_, zero_grad(set_to_none=False) or another in-place change of a "
                   "p.grad)")


def _buffer_version(opt) -> int:
    """The contiguous gradient buffer's version counters, summed (they only grow)."""
    return sum(map(VERSION, opt.grad_buffer.tensors))


class HandOverGuard:
    """``version``: the gradient buffer's version at the last hand-over or
    synchronisation (None before the first)."""

    def __init__(self):
        self.version: int | None = None

    def record(self, opt) -> None:
        """After a hand-over's or a synchronisation's own writes into the contiguous gradient buffer."""
        self.version = _buffer_version(opt)

    def late_gradients(self, opt) -> str:
        """The parameters whose .grad is no longer what the hand-over left,
        as "<first one's name> (and N more)", or ""."""
        if not opt.overlap_grad_sync or opt._probe.active:
            return ""
        left = opt._grad_views if opt.contiguous_grad_buffer else itertools.repeat(None)
        changed = itertools.compress(range(len(opt.params)), map(operator.is_not, map(GRAD, opt.params), left))
        late = [k for k in changed if opt._grad_sync.arrived[k] or id(opt.params[k]) in opt._probe.held]
        if not late:
            return ""
        first = param_names(opt.param_groups)[id(opt.params[late[0]])]
        return first + (f" (and {len(late) - 1} more)" if len(late) > 1 else "")

    def buffer_written(self, opt) -> bool:
        """Whether the contiguous gradient buffer was written since this
        iteration's last hand-over or synchronisation."""
        return (opt.contiguous_grad_buffer and opt.overlap_grad_sync and not opt._probe.active
                and any(opt._grad_sync.arrived) and _buffer_version(opt) != self.version)

    def refuse(self, opt) -> None:
        """grad_sync()'s and step()'s refusal of a gradient set, or of the
        buffer written, after the hand-over, before anything of the step is
        written; none with a host step in backward, done by then
        (host_step_report)."""
        if opt.iteration.host_step:
            return
        owner = type(opt).__name__
        late = self.late_gradients(opt)
        if late:
            left = "optimizer.grad_buffer_view(p)" if opt.contiguous_grad_buffer else "None"
            raise RuntimeError(
                f"{late}: its gradient was set after "
                f"backward handed it over ({owner}(overlap_grad_sync=True) reduces each gradient as "
                f"backward produces it), so this step would not see it: {_CHANGE_BEFORE_HAND_OVER}; to "
                f"step with what backward produced, set p.grad back to {left}")
        if self.buffer_written(opt):
            raise RuntimeError(
                f"{owner}: {_BUFFER_WRITTEN}, so this step would not see the change "
                "(overlap_grad_sync=True reduces each gradient as backward produces it). Clip with "
                f"optimizer.clip_grad_norm(); {_CHANGE_BEFORE_HAND_OVER}; then call optimizer.zero_grad() and run "
                "backward again")

    def host_step_report(self, opt) -> str:
        """What changed after the hand-over of an iteration a host step in
        backward has stepped, as the message step() raises once it is done,
        or ""."""
        late = self.late_gradients(opt)
        if late:
            what = (f"with the gradients backward produced: the gradient of {late} was set after backward handed "
                    "it over, and was not used")
        elif self.buffer_written(opt):
            what = (f"during backward: {_BUFFER_WRITTEN} while the host step was copying them down, so part of the "
                    "change may have reached this step")
        else:
            return ""
        return (f"{type(opt).__name__}(host_step_in_backward=True) stepped this iteration {what}: "
                f"{_CHANGE_BEFORE_HAND_OVER}")

    @staticmethod
    def refuse_added_into_consumed(opt, params) -> None:
        """Before the first gradient of an iteration after a step that left
        its reduced shards in the gradient buffer (Grads.CONSUMED): refuse a
        gradient that autograd added into the buffer (params: indices whose
        .grad to look at)."""
        if opt.iteration.grads is not Grads.CONSUMED:
            return
        names = param_names(opt.param_groups)
        for k in params:
            grad = opt.params[k].grad
            if grad is not None and grad.data_ptr() == opt._grad_views[k].data_ptr():
                raise RuntimeError(
                    f"{names[id(opt.params[k])]}: a gradient was added into the contiguous gradient buffer while "
                    f"it still holds the last step's reduced shard ({type(opt).__name__}(contiguous_grad_buffer="
                    "True) reduces in place): call optimizer.zero_grad() between a step and the next backward "
                    "(model.zero_grad(set_to_none=False) zeroes the views too, but the optimizer cannot tell that "
                    "from gradients accumulated over the reduced shard)")
