"""The Mosaic tier's kernels: an exact attention forward for Hopper (sm90) in Pallas Mosaic
GPU (wgmma, TMA, warp specialisation, clusters with TMA multicast).

    out, lse = mosaic_attention_forward(q, k, v, scale=..., causal=..., config=...,
                                        window=None, softcap=None, features=None)
    dq, dk, dv = backward.mosaic_attention_backward(inputs, (out, lse), (d_out, d_lse), ...)

q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (bf16 or f16, same dtype),
Hq % Hkv == 0 (GQA / MQA: query head h reads KV head h // (Hq // Hkv); K/V are
never repeated in memory).  out [B, T, Hq, Dv] (q's dtype or `out_dtype`),
lse f32 [B, Hq, T] = natural log of sum_j exp(scale * q.k_j) over visible keys.
Causal masking is bottom-right aligned: query i sees key j iff j <= i + (S - T); a
sliding window (left, right) keeps i + (S - T) - left <= j <= i + (S - T) + right; the
logit soft cap c makes the logits c·tanh(scale·q.k / c) (`pallas_kernels.visibility` and
`reference.py` state both). A row that sees no key gets out = 0 and lse = -inf.

Two kernels (chosen by head size, see `default_config`):

* "rows" (D, Dv <= 256 after padding to 64): FA3-style warp specialisation.
  One CTA = 2 consumer warpgroups x 64 query rows + 1 producer warpgroup that
  streams K and V tiles through a ring of shared-memory stages with TMA and
  mbarriers.  Consumers run S = Q K^T (wgmma, smem x smem), online softmax in
  registers (exp2, scale*log2(e) folded in), O += P V (wgmma, P from registers).
  A shared "schedule" barrier makes the two consumer warpgroups ping-pong: one
  runs its softmax while the other's matmuls occupy the tensor cores.

* "wide" (D or Dv > 256, e.g. 512): the 64 x Dv float32 accumulator does not
  fit one warpgroup's registers, so the two consumer warpgroups share the same
  64 query rows and split the work: S = Q K^T is split by key columns (each
  warpgroup computes 64 x block_kv/2), the row maxima are exchanged through
  shared memory so both use the same running max, each warpgroup publishes its
  half of P in shared memory, and O is split by Dv halves (each warpgroup owns a
  64 x Dv/2 accumulator, computing P_own V (P from registers) + P_other V
  (P from smem)).  K/V tiles go through one ring of uniform slots
  [2, block_kv, W] (W = config.wide_piece; a K slot holds 2W columns of the
  head dim, a V slot holds W columns of each Dv half).

Both kernels optionally run as clusters of `config.cluster` CTAs that share
every K/V tile with TMA multicast (each CTA issues 1/n of the tile; the ring's
"slot free" barriers become cluster barriers): either consecutive query tiles
of one head (cluster_axis="q"; they walk the union of their key ranges) or
sibling query heads of one GQA group on the same query tile
(cluster_axis="heads").

The launch grid is (heads, q tiles, batch) by default, which Pallas Mosaic GPU launches
last dim fastest: batch, then query tiles, heads slowest, so CTAs that run together mostly
read one head's K/V, shared in L2 (the measurements are in docs/history.md, session 18;
session 25 corrects its reading of the order).

Where the semantics go: `common.soft_cap` bends every block's scores; `common.score_mod`
is the element-wise hook applied to the scores of blocks that need masking (causality, the
window, a batch row's key length and the segment ids' comparison there; a bias would go
there too); `visibility.kv_walk` (and `visibility.q_walk`, the backward's walk over query
blocks) decides which key blocks a group of query rows walks, and which of
them need the mask (a window narrows both ends, the segments' block ranges too; with
segment ids every block walked is masked); the producer walks its
cluster's range, each consumer its own within it (`common.consumer_walk`).
"""

from pallas_kernels.mosaic.config import Config, default_config
from pallas_kernels.mosaic.forward import mosaic_attention_forward

__all__ = ["Config", "default_config", "mosaic_attention_forward"]
