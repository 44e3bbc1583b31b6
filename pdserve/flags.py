"""`pdserve` flags made from the config dataclasses, so that no default or help text is written twice.

A flag is one field of `ServeConfig` or of a config inside it (`EngineConfig`, `CacheConfig`,
`TransferConfig`, `RouterConfig`), named by its path (`("router", "ttft_target_s")`). The field
gives the rest: the flag's name (`metadata["flag"]`, else `--` and the field's name) and other
names (`metadata["aliases"]`), its help (`metadata["help"]`), its choices (`metadata["choices"]`),
its type (the field's annotation), and
its default, read off a default config (`ServeConfig()` for `serve`, whose engine compiles; a plain
`EngineConfig()` for `generate`). `build` puts the parsed values back into a config. A YAML file
of `serve` flags uses their argparse names (`http_port: 9000`), listed by `dests`.
No torch: `pdserve --help` starts fast.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

C = TypeVar("C")
Path = tuple[str, ...]

# The engine flags of both `serve` and `generate`, then `serve`'s own.
ENGINE: tuple[Path, ...] = (
    ("engine", "model"), ("engine", "dtype"), ("engine", "device"), ("engine", "cache", "memory_gib"),
    ("engine", "cache", "block_size"), ("engine", "num_threads"), ("engine", "compile"), ("engine", "linear"),
    ("engine", "chat_template"))
SERVE: tuple[Path, ...] = (
    ("engine", "max_num_seqs"), ("engine", "max_num_batched_tokens"), ("engine", "prefill_chunk_tokens"),
    ("engine", "cache", "enable_prefix_caching"),
    ("engine", "seed"), ("engine", "max_model_len"), ("address",), ("deployment",), ("cost_model",),
    ("num_prefill",), ("num_decode",),
    ("cpus_per_worker",), ("lend_threads",), ("transfer", "backend"), ("transfer", "timeout_s"), ("host",),
    ("http_port",),
    ("grpc_port",), ("router", "policy"), ("router", "ttft_target_s"), ("router", "tpot_target_s"),
    ("router", "max_queued"), ("router", "queue_timeout_s"), ("router", "default_max_tokens"),
    ("router", "on_prefill_failure"), ("router", "max_attempts"), ("router", "max_migrations"),
    ("router", "hang_timeout_s"), ("router", "flip_roles"), ("router", "prefix_aware"), ("router", "served_model_name"), ("ssl_certfile",),
    ("ssl_keyfile",), ("protect_metrics",))
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _field(config: object, path: Path) -> tuple[dataclasses.Field, Any]:
    """The dataclass field at `path` in `config`, and its value there."""
    *outer, name = path
    for part in outer:
        config = getattr(config, part)
    fields = {f.name: f for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    return fields[name], getattr(config, name)


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def dest(f: dataclasses.Field) -> str:
    """The argparse name of the flag of field `f` (also its key in a YAML file of flags)."""
    return flag_name(f)[2:].replace("-", "_")


def _type(f: dataclasses.Field) -> type:
    names = [t.strip() for t in str(f.type).split("|") if t.strip() != "None"]
    if len(names) != 1 or names[0] not in _TYPES:
        raise TypeError(f"field {f.name} ({f.type}) cannot be a flag: give it an int, float, str or bool type")
    return _TYPES[names[0]]


def add_flags(parser: argparse.ArgumentParser, paths: Sequence[Path], defaults: object) -> None:
    """Add one flag per path, its default taken from `defaults` (a ServeConfig)."""
    for path in paths:
        f, default = _field(defaults, path)
        if "help" not in f.metadata:
            raise TypeError(f"field {'.'.join(path)} has no help text in its metadata")
        kw: dict[str, Any] = {"default": default, "dest": dest(f), "choices": f.metadata.get("choices"),
                              "help": f.metadata["help"] + ("" if default is None else " (default: %(default)s)")}
        typ = _type(f)
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = typ
        parser.add_argument(flag_name(f), *f.metadata.get("aliases", ()), **kw)


def dests(paths: Sequence[Path], defaults: object) -> set[str]:
    """The argparse names of the flags of `paths`."""
    return {dest(_field(defaults, path)[0]) for path in paths}


def build(defaults: C, args: argparse.Namespace, paths: Sequence[Path]) -> C:
    """`defaults` with every field of `paths` set from the parsed `args` (nested configs replaced)."""
    values: dict[Path, Any] = {path: getattr(args, dest(_field(defaults, path)[0])) for path in paths}
    return _replace(defaults, (), values)


def _replace(config: C, prefix: Path, values: dict[Path, Any]) -> C:
    changes: dict[str, Any] = {}
    for path, value in values.items():
        if path[:len(prefix)] == prefix and len(path) == len(prefix) + 1:
            changes[path[-1]] = value
    for inner in {path[len(prefix)] for path in values if path[:len(prefix)] == prefix and len(path) > len(prefix) + 1}:
        changes[inner] = _replace(getattr(config, inner), (*prefix, inner), values)
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]
