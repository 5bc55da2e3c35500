"""A decode loop over a paged KV cache, with `ffpa_jax.update_kv_pages` and
`ffpa_jax.paged_attention`.

Sequences of different lengths share one pool of pages. A small host-side allocator hands
each sequence a free page whenever it grows past its last one and writes it in the
sequence's block-table row, as serving engines do; the jitted step writes each new token's
K and V into its page (the pools donated, so XLA updates them in place) and attends over
the sequence's pages. The "model" is one attention layer with random weights whose output
feeds the next step's input: enough to show the data flow, not a language model.

With --check (the default), every step's output is compared with `ffpa_jax.attention` over
the same keys kept contiguous.

    python examples/paged_decode.py                 # 24 steps, 4 sequences; fine on a CPU
    python examples/paged_decode.py --help          # every option
    python examples/paged_decode.py --interpret --steps 4
                                                    # the Pallas kernels in the interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys

if __name__ == "__main__":
    # Run as a script from a checkout: use this checkout's ffpa_jax.
    _ROOT = pathlib.Path(__file__).resolve().parents[1]
    if (_ROOT / "ffpa_jax").is_dir():
        sys.path.insert(0, str(_ROOT))

import jax
import jax.numpy as jnp
import numpy as np

import ffpa_jax


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
    batch: int = 4
    heads_q: int = 8
    heads_kv: int = 2
    head_dim: int = 64
    page_size: int = 16
    pool_pages: int = 64
    max_pages_per_seq: int = 16
    dtype: str = "float32"

    @property
    def width(self) -> int:
        return self.heads_q * self.head_dim


class PageAllocator:
    """Host-side bookkeeping: a free list of pool pages and each sequence's table row.

    `snapshot` hands the device copies: JAX may read a NumPy array without copying it, after
    the call has returned (dispatch is asynchronous), so arrays that this object changes in
    place must never be passed to JAX directly."""

    def __init__(self, setup: DecodeSetup):
        self.setup = setup
        self.free = list(range(setup.pool_pages))[::-1]
        # Unused entries point at page 0: never read, since they lie past the length.
        self.table = np.zeros((setup.batch, setup.max_pages_per_seq), np.int32)
        self.lengths = np.zeros(setup.batch, np.int32)

    def reserve(self, b: int, new_tokens: int) -> None:
        """Give sequence b pages for `new_tokens` more tokens."""
        page = self.setup.page_size
        have = -(-int(self.lengths[b]) // page)
        need = -(-(int(self.lengths[b]) + new_tokens) // page)
        if need > self.setup.max_pages_per_seq:
            raise RuntimeError(f"sequence {b} would need {need} pages; its table row holds "
                               f"{self.setup.max_pages_per_seq}")
        for j in range(have, need):
            if not self.free:
                raise RuntimeError("the page pool is exhausted")
            self.table[b, j] = self.free.pop()

    def snapshot(self, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """Copies of (table rows, lengths) that nothing changes later."""
        return self.table[rows].copy(), self.lengths[rows].copy()


def init_weights(setup: DecodeSetup, key) -> dict:
    kq, kk, kv, ko = jax.random.split(key, 4)
    d_in, hd = setup.width, setup.head_dim
    dense = lambda k, n_out: jax.random.normal(k, (d_in, n_out), jnp.float32) / np.sqrt(d_in)
    return dict(q=dense(kq, setup.heads_q * hd), k=dense(kk, setup.heads_kv * hd),
                v=dense(kv, setup.heads_kv * hd), o=dense(ko, d_in))


def project(setup: DecodeSetup, weights: dict, x):
    """x [B, T, width] -> q [B, T, Hq, D], k and v [B, T, Hkv, D]."""
    b, t, _ = x.shape
    dtype = jnp.dtype(setup.dtype)
    shape = lambda name, h: (x @ weights[name]).reshape(b, t, h, setup.head_dim).astype(dtype)
    return shape("q", setup.heads_q), shape("k", setup.heads_kv), shape("v", setup.heads_kv)


@functools.partial(jax.jit, static_argnames=("setup", "implementation", "interpret"),
                   donate_argnums=(2, 3))
def decode_step(weights, x, k_pages, v_pages, table, lengths, *, setup: DecodeSetup,
                implementation=None, interpret=False):
    """One token per sequence: write its K/V at position `lengths`, attend over
    lengths + 1 keys. Returns (attention output [B, Hq, D], next input, pools)."""
    q, k, v = project(setup, weights, x[:, None])
    k_pages, v_pages = ffpa_jax.update_kv_pages(k_pages, v_pages, k, v, table, lengths)
    out = ffpa_jax.paged_attention(q[:, 0], k_pages, v_pages, table, lengths + 1,
                                   implementation=implementation, interpret=interpret)
    x_next = jnp.tanh(out.reshape(x.shape[0], -1).astype(jnp.float32) @ weights["o"])
    return out, x_next, k_pages, v_pages


def run(setup: DecodeSetup, *, steps: int, prompt_lengths: list[int], seed: int = 0,
        check: bool = True, implementation=None, interpret: bool = False) -> float:
    """Prefill each prompt, decode `steps` tokens; returns the largest difference from
    contiguous attention over the same keys (0.0 without --check)."""
    key_w, key_x = jax.random.split(jax.random.key(seed))
    weights = init_weights(setup, key_w)
    dtype = jnp.dtype(setup.dtype)
    pool = (setup.heads_kv, setup.pool_pages, setup.page_size, setup.head_dim)
    k_pages, v_pages = jnp.zeros(pool, dtype), jnp.zeros(pool, dtype)
    alloc = PageAllocator(setup)
    # Contiguous copies of every sequence's keys, only to check the paged results.
    cache_k = [np.zeros((0, setup.heads_kv, setup.head_dim), np.float32)] * setup.batch
    cache_v = list(cache_k)

    # Prefill: each prompt's K/V written in one update of its own length.
    prompts = jax.random.normal(key_x, (setup.batch, max(prompt_lengths), setup.width))
    for b, n in enumerate(prompt_lengths):
        alloc.reserve(b, n)
        _, k, v = project(setup, weights, prompts[b:b + 1, :n])
        k_pages, v_pages = ffpa_jax.update_kv_pages(k_pages, v_pages, k, v,
                                                    alloc.snapshot(slice(b, b + 1))[0],
                                                    np.zeros(1, np.int32))
        alloc.lengths[b] = n
        cache_k[b], cache_v[b] = np.asarray(k[0], np.float32), np.asarray(v[0], np.float32)

    x = prompts[jnp.arange(setup.batch), jnp.asarray(prompt_lengths) - 1]
    worst = 0.0
    for step in range(steps):
        for b in range(setup.batch):
            alloc.reserve(b, 1)
        q, k, v = project(setup, weights, x[:, None])  # for the check only
        out, x, k_pages, v_pages = decode_step(
            weights, x, k_pages, v_pages, *alloc.snapshot(),
            setup=setup, implementation=implementation, interpret=interpret)
        alloc.lengths += 1
        if check:
            for b in range(setup.batch):
                cache_k[b] = np.concatenate([cache_k[b], np.asarray(k[b], np.float32)])
                cache_v[b] = np.concatenate([cache_v[b], np.asarray(v[b], np.float32)])
                want = ffpa_jax.attention(q[b], jnp.asarray(cache_k[b], dtype),
                                          jnp.asarray(cache_v[b], dtype), implementation="xla")
                worst = max(worst, float(jnp.max(jnp.abs(out[b].astype(jnp.float32)
                                                         - want[0].astype(jnp.float32)))))
        print(f"step {step:3d}  lengths {alloc.lengths.tolist()}  "
              f"pages in use {setup.pool_pages - len(alloc.free)}", flush=True)
    return worst


def implementation_name(implementation: str | None, interpret: bool) -> str:
    """What `ffpa_jax.paged_attention(..., implementation=, interpret=)` runs, in words: the
    dispatcher's rule it applies itself (`tuning.dispatch.paged_decode_kernels`)."""
    from tuning import dispatch
    if not dispatch.paged_decode_kernels(implementation, interpret=interpret):
        return "xla (the pages gathered into a contiguous cache, then plain JAX)"
    where = "in Pallas' interpreter" if interpret else f"on {jax.devices()[0].device_kind}"
    return f"pallas (the split-KV decode kernels reading the pages by index, {where})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/paged_decode.py",
        description="A decode loop over a paged KV cache (ffpa_jax.update_kv_pages and "
                    "ffpa_jax.paged_attention), checked against contiguous attention.")
    parser.add_argument("--steps", type=int, default=24,
                        help="tokens to decode (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4,
                        help="sequences (default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=16,
                        help="keys per page (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32", help="K, V and query dtype (default: %(default)s)")
    parser.add_argument("--implementation", choices=["auto", "pallas", "xla"], default="auto",
                        help="auto: the Pallas decode kernels on an NVIDIA GPU (or with "
                             "--interpret), XLA elsewhere (default: %(default)s)")
    parser.add_argument("--interpret", action="store_true",
                        help="run the Pallas kernels in Pallas' interpreter (CPU; slow)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the comparison with contiguous attention")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and prompts (default: %(default)s)")
    args = parser.parse_args(argv)
    implementation = None if args.implementation == "auto" else args.implementation
    for name in ("steps", "batch", "page_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    prompt_lengths = [5 + 11 * b for b in range(args.batch)]
    longest = max(prompt_lengths) + args.steps
    per_seq = -(-longest // args.page_size)
    setup = DecodeSetup(batch=args.batch, page_size=args.page_size,
                        max_pages_per_seq=per_seq, pool_pages=args.batch * per_seq + 2,
                        dtype=args.dtype)
    try:
        ran = implementation_name(implementation, args.interpret)
    except ValueError as exc:  # e.g. --implementation pallas without a GPU or --interpret
        parser.error(str(exc))
    print(f"paged_attention runs on: {ran}", flush=True)
    worst = run(setup, steps=args.steps, prompt_lengths=prompt_lengths, seed=args.seed,
                check=not args.no_check, implementation=implementation,
                interpret=args.interpret)
    if not args.no_check:
        tolerance = 1e-5 if args.dtype == "float32" else 2e-2
        print(f"largest difference from contiguous attention: {worst:.3e} "
              f"(tolerance {tolerance:g})")
        if not worst <= tolerance:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
