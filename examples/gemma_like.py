"""A decoder-only LM shaped like Gemma 4, trained on synthetic tokens with ffpa_jax's or
jax.nn's attention (Flax NNX, optax) and timed; then a check that both choices' first losses
agree within the project's tolerance rule.

What it takes from Gemma 4's published configuration (the 31B dense model):

- Layers: five sliding-window ("local") layers, then one global layer, repeated; the last
  layer is always global. Local: head dim 256, a window of 1024 tokens, half as many KV
  heads as query heads (31B: 32 / 16), RoPE base 10 000 over the whole head dim. Global:
  head dim 512, an eighth as many KV heads (31B: 32 / 4), keys and values from one
  projection (`attention_k_eq_v`), "proportional" RoPE, base 1 000 000, that rotates only
  the first quarter of the frequency pairs (`partial_rotary_factor` 0.25; the others get
  frequency 0).
- Attention: RMSNorm on queries and keys (learned scales) and on values (no scale), logit
  scale 1 (the norms stand in for 1/sqrt(D)), causal, no attention-logit soft cap (Gemma 4's
  config has none; Gemma 2 had 50). Gemma's `sliding_window` W shows a query the last W
  tokens, itself included: `local_window_size=(W - 1, 0)` in ffpa_jax's and jax.nn's terms.
- Blocks: RMSNorm before and after the attention and before and after the MLP, each result
  added to the residual; a gated MLP, gelu_tanh(x W_gate) * (x W_up) W_down, 4x as wide as
  the model; embeddings scaled by sqrt(d_model) and tied to the output; final logits
  soft-capped at 30.

Sources: the "gemma-4-31b" entry of src/transformers/models/gemma4/convert_gemma4_weights.py
in huggingface/transformers (hidden 5376, intermediate 4 x 5376, 60 layers,
["sliding_attention"] * 5 + ["full_attention"] repeated 10 times, 32 heads, 16 KV heads, 4
global KV heads, attention_k_eq_v, sliding_window 1024, final_logit_softcapping 30, RoPE
{full: proportional, theta 1e6, partial 0.25; sliding: default, theta 1e4}); its
configuration_gemma4.py (head_dim 256, global_head_dim 512, the last layer forced global);
`_compute_proportional_rope_parameters` in its modeling_rope_utils.py (the layout of the
partial rotation); mlx-lm's mlx_lm/models/gemma4_text.py (q/k/v norms, scale 1.0, values
from the raw key projection); a copy of the released 31B config.json
(huggingface.co/OpenMOSE/Gemma4-Text/blob/main/config.json: the same head dims, widths,
layer pattern, k_eq_v and soft cap).

Scaled down to one GPU (the "gpu" preset): 12 layers instead of 60 (two groups of five
local and one global), d_model 1024 (5376), MLP 4096 (21504), vocab 16384 (262144), 8 query
heads with 4 KV heads in local layers and 1 in global ones (the 31B's group sizes, 2 and 8).
Kept: the head dims, the window, the 5:1 pattern, the RoPE settings, the soft cap. Left
out: the per-layer output scalar, vision and audio, and what only other sizes have
(per-layer embeddings and shared KV caches of E2B/E4B, the experts of 26B-A4B). Assumed
(not published, as the checkpoints come trained): the initial values; the query and key
norms' scales start at D^-1/4, so that the first logits spread as 1/sqrt(D) attention's
do. The "ci" preset (the default without a GPU) keeps the head dims and the layer rule but
is tiny: 2 layers (one local, one global), d_model 64, vocab 128, window 16, 2 x 64 tokens,
float32.

Data: synthetic tokens from a fixed seed (no downloads): each row is a random half and
then its copy, so the loss can fall below log(vocab) only by attending further back than
the window, i.e. in the global layers. Next-token cross-entropy, optax Adam, a jitted step
that donates the parameters and optimizer state. bfloat16 parameters and activations on a
GPU, float32 on a CPU (the presets' `--dtype`).

`--attention ffpa` calls `ffpa_jax.attention(q, k, v, scale=1.0, is_causal=True,
local_window_size=(W - 1, 0) in local layers)` with the GQA keys and values as they are
(never repeated); `--attention jax.nn` calls `jax.nn.dot_product_attention` with the same
arguments and implementation="cudnn" where cuDNN takes the layer (a GPU, float16/bfloat16,
head dim <= 256 from Hopper on, 128 before: the local layers), "xla" otherwise (the global
layers, every layer on a CPU). The run prints what each layer kind ran, the compile time
and the first step apart, the median and mean time of the other steps (each waited for:
its loss read before the next is dispatched), tokens/s from that median, tokens/s with the
same steps dispatched back to back and waited for once (the device's pace, which a training
loop that reads its loss only now and then runs at), and the device's peak memory
(`memory_stats()`; n/a on a CPU).

`--devices N` trains with each sequence split along its length over the first N devices (a
1-D mesh "seq"; --seq-len a multiple of N), the parameters and optimizer state replicated:
context parallelism. ffpa_jax's attention runs in a `shard_map` over "seq" with
`context_axis="seq"` (each device computes its shard's rows; the model's other layers work
token by token, so they follow the tokens' sharding). ffpa_jax would also split query, key
and value sharded along the sequence under jit by itself, but through JAX's
custom_partitioning, which lowers the kernels of every layer again while XLA compiles
(docs/benchmarks.md); the shard_map lowers them as one device does. With ffpa the tokens
are put in ffpa_jax.zigzag's order by default (`--context-layout zigzag`: each device
holds an early and a late chunk of every sequence, so the causal global layers' work is
even over the devices; the positions follow the tokens, and attention is told the
layout); `--context-layout contiguous` keeps them in order. The
batches and the initial values are those of one device, so the losses agree with a
one-device run's to rounding; the peak memory is printed per device. The loss check runs on
one device. `--json PATH` writes the run's record as one JSON object (also when the device
runs out of memory: "out_of_memory" true, with the error's first line), for a measurement
that collects several runs.

The loss check (`--check`, on by default) then trains `--check-steps` steps three times from
the same initial parameters on the same batches: with ffpa_jax and with jax.nn in the run's
dtype, and a reference, jax.nn's dense XLA attention in float64 (on a CPU, or for a float32
run) or float32 (float32 matmuls, not TF32). The project's tolerance rule (docs/design.md:
a low-precision result's error against the reference is at most 2x the error of the
same-precision XLA computation, plus a floor of 4 ulps of its magnitude), applied to
losses, at every checked step:

    max |l_ffpa - l_ref| <= 2 max |l_jaxnn - l_ref| + 4 ulp(L_ref)

where l are the step's per-token cross-entropies (the max runs over the batch's tokens), L
the step's loss (their mean) and the ulp the run dtype's (4 ulps of bfloat16 at a loss of
5.5: 0.125). Per-token losses rather than their mean: the largest error over
many tokens is a steady measure of a run's accuracy (as the largest over output elements is
in the kernel tests), while the error of one mean is a single draw, and of two equally
accurate runs one misses twice the other's about three times in ten. The check trains by
gradient descent with updates of norm CHECK_STEP, not Adam: see `check_optimizer`.

Exit status: 0, or 1 when the check fails (or a loss is not finite), 2 for a bad option, 3
when the device runs out of memory (reported; jax.nn's XLA path holds [T, T] logits per
head in the global layers).

Run it from the repository (needs the `flax` extra: `pip install -e ".[flax]"`):

    python examples/gemma_like.py                       # this machine's preset
    python examples/gemma_like.py --help                # every option and its default
    python examples/gemma_like.py --attention jax.nn    # jax.nn's attention instead
    python examples/gemma_like.py --ffpa-implementation pallas --interpret
                                                        # the Pallas kernels, interpreted (CPU)

The GPU measurement, one process per line so that each peak memory is that run's own. The
loss check runs after the measurement, at --check-seq-len 2048 whatever --seq-len and
--attention are, so once is enough:

    python examples/gemma_like.py --attention ffpa   --seq-len 8192  --steps 20
    python examples/gemma_like.py --attention jax.nn --seq-len 8192  --steps 20 --no-check
    python examples/gemma_like.py --attention ffpa   --seq-len 32768 --steps 10 --no-check
    python examples/gemma_like.py --attention jax.nn --seq-len 32768 --steps 10 --no-check

(jax.nn at 32768 tokens may run out of memory in its XLA global layers: exit status 3, with
the reason printed.) Context parallelism over 2 and 4 GPUs:

    python examples/gemma_like.py --seq-len 32768 --steps 10 --no-check --devices 2
    python examples/gemma_like.py --seq-len 32768 --steps 10 --no-check --devices 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Sequence

if __name__ == "__main__":
    # Run as a script from a checkout: use this checkout's ffpa_jax (as the notebooks do).
    _ROOT = pathlib.Path(__file__).resolve().parents[1]
    if (_ROOT / "ffpa_jax").is_dir():
        sys.path.insert(0, str(_ROOT))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:
    import optax
    from flax import nnx
except ImportError as _missing:
    if __name__ == "__main__":
        raise SystemExit(f"examples/gemma_like.py needs Flax and optax ({_missing}); install "
                         'them with: pip install -e ".[flax]"') from None
    raise

import ffpa_jax
import tuning
from ffpa_jax import validation

ATTENTION_CHOICES = ("ffpa", "jax.nn")
EXIT_CHECK_FAILED = 1
EXIT_OUT_OF_MEMORY = 3
CHECK_STEP = 1.0    # the L2 norm of each parameter update of the loss check


# ------------------------------------------------------------------ configuration
@dataclasses.dataclass(frozen=True)
class LayerKind:
    """The attention of one kind of layer: Gemma 4 has two."""
    name: str               # "local" (sliding window) or "global"
    head_dim: int
    kv_heads: int
    window: int | None      # tokens a query sees, itself included (Gemma's sliding_window)
    rope_base: float
    rope_fraction: float    # share of the frequency pairs that rotate (the rest: frequency 0)
    k_eq_v: bool            # values from the key projection, no value projection

    def describe(self, heads_q: int) -> str:
        window = f", window {self.window}" if self.window else ", no window"
        kv = ", K=V projection" if self.k_eq_v else ""
        rope = (f"RoPE base {self.rope_base:g}" if self.rope_fraction == 1 else
                f"RoPE base {self.rope_base:g} on {self.rope_fraction:g} of the pairs")
        return (f"D={self.head_dim}, Hq={heads_q}, Hkv={self.kv_heads}{window}{kv}, {rope}")


@dataclasses.dataclass(frozen=True)
class GemmaLikeConfig:
    vocab: int
    d_model: int
    mlp_dim: int
    layers: int
    heads_q: int
    local: LayerKind
    global_: LayerKind
    global_every: int = 6           # Gemma 4: five local layers, then one global
    final_softcap: float | None = 30.0
    dtype: str = "float32"          # parameters and activations
    attention: str = "ffpa"         # "ffpa" or "jax.nn"
    ffpa_implementation: str | None = None   # ffpa_jax's: None or a tier's name
    interpret: bool = False         # ffpa_jax's Pallas kernels in the interpreter
    jaxnn_implementation: str = "auto"       # "auto" (cuDNN where it can) or "xla"
    context_axis: str | None = None  # the mesh axis the sequence is split over (see attend)
    # How the sequence lies over that axis's `context_parts` devices: "contiguous" (device i
    # holds the i-th part) or "zigzag" (the tokens come in ffpa_jax.zigzag's order, so that
    # each device holds an early and a late chunk and causal attention's work is even).
    context_layout: str = "contiguous"
    context_parts: int = 1


def layer_kinds(cfg: GemmaLikeConfig) -> tuple[LayerKind, ...]:
    """Every `global_every`-th layer is global, and the last one is (as transformers'
    Gemma4TextConfig forces), so that even a short stack has a global layer."""
    return tuple(cfg.global_ if (i + 1) % cfg.global_every == 0 or i == cfg.layers - 1
                 else cfg.local for i in range(cfg.layers))


def gemma4_kinds(heads_q: int, window: int) -> tuple[LayerKind, LayerKind]:
    """Gemma 4 31B's two layer kinds for `heads_q` query heads (its KV head ratios)."""
    local = LayerKind("local", head_dim=256, kv_heads=max(1, heads_q // 2), window=window,
                      rope_base=10_000.0, rope_fraction=1.0, k_eq_v=False)
    global_ = LayerKind("global", head_dim=512, kv_heads=max(1, heads_q // 8), window=None,
                        rope_base=1_000_000.0, rope_fraction=0.25, k_eq_v=True)
    return local, global_


@dataclasses.dataclass(frozen=True)
class Preset:
    vocab: int
    d_model: int
    mlp_dim: int
    layers: int
    heads_q: int
    window: int
    dtype: str
    seq_len: int
    batch: int
    steps: int
    check_steps: int


PRESETS = {
    "gpu": Preset(vocab=16_384, d_model=1024, mlp_dim=4096, layers=12, heads_q=8,
                  window=1024, dtype="bfloat16", seq_len=8192, batch=1, steps=20,
                  check_steps=3),
    "ci": Preset(vocab=128, d_model=64, mlp_dim=256, layers=2, heads_q=4, window=16,
                 dtype="float32", seq_len=64, batch=2, steps=4, check_steps=2),
}


def default_preset() -> str:
    return "gpu" if jax.default_backend() == "gpu" else "ci"


# ------------------------------------------------------------------ the model
def rope_frequencies(kind: LayerKind) -> np.ndarray:
    """[head_dim // 2] angular frequencies: base^(-2i / D) for the first `rope_fraction` of
    the pairs, 0 (no rotation) for the others, as Gemma 4's proportional RoPE."""
    pairs = kind.head_dim // 2
    rotated = int(kind.rope_fraction * pairs)
    freqs = np.zeros(pairs, np.float64)
    freqs[:rotated] = kind.rope_base ** (-2.0 * np.arange(rotated) / kind.head_dim)
    return freqs


def apply_rope(x: jax.Array, positions: jax.Array, kind: LayerKind) -> jax.Array:
    """x [B, T, H, D] rotated by position, the two halves of D paired (rotate-half)."""
    # Angles in float32 at least (positions reach the tens of thousands), float64 in the
    # float64 reference.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    angles = positions.astype(wide)[:, None] * jnp.asarray(rope_frequencies(kind), wide)[None, :]
    cos = jnp.cos(angles).astype(x.dtype)[None, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[None, :, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def window_argument(kind: LayerKind) -> tuple[int, int] | None:
    """Gemma's window of W tokens (the query included) as jax.nn's (left, right)."""
    return None if kind.window is None else (kind.window - 1, 0)


def jaxnn_implementation(kind: LayerKind, dtype: str, requested: str) -> tuple[str, str]:
    """(the `implementation` jax.nn is called with for this layer kind, why)."""
    if requested == "xla":
        return "xla", "--jaxnn-implementation xla"
    device = jax.devices()[0]
    if device.platform != "gpu":
        return "xla", "no GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "xla", f"cuDNN takes float16/bfloat16, not {dtype}"
    capability = tuple(int(x) for x in str(device.compute_capability).split("."))
    limit = 256 if capability >= (9, 0) else 128  # jax's check_is_flash_attention
    if kind.head_dim > limit or kind.head_dim % 8:
        return "xla", f"cuDNN's head dim limit here is {limit}"
    return "cudnn", f"head dim {kind.head_dim} <= {limit}"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kind: LayerKind,
           cfg: GemmaLikeConfig) -> jax.Array:
    """Causal attention of one layer; q [B, T, Hq, D], k and v [B, T, Hkv, D]."""
    window = window_argument(kind)
    if cfg.attention == "ffpa":
        def ffpa(q, k, v, **context):
            return ffpa_jax.attention(q, k, v, scale=1.0, is_causal=True,
                                      local_window_size=window,
                                      implementation=cfg.ffpa_implementation,
                                      interpret=cfg.interpret, **context)
        if cfg.context_axis is None:
            return ffpa(q, k, v)
        # The sequence split over the mesh axis: each device computes its shard's rows
        # (context parallelism). Under jit alone ffpa_jax would split sequence-sharded
        # q, k, v itself, through JAX's custom_partitioning, which lowers the kernels of
        # every layer's call again while XLA compiles; in a shard_map they are lowered as
        # on one device (docs/benchmarks.md: the model's compile time).
        spec = P(None, cfg.context_axis)
        return jax.shard_map(functools.partial(ffpa, context_axis=cfg.context_axis,
                                               context_layout=cfg.context_layout),
                             in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    if cfg.attention != "jax.nn":
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}; got {cfg.attention!r}")
    implementation, _ = jaxnn_implementation(kind, cfg.dtype, cfg.jaxnn_implementation)
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True,
                                        local_window_size=window,
                                        implementation=implementation)


def _dense(cfg: GemmaLikeConfig, rngs: nnx.Rngs, d_in: int, d_out: int) -> nnx.Linear:
    # float32 parameters at initialisation whatever the run's dtype, so that runs in
    # different dtypes start from the same values (cast afterwards: `initial_params`).
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=jnp.dtype(cfg.dtype),
                      param_dtype=jnp.float32, rngs=rngs)


def _norm(cfg: GemmaLikeConfig, rngs: nnx.Rngs, features: int, use_scale: bool = True,
          initial_scale: float = 1.0) -> nnx.RMSNorm:
    return nnx.RMSNorm(features, epsilon=1e-6, dtype=jnp.dtype(cfg.dtype),
                       param_dtype=jnp.float32, use_scale=use_scale,
                       scale_init=nnx.initializers.constant(initial_scale), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: GemmaLikeConfig, kind: LayerKind, *, rngs: nnx.Rngs):
        self.cfg, self.kind = cfg, kind
        d = kind.head_dim
        self.q_proj = _dense(cfg, rngs, cfg.d_model, cfg.heads_q * d)
        self.k_proj = _dense(cfg, rngs, cfg.d_model, kind.kv_heads * d)
        self.v_proj = None if kind.k_eq_v else _dense(cfg, rngs, cfg.d_model, kind.kv_heads * d)
        self.o_proj = _dense(cfg, rngs, cfg.heads_q * d, cfg.d_model)
        # With logit scale 1, unit-RMS queries and keys would start with logits of spread
        # sqrt(D) (a near one-hot softmax); scales of D^-1/4 each start them as 1/sqrt(D)
        # attention does, and training sets them from there.
        self.q_norm = _norm(cfg, rngs, d, initial_scale=d ** -0.25)
        self.k_norm = _norm(cfg, rngs, d, initial_scale=d ** -0.25)
        self.v_norm = _norm(cfg, rngs, d, use_scale=False)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        d, kind = self.kind.head_dim, self.kind
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.cfg.heads_q, d))
        k_raw = self.k_proj(x).reshape(b, t, kind.kv_heads, d)
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).reshape(b, t, kind.kv_heads, d)
        q = apply_rope(q, positions, kind)
        k = apply_rope(self.k_norm(k_raw), positions, kind)
        out = attend(q, k, self.v_norm(v_raw), kind, self.cfg)
        return self.o_proj(out.reshape(b, t, self.cfg.heads_q * d))


