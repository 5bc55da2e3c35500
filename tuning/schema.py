"""Reading and writing tuned-config files: FFPA's persisted format, schema_version 1.

A file is one JSON object::

    {"schema_version": 1, "device_name": "NVIDIA H100 80GB HBM3",
     "device_name_sanitized": "NVIDIA_H100_80GB_HBM3", "compute_capability": "9.0",
     "autotune_mode": "fast", "B": 1, "H": 32, "full_tasks": false,
     "tune_grid": {"headdims": [...], "seqlens": [...]}, "hardware_desc": {...},
     "generated_at": "...", "ffpa_jax_version": "...", "jax_version": "...",
     "jaxlib_version": "...", "entries": [ENTRY, ...]}

FFPA's own files carry `ffpa_version`, `torch_version` and `triton_version`
instead of our three version fields; every key we do not know is kept as is.
Each ENTRY names a direction, a kernel, the problem it was tuned for and the
winning launch `config` (see `_check_entry` for the exact fields).

Reading never raises: a file we cannot use is None, an entry we cannot use is
skipped (both with a debug log), because a stale or hand-edited file must never
break a user's training step; the built-in defaults then apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import logging
import os
import tempfile
import types
from pathlib import Path
from typing import Any, Iterable, Mapping

from tuning.device import sanitize_device_name
from tuning.registry import KERNELS, config_problem

logger = logging.getLogger("ffpa_jax.tuning")

SCHEMA_VERSION = 1
DIRECTIONS = ("forward", "backward")
DTYPES = ("bf16", "fp16", "fp32")
CASE_NAMES = ("common", "attn-mask", "dropout", "gqa", "mqa", "decode-attn")

# Used when the package metadata is unavailable (e.g. running from a checkout
# with PYTHONPATH=. on the GPU machine); keep in step with pyproject.toml.
_FALLBACK_FFPA_JAX_VERSION = "0.1.0"

_REQUIRED_POSITIVE_INTS = ("headdim", "seqlen_q", "seqlen_k", "nheads_q", "nheads_kv")
_OPTIONAL_POSITIVE_INTS = ("seqlen_q_bucket", "seqlen_k_bucket")
_REQUIRED_BOOLS = ("causal", "has_attn_bias", "has_dropout")
_OPTIONAL_BOOLS = ("enable_tma", "enable_ws")
# FFPA writes null for these when they do not apply to the entry.
_OPTIONAL_BOOLS_OR_NULL = ("bias_grad", "use_gemv")


@dataclasses.dataclass(frozen=True)
class TunedConfigFile:
    """A loaded, validated tuned-config file.

    `header` is every top-level key except "entries"; `entries` are the raw
    entry dicts that passed validation, in file order, unchanged (so writing
    them back keeps keys we do not know). Both are read-only views at the top
    level; treat nested values as read-only too, since loads are cached.
    """

    path: Path | None
    header: Mapping[str, Any]
    entries: tuple[Mapping[str, Any], ...]
    skipped: int = 0  # invalid entries dropped while loading

    def entry_autotune_mode(self, entry: Mapping[str, Any]) -> Any:
        """An entry's autotune mode: its own field if present, else the header's."""
        return entry.get("autotune_mode", self.header.get("autotune_mode"))


def _is_int(value: Any) -> bool:
    # JSON true/false load as bool, a subclass of int: never accept them as ints.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(entry: Any, header_mode: Any) -> str | None:
    """Why `entry` cannot be used, or None when it can."""
    if not isinstance(entry, dict):
        return f"entry is {type(entry).__name__}, expected an object"
    direction, kernel = entry.get("direction"), entry.get("kernel")
    if direction not in DIRECTIONS:
        return f"direction={direction!r} not in {DIRECTIONS}"
    if not isinstance(kernel, str):
        return f"kernel={kernel!r} is not a string"
    spec = KERNELS.get(kernel)
    if spec is None:
        return f"unknown kernel {kernel!r}"
    if spec.direction != direction:
        return f"kernel {kernel!r} is a {spec.direction} kernel, entry says {direction!r}"
    if entry.get("case_name") not in CASE_NAMES:
        return f"case_name={entry.get('case_name')!r} not in {CASE_NAMES}"
    if entry.get("dtype") not in DTYPES:
        return f"dtype={entry.get('dtype')!r} not in {DTYPES}"
    for key in _REQUIRED_POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
        if key not in entry and key in _OPTIONAL_POSITIVE_INTS:
            continue
        value = entry.get(key)
        if not (_is_int(value) and value > 0):
            return f"{key}={value!r} is not a positive int"
    for key in _REQUIRED_BOOLS + _OPTIONAL_BOOLS:
        if key not in entry and key in _OPTIONAL_BOOLS:
            continue
        if not isinstance(entry.get(key), bool):
            return f"{key}={entry.get(key)!r} is not a bool"
    for key in _OPTIONAL_BOOLS_OR_NULL:
        if entry.get(key) is not None and not isinstance(entry[key], bool):
            return f"{key}={entry[key]!r} is not a bool or null"
    storage = entry.get("grad_kv_storage_dtype")
    if storage is not None and not isinstance(storage, str):
        return f"grad_kv_storage_dtype={storage!r} is not a string or null"
    chunk = entry.get("preprocess_d_chunk")
    if chunk is not None and not isinstance(chunk, (bool, int)):
        return f"preprocess_d_chunk={chunk!r} is not a bool, int or null"
    mode = entry.get("autotune_mode", header_mode)
    if not isinstance(mode, str):
        return f"autotune_mode={mode!r} (entry or header) is not a string"
    return config_problem(kernel, entry.get("config"))


def _read_json(path: Path) -> Any:
    """The parsed JSON at `path`, or None (debug-logged) when it cannot be read."""
    try:
        raw = path.read_bytes()
    except OSError as err:  # missing, a directory, unreadable, ...
        logger.debug("tuned configs: cannot read %s: %s", path, err)
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # empty, not JSON, bad encoding
        logger.debug("tuned configs: %s is not valid JSON: %s", path, err)
        return None


def load_config_file(path: str | os.PathLike[str]) -> TunedConfigFile | None:
    """Parse and validate the tuned-config file at `path`; never raises.

    Returns None (with a debug log) for a missing, empty, non-JSON or non-object
    file, a schema_version other than 1, or "entries" that is not a list. Each
    invalid entry (bad types, missing required fields, unknown kernel, a config
    `registry.config_problem` rejects) is skipped with a debug log.
    """
    path = Path(path)
    document = _read_json(path)
    if document is None:
        return None
    if not isinstance(document, dict):
        logger.debug("tuned configs: %s holds a %s, expected an object", path,
                     type(document).__name__)
        return None
    version = document.get("schema_version")
    if not (_is_int(version) and version == SCHEMA_VERSION):
        logger.debug("tuned configs: %s has schema_version=%r, expected %d", path, version,
                     SCHEMA_VERSION)
        return None
    raw_entries = document.get("entries")
    if not isinstance(raw_entries, list):
        logger.debug("tuned configs: %s has no 'entries' list", path)
        return None

    header = {key: value for key, value in document.items() if key != "entries"}
    header_mode = header.get("autotune_mode")
    valid: list[Mapping[str, Any]] = []
    for index, entry in enumerate(raw_entries):
        problem = _check_entry(entry, header_mode)
        if problem is None:
            valid.append(types.MappingProxyType(entry))
        else:
            logger.debug("tuned configs: %s: skipping entry %d: %s", path, index, problem)
    return TunedConfigFile(
        path=path,
        header=types.MappingProxyType(header),
        entries=tuple(valid),
        skipped=len(raw_entries) - len(valid),
    )


def _distribution_version(name: str, fallback: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return fallback


def _jax_version(module: str) -> str:
    """Version of `jax` or `jaxlib`, from metadata first (no import needed)."""
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(__import__(module).__version__)
    except Exception:  # Not installed or no __version__: record that, don't fail.
        return "unknown"


def _complete_header(header: Mapping[str, Any]) -> dict[str, Any]:
    """`header` with the fields every file we write must carry filled in."""
    document = {key: value for key, value in header.items() if key != "entries"}
    # We only ever write schema 1: the version describes the bytes we emit.
    document["schema_version"] = SCHEMA_VERSION
    if isinstance(document.get("device_name"), str):
        # Derived, so always recomputed: a stale copy would name another file.
        document["device_name_sanitized"] = sanitize_device_name(document["device_name"])
    document.setdefault("ffpa_jax_version",
                        _distribution_version("ffpa-jax", _FALLBACK_FFPA_JAX_VERSION))
    document.setdefault("jax_version", _jax_version("jax"))
    document.setdefault("jaxlib_version", _jax_version("jaxlib"))
    document.setdefault("generated_at",
                        datetime.datetime.now(datetime.timezone.utc).isoformat())
    return document


def _atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so readers see the old file or the new one, never half.

    The temp file lives in the same directory so os.replace is a rename on one
    filesystem; its ".tmp" suffix keeps it out of any "*.json" scan meanwhile.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp makes 0600; config files are shared.
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def write_config_file(
    path: str | os.PathLike[str],
    header: Mapping[str, Any],
    entries: Iterable[Mapping[str, Any]],
) -> Path:
    """Atomically write a schema-1 tuned-config file; returns its path.

    `header` holds the top-level fields (any "entries" key in it is ignored);
    `schema_version` is set to 1, `device_name_sanitized` derived from
    `device_name`, and `ffpa_jax_version`, `jax_version`, `jaxlib_version` and
    `generated_at` filled in when absent. Unknown keys are written unchanged.
    `write_config_file(p, f.header, f.entries)` round-trips a loaded file `f`.
    Entries are not validated here: the reader skips invalid ones.
    """
    path = Path(path)
    document = _complete_header(header)
    document["entries"] = [dict(entry) for entry in entries]
    # Sorted keys match FFPA's files and make regenerated files diff cleanly;
    # NaN/Infinity are not JSON, so refuse them rather than write them.
    text = json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
    _atomic_write_text(path, text)
    return path
