"""Tuned launch parameters and the dispatcher: FFPA's persisted-config schema, its lookup at
trace time, the built-in defaults, and `dispatch`, which picks each direction's tier and
every kernel's config for a call (its `plan`, and `explain` for why).
"""

from tuning.defaults import default_config
from tuning.device import current_device, multiprocessor_count, sanitize_device_name
from tuning.dispatch import IMPLEMENTATIONS, Device, explain, plan, plan_for_tiers
from tuning.lookup import dtype_name, lookup_config
from tuning.registry import KERNELS, config_problem
from tuning.schema import load_config_file, write_config_file
from tuning.select import kernel_config

__all__ = [
    "Device",
    "IMPLEMENTATIONS",
    "KERNELS",
    "config_problem",
    "current_device",
    "default_config",
    "dtype_name",
    "explain",
    "kernel_config",
    "load_config_file",
    "lookup_config",
    "multiprocessor_count",
    "plan",
    "plan_for_tiers",
    "sanitize_device_name",
    "write_config_file",
]