class Block(nnx.Module):
    def __init__(self, cfg: GemmaLikeConfig, kind: LayerKind, *, rngs: nnx.Rngs):
        self.attn = Attention(cfg, kind, rngs=rngs)
        self.pre_attn_norm = _norm(cfg, rngs, cfg.d_model)
        self.post_attn_norm = _norm(cfg, rngs, cfg.d_model)
        self.pre_mlp_norm = _norm(cfg, rngs, cfg.d_model)
        self.post_mlp_norm = _norm(cfg, rngs, cfg.d_model)
        self.gate = _dense(cfg, rngs, cfg.d_model, cfg.mlp_dim)
        self.up = _dense(cfg, rngs, cfg.d_model, cfg.mlp_dim)
        self.down = _dense(cfg, rngs, cfg.mlp_dim, cfg.d_model)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.post_attn_norm(self.attn(self.pre_attn_norm(x), positions))
        h = self.pre_mlp_norm(x)
        h = self.down(jax.nn.gelu(self.gate(h), approximate=True) * self.up(h))
        return x + self.post_mlp_norm(h)


class GemmaLike(nnx.Module):
    def __init__(self, cfg: GemmaLikeConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=jnp.dtype(cfg.dtype),
                               param_dtype=jnp.float32, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, kind, rngs=rngs) for kind in layer_kinds(cfg)])
        self.final_norm = _norm(cfg, rngs, cfg.d_model)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int32 [B, T] -> logits [B, T, vocab], float32 or wider."""
        dtype = jnp.dtype(self.cfg.dtype)
        x = self.embed(tokens) * jnp.asarray(math.sqrt(self.cfg.d_model), dtype)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        if self.cfg.context_layout == "zigzag" and self.cfg.context_parts > 1:
            # The tokens come in zigzag order (run_steps): so do their positions.
            positions = ffpa_jax.zigzag(positions, self.cfg.context_parts, axis=0)
        for block in self.blocks:
            x = block(x, positions)
        logits = self.embed.attend(self.final_norm(x))
        logits = logits.astype(jnp.promote_types(dtype, jnp.float32))
        cap = self.cfg.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


# ------------------------------------------------------------------ data and training
def synthetic_tokens(key: jax.Array, batch: int, length: int, vocab: int) -> jax.Array:
    """int32 [batch, length]: a random first half, then its copy."""
    half = -(-length // 2)
    first = jax.random.randint(key, (batch, half), 0, vocab, dtype=jnp.int32)
    return jnp.concatenate([first, first], axis=1)[:, :length]


def float32_init(cfg: GemmaLikeConfig, seed: int):
    """The initial parameters (float32, on the host): the same for every dtype and choice."""
    model = GemmaLike(dataclasses.replace(cfg, dtype="float32"), rngs=nnx.Rngs(seed))
    return jax.device_get(nnx.split(model)[1])


def initial_params(cfg: GemmaLikeConfig, init) -> tuple:
    """(graphdef of the model in cfg's dtype, the parameters `init` in that dtype)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: GemmaLike(cfg, rngs=nnx.Rngs(0))))[0]
    dtype = jnp.dtype(cfg.dtype)
    return graphdef, jax.tree.map(lambda a: jnp.asarray(a, dtype), init)


def make_train_step(graphdef, tx: optax.GradientTransformation, treedef) -> Callable:
    """step(leaves, outputs, inputs [B, T], targets [B, T]) -> (leaves, (loss, per-token
    losses [B, T])); jitted, the leaves and `outputs` donated. `leaves` are those of the
    state (params, opt_state), whose structure is `treedef`: the call takes and returns a
    plain list of arrays, so that no call flattens and rebuilds the state's nnx Variables on
    the host (Python work a waited-for step adds to its time). `outputs` are the previous
    step's (loss, per-token losses), unread but kept (`keep_unused`) and donated, so that
    this step's land in the same buffers: XLA may place earlier values of the step in an
    output's buffer (the optimizer's bias correction shared the loss's), and a CUDA graph
    re-records every command that touches a buffer whose address moved since the last
    step, as fresh output buffers do at every step (docs/history.md, session 42). Inputs
    and targets come apart (not one [B, T + 1] array) so that both split evenly over a
    sequence mesh."""
    def losses(params, inputs, targets):
        logits = nnx.merge(graphdef, params)(inputs)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return per_token.mean(), per_token

    def step(leaves, outputs, inputs, targets):
        del outputs  # donated only, for their buffers
        params, opt_state = jax.tree.unflatten(treedef, leaves)
        (loss, per_token), grads = jax.value_and_grad(losses, has_aux=True)(params, inputs,
                                                                          targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (jax.tree.leaves((optax.apply_updates(params, updates), opt_state)),
                (loss, per_token))

    return jax.jit(step, donate_argnums=(0, 1), keep_unused=True)


def first_outputs(step: Callable, leaves, inputs, targets):
    """Zeros in the shape of `step`'s (loss, per-token losses): what the first call of a
    step of `make_train_step` takes as the previous step's outputs."""
    shapes = jax.eval_shape(step, leaves, None, inputs, targets)[1]
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)


def parameter_count(init) -> int:
    return sum(int(np.size(a)) for a in jax.tree.leaves(init))


class ProgressBar:
    """A one-line bar redrawn in place on a terminal; elsewhere (a log, a test's pipe) a
    line at every tenth of the run."""

    def __init__(self, total: int, stream=None, width: int = 30):
        self.total, self.width = total, width
        self.stream = sys.stderr if stream is None else stream
        self.live = getattr(self.stream, "isatty", lambda: False)()
        self.every = max(1, total // 10)

    def update(self, done: int, text: str) -> None:
        filled = self.width * done // self.total
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {text}"
        if self.live:
            self.stream.write("\r" + bar)
        elif done % self.every == 0 or done == self.total:
            self.stream.write(bar + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


@dataclasses.dataclass
class Timings:
    compile_s: float
    first_step_s: float
    step_s: list[float]             # the steps after the first, each waited for
    losses: list[float]
    # The mean step of the same number of steps dispatched back to back and waited for once
    # (None: not measured); see run_steps.
    back_to_back_step_s: float | None = None

    @property
    def median_step_s(self) -> float | None:
        """The median of the steps after the first (None after a single step)."""
        return float(np.median(self.step_s)) if self.step_s else None


def sequence_mesh(devices: int) -> jax.sharding.Mesh:
    """A 1-D mesh "seq" over the first `devices` devices."""
    return jax.make_mesh((devices,), ("seq",), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))


# The waited-for steps `--profile` traces: past the first two (the first step's one-time
# work, then one that may still finish it), three steps.
PROFILED = range(2, 5)


def run_steps(cfg: GemmaLikeConfig, init, data_key: jax.Array, tx: optax.GradientTransformation,
              *, steps: int, batch: int, seq_len: int, progress: bool = False,
              mesh: jax.sharding.Mesh | None = None, back_to_back: bool = False,
              profile_dir: str | None = None) -> tuple[Timings, np.ndarray]:
    """Train `steps` steps from `init` with `tx`; returns the timings and the per-token
    losses of every step [steps, batch, seq_len] (float64). Each step is waited for (its
    loss read) before the next is dispatched, so its time includes the host's dispatch and
    the loss's copy, which a training loop that reads its loss only now and then hides
    behind the device's work. With `back_to_back`, the steps after the first are then run
    again on the trained state that way (dispatched in turn, waited for once) and their mean
    is `Timings.back_to_back_step_s`. With `profile_dir`, a JAX profiler trace of the
    waited-for steps PROFILED (the 3rd to the 5th) is written there. With a `mesh` (see
    `sequence_mesh`) the tokens are split along the sequence over its devices and the
    parameters and optimizer state replicated: the model's sharding follows the tokens',
    and ffpa_jax's attention runs context-parallel in a shard_map over the mesh's axis
    (`attend`). The same batches and initial values either way, so the losses agree to
    rounding."""
    parts = 1
    if mesh is not None:
        parts = mesh.devices.size
        cfg = dataclasses.replace(cfg, context_axis=mesh.axis_names[0], context_parts=parts)
    zigzagged = cfg.context_layout == "zigzag" and parts > 1
    graphdef, params = initial_params(cfg, init)
    leaves, treedef = jax.tree.flatten((params, tx.init(params)))
    keys = jax.random.split(data_key, steps)

    def split_batch(key):
        tokens = synthetic_tokens(key, batch=batch, length=seq_len + 1, vocab=cfg.vocab)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if zigzagged:
            # Every layer but attention works token by token, and attention is told the
            # order (context_layout): the model computes what it computes in the natural
            # order, its per-token losses in this one.
            inputs, targets = (ffpa_jax.zigzag(x, parts, axis=1) for x in (inputs, targets))
        return inputs, targets

    if mesh is None:
        batch_of = jax.jit(split_batch)
    else:
        leaves = jax.device_put(leaves, NamedSharding(mesh, P()))
        along_seq = NamedSharding(mesh, P(None, "seq"))
        batch_of = jax.jit(split_batch, out_shardings=(along_seq, along_seq))
    step = make_train_step(graphdef, tx, treedef)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        start = time.perf_counter()
        first_batch = batch_of(keys[0])
        # The step's outputs, made once and donated back at every step (make_train_step).
        outputs = first_outputs(step, leaves, *first_batch)
        if mesh is not None:
            outputs = jax.device_put(outputs, (NamedSharding(mesh, P()), along_seq))
        compiled = step.lower(leaves, outputs, *first_batch).compile()
        compile_s = time.perf_counter() - start
        bar = ProgressBar(steps) if progress else None
        seconds, losses, per_token = [], [], []
        for i in range(steps):
            inputs, targets = jax.block_until_ready(batch_of(keys[i]))
            if profile_dir is not None and i == PROFILED.start:
                jax.profiler.start_trace(profile_dir, create_perfetto_trace=True)
            start = time.perf_counter()
            leaves, outputs = compiled(leaves, outputs, inputs, targets)
            # The whole step on every device: reading the loss alone waits for the device
            # that holds the copy read, and a later device's tail would be timed nowhere.
            jax.block_until_ready((leaves, outputs))
            loss, token_losses = outputs
            loss = float(loss)
            seconds.append(time.perf_counter() - start)
            losses.append(loss)
            if zigzagged:
                token_losses = ffpa_jax.unzigzag(token_losses, parts, axis=1)
            per_token.append(np.asarray(token_losses, np.float64))
            if profile_dir is not None and i == PROFILED.stop - 1:
                jax.profiler.stop_trace()
            if bar:
                bar.update(i + 1, f"loss {loss:.4f}  {1e3 * seconds[-1]:.1f} ms/step")
        if bar:
            bar.close()
        back_to_back_s = None
        if back_to_back and steps > 1:
            batches = jax.block_until_ready([batch_of(key) for key in keys[1:]])
            start = time.perf_counter()
            for inputs, targets in batches:
                leaves, outputs = compiled(leaves, outputs, inputs, targets)
            jax.block_until_ready((leaves, outputs))
            back_to_back_s = (time.perf_counter() - start) / len(batches)
    return (Timings(compile_s, seconds[0], seconds[1:], losses, back_to_back_s),
            np.stack(per_token))


# ------------------------------------------------------------------ the loss check
def ulp(x: float, dtype) -> float:
    """The spacing of `dtype`'s numbers at magnitude x."""
    x = max(abs(float(x)), float(jnp.finfo(dtype).tiny))
    return float(jnp.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(x))


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    step: int
    err_ffpa: float     # max over tokens |l_ffpa - l_ref|
    err_jaxnn: float    # max over tokens |l_jaxnn - l_ref|
    bound: float        # 2 * err_jaxnn + 4 ulp(the reference's loss)

    @property
    def ok(self) -> bool:
        return self.err_ffpa <= self.bound


def judge_losses(ffpa: np.ndarray, jaxnn: np.ndarray, reference: np.ndarray,
                 dtype) -> list[StepVerdict]:
    """The tolerance rule on per-token losses [steps, B, T] of each run (see the module
    docstring)."""
    verdicts = []
    for i, (a, b, ref) in enumerate(zip(ffpa, jaxnn, reference)):
        err_ffpa = float(np.max(np.abs(a - ref)))
        err_jaxnn = float(np.max(np.abs(b - ref)))
        floor = 4 * ulp(np.mean(ref), dtype)
        verdicts.append(StepVerdict(i + 1, err_ffpa, err_jaxnn, 2 * err_jaxnn + floor))
    return verdicts


def reference_dtype(dtype: str) -> str:
    """float64 where the run is float32 or where there is no GPU, else float32."""
    if jax.default_backend() != "gpu" or jnp.dtype(dtype) == jnp.dtype(jnp.float32):
        return "float64"
    return "float32"


def check_optimizer() -> optax.GradientTransformation:
    """Gradient descent by a step of fixed length CHECK_STEP: what the check trains with.
    Not Adam: its first update is lr * sign(g) for every parameter, so a gradient within
    rounding of 0 moves its parameter by +-lr at random, and the runs' later losses would
    differ by that chance more than by the attention's accuracy. This step is a smooth
    function of the gradient: a gradient error shows in the next losses in proportion.
    The norm is taken in float32 at least, so that its rounding in a bfloat16 run does
    not scale the whole step by chance either."""
    def update(grads, state, params=None):
        del params
        wide = [g.astype(jnp.promote_types(g.dtype, jnp.float32)) for g in jax.tree.leaves(grads)]
        factor = -CHECK_STEP / jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in wide))
        return jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def check_losses(cfg: GemmaLikeConfig, init, data_key: jax.Array, *, steps: int, batch: int,
                 seq_len: int) -> list[StepVerdict]:
    """Train `steps` steps with each attention choice and the reference, from `init` on the
    batches of `data_key`, and judge the per-token losses."""
    def per_token_losses(run_cfg):
        return run_steps(run_cfg, init, data_key, check_optimizer(), steps=steps,
                         batch=batch, seq_len=seq_len)[1]

    runs = {choice: per_token_losses(dataclasses.replace(cfg, attention=choice))
            for choice in ATTENTION_CHOICES}
    ref_cfg = dataclasses.replace(cfg, attention="jax.nn", jaxnn_implementation="xla",
                                  dtype=reference_dtype(cfg.dtype))
    # "highest": float32 matmuls in float32, not TF32 (a GPU's default for them).
    with jax.enable_x64(ref_cfg.dtype == "float64"), jax.default_matmul_precision("highest"):
        reference = per_token_losses(ref_cfg)
    return judge_losses(runs["ffpa"], runs["jax.nn"], reference, jnp.dtype(cfg.dtype))


