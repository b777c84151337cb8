"""Memory planned up front, like vLLM's gpu_memory_utilization.

An engine may use `gpu_memory_utilization` of the device's memory, at most JAX's allocator's limit (75% of a
GPU unless XLA_CLIENT_MEM_FRACTION says otherwise; the command lines set it from the knob); a PD prefill
worker sharing the device with its decode worker takes `share` of what is left. From that budget come, in
order: what is in use already (the weights), what other engines on the device hold back beyond it
(`reserved`: the prefill worker's step temporaries, which are allocated only while its step runs), the GDN
slot pools (fixed by max_num_seqs), the temporaries of the largest step program (measured: that program
compiled on a minimal pool) and a margin; the KV pages get the rest, at most as many as every slot at
max_model_len can use. Planned so, both PD workers' pools and step temporaries together stay within the
fraction. A configuration whose budget cannot hold one sequence of max_model_len fails at construction,
naming the knobs. Off the GPU (no memory limit reported) the pool holds every slot at max_model_len.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from ..model.config import ModelConfig
from .config import EngineConfig

GiB = 1 << 30
MARGIN_BYTES = 256 << 20  # XLA's and the runtime's own allocations beside the engine's buffers
SNAPSHOT_SHARE = 0.1  # of what the KV pages could have, the prefix cache's GDN state snapshots take
COPY_INDEX_BYTES = 1 << 20  # a state copy program's index arrays and per-slot scalars, beside the bytes it gathers
STAGING_SHARE = 0.02  # of the budget, at most, a PD decode server's handoffs staged ahead of their import take


def kv_bytes_per_page(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool) -> int:
    """Bytes of one KV page across every attention layer (and the MTP layer's)."""
    layers = len(cfg.attention_layer_ids) + (cfg.mtp_num_hidden_layers if with_mtp else 0)
    return 2 * layers * ecfg.kv_page_size * cfg.num_key_value_heads * cfg.head_dim * ecfg.jnp_dtype.itemsize


def gdn_slot_bytes(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """Bytes of the per-slot pools: per slot and GDN layer a conv buffer of Kc-1+K inputs (activation dtype)
    and 1+K fp32 recurrent states; per slot the penalties' output counts and prompt token bits."""
    K = ecfg.num_speculative_tokens
    conv = (cfg.linear_conv_kernel_dim - 1 + K) * cfg.conv_dim * ecfg.jnp_dtype.itemsize
    ssm = (1 + K) * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    penalties = cfg.vocab_size * 4 + -(-cfg.vocab_size // 32) * 4  # output_counts, prompt_tokens (penalties.py)
    return ecfg.num_slots * (len(cfg.gdn_layer_ids) * (conv + ssm) + penalties)


def handoff_bytes(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, pages: int, slots: int = 1) -> int:
    """Bytes of the pages' KV and the slots' committed GDN state: what a handoff (or a batch of them) moves."""
    return pages * kv_bytes_per_page(cfg, ecfg, with_mtp) + slots * snapshot_bytes(cfg, ecfg)


def snapshot_bytes(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """Bytes of one prefix-cache snapshot: every GDN layer's conv window (activation dtype) and fp32 state."""
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * ecfg.jnp_dtype.itemsize
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.gdn_layer_ids) * (conv + ssm)


JAX_DEFAULT_MEMORY_FRACTION = 0.75  # of the GPU's memory, JAX's allocator's limit unless XLA_CLIENT_MEM_FRACTION says


def allocator_fraction() -> float:
    """The fraction of a GPU's memory JAX's allocator may take, as JAX reads it from its environment."""
    try:
        from jaxlib import xla_client

        return float(xla_client.generate_pjrt_gpu_plugin_options().get("memory_fraction", JAX_DEFAULT_MEMORY_FRACTION))
    except (ImportError, AttributeError, ValueError):
        return JAX_DEFAULT_MEMORY_FRACTION


def device_memory(device=None) -> tuple[int, int, int] | None:
    """(the device's memory, bytes in use, JAX's allocator's limit) of the device (default: JAX's first), or
    None where it reports no limit. The device's memory is the allocator's limit over its fraction."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    limit = int(stats["bytes_limit"])
    return int(limit / allocator_fraction()), int(stats.get("bytes_in_use", 0)), limit


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    num_kv_pages: int  # page 0 included (the null page)
    page_bytes: int
    gdn_bytes: int
    step_peak: int  # temporaries of the largest step program (0: not measured)
    budget: int | None  # bytes the engine may use beside what was in use (None: no device limit)
    num_snapshots: int = 0  # the prefix cache's GDN state snapshots, snapshot 0 included (0: none)
    snapshot_bytes: int = 0  # of one
    copy_peak: int = 0  # temporaries of the largest state copy program (state_copies.py), run between steps
    staged_handoffs: int = 0  # PD handoffs a decode server may hold on the device ahead of their import
    staged_bytes: int = 0  # their bytes

    def check(self, ecfg: EngineConfig) -> "MemoryPlan":
        """Raise ValueError when the usable pages cannot hold one sequence of max_model_len; else self."""
        if self.num_kv_pages - 1 < ecfg.max_pages_per_seq:
            raise ValueError(f"EngineConfig: {self.num_kv_pages - 1} usable KV pages cannot hold one sequence of "
                             f"max_model_len {ecfg.max_model_len} ({ecfg.max_pages_per_seq} pages of {ecfg.kv_page_size})")
        return self

    def describe(self, ecfg: EngineConfig) -> str:
        pages = self.num_kv_pages - 1
        parts = [f"KV pages {pages} ({pages * ecfg.kv_page_size} tokens of context, "
                 f"{pages * self.page_bytes / GiB:.2f} GiB)",
                 f"GDN slots {ecfg.max_num_seqs} ({self.gdn_bytes / GiB:.2f} GiB)"]
        if self.num_snapshots:
            parts.append(f"prefix-cache state snapshots {self.num_snapshots - 1} "
                         f"({(self.num_snapshots - 1) * self.snapshot_bytes / GiB:.2f} GiB)")
        if self.staged_bytes:
            parts.append(f"handoffs staged ahead {self.staged_bytes / GiB:.2f} GiB")
        if self.budget is not None:
            parts += [f"largest step program {self.step_peak / GiB:.2f} GiB",
                      f"largest state copy {self.copy_peak / GiB:.2f} GiB", f"budget {self.budget / GiB:.2f} GiB"]
        return "memory: " + ", ".join(parts)


def plan_memory(cfg: ModelConfig, ecfg: EngineConfig, with_mtp: bool, memory: tuple[int, ...] | None,
                step_peak: Callable[[int], int], share: float = 1.0, reserved: int = 0,
                snapshots: bool = False, copy_peak: int = 0, staged: tuple[int, int] = (0, 0)) -> MemoryPlan:
    """The engine's KV page count (module docstring). memory: (the device's bytes, bytes in use[, the
    allocator's limit]) as device_memory() gives them; gpu_memory_utilization is a fraction of the device's
    bytes, capped at the allocator's limit. step_peak(num_pages): bytes of the largest step program's
    temporaries, compiled on a pool of num_pages pages; reserved: bytes other engines on the device need
    beyond what is in use. snapshots: the engine keeps prefix-cache state snapshots: ecfg.num_state_snapshots,
    else SNAPSHOT_SHARE of what the pages could have (off the GPU: two per request slot). copy_peak: bytes of the
    largest state copy program's temporaries (they run between steps: the larger of the two is planned); staged:
    (handoffs a decode server would hold on the device ahead of their import, bytes of one): at most
    STAGING_SHARE of the budget, at least one."""
    page = kv_bytes_per_page(cfg, ecfg, with_mtp)
    gdn = gdn_slot_bytes(cfg, ecfg)
    copy_peak += COPY_INDEX_BYTES
    snap = snapshot_bytes(cfg, ecfg) if snapshots and cfg.gdn_layer_ids else 0
    every_slot = ecfg.max_num_seqs * ecfg.max_pages_per_seq + 1
    fixed = None if not snap else ecfg.num_state_snapshots
    if ecfg.num_kv_pages is not None or memory is None:
        num_snaps = 0 if not snap else 1 + (fixed if fixed is not None else 2 * ecfg.max_num_seqs)
        pages = ecfg.num_kv_pages if ecfg.num_kv_pages is not None else every_slot
        return MemoryPlan(pages, page, gdn, 0, None, num_snaps, snap, copy_peak, staged[0], staged[0] * staged[1])
    total, in_use, cap = (*memory, memory[0])[:3]
    usable = min(ecfg.gpu_memory_utilization * total, cap)
    budget = int(share * (usable - in_use - reserved))
    one_sequence = ecfg.max_pages_per_seq + 1
    peak = step_peak(one_sequence)
    num_staged = min(staged[0], max(1, int(STAGING_SHARE * budget) // max(staged[1], 1))) if staged[0] else 0
    staged_bytes = num_staged * staged[1]
    free = budget - gdn - max(peak, copy_peak) - staged_bytes - MARGIN_BYTES
    num_snaps = 0
    if snap:
        num_snaps = 1 + (fixed if fixed is not None else max(int(SNAPSHOT_SHARE * free) // snap, 1))
        free -= num_snaps * snap
    pages = free // max(page, 1)
    if pages < one_sequence:
        raise ValueError(
            f"EngineConfig: the memory budget of {budget / GiB:.2f} GiB (gpu_memory_utilization "
            f"{ecfg.gpu_memory_utilization} of the device's {total / GiB:.1f} GiB"
            f"{f' capped at JAX allocator limit {cap / GiB:.1f} GiB' if cap < ecfg.gpu_memory_utilization * total else ''}"
            f", less {in_use / GiB:.2f} GiB in "
            f"use{f' and {reserved / GiB:.2f} GiB for the other PD worker' if reserved else ''}"
            f"{'' if share == 1 else f', times the share {share}'}) leaves {max(pages, 0)} KV pages after the GDN "
            f"slots ({gdn / GiB:.2f} GiB for max_num_seqs {ecfg.max_num_seqs}) and the largest step program "
            f"({peak / GiB:.2f} GiB for max_num_batched_tokens {ecfg.max_num_batched_tokens})"
            f"{f' and {staged_bytes / GiB:.2f} GiB of handoffs staged ahead' if staged_bytes else ''}; one sequence of "
            f"max_model_len {ecfg.max_model_len} needs {one_sequence}. Lower max_num_seqs, max_num_batched_tokens "
            f"or max_model_len, or raise gpu_memory_utilization.")
    return MemoryPlan(int(min(pages, every_slot)), page, gdn, peak, budget, num_snaps, snap, copy_peak, num_staged,
                      staged_bytes)
