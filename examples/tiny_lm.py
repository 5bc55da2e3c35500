"""A small causal transformer language model in Flax (linen), trained with ffpa_jax attention.

Everything a training script needs, small enough to run on a CPU through the
Pallas interpreter and unchanged on GPUs:

- `TinyLM`: token + position embeddings, pre-LayerNorm blocks of
  `nn.MultiHeadDotProductAttention` (whose `attention_fn` is
  `ffpa_jax.flax_attention_fn`, causal) and an MLP, tied output embedding.
- `synthetic_batch`: arithmetic sequences mod `vocab` with a random start and
  step per row. The first token says nothing about the step, so the model must
  look back (attention) to predict well; the loss falls fast from log(vocab).
- `make_train_step` (one device, `jax.jit`), `make_pmap_train_step` (`jax.pmap`,
  gradients averaged with `lax.pmean`) and `make_sharded_train_step` (`jax.jit`
  with the batch sharded over a `Mesh`: the attention kernels run shard-locally).
- `train`: a loop that returns the losses.

Run it from the repository (needs the `flax` extra: `pip install -e ".[flax]"`):

    python examples/tiny_lm.py              # 200 jit steps; small enough for a CPU
    python examples/tiny_lm.py --help       # every option
    python examples/tiny_lm.py --implementation pallas --interpret --steps 20
                                            # the Pallas kernels in the interpreter (slow)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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

try:
    import flax.linen as nn
    import optax
except ImportError as _missing:
    if __name__ == "__main__":
        raise SystemExit(f"examples/tiny_lm.py needs Flax and optax ({_missing}); install "
                         'them with: pip install -e ".[flax]"') from None
    raise

from ffpa_jax.flax_attention import flax_attention_fn


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 16
    seq_len: int = 16
    d_model: int = 32
    num_heads: int = 2
    num_layers: int = 2
    mlp_ratio: int = 4
    attn_dropout: float = 0.0
    dtype: str = "float32"          # computation dtype (params stay float32)
    attention: str = "ffpa"         # "ffpa" (ffpa_jax) or "flax" (Flax's own attention)
    implementation: str | None = None   # ffpa_jax's: None, "pallas", "chunked" or "xla"
    interpret: bool = False         # run the Pallas kernels in the interpreter (CPU)


def attention_fn(cfg: LMConfig) -> Callable:
    """The `attention_fn` of every attention layer of the model."""
    if cfg.attention == "flax":
        return nn.dot_product_attention
    if cfg.attention != "ffpa":
        raise ValueError(f"attention must be 'ffpa' or 'flax'; got {cfg.attention!r}")
    return functools.partial(flax_attention_fn, is_causal=True,
                             implementation=cfg.implementation, interpret=cfg.interpret)


class Block(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        mask = None
        if cfg.attention == "flax":  # Flax's attention needs the causal mask spelled out
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32), dtype=jnp.bool_)
        h = nn.LayerNorm(dtype=dtype)(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads, dtype=dtype, dropout_rate=cfg.attn_dropout,
            broadcast_dropout=False, deterministic=deterministic,
            attention_fn=attention_fn(cfg))(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=dtype)(x)
        h = nn.Dense(cfg.mlp_ratio * cfg.d_model, dtype=dtype)(h)
        h = nn.gelu(h)
        h = nn.Dense(cfg.d_model, dtype=dtype)(h)
        return x + h


class TinyLM(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool = True):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab, cfg.d_model, dtype=dtype)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (cfg.seq_len, cfg.d_model))
        x = embed(tokens) + pos[: tokens.shape[-1]].astype(dtype)
        for _ in range(cfg.num_layers):
            x = Block(cfg)(x, deterministic=deterministic)
        x = nn.LayerNorm(dtype=dtype)(x)
        return embed.attend(x).astype(jnp.float32)  # logits [B, T, vocab]


def synthetic_batch(key, batch: int, seq_len: int, vocab: int) -> jax.Array:
    """int32 [batch, seq_len]: (start + step·t) mod vocab, start and step random per row."""
    k_start, k_step = jax.random.split(key)
    start = jax.random.randint(k_start, (batch, 1), 0, vocab)
    step = jax.random.randint(k_step, (batch, 1), 1, 4)
    return ((start + step * jnp.arange(seq_len)[None, :]) % vocab).astype(jnp.int32)


def loss_fn(params, model: TinyLM, tokens, dropout_rng=None):
    """Mean next-token cross-entropy."""
    deterministic = dropout_rng is None
    rngs = None if deterministic else {"dropout": dropout_rng}
    logits = model.apply({"params": params}, tokens[:, :-1], deterministic=deterministic,
                         rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def init(cfg: LMConfig, key, learning_rate: float = 3e-3):
    """(model, params, optimizer, optimizer state)."""
    model = TinyLM(cfg)
    tokens = jnp.zeros((1, cfg.seq_len - 1), jnp.int32)
    params = model.init(key, tokens)["params"]
    tx = optax.adam(learning_rate)
    return model, params, tx, tx.init(params)


def _update(model, tx, params, opt_state, tokens, dropout_rng, grad_reduce=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, model, tokens, dropout_rng)
    if grad_reduce is not None:
        loss, grads = grad_reduce((loss, grads))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make_train_step(model: TinyLM, tx) -> Callable:
    """One device: step(params, opt_state, tokens, dropout_rng) -> (params, opt_state, loss)."""
    return jax.jit(functools.partial(_update, model, tx))


def make_pmap_train_step(model: TinyLM, tx, axis_name: str = "devices") -> Callable:
    """`jax.pmap` over the leading axis of (replicated params/opt_state, tokens split per
    device, per-device dropout keys); loss and gradients averaged across devices."""
    reduce = functools.partial(jax.lax.pmean, axis_name=axis_name)
    step = functools.partial(_update, model, tx, grad_reduce=reduce)
    return jax.pmap(step, axis_name=axis_name)


def make_sharded_train_step(model: TinyLM, tx, mesh: jax.sharding.Mesh,
                            batch_axis: str = "data") -> Callable:
    """`jax.jit` with the tokens sharded over `batch_axis` of `mesh` and everything else
    replicated. The attention kernels run on each device's batch shard."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    replicated = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P(batch_axis))
    return jax.jit(functools.partial(_update, model, tx),
                   in_shardings=(replicated, replicated, data, replicated),
                   out_shardings=(replicated, replicated, replicated))