# ------------------------------------------------------------------ reports
def ffpa_tiers(cfg: GemmaLikeConfig, kind: LayerKind, batch: int, seq_len: int) -> str:
    """Which ffpa_jax tier runs each direction of this layer kind's attention, as
    `python -m ffpa_jax.info` asks it (`tuning.explain`)."""
    sds = jax.ShapeDtypeStruct
    dtype = jnp.dtype(cfg.dtype)
    q = sds((batch, seq_len, cfg.heads_q, kind.head_dim), dtype)
    kv = sds((batch, seq_len, kind.kv_heads, kind.head_dim), dtype)
    call = validation.validate(q, kv, kv, None, None, scale=1.0, is_causal=True,
                               dropout_rate=0.0, dropout_rng=None, return_lse=False,
                               implementation=cfg.ffpa_implementation,
                               interpret=cfg.interpret,
                               local_window_size=window_argument(kind))
    explained = tuning.explain(call.problem, cfg.ffpa_implementation, interpret=cfg.interpret)
    forward, backward = explained.forward.tier, explained.backward.tier
    interpreted = " (interpreted)" if cfg.interpret else ""
    if forward == backward:
        return f"ffpa_jax {forward} in both directions{interpreted}"
    return f"ffpa_jax forward {forward}, backward {backward}{interpreted}"


