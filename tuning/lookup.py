"""Find the tuned launch config for one kernel call, at trace time.

Rules (docs/design.md, "Tuned configs"), applied in this order:

1. File: `<dir>/<sanitized device name>.json` of the first of these directories
   that holds one: `$FFPA_TUNED_CONFIG_DIR` (when set); the user's directory,
   where `python -m tuning.autotune` writes by default (`user_config_dir()`:
   `$XDG_CACHE_HOME/ffpa_jax/tuned_configs`, else `~/.cache/ffpa_jax/tuned_configs`);
   the packaged `tuning/configs/`. When none holds one, the first file (by file
   name, the directories in the same order) whose header `compute_capability`
   equals the device's is used instead.
2. Keep entries whose direction, kernel, autotune mode (the entry's own
   "autotune_mode", else the file's), dtype, causal, has_attn_bias and
   has_dropout match; for backward entries also bias_grad, when the caller
   gives one (an entry without bias_grad counts as False).
3. Nearest stored head dim, ties to the larger (320/512 stored: 416 -> 512).
4. Smallest stored seqlen >= the runtime one, else the largest stored: first
   for seqlen_q, then for seqlen_k among the survivors (the *_bucket fields
   when present).
5. Prefer an exact (nheads_q, nheads_kv) match without requiring it; remaining
   ties go to the first entry in file order.
6. No compatible entry, a missing or malformed file, no GPU, or
   FFPA_SKIP_PERSIST_TUNED_CONFIG (or FFPA's spelling
   FFPA_SKIP_PERSISIT_TUNED_CONFIG) set to 1/true/yes/on: None, silently; the
   caller then uses the built-in default.

The dtype must match exactly: fp16 does NOT fall back to bf16 entries (nor the
reverse), because the best tiles differ between the two on real hardware and a
wrong guess is worse than the built-in default.

With FFPA_LOGGER_LEVEL=DEBUG every distinct lookup logs its hit or miss once
per process on the "ffpa_jax.tuning" logger. Results are cached by the full
argument tuple plus the environment variables above, so once a shape has been
traced a lookup costs a dict probe.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from tuning.device import current_device, sanitize_device_name
from tuning.schema import TunedConfigFile, load_config_file

logger = logging.getLogger("ffpa_jax.tuning")

PACKAGED_CONFIG_DIR = Path(__file__).resolve().parent / "configs"

ENV_CONFIG_DIR = "FFPA_TUNED_CONFIG_DIR"
# FFPA reads its own misspelled name; accept both so one setting works for both.
ENV_SKIP = ("FFPA_SKIP_PERSIST_TUNED_CONFIG", "FFPA_SKIP_PERSISIT_TUNED_CONFIG")
ENV_LOGGER_LEVEL = "FFPA_LOGGER_LEVEL"
_TRUTHY = frozenset({"1", "true", "yes", "on"})

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32",
}


class _Query(NamedTuple):
    """One lookup, normalized so equal requests share a cache slot."""

    direction: str
    kernel: str
    dtype: str
    headdim: int
    seqlen_q: int
    seqlen_k: int
    causal: bool
    has_attn_bias: bool
    has_dropout: bool
    nheads_q: int | None
    nheads_kv: int | None
    autotune_mode: str
    bias_grad: bool | None
    device_name: str | None
    compute_capability: str | None


class _Env(NamedTuple):
    """The environment variables that change a lookup's answer."""

    config_dir: str | None
    user_dir: str
    skip: bool


