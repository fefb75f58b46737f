"""apex's storage options of the ZeRO engine: their checks, and the
StorageSpec ([Note: storage codecs] in _storage.py) they stand for.

- dtype: the optimizer state's dtype (the master, when stored, and the
  rule's states): fp32, fp16 or bf16, stored plain, as apex stores them;
- store_params: keep a master of the parameter shard in `dtype`; False:
  the step reads and updates the parameter shard itself (param_sync_dtype);
  None (the default): False where that shard is an exact fp32 master
  (resolve_store_params), True elsewhere;
- store_param_remainders (with store_params=False, dtype fp32, bf16
  parameters): the fp32 master is the bf16 parameter plus an int16 low half;
- with_scaled_states (with store_params=True, dtype fp16 or bf16): fp16
  master and states carry a power-of-two scale per shard fragment. bf16 has
  fp32's exponent range, so a power-of-two scale changes none of its
  roundings: bf16 states are stored plain, to the same values.
"""
from __future__ import annotations

import torch

from .. import _storage

STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_storage_options(dtype, store_params: bool | None, store_param_remainders: bool,
                          with_scaled_states: bool) -> None:
    """apex's rules for combining the storage options (ValueError naming the fix)."""
    if dtype not in STATE_DTYPES:
        raise ValueError(f"dtype (the optimizer state's dtype) must be torch.float32, torch.float16 or "
                         f"torch.bfloat16, got {dtype!r}")
    if store_param_remainders:
        if store_params:
            raise ValueError(
                "store_param_remainders=True needs store_params=False, as in apex: the bf16 parameters and "
                "their int16 remainders are the master, so no master is stored. (shardadam used to ask for the "
                "reverse, store_params=True with store_param_remainders=True; it now follows apex: pass "
                "store_params=False)")
        if with_scaled_states:
            raise ValueError("store_param_remainders=True and with_scaled_states=True are two ways to store the "
                             "master: choose one")
        if dtype != torch.float32:
            raise ValueError(f"store_param_remainders=True needs dtype=torch.float32 (the remainders complete bf16 "
                             f"parameters to fp32 masters), got dtype={dtype}")
    if with_scaled_states:
        if store_params is False:
            raise ValueError("with_scaled_states=True needs store_params=True: it scales the stored master")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"with_scaled_states=True stores the master and the states in `dtype`, which must be "
                f"torch.float16 (with per-fragment scales: what shardadam stored whatever dtype said, before "
                f"dtype was honoured) or torch.bfloat16, got dtype={dtype}")


# What a DistributedFusedAdam's parameters may be: the dtypes its kernels
# compute with, and float64, carried in float32 as apex carries it.
PARAM_DTYPES = STATE_DTYPES + (torch.float64,)


def sync_class(param_dtype: torch.dtype, grad_sync_dtype=None, param_sync_dtype=None) -> tuple:
    """A parameter's (grad_sync_dtype, param_sync_dtype) ([Note: sync
    classes] in _rows.py): those given, else its own dtype (float32 for a
    float64 parameter), the gradient's following the parameter's."""
    param_sync = param_sync_dtype or (param_dtype if param_dtype in STATE_DTYPES else torch.float32)
    return grad_sync_dtype or param_sync, param_sync


def check_sync_dtypes(grad_sync_dtype, param_sync_dtype) -> None:
    """Both sync dtypes, when given, are floating point: apex also carries
    parameters as integer or byte dtypes (copying their most significant
    bytes, e.g. FP8 as uint8); here they are not."""
    for name, value in (("grad_sync_dtype", grad_sync_dtype), ("param_sync_dtype", param_sync_dtype)):
        if value is not None and value not in STATE_DTYPES:
            raise ValueError(f"{name}={value}: the sync dtypes must be torch.float32, torch.float16 or "
                             f"torch.bfloat16 (apex's integer and byte parameter sync, which copies the most "
                             f"significant bytes, is not supported)")


def resolve_store_params(store_params: bool | None, dtype, store_param_remainders: bool, with_scaled_states: bool,
                         param_sync_dtypes, stochastic_round: bool = False) -> bool:
    """store_params=None: no master of its own where the parameter shard is
    one already, bit for bit (fp32 state, every parameter synchronised in
    fp32: the update reads and writes the same fp32 values either way),
    saving 4 bytes per parameter and rank where the shard lives in the
    contiguous parameter buffer; a master where the shard is rounded or
    the options need one. Remainders and bf16_stochastic_round are ways of
    keeping no master."""
    if store_params is not None:
        return store_params
    if store_param_remainders or stochastic_round:
        return False
    exact = dtype == torch.float32 and set(param_sync_dtypes) == {torch.float32}
    return with_scaled_states or not exact


def state_dtypes(rule, **given) -> dict:
    """exp_avg_dtype / exp_avg_sq_dtype (None: `dtype`): a state's storage of
    its own, by state name. FP8 E4M3 (torch.float8_e4m3fn, or torch.uint8 as
    TransformerEngine spells it) carries a scale per shard fragment, but an
    FP8 exp_avg_sq is kept blockwise ([Note: FP8 second moments] in
    _storage.py); "blockwise8" keeps a maximum per block of 256 elements of
    each fragment."""
    chosen = {}
    for option, value in given.items():
        if value is None:
            continue
        name = option.removesuffix("_dtype")
        if name not in rule.states:
            raise ValueError(f"{option}: {rule.title} keeps no {name} (its states: {', '.join(rule.states)})")
        if value not in STATE_DTYPES + (torch.float8_e4m3fn, torch.uint8, _storage.BLOCKWISE8):
            raise ValueError(f"{option} must be torch.float32, torch.float16, torch.bfloat16, FP8 "
                             f"(torch.float8_e4m3fn, or torch.uint8 as TransformerEngine spells it) or "
                             f"{_storage.BLOCKWISE8!r} (8-bit blockwise), got {value!r}")
        chosen[name] = _storage.state_storage(name, value)
    return chosen


def storage_spec(rule, dtype, store_params: bool, store_param_remainders: bool,
                 with_scaled_states: bool, own_dtypes: dict | None = None) -> _storage.StorageSpec:
    """The StorageSpec of checked options (own_dtypes: state_dtypes's)."""
    own_dtypes = own_dtypes or {}
    states = tuple((name, own_dtypes.get(name, dtype)) for name in rule.states
                   if own_dtypes.get(name, dtype) != torch.float32)
    if store_param_remainders:
        return _storage.StorageSpec(_storage.REMAINDER, torch.float32, states)
    master = _storage.SEPARATE if store_params else _storage.PARAM
    # A state given fp16 of its own is scaled, as FusedAdam's; `dtype` fp16 only with with_scaled_states (apex).
    scaled = with_scaled_states or torch.float16 in own_dtypes.values()
    return _storage.StorageSpec(master, dtype, states, scaled_fp16=scaled)
