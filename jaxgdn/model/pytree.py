"""`pytree_dataclass`: a dataclass registered as a JAX pytree whose fields are all children."""

import dataclasses

import jax


def pytree_dataclass(cls):
    """Make `cls` a dataclass and a pytree; None-valued fields are allowed (they are empty subtrees)."""
    cls = dataclasses.dataclass(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])
