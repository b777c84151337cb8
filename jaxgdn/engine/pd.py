"""PD disaggregation by explicit state passing.

The prefill worker runs prompt[:-1] and exports a `Handoff`: the trunk and MTP KV pages of positions
0..N-2, each GDN layer's conv window and recurrent state h(N-1), the prompt and num_computed = N-1. The
decode worker imports it into freshly allocated pages and a fresh slot, then runs the prompt tail x_N
itself (a recurrence is not idempotent, so the handoff point must be h(N-1), never h(N)).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..model.config import FULL_ATTENTION, ModelConfig
from .request import Request, SamplingParams
from .state import EngineState, GDNSlots, PagedKV
from .structured import StructuredOutputsParams

Array = Any


@dataclasses.dataclass
class Handoff:
    """What crosses from the prefill worker to the decode worker for one request.

    kv_k/kv_v: [n_attention_layers, n_pages, page_size, Hkv, D] (positions 0..num_computed-1 in order);
    mtp_k/mtp_v: [n_mtp_layers, n_pages, page_size, Hkv, D]; conv: [n_gdn_layers, Kc-1, C];
    ssm: [n_gdn_layers, Hv, dk, dv] fp32.
    """

    prompt_token_ids: list[int]
    num_computed: int
    sampling_params: SamplingParams
    kv_k: Array
    kv_v: Array
    mtp_k: Array
    mtp_v: Array
    conv: Array
    ssm: Array
    request_id: int = -1  # the prefill worker's id, for the orchestrator's bookkeeping
    fingerprint: str = ""  # config_fingerprint of the prefill side; the decode side must match it
    num_cached_tokens: int = 0  # of the prompt, found in the prefill worker's prefix cache
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: Request.prompt_logprobs

    ARRAYS = ("kv_k", "kv_v", "mtp_k", "mtp_v", "conv", "ssm")

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(getattr(self, n).shape)) * getattr(self, n).dtype.itemsize for n in self.ARRAYS)

    _MAGIC = b"JAXGDN-HANDOFF-2"  # format tag and version: 16 bytes, then a little-endian uint64 header length

    def to_bytes(self) -> bytes:
        """Serialise to cross a process boundary: tag, header length, JSON header (request fields and each
        array's dtype, shape and offset), then the arrays' raw bytes. One device-to-host fetch for all
        arrays and one copy into the result (an .npz costs several copies more)."""
        host = jax.device_get([getattr(self, name) for name in self.ARRAYS])
        layout, offset = [], 0
        for name, arr in zip(self.ARRAYS, host):
            layout.append([name, arr.dtype.name, list(arr.shape), offset])
            offset += arr.nbytes
        meta = {"prompt_token_ids": self.prompt_token_ids, "num_computed": self.num_computed,
                "sampling_params": dataclasses.asdict(self.sampling_params), "request_id": self.request_id,
                "fingerprint": self.fingerprint, "num_cached_tokens": self.num_cached_tokens,
                "prompt_logprobs": self.prompt_logprobs, "arrays": layout}
        header = json.dumps(meta).encode()
        raw = [memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)) for arr in host]
        return b"".join([self._MAGIC, len(header).to_bytes(8, "little"), header, *raw])

    @classmethod
    def from_bytes(cls, data: bytes) -> "Handoff":
        """Inverse of to_bytes; the arrays are read-only views into data (no copy). Raises ValueError for
        bytes of another format or version, or cut short."""
        tag = len(cls._MAGIC)
        if bytes(data[:tag]) != cls._MAGIC:
            if bytes(data[: tag - 1]) == cls._MAGIC[:-1]:
                raise ValueError(f"handoff format {bytes(data[tag - 1:tag])!r}, this jaxgdn reads {cls._MAGIC[-1:]!r}")
            raise ValueError("not a jaxgdn handoff (Handoff.to_bytes output expected)")
        size = int.from_bytes(data[tag : tag + 8], "little")
        try:
            meta = json.loads(bytes(data[tag + 8 : tag + 8 + size]))
            layout = meta.pop("arrays")
        except (ValueError, KeyError):
            raise ValueError(f"handoff header unreadable ({len(data)} bytes: truncated?)") from None
        base = tag + 8 + size
        arrays = {}
        for name, dtype, shape, start in layout:
            dt = jnp.dtype(dtype)  # knows bfloat16, which numpy alone does not
            count = int(np.prod(shape, dtype=np.int64))
            if base + start + count * dt.itemsize > len(data):
                raise ValueError(f"handoff truncated: {len(data)} bytes, its {name} ends at "
                                 f"{base + start + count * dt.itemsize}")
            arrays[name] = np.frombuffer(data, dt, count, base + start).reshape(shape)
        sp = meta.pop("sampling_params")
        sp["stop_token_ids"] = tuple(sp["stop_token_ids"])
        if sp.get("structured_outputs") is not None:
            sp["structured_outputs"] = StructuredOutputsParams(**sp["structured_outputs"])
        return cls(sampling_params=SamplingParams(**sp), **meta, **arrays)


def config_fingerprint(cfg: ModelConfig, dtype: str, kv_page_size: int) -> str:
    """What both sides of a handoff must share: the model config, the cache dtype and the page size."""
    text = json.dumps([dataclasses.asdict(cfg), str(dtype), kv_page_size], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def handoff_problem(h: Handoff, cfg: ModelConfig, fingerprint: str, page_size: int, num_mtp_layers: int) -> str | None:
    """Why a decode worker cannot import h (another model or configuration, arrays of the wrong sizes), or None."""
    if h.fingerprint != fingerprint:
        return (f"handoff from another model or configuration (fingerprint {h.fingerprint or 'none'}, this worker's "
                f"{fingerprint}): serve both sides with the same checkpoint, dtype and kv_page_size")
    if not 0 <= h.num_computed < len(h.prompt_token_ids):
        return f"handoff of {h.num_computed} computed tokens for a prompt of {len(h.prompt_token_ids)}"
    pages = -(-h.num_computed // page_size)
    n_attn, n_gdn = len(cfg.attention_layer_ids), len(cfg.gdn_layer_ids)
    kv = (n_attn, pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
    want = {"kv_k": kv, "kv_v": kv, "conv": (n_gdn, cfg.linear_conv_kernel_dim - 1, None),
            "ssm": (n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)}
    if num_mtp_layers:
        want["mtp_k"] = want["mtp_v"] = (num_mtp_layers,) + kv[1:]
    for name, shape in want.items():
        got = tuple(getattr(h, name).shape)
        if not pages and name.startswith(("kv", "mtp")) and got in ((0,), shape):
            continue
        if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
            return f"handoff {name} of shape {got}, expected {tuple('*' if w is None else w for w in shape)}"
    return None


def export_handoff(cfg: ModelConfig, state: EngineState, req: Request, full_prompt: list[int],
                   fingerprint: str = "", conv_order: np.ndarray | None = None) -> Handoff:
    """Gather a finished prefill request's state from the prefill worker's pools. conv_order: the pools' conv
    channel order under tensor parallelism (`tensor_parallel.conv_channel_order`); the handoff carries the
    single-device order."""
    n_pages = -(-req.num_computed // state.layers[cfg.attention_layer_ids[0]].k.shape[1]) if req.num_computed else 0
    pages = jnp.asarray(req.pages[:n_pages], jnp.int32)
    attn = [state.layers[i] for i in cfg.attention_layer_ids]
    gdn = [state.layers[i] for i in cfg.gdn_layer_ids]
    kc1 = cfg.linear_conv_kernel_dim - 1
    slot = req.slot
    # The committed GDN state of a prefill row is checkpoint 0 / conv offset 0 (num_accepted = 1).
    stack = lambda xs: jnp.stack(xs) if xs else jnp.zeros((0,))  # noqa: E731
    return Handoff(
        prompt_token_ids=list(full_prompt),
        num_computed=req.num_computed,
        sampling_params=req.sampling_params,
        kv_k=stack([kv.k[pages] for kv in attn]),
        kv_v=stack([kv.v[pages] for kv in attn]),
        mtp_k=stack([kv.k[pages] for kv in state.mtp_layers]),
        mtp_v=stack([kv.v[pages] for kv in state.mtp_layers]),
        conv=stack([g.conv[slot, :kc1] if conv_order is None else g.conv[slot, :kc1][:, np.argsort(conv_order)]
                    for g in gdn]),
        ssm=stack([g.ssm[slot, 0] for g in gdn]),
        request_id=req.request_id,
        fingerprint=fingerprint,
        num_cached_tokens=req.num_cached_tokens or 0,
        prompt_logprobs=req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None else None,
    )


def import_handoff(cfg: ModelConfig, state: EngineState, h: Handoff, slot: int, pages: list[int],
                   device=None, conv_order: np.ndarray | None = None) -> EngineState:
    """Write a handoff into the decode worker's pools at a fresh slot and pages. Resets the slot's
    num_accepted to 1 and its drafts to -1; last_sampled is left as the slot's previous occupant had it
    (the fixed input kernel never reads it for the prompt tail; the buggy one does). device: the pools' device
    or sharding (replicated over a tensor-parallel mesh); conv_order as in export_handoff."""
    put = (lambda x: jax.device_put(jnp.asarray(x), device)) if device is not None else jnp.asarray
    n_pages = h.kv_k.shape[1] if h.kv_k.ndim > 1 else 0
    dst = jnp.asarray(pages[:n_pages], jnp.int32)
    layers = list(state.layers)
    a = g = 0
    for i, t in enumerate(cfg.layer_types):
        if t == FULL_ATTENTION:
            kv = layers[i]
            if n_pages:
                kv = PagedKV(k=kv.k.at[dst].set(put(h.kv_k[a]).astype(kv.k.dtype)),
                             v=kv.v.at[dst].set(put(h.kv_v[a]).astype(kv.v.dtype)))
            layers[i] = kv
            a += 1
        else:
            s = layers[i]
            kc1 = h.conv.shape[1]
            window = h.conv[g] if conv_order is None else np.asarray(h.conv[g])[:, conv_order]
            conv = s.conv.at[slot].set(0).at[slot, :kc1].set(put(window).astype(s.conv.dtype))
            ssm = s.ssm.at[slot].set(0).at[slot, 0].set(put(h.ssm[g]).astype(jnp.float32))
            layers[i] = GDNSlots(conv=conv, ssm=ssm)
            g += 1
    mtp_layers = list(state.mtp_layers)
    if n_pages and h.mtp_k.ndim > 1:
        for m, kv in enumerate(mtp_layers):
            mtp_layers[m] = PagedKV(k=kv.k.at[dst].set(put(h.mtp_k[m]).astype(kv.k.dtype)),
                                    v=kv.v.at[dst].set(put(h.mtp_v[m]).astype(kv.v.dtype)))
    return dataclasses.replace(
        state, layers=tuple(layers), mtp_layers=tuple(mtp_layers), draft_tokens=state.draft_tokens.at[slot].set(-1),
        num_accepted=state.num_accepted.at[slot].set(1), num_computed=state.num_computed.at[slot].set(h.num_computed),
    )