def batches(key, n_steps: int, batch: int, cfg: LMConfig) -> list[jax.Array]:
    """The same `n_steps` batches for every way of training (so runs are comparable)."""
    keys = jax.random.split(key, n_steps)
    return [synthetic_batch(k, batch, cfg.seq_len, cfg.vocab) for k in keys]


def train(cfg: LMConfig, n_steps: int = 50, batch: int = 8, seed: int = 0,
          learning_rate: float = 3e-3, mode: str = "jit", mesh=None,
          data: Sequence[jax.Array] | None = None) -> tuple[np.ndarray, dict]:
    """Train `n_steps` and return (losses [n_steps], final params).

    mode: "jit" (one device), "pmap" (all local devices; `batch` is split between
    them) or "sharded" (jit over `mesh`, default: all devices on one "data" axis).
    Dropout keys, when cfg.attn_dropout > 0, are drawn per step (and per device for
    pmap); runs with dropout are comparable between modes only through their trend.
    """
    key_init, key_data, key_drop = jax.random.split(jax.random.key(seed), 3)
    model, params, tx, opt_state = init(cfg, key_init, learning_rate)
    data = list(data) if data is not None else batches(key_data, n_steps, batch, cfg)
    drop_keys = jax.random.split(key_drop, n_steps)
    use_dropout = cfg.attn_dropout > 0
    losses = []
    if mode == "jit":
        step = make_train_step(model, tx)
        for i, tokens in enumerate(data):
            params, opt_state, loss = step(params, opt_state, tokens,
                                           drop_keys[i] if use_dropout else None)
            losses.append(loss)
    elif mode == "pmap":
        n = jax.local_device_count()
        if batch % n:
            raise ValueError(f"batch {batch} is not divisible by the {n} local devices")
        step = make_pmap_train_step(model, tx)
        params, opt_state = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)),
                                         (params, opt_state))
        for i, tokens in enumerate(data):
            shards = tokens.reshape(n, tokens.shape[0] // n, *tokens.shape[1:])
            keys = jax.random.split(drop_keys[i], n) if use_dropout else None
            params, opt_state, loss = step(params, opt_state, shards, keys)
            losses.append(loss[0])
        params = jax.tree.map(lambda x: x[0], params)
    elif mode == "sharded":
        if mesh is None:
            mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
        step = make_sharded_train_step(model, tx, mesh)
        for i, tokens in enumerate(data):
            params, opt_state, loss = step(params, opt_state, tokens,
                                           drop_keys[i] if use_dropout else None)
            losses.append(loss)
    else:
        raise ValueError(f"mode must be 'jit', 'pmap' or 'sharded'; got {mode!r}")
    return np.asarray(jax.device_get(losses), np.float64), params


# ------------------------------------------------------------------ the command line
def build_parser() -> argparse.ArgumentParser:
    defaults = LMConfig()
    parser = argparse.ArgumentParser(
        prog="python examples/tiny_lm.py",
        description="Train a small causal Flax LM whose attention is ffpa_jax's, on "
                    "synthetic arithmetic sequences, and print the loss as it falls from "
                    "log(vocab). The defaults are small enough for a CPU.")
    train_opts = parser.add_argument_group("training")
    train_opts.add_argument("--steps", type=_positive, default=200,
                            help="training steps (default: %(default)s)")
    train_opts.add_argument("--batch", type=_positive, default=16,
                            help="sequences per step (default: %(default)s)")
    train_opts.add_argument("--lr", type=float, default=3e-3,
                            help="Adam learning rate (default: %(default)s)")
    train_opts.add_argument("--mode", choices=["jit", "pmap", "sharded"], default="jit",
                            help="one device (jit), every local device with pmap, or jit "
                                 "with the batch sharded over them (default: %(default)s)")
    train_opts.add_argument("--seed", type=int, default=0)
    model = parser.add_argument_group("model")
    model.add_argument("--vocab", type=_positive, default=defaults.vocab)
    model.add_argument("--seq-len", type=_positive, default=defaults.seq_len)
    model.add_argument("--d-model", type=_positive, default=defaults.d_model)
    model.add_argument("--heads", type=_positive, default=defaults.num_heads)
    model.add_argument("--layers", type=_positive, default=defaults.num_layers)
    model.add_argument("--dropout", type=float, default=defaults.attn_dropout,
                       help="attention dropout rate (default: %(default)s)")
    model.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       default=defaults.dtype, help="computation dtype (default: %(default)s)")
    attn = parser.add_argument_group("attention")
    attn.add_argument("--attention", choices=["ffpa", "flax"], default=defaults.attention,
                      help="ffpa_jax's attention, or Flax's own to compare (default: "
                           "%(default)s)")
    attn.add_argument("--implementation", choices=["auto", "pallas", "chunked", "xla"],
                      default="auto",
                      help="ffpa_jax's implementation; auto: the tuned tiers on an NVIDIA "
                           "GPU, the XLA path elsewhere (default: %(default)s)")
    attn.add_argument("--interpret", action="store_true",
                      help="run the Pallas kernels in Pallas' interpreter (CPU; slow)")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1); got {args.dropout}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    cfg = LMConfig(vocab=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                   num_heads=args.heads, num_layers=args.layers, attn_dropout=args.dropout,
                   dtype=args.dtype, attention=args.attention,
                   implementation=None if args.implementation == "auto" else args.implementation,
                   interpret=args.interpret)
    devices = jax.devices()
    print(f"devices: {len(devices)} x {getattr(devices[0], 'device_kind', devices[0].platform)}"
          f"; mode {args.mode}, {args.steps} steps of {args.batch} sequences")
    print(f"model: {cfg}")
    start = time.perf_counter()
    try:
        losses, _ = train(cfg, n_steps=args.steps, batch=args.batch, seed=args.seed,
                          learning_rate=args.lr, mode=args.mode)
    except ValueError as exc:  # e.g. a batch that the devices cannot split evenly
        parser.error(str(exc))
    seconds = time.perf_counter() - start
    print(f"(a model that guesses uniformly has loss log(vocab) = {math.log(cfg.vocab):.3f})")
    every = max(1, args.steps // 10)
    shown = sorted({0, *range(every - 1, args.steps, every), args.steps - 1})
    for i in shown:
        print(f"step {i + 1:>5}: loss {losses[i]:.4f}")
    print(f"{args.steps} steps in {seconds:.1f} s (compile included)")
    return 0 if np.all(np.isfinite(losses)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
