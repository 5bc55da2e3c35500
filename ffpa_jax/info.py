"""`python -m ffpa_jax.info`: what ffpa_jax sees on this machine, and what a call would run.

    python -m ffpa_jax.info
    python -m ffpa_jax.info --shape 1,4096,32,128 --kv-heads 8 --causal --dtype bf16
    python -m ffpa_jax.info --shape 1,4096,32,512 --device-name "NVIDIA H200"

Prints the device, the jax/jaxlib (and Triton) versions, which tuned-config file the lookup
reads for this device, and, for a shape (q [B, T, Hq, D]; `--kv-heads`, `--kv-len`, `--dv`,
`--causal`, `--dtype`, `--bias`, `--mask`, `--dropout` for the rest), which implementation
and tier each direction runs and every launch config a call would use, each with why: the
tuned entry it matched, or the built-in default or rule. `--device-name` (and
`--compute-capability`) answer for that GPU's tuned file from any machine. Runtime autotune
(`autotune="fast"`) is not shown: it measures at trace time. `--context-parallel P` (with
`--context-layout`, `--context-strategy`) adds the call with its sequence split over P
devices: the strategy, each kind of block with its tier, and the ring backward's rounds.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

import jax
import jax.numpy as jnp

import tuning
from ffpa_jax import context_blocks, context_local, validation
from ffpa_jax.backend import default_backend_is_nvidia_gpu
from pallas_kernels import tiers
from pallas_kernels.problem import DTYPES, Problem
from tuning import dispatch
from tuning.lookup import ENV_CONFIG_DIR, config_dirs, find_config_file

_DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                "fp32": "fp32", "float32": "fp32"}
WIDTH = 100


def _ints(text: str, count: int | None = None) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}")
    if count is not None and len(values) != count:
        raise argparse.ArgumentTypeError(f"expected {count} comma-separated integers; "
                                         f"got {text!r}")
    return values


def _dtype(text: str) -> str:
    if text.lower() not in _DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"dtype must be one of bf16, fp16, fp32; got {text!r}")
    return _DTYPE_NAMES[text.lower()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ffpa_jax.info", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Without --shape only the machine's part is printed.")
    parser.add_argument("--shape", type=lambda t: _ints(t, 4), metavar="B,T,Hq,D",
                        help="the query's shape")
    parser.add_argument("--kv-heads", type=int, default=None, metavar="H",
                        help="key/value heads (default Hq)")
    parser.add_argument("--kv-len", type=int, default=None, metavar="S",
                        help="key/value sequence length (default T)")
    parser.add_argument("--dv", type=int, default=None, help="value head dim (default D)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", type=_dtype, default="bf16", help="bf16 (default), fp16, fp32")
    parser.add_argument("--bias", type=lambda t: _ints(t, 4), default=None, metavar="B,H,T,S",
                        help="a float32 bias of this 4-D shape (each dim 1 or full)")
    parser.add_argument("--mask", type=lambda t: _ints(t, 4), default=None, metavar="B,H,T,S",
                        help="a bool mask of this 4-D shape (each dim 1 or full)")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="RATE")
    parser.add_argument("--window", type=lambda t: _ints(t, 2), default=None, metavar="L,R",
                        help="as attention()'s local_window_size (keys left and right of a "
                             "query's diagonal)")
    parser.add_argument("--implementation", choices=[n for n in dispatch.IMPLEMENTATIONS if n],
                        default=None,
                        help="as attention()'s argument (default None: what a call picks)")
    parser.add_argument("--device-name", default=None,
                        help="answer for this NVIDIA GPU (its device_kind, e.g. 'NVIDIA H200') "
                             "instead of JAX's device")
    parser.add_argument("--compute-capability", default=None, metavar="CC",
                        help="with --device-name: its compute capability (e.g. 9.0), for the "
                             "lookup's same-capability fallback")
    parser.add_argument("--deterministic", choices=("true", "false"), default=None,
                        help="as attention()'s argument (default None: XLA_FLAGS decides)")
    parser.add_argument("--context-parallel", type=int, default=None, metavar="P",
                        help="also the call with its sequence split over P devices "
                             "(context_axis): its strategy, blocks and their tiers, and the "
                             "ring backward's rounds, each with why (JAX's device)")
    parser.add_argument("--context-layout", choices=("contiguous", "zigzag"),
                        default="contiguous", help="as attention()'s context_layout")
    parser.add_argument("--context-strategy", choices=context_blocks.STRATEGIES, default=None,
                        help="as attention()'s context_strategy (default None: the rule)")
    return parser


# ---------------------------------------------------------------- the machine


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception as exc:  # noqa: BLE001 - report what is missing, never fail
        return f"not importable ({type(exc).__name__})"


def _package_version() -> str:
    try:
        return importlib.metadata.version("ffpa-jax")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def machine_lines(device_name: str | None, capability: str | None) -> list[str]:
    device = jax.devices()[0]
    gpu = default_backend_is_nvidia_gpu()
    kind = getattr(device, "device_kind", "?")
    lines = [f"ffpa_jax {_package_version()} ({os.path.dirname(os.path.abspath(__file__))})",
             f"device: {kind} (platform {device.platform}, {jax.device_count()} device(s)); "
             + ("an NVIDIA GPU: the compiled kernels run" if gpu else
                "no NVIDIA GPU: attention() runs the plain-JAX path here"),
             f"versions: jax {jax.__version__}, jaxlib {_version('jaxlib')}, "
             f"triton {_version('triton')}"]
    dirs = [str(d) for d in config_dirs()]
    env = os.environ.get(ENV_CONFIG_DIR)
    lines.append("tuned configs, in the lookup's order: " + ", ".join(dirs)
                 + ("" if env else f" (${ENV_CONFIG_DIR} unset)"))
    if device_name is None and gpu:
        device_name = str(kind)
        capability = capability or str(getattr(device, "compute_capability", "")) or None
    if device_name is None:
        lines.append("  for this device: none (no GPU: the built-in defaults and rules apply)")
        return lines
    found = find_config_file(device_name, capability)
    label = f"for {device_name}" + (f" (cc {capability})" if capability else "")
    if found is None:
        lines.append(f"  {label}: no file (the built-in defaults and rules apply)")
    else:
        made_on = found.header.get("device_name")
        lines.append(f"  {label}: {found.path} ({len(found.entries)} entries, autotune mode "
                     f"{found.header.get('autotune_mode')}"
                     + ("" if made_on == device_name else f", made on {made_on!r}") + ")")
    return lines


# ---------------------------------------------------------------- a call


def problem_of(args) -> Problem:
    """The call's `Problem`, checked as attention() checks its arguments."""
    b, t, hq, d = args.shape
    s = args.kv_len or t
    hkv = args.kv_heads or hq
    dtype = DTYPES[args.dtype]
    sds = jax.ShapeDtypeStruct
    bias = None if args.bias is None else sds(args.bias, jnp.float32)
    mask = None if args.mask is None else sds(args.mask, jnp.bool_)
    rng = jax.random.key(0) if args.dropout else None
    call = validation.validate(
        sds((b, t, hq, d), dtype), sds((b, s, hkv, d), dtype),
        sds((b, s, hkv, args.dv or d), dtype), bias, mask, scale=None, is_causal=args.causal,
        dropout_rate=args.dropout, dropout_rng=rng, return_lse=False,
        local_window_size=args.window,
        implementation=args.implementation, interpret=False)
    return call.problem


