"""Where an engine's weights and pools live: one device (or JAX's default), or a tensor-parallel mesh."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from ..model.config import ModelConfig
from ..model.params import ModelParams
from .tensor_parallel import make_mesh, mesh_size, param_specs, place, shard_major, shardings, state_specs


@dataclasses.dataclass(frozen=True)
class Placement:
    """device: the engine's device, or with a mesh this process's first device of it (memory stats, platform);
    None: JAX's default. mesh: the tensor-parallel mesh (None on one device)."""

    device: Any = None
    mesh: Any = None

    @classmethod
    def of(cls, tp: int, device=None, mesh=None) -> "Placement":
        """tp > 1: the given mesh of tp devices, else the first tp devices; tp = 1: the device."""
        if tp == 1:
            return cls(device=device)
        mesh = mesh if mesh is not None else make_mesh(jax.devices(), tp)
        if mesh_size(mesh) != tp:
            raise ValueError(f"EngineConfig: tensor_parallel_size {tp} with a mesh of {mesh_size(mesh)} devices")
        local = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
        return cls(device=local, mesh=mesh)

    @property
    def platform(self) -> str:
        return self.device.platform if self.device is not None else jax.default_backend()

    def put_params(self, params: ModelParams, cfg: ModelConfig) -> ModelParams:
        """The serving weights on the device, or split over the mesh (shard-major, each shard its block)."""
        if self.mesh is not None:
            return place(shard_major(params, cfg, mesh_size(self.mesh)), self.mesh, param_specs(params))
        return jax.device_put(params, self.device) if self.device is not None else params

    def abstract_state(self, new_state: Callable[[], Any]):
        """The state's shapes (with its shardings on a mesh), allocating nothing."""
        state = jax.eval_shape(new_state)
        if self.mesh is None:
            return state
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                            shardings(self.mesh, state_specs(state)))

    def make_state(self, new_state: Callable[[], Any], host_drawn: bool = False):
        """The device state from new_state(): on the device, or created split over the mesh, never whole on one
        device (host_drawn: its values come from the host, e.g. the garbage of slot-hygiene tests)."""
        if self.mesh is None:
            state = new_state()
            return jax.device_put(state, self.device) if self.device is not None else state
        specs = state_specs(jax.eval_shape(new_state))
        if host_drawn:
            return place(new_state(), self.mesh, specs)
        return jax.jit(new_state, out_shardings=shardings(self.mesh, specs))()
