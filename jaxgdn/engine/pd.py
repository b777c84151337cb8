"""PD disaggregation by explicit state passing.

The prefill worker runs prompt[:-1] and hands off a `Handoff`: the trunk and MTP KV pages of positions
0..N-2, each GDN layer's conv window and recurrent state h(N-1), the prompt and num_computed = N-1. The
decode worker writes it into freshly allocated pages and a fresh slot (`state_copies`), then runs the prompt
tail x_N itself (a recurrence is not idempotent, so the handoff point must be h(N-1), never h(N)).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from .request import SamplingParams

Array = Any


@dataclasses.dataclass
class Handoff:
    """What crosses from the prefill worker to the decode worker for one request.

    kv_k/kv_v: [n_attention_layers, P, page_size, Hkv, D] (positions 0..num_computed-1 in order: the first
    ceil(num_computed / page_size) pages count, a device copy may carry padding pages after them);
    mtp_k/mtp_v: [n_mtp_layers, P, page_size, Hkv, D]; conv: [n_gdn_layers, Kc-1, C]; ssm: [n_gdn_layers, Hv, dk, dv] fp32.
    A handoff fresh from a prefill engine (workers.PrefillRole) has no arrays yet: its state stays in the prefill worker's pages and slot
    (`source`) until a decode worker on the same devices copies it from there, or `export()` gathers it.
    """

    prompt_token_ids: list[int]
    num_computed: int
    sampling_params: SamplingParams
    kv_k: Array = None
    kv_v: Array = None
    mtp_k: Array = None
    mtp_v: Array = None
    conv: Array = None
    ssm: Array = None
    request_id: int = -1  # the prefill worker's id, for the orchestrator's bookkeeping
    fingerprint: str = ""  # config_fingerprint of the prefill side; the decode side must match it
    num_cached_tokens: int = 0  # of the prompt, found in the prefill worker's prefix cache
    prompt_logprobs: list | None = None  # with SamplingParams.prompt_logprobs: Request.prompt_logprobs
    source: Any = dataclasses.field(default=None, repr=False, compare=False)  # workers.Parked, until exported
    # pages of kv_k's axis 1 that count, where an export padded the arrays to a program's page bucket
    valid_pages: int | None = dataclasses.field(default=None, repr=False, compare=False)

    ARRAYS = ("kv_k", "kv_v", "mtp_k", "mtp_v", "conv", "ssm")

    @property
    def arrays(self) -> tuple | None:
        return None if self.kv_k is None else tuple(getattr(self, n) for n in self.ARRAYS)

    def num_pages(self, page_size: int) -> int:
        return -(-self.num_computed // page_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the state it moves (its pages without padding)."""
        if self.arrays is None:
            return self.source.nbytes if self.source is not None else 0
        total = 0
        for name in self.ARRAYS:
            a = getattr(self, name)
            shape = list(a.shape)
            if self.valid_pages is not None and name.startswith(("kv", "mtp")) and len(shape) > 2:
                shape[1] = self.valid_pages
            total += int(np.prod(shape)) * a.dtype.itemsize
        return total

    def export(self) -> "Handoff":
        """Gather the state from the prefill worker's pools into arrays (on its engine's thread: the worker's pools
        change with its steps) and free its pages and slot there. Returns self."""
        if self.arrays is None:
            if self.source is None:
                raise ValueError("a handoff without arrays or a prefill worker holding its state")
            self.source.export(self)
        return self

    _MAGIC = b"JAXGDN-HANDOFF-2"  # format tag and version: 16 bytes, then a little-endian uint64 header length

    def to_bytes(self) -> bytes:
        """Serialise to cross a process boundary: tag, header length, JSON header (request fields and each
        array's dtype, shape and offset), then the arrays' raw bytes. One device-to-host fetch for all
        arrays and one copy into the result (an .npz costs several copies more)."""
        host = jax.device_get(list(self.export().arrays))
        layout, offset, kept = [], 0, []
        for name, arr in zip(self.ARRAYS, host):
            if self.valid_pages is not None and name.startswith(("kv", "mtp")) and arr.ndim > 2:
                arr = arr[:, : self.valid_pages]  # the pages that count, without an export's padding
            kept.append(arr)
            layout.append([name, arr.dtype.name, list(arr.shape), offset])
            offset += arr.nbytes
        meta = {"prompt_token_ids": self.prompt_token_ids, "num_computed": self.num_computed,
                "sampling_params": dataclasses.asdict(self.sampling_params), "request_id": self.request_id,
                "fingerprint": self.fingerprint, "num_cached_tokens": self.num_cached_tokens,
                "prompt_logprobs": self.prompt_logprobs, "arrays": layout}
        header = json.dumps(meta).encode()
        raw = [memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)) for arr in kept]
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
        return cls(sampling_params=SamplingParams.from_dict(meta.pop("sampling_params")), **meta, **arrays)


def config_fingerprint(cfg: ModelConfig, dtype: str, kv_page_size: int) -> str:
    """What both sides of a handoff must share: the model config, the cache dtype and the page size."""
    text = json.dumps([dataclasses.asdict(cfg), str(dtype), kv_page_size], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def handoff_problem(h: Handoff, cfg: ModelConfig, fingerprint: str, page_size: int, num_mtp_layers: int) -> str | None:
    """Why a decode worker cannot import h (another model or configuration, arrays of the wrong sizes), or None.
    The page axis may hold padding pages after the ones that count."""
    if h.fingerprint != fingerprint:
        return (f"handoff from another model or configuration (fingerprint {h.fingerprint or 'none'}, this worker's "
                f"{fingerprint}): serve both sides with the same checkpoint, dtype and kv_page_size")
    if not 0 <= h.num_computed < len(h.prompt_token_ids):
        return f"handoff of {h.num_computed} computed tokens for a prompt of {len(h.prompt_token_ids)}"
    if h.arrays is None:  # its state is in a prefill worker's pools, laid out as this worker's
        return None
    pages = h.num_pages(page_size)
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
        paged = name.startswith(("kv", "mtp"))
        if len(got) != len(shape) or any(w is not None and g != w and not (paged and i == 1 and g > w)
                                         for i, (g, w) in enumerate(zip(got, shape))):
            return f"handoff {name} of shape {got}, expected {tuple('*' if w is None else w for w in shape)}"
    return None
