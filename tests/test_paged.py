"""Paged KV decode: `ffpa_jax.paged_attention` and `update_kv_pages`.

The caches are built contiguous first ([B, S, Hkv, D], fresh random values), then
scattered into a shuffled page pool with numpy; the float64 reference attends over the
contiguous cache with each sequence's keys below its length visible (and, with a window,
those from length - 1 - left on). The tolerance rule is the suite's (attn_testing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import assert_lse_matches, assert_matches_reference
from conftest import interpret_flag
from ffpa_jax.reference import mha_reference


@dataclasses.dataclass(frozen=True)
class PagedCase:
    b: int = 3
    hq: int = 4
    hkv: int = 2
    d: int = 64
    dv: int | None = None
    page: int = 16
    per_seq: int = 4  # pages per sequence in the table
    lengths: tuple[int, ...] = (1, 37, 64)
    dtype: str = "bfloat16"
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    spare_pages: int = 3  # pool pages no sequence uses

    @property
    def s(self) -> int:
        return self.page * self.per_seq

    @property
    def head_dim_v(self) -> int:
        return self.d if self.dv is None else self.dv


def make_paged(case: PagedCase, seed: int = 0):
    """q [B, Hq, D], the contiguous caches, their page pools, the table and the lengths."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    q = rng.standard_normal((case.b, case.hq, case.d))
    k = rng.standard_normal((case.b, case.s, case.hkv, case.d))
    v = rng.standard_normal((case.b, case.s, case.hkv, case.head_dim_v))
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32).astype(dtype)) for x in (q, k, v))
    n_pages = case.b * case.per_seq + case.spare_pages
    table = rng.permutation(n_pages)[:case.b * case.per_seq].reshape(case.b, case.per_seq)
    # The pool starts with values no sequence reads: they must not reach any output.
    k_pages = np.array(jnp.asarray(rng.standard_normal((case.hkv, n_pages, case.page, case.d))
                                     * 100, jnp.float32).astype(dtype))
    v_pages = np.array(jnp.asarray(rng.standard_normal((case.hkv, n_pages, case.page,
                                                          case.head_dim_v)) * 100,
                                     jnp.float32).astype(dtype))
    for b in range(case.b):
        for j in range(case.lengths[b]):
            page, row = table[b, j // case.page], j % case.page
            k_pages[:, page, row] = k[b, j]
            v_pages[:, page, row] = v[b, j]
    sinks = rng.standard_normal(case.hq).astype(np.float32) if case.sinks else None
    return dict(q=q, k=k, v=v, k_pages=k_pages, v_pages=v_pages,
                table=table.astype(np.int32), lengths=np.asarray(case.lengths, np.int32),
                sinks=sinks)


def reference(case: PagedCase, data, *, float64: bool):
    """(out [B, Hq, Dv], lse [B, Hq]) over the contiguous caches."""
    keys = np.arange(case.s)
    lengths = data["lengths"][:, None]
    visible = keys[None, :] < lengths
    if case.window is not None:
        visible &= keys[None, :] >= lengths - 1 - case.window[0]
    conv = (lambda x: jnp.asarray(np.asarray(x, np.float64))) if float64 else jnp.asarray
    sinks = None if data["sinks"] is None else conv(data["sinks"])
    out, lse = mha_reference(conv(data["q"])[:, None], conv(data["k"]), conv(data["v"]),
                             mask=jnp.asarray(visible)[:, None, None, :],
                             scale=1.0 / np.sqrt(case.d), softcap=case.softcap, sinks=sinks)
    return np.asarray(out[:, 0].astype(jnp.float32 if not float64 else jnp.float64)), \
        np.asarray(lse[:, :, 0])


def run_paged(case: PagedCase, data, **kw):
    extra = dict(local_window_size=case.window, logits_soft_cap=case.softcap,
                 sinks=None if data["sinks"] is None else jnp.asarray(data["sinks"]))
    fn = jax.jit(lambda q, kp, vp, t, n: ffpa_jax.paged_attention(
        q, kp, vp, t, n, return_lse=True, **extra, **kw))
    return fn(*(jnp.asarray(data[n]) for n in ("q", "k_pages", "v_pages", "table", "lengths")))


def check_paged(case: PagedCase, **kw):
    data = make_paged(case)
    out, lse = run_paged(case, data, **kw)
    assert out.shape == (case.b, case.hq, case.head_dim_v)
    assert out.dtype == jnp.dtype(case.dtype)
    with jax.enable_x64(True):
        ref_out, ref_lse = reference(case, data, float64=True)
    xla_out, xla_lse = reference(case, data, float64=False)
    assert_matches_reference("out", out, ref_out, xla_out, case.dtype)
    assert_lse_matches(lse, ref_lse, xla_lse)
    return out, lse


CASES = [
    PagedCase(),  # page 16, 4 pages per sequence; a 64-key tile spans 4 pages
    PagedCase(b=2, hq=8, hkv=1, d=111, dv=40, page=64, per_seq=3, lengths=(113, 192)),
    PagedCase(b=2, hq=2, hkv=2, d=40, dv=59, page=5, per_seq=41, lengths=(203, 0),
              dtype="float16"),
    PagedCase(b=1, hq=8, hkv=2, d=128, page=16, per_seq=64, lengths=(1023,),
              window=(100, 0), softcap=20.0, sinks=True),
    PagedCase(b=2, hq=4, hkv=1, d=320, page=32, per_seq=8, lengths=(256, 77), sinks=True),
    PagedCase(b=1, hq=2, hkv=1, d=1000, dv=77, page=16, per_seq=4, lengths=(50,),
              dtype="float32"),
    PagedCase(b=2, hq=4, hkv=4, d=64, page=1, per_seq=130, lengths=(130, 129),
              window=(7, 3)),
]


def _case_id(c: PagedCase) -> str:
    return (f"B{c.b}-H{c.hq}.{c.hkv}-D{c.d}.{c.head_dim_v}-page{c.page}x{c.per_seq}-{c.dtype}"
            + ("-window" if c.window else "") + ("-cap" if c.softcap else "")
            + ("-sinks" if c.sinks else ""))


# The plain first case with `-m slow`: the fourth takes 16-key pages with a window, a soft
# cap and sinks.
@pytest.mark.parametrize("case", [pytest.param(CASES[0], marks=pytest.mark.slow), *CASES[1:]],
                         ids=_case_id)
def test_paged_kernels_match_reference(case, kernel_mode):
    check_paged(case, implementation="pallas", interpret=interpret_flag(kernel_mode))


@pytest.mark.parametrize("case", CASES[:4], ids=_case_id)
def test_paged_xla_path_matches_reference(case):
    check_paged(case, implementation="xla")


def test_empty_sequence_gives_zero_and_no_lse(kernel_mode):
    case = PagedCase(b=2, lengths=(0, 5))
    out, lse = check_paged(case, implementation="pallas", interpret=interpret_flag(kernel_mode))
    assert np.all(np.asarray(out[0], np.float32) == 0.0)
    assert np.all(np.asarray(lse[0]) == -np.inf)


def test_paged_default_runs_xla_without_gpu():
    """implementation=None: the decode kernels on an NVIDIA GPU, the XLA path elsewhere
    (the same results either way)."""
    case = PagedCase(b=2, lengths=(20, 64))
    check_paged(case)


def test_update_kv_pages_writes_each_token_where_the_table_says():
    rng = np.random.default_rng(1)
    hkv, n_pages, page, d, dv = 2, 9, 4, 8, 6
    table = np.asarray([[3, 7, 0], [5, 1, 8]], np.int32)
    k_pages = jnp.asarray(rng.standard_normal((hkv, n_pages, page, d)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((hkv, n_pages, page, dv)), jnp.float32)
    before_k, before_v = np.asarray(k_pages), np.asarray(v_pages)
    positions = np.asarray([2, 5], np.int32)
    key = rng.standard_normal((2, 3, hkv, d)).astype(np.float32)  # 3 tokens each
    value = rng.standard_normal((2, 3, hkv, dv)).astype(np.float32)
    k_new, v_new = jax.jit(ffpa_jax.update_kv_pages)(k_pages, v_pages, key, value, table,
                                                     positions)
    expect_k, expect_v = before_k.copy(), before_v.copy()
    for b in range(2):
        for i in range(3):
            j = positions[b] + i
            expect_k[:, table[b, j // page], j % page] = key[b, i]
            expect_v[:, table[b, j // page], j % page] = value[b, i]
    np.testing.assert_array_equal(np.asarray(k_new), expect_k)
    np.testing.assert_array_equal(np.asarray(v_new), expect_v)
    # One token per sequence as [B, Hkv, D].
    k_one, _ = ffpa_jax.update_kv_pages(k_pages, v_pages, key[:, 0], value[:, 0], table,
                                        positions)
    np.testing.assert_array_equal(np.asarray(k_one)[:, table[1, 1], 1], key[1, 0])


def test_decode_loop_matches_attention_on_the_contiguous_cache(kernel_mode):
    """A prompt written in one update, then tokens one at a time: each step's paged
    attention equals `attention` over the same keys kept contiguous."""
    rng = np.random.default_rng(2)
    b, hq, hkv, d, page, per_seq = 2, 4, 2, 32, 8, 6
    n_pages = b * per_seq
    table = jnp.asarray(rng.permutation(n_pages).reshape(b, per_seq), jnp.int32)
    k_pages = jnp.zeros((hkv, n_pages, page, d), jnp.float32)
    v_pages = jnp.zeros((hkv, n_pages, page, d), jnp.float32)
    prompt = 13
    keys = jnp.asarray(rng.standard_normal((b, prompt + 3, hkv, d)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, prompt + 3, hkv, d)), jnp.float32)
    k_pages, v_pages = ffpa_jax.update_kv_pages(k_pages, v_pages, keys[:, :prompt],
                                                values[:, :prompt], table,
                                                jnp.zeros((b,), jnp.int32))
    interpret = interpret_flag(kernel_mode)
    for step in range(prompt, prompt + 3):
        k_pages, v_pages = ffpa_jax.update_kv_pages(k_pages, v_pages, keys[:, step],
                                                    values[:, step], table,
                                                    jnp.full((b,), step, jnp.int32))
        q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
        got = ffpa_jax.paged_attention(q, k_pages, v_pages, table,
                                       jnp.full((b,), step + 1, jnp.int32),
                                       implementation="pallas", interpret=interpret)
        want = ffpa_jax.attention(q[:, None], keys[:, :step + 1], values[:, :step + 1],
                                  implementation="xla")[:, 0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_gather_pages_inverts_the_table():
    data = make_paged(PagedCase(lengths=(64, 64, 64)))
    dense = ffpa_jax.gather_pages(jnp.asarray(data["k_pages"]), jnp.asarray(data["table"]))
    np.testing.assert_array_equal(np.asarray(dense), data["k"])


# ------------------------------------------------------------------ bad input

def _args(**change):
    base = dict(query=jnp.ones((2, 4, 8), jnp.bfloat16),
                k_pages=jnp.ones((2, 5, 4, 8), jnp.bfloat16),
                v_pages=jnp.ones((2, 5, 4, 8), jnp.bfloat16),
                block_tables=jnp.asarray([[0, 1], [2, 3]], jnp.int32),
                lengths=jnp.asarray([3, 8], jnp.int32))
    base.update(change)
    return base


@pytest.mark.parametrize("change,error,words", [
    (dict(query=jnp.ones((2, 1, 4, 8), jnp.bfloat16)), ValueError, "query must be [B, Hq, D]"),
    (dict(k_pages=jnp.ones((5, 4, 8), jnp.bfloat16)), ValueError, "k_pages must be [Hkv, P"),
    (dict(v_pages=jnp.ones((2, 6, 4, 8), jnp.bfloat16)), ValueError, "must agree on [Hkv, P"),
    (dict(k_pages=jnp.ones((3, 5, 4, 8), jnp.bfloat16),
          v_pages=jnp.ones((3, 5, 4, 8), jnp.bfloat16)), ValueError, "multiple of"),
    (dict(k_pages=jnp.ones((2, 5, 4, 8), jnp.float32)), TypeError, "same dtype"),
    (dict(block_tables=jnp.asarray([[0, 1]], jnp.int32)), ValueError, "block_tables must be"),
    (dict(block_tables=jnp.asarray([[0., 1.], [2., 3.]])), TypeError, "block_tables must be int32"),
    (dict(block_tables=jnp.asarray([[0, 1], [5, 3]], jnp.int32)), ValueError,
     "block_tables[1, 0] = 5 is not a page"),
    (dict(lengths=jnp.asarray([3, 9], jnp.int32)), ValueError, "lengths[1] = 9"),
    (dict(lengths=jnp.asarray([3], jnp.int32)), ValueError, "lengths must have shape"),
])
def test_bad_paged_input_names_the_argument(change, error, words):
    with pytest.raises(error) as info:
        ffpa_jax.paged_attention(**_args(**change))
    assert words in str(info.value)


def test_table_entries_past_a_length_are_not_checked():
    # Sequence 0 uses one page (length 3): its second entry may be anything.
    out = ffpa_jax.paged_attention(**_args(block_tables=jnp.asarray([[0, -1], [2, 3]],
                                                                    jnp.int32)))
    assert out.shape == (2, 4, 8)


def test_paged_options_are_checked():
    with pytest.raises(ValueError, match="implementation must be one of None, 'pallas' or 'xla'"):
        ffpa_jax.paged_attention(**_args(), implementation="chunked")
    with pytest.raises(ValueError, match="logits_soft_cap"):
        ffpa_jax.paged_attention(**_args(), logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match="sinks must have shape"):
        ffpa_jax.paged_attention(**_args(), sinks=jnp.ones((3,)))


def test_bad_update_names_the_argument():
    kp = jnp.zeros((2, 5, 4, 8))
    table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    with pytest.raises(ValueError, match=r"positions\[1\] = 7 with T = 2"):
        ffpa_jax.update_kv_pages(kp, kp, jnp.ones((2, 2, 2, 8)), jnp.ones((2, 2, 2, 8)), table,
                                 jnp.asarray([0, 7], jnp.int32))
    with pytest.raises(ValueError, match="key must be"):
        ffpa_jax.update_kv_pages(kp, kp, jnp.ones((2, 2, 3, 8)), jnp.ones((2, 2, 3, 8)), table,
                                 jnp.asarray([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="block_tables"):
        ffpa_jax.update_kv_pages(kp, kp, jnp.ones((2, 1, 2, 8)), jnp.ones((2, 1, 2, 8)),
                                 jnp.asarray([[0, 9], [2, 3]], jnp.int32),
                                 jnp.asarray([4, 1], jnp.int32))


# ------------------------------------------------------------------ CUDA lowering

@pytest.mark.parametrize("d,page,window", [(128, 16, None), (128, 64, (256, 0)),
                                           (512, 16, None), (1024, 32, (64, 0))])
def test_paged_decode_lowers_for_cuda(d, page, window):
    from pallas_kernels import DecodeConfig, PagedKV, Problem, paged_decode_attention
    from tuning import default_config
    config = DecodeConfig.from_tuned(default_config("decode_fwd_stage1", headdim=d, dtype="bf16"),
                                     default_config("decode_fwd_stage2", headdim=d,
                                                    dtype="bf16"))
    sd = jax.ShapeDtypeStruct
    args = (sd((8, 1, 32, d), jnp.bfloat16), sd((8, 700, page, d), jnp.bfloat16),
            sd((8, 700, page, d), jnp.bfloat16), sd((8, 8192 // page), jnp.int32),
            sd((8,), jnp.int32), sd((32,), jnp.float32))

    def f(q, kp, vp, table, lengths, sinks):
        problem = Problem(batch=8, seq_q=1, seq_k=8192, heads_q=32, heads_kv=8, head_dim=d,
                          head_dim_v=d, dtype=q.dtype, scale=0.1, window=window,
                          softcap=30.0, kv_lengths=True, sinks=True)
        return paged_decode_attention(problem, config, q, PagedKV(kp, vp, table, lengths),
                                      num_splits=8, sinks=sinks)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
