"""The model runner: one jitted program per bucket for a whole engine step, with the state donated.

step = input assembly kernel -> model over the ragged rows (paged KV + GDN slots) -> logits at
logits_indices -> position-keyed sampling -> per-slot bookkeeping (last_sampled, num_accepted). The
only host round trip is the sampled tokens coming back.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.input_assembly import combine_sampled_and_draft_tokens

from .cache import EngineState
from .config import ModelConfig
from .input_batch import StepArrays
from .model import logits_from_hidden
from .paged_forward import RowView, forward_paged
from .params import ModelParams
from .sampling import position_keys, sample_tokens


def _device_step(params: ModelParams, state: EngineState, a: dict[str, Any], *, cfg: ModelConfig, gdn_impl: str,
                 input_impl: str, unguarded: bool):
    num_logits = a["temperature"].shape[0]
    ids, logits_indices = combine_sampled_and_draft_tokens(
        a["input_ids"], a["idx_mapping"], state.last_sampled, a["query_start_loc"], a["seq_lens"], a["prefill_len"],
        state.draft_tokens, a["cu_num_logits"], num_logits=num_logits, unguarded=unguarded, impl=input_impl,
    )
    view = RowView(
        token_index=a["token_index"], positions=a["row_positions"], kv_slots=a["kv_slots"],
        block_tables=a["block_tables"], seq_lens=a["seq_lens"], idx_mapping=a["idx_mapping"], fresh=a["fresh"],
    )
    hidden, state = forward_paged(params, cfg, ids, view, state, gdn_impl)
    logits = logits_from_hidden(params, hidden[logits_indices]).astype(jnp.float32)
    # The token sampled from logits row i sits at the position after that row's input token.
    keys = position_keys(a["seeds"], a["request_ids"], a["positions"][logits_indices] + 1)
    sampled = sample_tokens(logits, a["temperature"], a["top_k"], a["top_p"], keys)
    row_token = sampled[a["cu_num_logits"][:-1]]  # K = 0: one logits row per request row
    S = state.last_sampled.shape[0]
    real = a["idx_mapping"] > 0
    last = state.last_sampled.at[jnp.where(a["samples"] & real, a["idx_mapping"], S)].set(row_token, mode="drop")
    accepted = state.num_accepted.at[jnp.where(real, a["idx_mapping"], S)].set(1, mode="drop")
    state = EngineState(layers=state.layers, mtp_layers=state.mtp_layers, last_sampled=last,
                        draft_tokens=state.draft_tokens, num_accepted=accepted)
    return state, row_token, ids


class ModelRunner:
    """Holds params and the device state; runs steps; counts compiled bucket shapes."""

    def __init__(self, params: ModelParams, cfg: ModelConfig, state: EngineState, *, gdn_impl: str = "chunked",
                 input_impl: str = "xla", reproduce_pd_mtp_bug: bool = False):
        self.params = params
        self.cfg = cfg
        self.state = state
        self.shapes_seen: set[tuple[int, int, int]] = set()
        self._step = jax.jit(
            functools.partial(_device_step, cfg=cfg, gdn_impl=gdn_impl, input_impl=input_impl,
                              unguarded=reproduce_pd_mtp_bug),
            donate_argnums=(1,),
        )

    @property
    def num_compiled_shapes(self) -> int:
        return len(self.shapes_seen)

    def run(self, arrays: StepArrays) -> tuple[np.ndarray, np.ndarray]:
        """Run one step. Returns (sampled token per row [R], assembled input ids [T]) on the host."""
        self.shapes_seen.add(arrays.shape_key)
        device_args = {k: jnp.asarray(v) for k, v in vars(arrays).items() if k != "row_kind"}
        self.state, row_token, ids = self._step(self.params, self.state, device_args)
        return np.asarray(row_token), np.asarray(ids)
