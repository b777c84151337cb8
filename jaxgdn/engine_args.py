"""The engine flags of every command line (generate, serve, eval, bench), made from EngineConfig's fields: a field's
type gives the flag's form, its docstring the flag's help, its default the flag's default."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import types
import typing

from .engine.config import EngineConfig

TRISTATE = {"auto": None, "on": True, "off": False}  # a `bool | None` field's words


@functools.cache
def field_docs(cls=EngineConfig) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), whitespace folded."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def _optional(kind, none: str):
    """argparse type of an `int | None` field: its none word (auto, off) or a value."""
    def parse(text: str):
        if text.lower() == none:
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} or '{none}', got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def _tristate(text: str) -> bool | None:
    if text not in TRISTATE:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(TRISTATE)}, got {text!r}")
    return TRISTATE[text]


def add_engine_flags(ap, names: list[str] | None = None, **defaults) -> None:
    """Add a flag to ap (a parser or group) for each EngineConfig field in names (None: every field); defaults
    overrides a flag's default by its field name (e.g. max_num_seqs=16). A `bool` field is --x / --no-x, a
    `bool | None` one takes auto/on/off, a Literal one its choices, an `int | None` one a number or its none word."""
    hints, docs = typing.get_type_hints(EngineConfig), field_docs()
    for f in dataclasses.fields(EngineConfig):
        if names is not None and f.name not in names:
            continue
        default = defaults.get(f.name, f.default)
        kind, flags = hints[f.name], ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        args = typing.get_args(kind)
        optional = typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else kind
        none = f.metadata.get("none", "auto")
        shown = none if default is None else ("on" if default else "off") if isinstance(default, bool) else default
        help = docs[f.name].replace("%", "%%") + f" (default: {shown})"
        if base is bool and not optional:
            ap.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help)
        elif base is bool:
            ap.add_argument(*flags, type=_tristate, choices=list(TRISTATE.values()), default=default, help=help,
                            metavar="{" + ",".join(TRISTATE) + "}")
        elif typing.get_origin(base) is typing.Literal:
            ap.add_argument(*flags, choices=typing.get_args(base), default=default, help=help)
        else:
            ap.add_argument(*flags, type=_optional(base, none) if optional else base, default=default, help=help,
                            metavar=f"N|{none}" if optional else "N" if base is int else None)


def add_engine_args(ap: argparse.ArgumentParser, **defaults) -> argparse._ArgumentGroup:
    """Add every engine flag to ap, in a group "engine" (returned); defaults: see add_engine_flags."""
    group = ap.add_argument_group("engine", "EngineConfig's fields")
    add_engine_flags(group, **defaults)
    return group


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of the parsed engine flags (those args has; a None for a field that cannot be None keeps
    the field's default); ValueError names a bad one."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    fields = {k: v for k, v in fields.items() if v is not None or type(None) in typing.get_args(hints[k])}
    config = EngineConfig(**{**fields, **overrides})
    use_memory_fraction(config.gpu_memory_utilization)
    return config


def use_memory_fraction(fraction: float) -> None:
    """Let JAX's allocator take `fraction` of each GPU (its default is 75%), so --gpu-memory-utilization means
    a fraction of the GPU's memory, as in vLLM; a fraction the user set in the environment stands. Takes
    effect if no GPU was used yet in this process (and in the processes it starts)."""
    if not (os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")):
        os.environ["XLA_CLIENT_MEM_FRACTION"] = str(fraction)


def add_distributed_args(ap: argparse.ArgumentParser) -> None:
    """Flags of a run over several processes (hosts): one engine whose mesh spans every process's devices."""
    g = ap.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="process 0's address; every process runs the same command with its own --process-id")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0..num_processes-1")


def init_distributed(args: argparse.Namespace) -> bool:
    """jax.distributed.initialize from the flags, before JAX first touches a device; True on process 0 (the
    one that prints) or when the run is a single process."""
    if not args.coordinator_address:
        return True
    import jax

    jax.distributed.initialize(args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id)
    return jax.process_index() == 0