def implementation_line(cfg: GemmaLikeConfig, kind: LayerKind, batch: int,
                        seq_len: int) -> str:
    if cfg.attention == "ffpa":
        return ffpa_tiers(cfg, kind, batch, seq_len)
    implementation, why = jaxnn_implementation(kind, cfg.dtype, cfg.jaxnn_implementation)
    return f"jax.nn implementation={implementation!r} ({why})"


def peak_memory_bytes(devices: int) -> list[int] | None:
    """Each of the first `devices` devices' peak bytes in use, or None where the device
    keeps no such count (a CPU)."""
    peaks = []
    for device in jax.devices()[:devices]:
        stats = device.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(int(stats["peak_bytes_in_use"]))
    return peaks


def peak_memory_text(devices: int = 1) -> str:
    peaks = peak_memory_bytes(devices)
    if peaks is None:
        return "n/a on CPU" if jax.default_backend() == "cpu" else "n/a on this device"
    if devices == 1:
        return f"{peaks[0] / 2**30:.2f} GiB"
    each = ", ".join(f"{peak / 2**30:.2f}" for peak in peaks)
    return f"{max(peaks) / 2**30:.2f} GiB per device at most (each: {each} GiB)"


def write_record(path: str | None, record: dict) -> None:
    """The run's record as one JSON object in `path` (nothing without a path)."""
    if path is not None:
        pathlib.Path(path).write_text(json.dumps(record, indent=1) + "\n")
        print(f"record written to {path}")


