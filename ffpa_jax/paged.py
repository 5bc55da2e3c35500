"""Paged KV-cache decode: `paged_attention` and `update_kv_pages`.

The page layout is JAX's own paged attention's (`jax.experimental.pallas.ops.gpu` and
`...ops.tpu.paged_attention`): K and V live in a pool of pages [Hkv, P, page, D] shared by
all sequences, and a block table row per sequence names its pages in order, so key j of
sequence b is row j % page of page block_tables[b, j // page]. A serving loop appends each
new token's K/V with `update_kv_pages` and attends with `paged_attention`; the decode
kernels read the pages by index, and the query heads of a GQA group share each page read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import tuning
import tuning.dispatch
from ffpa_jax import validation
from ffpa_jax.reference import mha_reference
from pallas_kernels import PagedKV, paged_decode_attention


def paged_attention(query: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, lengths: jax.Array, *,
                    scale: float | None = None,
                    local_window_size: int | tuple[int, int] | None = None,
                    logits_soft_cap: float | None = None, sinks: jax.Array | None = None,
                    return_lse: bool = False, implementation: str | None = None,
                    interpret: bool = False):
    """Attention of one new query token per sequence over its paged KV cache.

    Args:
      query: [B, Hq, D], the newest token of each sequence.
      k_pages: [Hkv, P, page, D], the pool of key pages; Hq must be a multiple of Hkv.
      v_pages: [Hkv, P, page, Dv].
      block_tables: int32 [B, pages_per_seq]: the pages of sequence b, in order.
      lengths: int32 [B]: sequence b's keys are its first lengths[b] positions (the query
        is its last token, which `update_kv_pages` has already written). Table entries past
        a sequence's length are never read. A length of 0 gives output 0.
      scale: logit scale, default 1/sqrt(D).
      local_window_size: w or (left, right), as in `attention`, aligned to each sequence's
        own end: the query (position lengths[b] - 1) sees keys from lengths[b] - 1 - left.
      logits_soft_cap: c > 0: logits = c * tanh(logits / c).
      sinks: float [Hq]: a per-head logit in each row's denominator, without a value.
      return_lse: also return the log-sum-exp of the logits, [B, Hq] float32.
      implementation: None (the fused tier's paged decode kernels on an NVIDIA GPU, the
        dense tier elsewhere), or one of those two tiers' names ({names}; the dense tier
        gathers the pages into a contiguous cache first).
      interpret: run the Pallas kernels in Pallas' interpreter (CPU testing).

    Returns:
      out [B, Hq, Dv] in query's dtype, or (out, lse). Forward only: serving needs no
      gradient (train with `attention`).
    """
    call = validation.validate_paged(
        query, k_pages, v_pages, block_tables, lengths, scale=scale,
        local_window_size=local_window_size, logits_soft_cap=logits_soft_cap, sinks=sinks,
        return_lse=return_lse, implementation=implementation, interpret=interpret)
    problem = call.problem
    q = query[:, None]  # [B, 1, Hq, D]: the decode kernels' layout
    tables = jnp.asarray(block_tables).astype(jnp.int32)
    lens = jnp.asarray(lengths).astype(jnp.int32)
    sink_logits = None if sinks is None else jnp.asarray(sinks).astype(jnp.float32)
    # The paged decode kernels on an NVIDIA GPU or when interpreting (an explicit fused tier
    # elsewhere is refused there), the dense path otherwise.
    if not tuning.dispatch.paged_decode_kernels(implementation, interpret=interpret):
        out, lse = _paged_reference(q, k_pages, v_pages, tables, lens, problem, sink_logits)
    else:
        config = tuning.dispatch.paged_decode_configs(problem, interpret=interpret)
        out, lse = paged_decode_attention(
            problem, config, q, PagedKV(k_pages, v_pages, tables, lens),
            num_splits=config.num_splits, interpret=interpret, sinks=sink_logits)
    out, lse = out[:, 0], lse[:, :, 0]
    return (out, lse) if return_lse else out


paged_attention.__doc__ = paged_attention.__doc__.replace(
    "{names}", ", ".join(repr(n) for n in validation.PAGED_IMPLEMENTATIONS if n))


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """The contiguous cache [B, pages_per_seq · page, Hkv, D] of a page pool
    [Hkv, P, page, D] under `block_tables` [B, pages_per_seq] (a copy: for the XLA path,
    tests and users who want the dense cache back)."""
    hkv, _, page, d = pages.shape
    batch, per_seq = block_tables.shape
    picked = pages[:, block_tables]  # [Hkv, B, pages_per_seq, page, D]
    return picked.transpose(1, 2, 3, 0, 4).reshape(batch, per_seq * page, hkv, d)


# Jitted: called eagerly, its dozen small ops would each compile on the first call.
@functools.partial(jax.jit, static_argnames=("problem",))
def _paged_reference(q, k_pages, v_pages, tables, lengths, problem, sinks):
    """The XLA path: the pages gathered into a contiguous cache, then the reference with
    each sequence's keys [lengths - 1 - left, lengths) visible (O(B·S), no [T, S] mask)."""
    k, v = gather_pages(k_pages, tables), gather_pages(v_pages, tables)
    keys = jnp.arange(k.shape[1])
    visible = keys[None, :] < lengths[:, None]
    if problem.window is not None:
        visible &= keys[None, :] >= lengths[:, None] - 1 - problem.window[0]
    return mha_reference(q, k, v, mask=visible[:, None, None, :], scale=problem.scale,
                         softcap=problem.softcap, sinks=sinks)


def update_kv_pages(k_pages: jax.Array, v_pages: jax.Array, key: jax.Array,
                    value: jax.Array, block_tables: jax.Array, positions: jax.Array):
    """Write new tokens' K and V into their pages: returns (k_pages, v_pages).

    Args:
      k_pages, v_pages: the pools [Hkv, P, page, D] and [Hkv, P, page, Dv].
      key: [B, T, Hkv, D] (or [B, Hkv, D] for one token): sequence b's tokens at positions
        positions[b] .. positions[b] + T - 1.
      value: [B, T, Hkv, Dv] (or [B, Hkv, Dv]).
      block_tables: int32 [B, pages_per_seq], as in `paged_attention`.
      positions: int32 [B]: where each sequence's first new token goes (its length before
        the update). A position past the table's pages is dropped, not wrapped.

    A functional update (`.at[].set`): under `jax.jit` with the pools donated
    (`donate_argnums`), XLA writes them in place.
    """
    key, value = validation.validate_kv_update(k_pages, v_pages, key, value, block_tables,
                                               positions)
    page = k_pages.shape[2]
    batch, t = key.shape[:2]
    tables = jnp.asarray(block_tables).astype(jnp.int32)
    pos = jnp.asarray(positions).astype(jnp.int32)[:, None] + jnp.arange(t)[None, :]  # [B, T]
    slot = jnp.clip(pos // page, 0, tables.shape[1] - 1)
    pages = jnp.take_along_axis(tables, slot, axis=1)
    # Positions past the table go to an index past the pool, which mode="drop" skips.
    in_table = (pos >= 0) & (pos < tables.shape[1] * page)
    pages = jnp.where(in_table, pages, k_pages.shape[1])
    rows = pos % page
    k_new = key.transpose(2, 0, 1, 3).astype(k_pages.dtype)  # [Hkv, B, T, D]
    v_new = value.transpose(2, 0, 1, 3).astype(v_pages.dtype)
    k_pages = k_pages.at[:, pages, rows].set(k_new, mode="drop")
    v_pages = v_pages.at[:, pages, rows].set(v_new, mode="drop")
    return k_pages, v_pages