def _describe(p: Problem) -> str:
    extras = ["causal" if p.causal else "not causal",
              *([f"window {p.window}"] if p.window is not None else []),
              f"bias {p.bias_shape}" if p.bias_shape else "no bias",
              f"mask {p.mask_shape}" if p.mask_shape else "no mask",
              f"dropout {p.dropout_rate:g}" if p.dropout_rate else "no dropout"]
    return (f"B={p.batch} T={p.seq_q} S={p.seq_k} Hq={p.heads_q} Hkv={p.heads_kv} "
            f"D={p.head_dim} Dv={p.head_dim_v} {p.dtype_name}, " + ", ".join(extras))


def _settings_text(settings) -> str:
    return " ".join(f"{k}={v}" for k, v in settings if k != "num_ctas")


def _tier_lines(tier, plan, direction: str) -> list[str]:
    """The launch configs `tier` runs `direction` of `plan` with, each with why, and the
    tier's own lines."""
    lines = [f"    {tier.summary}; no launch configs"] if tier.differentiated_by_jax else []
    launched = tier.runs(plan, direction)
    for kernel in plan.kernels:
        if kernel.direction == direction and kernel.kernel in launched:
            lines += [f"    {kernel.kernel}: {_settings_text(kernel.settings)}",
                      f"      <- {kernel.why}"]
    return lines + [f"    {line}" for line in tier.describe(plan, direction)]