def out_of_memory_exit(error: Exception, what: str, json_path: str | None = None,
                       record: dict | None = None) -> int:
    """EXIT_OUT_OF_MEMORY, said in one line (and in the --json record, so that a run that
    runs out of memory is recorded too), if `error` is the device running out of memory;
    any other error goes on up."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        raise error
    first_line = text.splitlines()[0][:200]
    print(f"out of device memory: {what} ({first_line})")
    write_record(json_path, {**(record or {}), "out_of_memory": True,
                             "exit_reason": f"out of device memory: {what}",
                             "error": first_line})
    return EXIT_OUT_OF_MEMORY


def print_model(cfg: GemmaLikeConfig, init, batch: int, seq_len: int) -> dict[str, str]:
    """Prints the model and what each layer kind's attention runs; returns the latter by
    layer kind."""
    kinds = layer_kinds(cfg)
    ran = {}
    pattern = "".join("G" if kind.name == "global" else "L" for kind in kinds)
    print(f"model: {cfg.layers} layers {pattern} (L local, G global), d_model {cfg.d_model}, "
          f"MLP {cfg.mlp_dim}, vocab {cfg.vocab}, {parameter_count(init) / 1e6:.2f}M "
          f"parameters, {cfg.dtype}")
    for kind in (cfg.local, cfg.global_):
        count = sum(k is kind for k in kinds)
        if count:
            print(f"  {kind.name} layers x{count}: {kind.describe(cfg.heads_q)}")
            ran[kind.name] = implementation_line(cfg, kind, batch, seq_len)
            print(f"    attention: {ran[kind.name]}")
    return ran


def print_timings(timings: Timings, batch: int, seq_len: int, vocab: int,
                  devices: int = 1) -> None:
    print(f"trace and compile: {timings.compile_s:.2f} s; first step: "
          f"{timings.first_step_s:.3f} s (both left out of the step time)")
    if timings.step_s:
        median = timings.median_step_s
        print(f"step time: median {1e3 * median:.2f} ms, mean "
              f"{1e3 * float(np.mean(timings.step_s)):.2f} ms over {len(timings.step_s)} steps")
        print(f"tokens/s: {batch * seq_len / median:,.0f} (the median step, each waited for)")
        if timings.back_to_back_step_s:
            print(f"tokens/s: {batch * seq_len / timings.back_to_back_step_s:,.0f} with the "
                  f"{len(timings.step_s)} steps dispatched back to back (mean step "
                  f"{1e3 * timings.back_to_back_step_s:.2f} ms): the device's pace")
    else:
        print("step time: n/a (a single step: the first, reported above)")
    print(f"peak device memory: {peak_memory_text(devices)}")
    print(f"loss: first {timings.losses[0]:.4f}, last {timings.losses[-1]:.4f} "
          f"(uniform guessing: log(vocab) = {math.log(vocab):.4f})")


def print_verdicts(verdicts: Sequence[StepVerdict]) -> None:
    for v in verdicts:
        print(f"  step {v.step}: max per-token |loss - ref|: ffpa {v.err_ffpa:.3e}, "
              f"jax.nn {v.err_jaxnn:.3e}; bound {v.bound:.3e}  {'ok' if v.ok else 'FAILED'}")


# ------------------------------------------------------------------ the command line
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except None: those options say in words what they default to."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/gemma_like.py", formatter_class=_HelpFormatter,
        description="Train a decoder-only LM shaped like Gemma 4 (sliding-window layers "
                    "with D=256, one global layer in six with D=512 and GQA) on synthetic "
                    "tokens, with ffpa_jax's or jax.nn's attention; print the step time, "
                    "tokens/s and peak device memory, then check that both attention "
                    "choices' first losses agree within the project's tolerance rule.")
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, default="ffpa",
                        help="the attention of every layer")
    parser.add_argument("--preset", choices=("auto", *PRESETS), default="auto",
                        help="sizes and dtype: gpu (one GPU), ci (a CPU, in seconds); auto "
                             "picks gpu where JAX's default backend is a GPU")
    run = parser.add_argument_group("run")
    run.add_argument("--seq-len", type=_positive,
                     help="tokens per sequence" + _preset_defaults("seq_len"))
    run.add_argument("--steps", type=_positive,
                     help="training steps timed" + _preset_defaults("steps"))
    run.add_argument("--batch", type=_positive,
                     help="sequences per step" + _preset_defaults("batch"))
    run.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    run.add_argument("--seed", type=int, default=0,
                     help="seed of the initial parameters and of the tokens")
    run.add_argument("--devices", type=_positive, default=1, metavar="N",
                     help="train with each sequence split along its length over the first N "
                          "devices (context parallelism; parameters replicated); --seq-len "
                          "must be a multiple of N. The loss check stays on one device")
    run.add_argument("--context-layout", choices=("zigzag", "contiguous"), default=None,
                     help="with --devices N > 1 and ffpa: how the sequence lies over the "
                          "devices: zigzag (each device an early and a late chunk, causal work "
                          "balanced; --seq-len a multiple of 2N) or contiguous (device i the "
                          "i-th part). Default: zigzag for ffpa; jax.nn takes contiguous only")
    run.add_argument("--profile", metavar="DIR",
                     help=f"write a JAX profiler trace of waited-for steps {PROFILED.start + 1} "
                          f"to {PROFILED.stop} to DIR (TensorBoard, Perfetto; "
                          "scripts/step_profile.py DIR sums it by kernel); needs --steps "
                          f">= {PROFILED.stop}")
    run.add_argument("--json", metavar="PATH",
                     help="also write the run's record (devices, attention, timings, tokens/s, "
                          "peak memory per device, losses, the check's verdict; or that it "
                          "ran out of memory) as one JSON object to PATH")
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=_positive,
                       help="decoder layers" + _preset_defaults("layers"))
    model.add_argument("--global-every", type=_positive, default=6,
                       help="every N-th layer is global (Gemma 4: 6); the last always is")
    model.add_argument("--window", type=_positive,
                       help="sliding window of the local layers in tokens, the query "
                            "included" + _preset_defaults("window"))
    model.add_argument("--heads", type=_positive,
                       help="query heads; KV heads: half of them in local layers, an eighth "
                            "(at least 1) in global layers" + _preset_defaults("heads_q"))
    model.add_argument("--d-model", type=_positive,
                       help="width of the residual stream" + _preset_defaults("d_model"))
    model.add_argument("--mlp-dim", type=_positive,
                       help="width of the gated MLP" + _preset_defaults("mlp_dim"))
    model.add_argument("--vocab", type=_positive,
                       help="vocabulary size" + _preset_defaults("vocab"))
    model.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                       help="parameters and activations" + _preset_defaults("dtype"))
    attn = parser.add_argument_group("attention implementations")
    attn.add_argument("--ffpa-implementation",
                      choices=("auto", *(n for n in tuning.IMPLEMENTATIONS if n)),
                      default="auto",
                      help="ffpa_jax's; auto: the dispatcher's choice (its measured tiers on an "
                           "NVIDIA GPU, its XLA path elsewhere)")
    attn.add_argument("--interpret", action="store_true",
                      help="ffpa_jax's Pallas kernels in Pallas' interpreter (CPU; slow)")
    attn.add_argument("--jaxnn-implementation", choices=("auto", "xla"), default="auto",
                      help="jax.nn's; auto: cuDNN for the layers it supports, XLA otherwise")
    check = parser.add_argument_group("loss check")
    check.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                       help="after the timed run, train the first steps with both choices "
                            "and a reference, and apply the tolerance rule (exit 1 if it "
                            "fails)")
    check.add_argument("--check-steps", type=_positive,
                       help="steps the check trains" + _preset_defaults("check_steps"))
    check.add_argument("--check-seq-len", type=_positive, default=2048,
                       help="the check's sequence length, at most --seq-len (jax.nn's XLA "
                            "path and the reference hold [T, T] logits per head)")
    return parser


def _preset_defaults(field: str) -> str:
    """' (default: gpu preset X, ci preset Y)' for a field of the presets."""
    values = ", ".join(f"{name} preset {getattr(preset, field)}"
                       for name, preset in PRESETS.items())
    return f" (default: {values})"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def _given_or(value, preset_value):
    return preset_value if value is None else value


def config_from_args(args, parser: argparse.ArgumentParser) -> tuple[GemmaLikeConfig, dict]:
    """The model's configuration and the run's settings, each option checked."""
    preset = PRESETS[default_preset() if args.preset == "auto" else args.preset]
    heads = _given_or(args.heads, preset.heads_q)
    window = _given_or(args.window, preset.window)
    local, global_ = gemma4_kinds(heads, window)
    for kind in (local, global_):
        if heads % kind.kv_heads:
            parser.error(f"--heads {heads} is not a multiple of the {kind.name} layers' "
                         f"{kind.kv_heads} KV heads")
    if args.profile is not None and _given_or(args.steps, preset.steps) < PROFILED.stop:
        parser.error(f"--profile traces steps {PROFILED.start + 1} to {PROFILED.stop}: pass "
                     f"--steps {PROFILED.stop} or more")
    if not args.lr > 0:
        parser.error(f"--lr must be positive; got {args.lr}")
    implementation = None if args.ffpa_implementation == "auto" else args.ffpa_implementation
    if implementation == "pallas" and not args.interpret and jax.default_backend() != "gpu":
        parser.error("--ffpa-implementation pallas needs an NVIDIA GPU, or --interpret")
    cfg = GemmaLikeConfig(
        vocab=_given_or(args.vocab, preset.vocab), d_model=_given_or(args.d_model,
                                                                     preset.d_model),
        mlp_dim=_given_or(args.mlp_dim, preset.mlp_dim),
        layers=_given_or(args.layers, preset.layers), heads_q=heads, local=local,
        global_=global_, global_every=args.global_every,
        dtype=_given_or(args.dtype, preset.dtype), attention=args.attention,
        ffpa_implementation=implementation, interpret=args.interpret,
        jaxnn_implementation=args.jaxnn_implementation)
    seq_len = _given_or(args.seq_len, preset.seq_len)
    if seq_len % args.devices:
        parser.error(f"--seq-len {seq_len} is not a multiple of --devices {args.devices} (the "
                     "sequence is split evenly over the devices)")
    layout = args.context_layout or ("zigzag" if args.attention == "ffpa" else "contiguous")
    if layout == "zigzag" and args.attention != "ffpa":
        parser.error("--context-layout zigzag needs --attention ffpa (jax.nn's attention does "
                     "not know the order)")
    if layout == "zigzag" and args.devices > 1 and seq_len % (2 * args.devices):
        parser.error(f"--seq-len {seq_len} is not a multiple of 2 x --devices {args.devices} "
                     "(the zigzag layout splits the sequence into 2N chunks); or pass "
                     "--context-layout contiguous")
    cfg = dataclasses.replace(cfg, context_layout=layout)
    if args.devices > jax.device_count():
        parser.error(f"--devices {args.devices}: there are {jax.device_count()} devices")
    run = dict(seq_len=seq_len, steps=_given_or(args.steps, preset.steps),
               batch=_given_or(args.batch, preset.batch), lr=args.lr, seed=args.seed,
               check_steps=_given_or(args.check_steps, preset.check_steps),
               check_seq_len=min(args.check_seq_len, seq_len), devices=args.devices)
    return cfg, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, run = config_from_args(args, parser)
    device, devices = jax.devices()[0], run["devices"]
    where = (f"{device.device_kind} ({jax.default_backend()})" if devices == 1 else
             f"{devices} x {device.device_kind} ({jax.default_backend()}), the sequence "
             f"sharded over the {devices} devices ({cfg.context_layout})")
    print(f"device: {where}; attention {cfg.attention}; {run['steps']} steps of "
          f"{run['batch']} x {run['seq_len']} tokens, Adam lr {run['lr']:g}")
    init = float32_init(cfg, run["seed"])
    ran = print_model(cfg, init, run["batch"], run["seq_len"])
    record = {"device_kind": device.device_kind, "backend": jax.default_backend(),
              "devices": devices, "attention": cfg.attention, "layer_attention": ran,
              "context_layout": cfg.context_layout if devices > 1 else None,
              "dtype": cfg.dtype, "batch": run["batch"], "seq_len": run["seq_len"],
              "steps": run["steps"], "out_of_memory": False}
    data_key = jax.random.key(run["seed"])
    mesh = sequence_mesh(devices) if devices > 1 else None
    try:
        timings, _ = run_steps(cfg, init, data_key, optax.adam(run["lr"]), steps=run["steps"],
                               batch=run["batch"], seq_len=run["seq_len"], progress=True,
                               mesh=mesh, back_to_back=True, profile_dir=args.profile)
    except jax.errors.JaxRuntimeError as error:
        return out_of_memory_exit(error, f"{cfg.attention} at {run['batch']} x "
                                         f"{run['seq_len']} tokens", args.json, record)
    print_timings(timings, run["batch"], run["seq_len"], cfg.vocab, devices)
    median = timings.median_step_s
    record.update(compile_s=timings.compile_s, first_step_s=timings.first_step_s,
                  step_s=timings.step_s, median_step_s=median,
                  tokens_per_s=None if median is None else run["batch"] * run["seq_len"]
                  / median,
                  back_to_back_step_s=timings.back_to_back_step_s,
                  tokens_per_s_back_to_back=None if not timings.back_to_back_step_s else
                  run["batch"] * run["seq_len"] / timings.back_to_back_step_s,
                  peak_memory_bytes=peak_memory_bytes(devices), losses=timings.losses,
                  loss_check=None)
    if not np.all(np.isfinite(timings.losses)):
        print("non-finite loss")
        write_record(args.json, {**record, "exit_reason": "non-finite loss"})
        return EXIT_CHECK_FAILED
    if not args.check:
        write_record(args.json, record)
        return 0
    steps, seq_len = run["check_steps"], run["check_seq_len"]
    print(f"loss check: {steps} step(s) of {run['batch']} x {seq_len} tokens from the same "
          f"initialisation, gradient descent by steps of norm {CHECK_STEP:g}; ffpa and jax.nn "
          f"in {cfg.dtype}, reference jax.nn xla in {reference_dtype(cfg.dtype)}"
          + (", on one device" if devices > 1 else ""))
    print("  rule: max per-token |loss - ref| of ffpa <= 2 x jax.nn's + 4 ulp(the loss)")
    try:
        verdicts = check_losses(cfg, init, data_key, steps=steps, batch=run["batch"],
                                seq_len=seq_len)
    except jax.errors.JaxRuntimeError as error:
        return out_of_memory_exit(error, f"the loss check at {run['batch']} x {seq_len} "
                                         "tokens (a smaller --check-seq-len needs less)",
                                  args.json, record)
    print_verdicts(verdicts)
    passed = all(v.ok for v in verdicts)
    print(f"loss check: {'passed' if passed else 'FAILED'}")
    record["loss_check"] = {"passed": passed, "seq_len": seq_len,
                            "steps": [dataclasses.asdict(v) | {"ok": v.ok} for v in verdicts]}
    write_record(args.json, record)
    return 0 if passed else EXIT_CHECK_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