def dtype_name(dtype: Any) -> str:
    """"bf16"/"fp16"/"fp32" for the usual spellings and dtype objects."""
    if isinstance(dtype, str):
        name = dtype.lower()
    else:
        try:
            import numpy as np  # jnp.bfloat16 and friends are numpy dtypes.

            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    # An unknown name is kept: it matches no entry, so the lookup misses.
    return _DTYPE_ALIASES.get(name, name)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def user_config_dir() -> Path:
    """The user's tuned-config directory, the autotuner's default output:
    `$XDG_CACHE_HOME/ffpa_jax/tuned_configs`, else `~/.cache/ffpa_jax/tuned_configs`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ffpa_jax" / "tuned_configs"


def _read_env() -> _Env:
    skip = any(os.environ.get(name, "").strip().lower() in _TRUTHY for name in ENV_SKIP)
    return _Env(config_dir=os.environ.get(ENV_CONFIG_DIR) or None,
                user_dir=str(user_config_dir()), skip=skip)


def _configure_debug_logging() -> None:
    """Honour FFPA_LOGGER_LEVEL=DEBUG (read per call: tests and users flip it)."""
    if os.environ.get(ENV_LOGGER_LEVEL, "").strip().upper() != "DEBUG":
        return
    if logger.level != logging.DEBUG:
        logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())


# ---------------------------------------------------------------- files


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime_ns: int, size: int) -> TunedConfigFile | None:
    # mtime and size are in the key so a rewritten file is read again.
    del mtime_ns, size
    return load_config_file(path)


def _load(path: Path) -> TunedConfigFile | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return _load_cached(str(path), stat.st_mtime_ns, stat.st_size)


def _config_dirs(env: _Env) -> list[Path]:
    dirs = [Path(env.config_dir)] if env.config_dir else []
    return dirs + [Path(env.user_dir), PACKAGED_CONFIG_DIR]


def config_dirs() -> list[Path]:
    """The directories the lookup reads, in order (rule 1)."""
    return _config_dirs(_read_env())


def find_config_file(device_name: str, capability: str | None = None) -> TunedConfigFile | None:
    """The tuned-config file the lookup reads for this device (rule 1), or None."""
    return _find_file(device_name, capability, _read_env())


def _capability_fallback(dirs: list[Path], capability: str) -> TunedConfigFile | None:
    """The first loadable file in `dirs` made on a device of the same capability."""
    for directory in dirs:
        try:
            candidates = sorted(p for p in directory.glob("*.json") if p.is_file())
        except OSError:
            continue
        for candidate in candidates:
            loaded = _load(candidate)
            if loaded is not None and str(loaded.header.get("compute_capability")) == capability:
                return loaded
    return None


def _find_file(device_name: str, capability: str | None, env: _Env) -> TunedConfigFile | None:
    """The config file for this device (rule 1), loaded, or None."""
    dirs = _config_dirs(env)
    filename = sanitize_device_name(device_name) + ".json"
    for directory in dirs:
        exact = directory / filename
        if exact.is_file():
            # An existing but malformed file is a miss, not a reason to look on.
            return _load(exact)
    if capability is None:
        return None
    return _capability_fallback(dirs, capability)


# ---------------------------------------------------------------- selection


def _matches_variant(file: TunedConfigFile, entry: Mapping[str, Any], query: _Query) -> bool:
    """Rule 2: the entry was tuned for this exact kernel variant."""
    if (entry["direction"] != query.direction
            or entry["kernel"] != query.kernel
            or file.entry_autotune_mode(entry) != query.autotune_mode
            or entry["dtype"] != query.dtype
            or entry["causal"] != query.causal
            or entry["has_attn_bias"] != query.has_attn_bias
            or entry["has_dropout"] != query.has_dropout):
        return False
    if query.direction == "backward" and query.bias_grad is not None:
        return bool(entry.get("bias_grad") or False) == query.bias_grad
    return True


def _nearest_headdim(stored: set[int], headdim: int) -> int:
    # Ties go to the larger head dim: its tiles cover the smaller problem too.
    return min(stored, key=lambda d: (abs(d - headdim), -d))


def _seqlen_bucket(stored: set[int], seqlen: int) -> int:
    at_least = [s for s in stored if s >= seqlen]
    return min(at_least) if at_least else max(stored)


def _stored_seqlen(entry: Mapping[str, Any], field: str) -> int:
    return entry.get(f"{field}_bucket", entry[field])


def _heads_match(entry: Mapping[str, Any], query: _Query) -> bool:
    return ((query.nheads_q is None or entry["nheads_q"] == query.nheads_q)
            and (query.nheads_kv is None or entry["nheads_kv"] == query.nheads_kv))


def _select_entry(file: TunedConfigFile, query: _Query) -> Mapping[str, Any] | None:
    """Rules 2-5 over the entries of `file`."""
    candidates = [e for e in file.entries if _matches_variant(file, e, query)]
    if not candidates:
        return None
    headdim = _nearest_headdim({e["headdim"] for e in candidates}, query.headdim)
    candidates = [e for e in candidates if e["headdim"] == headdim]
    for field, runtime in (("seqlen_q", query.seqlen_q), ("seqlen_k", query.seqlen_k)):
        bucket = _seqlen_bucket({_stored_seqlen(e, field) for e in candidates}, runtime)
        candidates = [e for e in candidates if _stored_seqlen(e, field) == bucket]
    exact_heads = [e for e in candidates if _heads_match(e, query)]
    return (exact_heads or candidates)[0]


# ---------------------------------------------------------------- lookup


def _resolve_device(query: _Query) -> tuple[str | None, str | None]:
    if query.device_name is not None:
        return query.device_name, query.compute_capability
    name, capability = current_device()
    if name is None:
        return None, None
    return name, query.compute_capability or capability


@functools.lru_cache(maxsize=4096)
def _cached_lookup(query: _Query, env: _Env) -> tuple[Mapping[str, Any] | None, Any, str]:
    """(entry or None, the file's batch size "B" or None, why) for one query; the entry
    must not be mutated."""
    if env.skip:
        return None, None, "skipped: FFPA_SKIP_PERSIST_TUNED_CONFIG is set"
    device_name, capability = _resolve_device(query)
    if device_name is None:
        return None, None, "no GPU device"
    file = _find_file(device_name, capability, env)
    if file is None:
        return None, None, f"no usable tuned-config file for {device_name!r} (cc {capability})"
    entry = _select_entry(file, query)
    if entry is None:
        return None, None, f"no compatible entry in {file.path}"
    where = (f"{file.path}: headdim={entry['headdim']} "
             f"seqlen_q={_stored_seqlen(entry, 'seqlen_q')} "
             f"seqlen_k={_stored_seqlen(entry, 'seqlen_k')} "
             f"heads={entry['nheads_q']}/{entry['nheads_kv']}")
    return entry, file.header.get("B"), where


_logged: set[tuple[_Query, _Env]] = set()


def _log_once(query: _Query, env: _Env, hit: bool, why: str) -> None:
    if not logger.isEnabledFor(logging.DEBUG) or (query, env) in _logged:
        return
    _logged.add((query, env))
    logger.debug("tuned config %s for %s %s: %s", "hit" if hit else "miss",
                 query.direction, query._asdict(), why)


class TunedEntry(NamedTuple):
    """A matched entry (a fresh copy) and the batch size its file was tuned at."""

    entry: dict[str, Any]
    file_batch: int | None


# The lookup's optional fields and their defaults (`explain_entry`).
_QUERY_DEFAULTS = dict(causal=False, has_attn_bias=False, has_dropout=False, nheads_q=None,
                       nheads_kv=None, autotune_mode="fast", bias_grad=None, device_name=None,
                       compute_capability=None)
_QUERY_REQUIRED = ("dtype", "headdim", "seqlen_q", "seqlen_k")


def _query(direction: str, kernel: str, fields: Mapping[str, Any]) -> _Query:
    """The normalized query of `explain_entry`'s keywords (a TypeError names a missing or
    unknown one)."""
    missing = [name for name in _QUERY_REQUIRED if name not in fields]
    unknown = sorted(set(fields) - set(_QUERY_REQUIRED) - set(_QUERY_DEFAULTS))
    if missing or unknown:
        raise TypeError(f"tuned lookup: missing fields {missing}, unknown fields {unknown}; "
                        f"it takes {list(_QUERY_REQUIRED)} and {list(_QUERY_DEFAULTS)}")
    f = {**_QUERY_DEFAULTS, **fields}
    optional_str = lambda x: None if x is None else str(x)  # noqa: E731
    return _Query(
        direction=str(direction), kernel=str(kernel), dtype=dtype_name(f["dtype"]),
        headdim=int(f["headdim"]), seqlen_q=int(f["seqlen_q"]), seqlen_k=int(f["seqlen_k"]),
        causal=bool(f["causal"]), has_attn_bias=bool(f["has_attn_bias"]),
        has_dropout=bool(f["has_dropout"]), nheads_q=_optional_int(f["nheads_q"]),
        nheads_kv=_optional_int(f["nheads_kv"]), autotune_mode=str(f["autotune_mode"]),
        bias_grad=None if f["bias_grad"] is None else bool(f["bias_grad"]),
        device_name=optional_str(f["device_name"]),
        compute_capability=optional_str(f["compute_capability"]))


def explain_entry(direction: str, kernel: str, **fields: Any) -> tuple[TunedEntry | None, str]:
    """(the matched entry, a fresh copy, with its file's "B", or None; why: the file and
    stored problem matched, or why nothing matched). `fields`: `dtype` ("bf16"/"fp16"/"fp32"
    or a numpy/JAX dtype), `headdim`, `seqlen_q`, `seqlen_k` (required), and optionally
    `causal`, `has_attn_bias`, `has_dropout`, `nheads_q`, `nheads_kv`, `autotune_mode`,
    `bias_grad`, `device_name` (None: JAX's current device) and `compute_capability`; see
    the module docstring for the matching rules."""
    _configure_debug_logging()
    query = _query(direction, kernel, fields)
    env = _read_env()
    entry, batch, why = _cached_lookup(query, env)
    _log_once(query, env, entry is not None, why)
    if entry is None:
        return None, why
    copied = dict(entry)
    copied["config"] = dict(entry["config"])
    return TunedEntry(copied, batch if isinstance(batch, int) and batch > 0 else None), why


def lookup_entry(direction: str, kernel: str, **query: Any) -> TunedEntry | None:
    """The matched entry (a fresh copy) with its file's "B", or None: `explain_entry`
    without the why."""
    return explain_entry(direction, kernel, **query)[0]


def lookup_config(direction: str, kernel: str, **query: Any) -> dict[str, Any] | None:
    """The tuned `config` dict for this kernel call, or None for the built-in default.

    `direction` is "forward" or "backward", `kernel` a name from
    `tuning.registry.KERNELS`; `query` holds `explain_entry`'s keywords: `dtype`
    "bf16"/"fp16"/"fp32" (or a numpy/JAX dtype), `headdim`, `seqlen_q`, `seqlen_k` (required),
    the problem's options, `device_name=None` for JAX's current device (no GPU: None) and
    `compute_capability` (e.g. "9.0") for the same-capability fallback file. Returns a fresh
    copy each call, safe to mutate. Never raises for a bad or missing file; see the module
    docstring for the matching rules.
    """
    found = lookup_entry(direction, kernel, **query)
    return None if found is None else found.entry["config"]


def clear_cache() -> None:
    """Forget loaded files, cached lookups and which lookups were logged."""
    _cached_lookup.cache_clear()
    _load_cached.cache_clear()
    _logged.clear()