def call_lines(problem: Problem, implementation: str | None, device_name: str | None,
               capability: str | None, deterministic: bool | None = None) -> list[str]:
    """What a call of `problem` runs (`tuning.dispatch.explain`): each direction's tier with
    why, its kernels' configs with why, the tiers passed over, and the backward's order."""
    device = (dispatch.Device.current() if device_name is None else
              dispatch.Device(nvidia_gpu=True, name=device_name, compute_capability=capability))
    explained = dispatch.explain(problem, implementation, device=device,
                                 deterministic=deterministic)
    plan = explained.plan
    where = (f"on an NVIDIA GPU ({device.name})" if device.nvidia_gpu else
             "without an NVIDIA GPU")
    lines = [f"problem: {_describe(problem)}", f"implementation={implementation!r} {where}"]
    for direction in dispatch.DIRECTIONS:
        choice = explained.choice(direction)
        lines.append(f"  {direction}: {choice.tier} <- {choice.why}")
        lines += _tier_lines(tiers.BY_NAME[choice.tier], plan, direction)
    if explained.vjp_forward is not None:
        choice = explained.vjp_forward
        lines.append(f"  forward when differentiated: {choice.tier} <- {choice.why}")
        lines += _tier_lines(tiers.BY_NAME[choice.tier], plan.for_vjp(), "forward")
    for name, why in explained.passed_over:
        lines.append(f"  passed over: {name} ({why})")
    backward = tiers.BY_NAME[explained.backward.tier]
    order = ("may add in a varying order" if not backward.ordered_backward else
             "runs XLA's operations, bitwise reproducible as XLA makes them "
             "(--xla_gpu_deterministic_ops)" if backward.xla_backward else
             "adds in one order: reruns are bitwise equal")
    lines.append(f"  backward order: {backward.name} {order} ({explained.determinism}; "
                 f"{'required' if plan.deterministic else 'not required'})")
    if not device.nvidia_gpu:
        lines.append("  (pass --device-name to see what a given GPU would run)")
    return lines


def _wrap(line: str) -> list[str]:
    """`line` folded at WIDTH columns, continuation lines indented under its first word; a
    word longer than that (a deep folder path) is folded after one of its slashes."""
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    out, rest = [], line
    while len(rest) > WIDTH:
        cut = rest.rfind(" ", len(indent) + 1, WIDTH)
        if cut > len(indent):
            out.append(rest[:cut])
            rest = indent + rest[cut + 1:]
            continue
        cut = rest.rfind("/", len(indent) + 1, WIDTH)
        if cut <= len(indent):
            break
        out.append(rest[:cut + 1])
        rest = indent + rest[cut + 1:]
    return out + [rest]


def _context_lines(parser, args, problem: Problem, deterministic: bool | None) -> list[str]:
    """`context_local.explain`'s lines for --context-parallel (JAX's device only: the
    blocks' plans are the dispatcher's for it)."""
    if args.device_name is not None:
        parser.error("--context-parallel answers for JAX's device: drop --device-name")
    if args.context_parallel < 1:
        parser.error(f"--context-parallel must be at least 1; got {args.context_parallel}")
    try:
        return context_local.explain(problem, args.context_parallel, args.context_layout,
                                     args.context_strategy, implementation=args.implementation,
                                     deterministic=deterministic)
    except ValueError as err:
        parser.error(str(err))


def _tuned_file(device_name: str | None, capability: str | None) -> str | None:
    if device_name is None and default_backend_is_nvidia_gpu():
        device_name, capability = tuning.current_device()
    found = None if device_name is None else find_config_file(device_name, capability)
    return None if found is None else str(found.path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compute_capability and not args.device_name:
        parser.error("--compute-capability goes with --device-name")
    lines = machine_lines(args.device_name, args.compute_capability)
    if args.shape is not None:
        try:
            problem = problem_of(args)
        except (TypeError, ValueError) as err:
            parser.error(str(err))
        deterministic = None if args.deterministic is None else args.deterministic == "true"
        try:
            calls = call_lines(problem, args.implementation, args.device_name,
                               args.compute_capability, deterministic)
        except ValueError as err:  # an implementation this machine cannot run, say
            parser.error(str(err))
        path = _tuned_file(args.device_name, args.compute_capability)
        lines += [line.replace(path, "the tuned file") if path else line for line in calls]
        if args.context_parallel is not None:
            lines += _context_lines(parser, args, problem, deterministic)
    elif any(v is not None for v in (args.kv_heads, args.kv_len, args.dv, args.bias,
                                     args.mask, args.implementation, args.deterministic,
                                     args.context_parallel, args.context_strategy)):
        parser.error("--kv-heads, --kv-len, --dv, --bias, --mask, --implementation, "
                     "--deterministic and --context-* describe a call: give its --shape too")
    for line in lines:
        print("\n".join(_wrap(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
