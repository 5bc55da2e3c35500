"""Tuned launch parameters: FFPA's persisted-config schema, lookup at trace time, defaults.

`launch_config` is the one function the kernels' callers use: a tuned entry for
this device and problem when one matches, else the built-in default.
"""

from tuning.defaults import default_config
from tuning.device import current_device, multiprocessor_count, sanitize_device_name
from tuning.lookup import dtype_name, lookup_config
from tuning.registry import KERNELS, config_problem
from tuning.schema import load_config_file, write_config_file
from tuning.plan import decode_config, explain_tiers, make_plan, tiers, uses_decode
from tuning.select import config_for, explain_config, launch_config, tier

__all__ = [
    "KERNELS",
    "config_for",
    "decode_config",
    "explain_config",
    "explain_tiers",
    "make_plan",
    "tiers",
    "uses_decode",
    "config_problem",
    "current_device",
    "default_config",
    "dtype_name",
    "launch_config",
    "load_config_file",
    "lookup_config",
    "multiprocessor_count",
    "sanitize_device_name",
    "tier",
    "write_config_file",
]
