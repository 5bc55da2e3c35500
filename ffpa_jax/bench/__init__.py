"""`python -m ffpa_jax.bench`: ffpa_jax against its peers, measured side by side in one run.

Case kinds (--case): self, cross (T != S), decode (T = 1), gqa, mqa, causal, attn-mask
(90%-sparse block mask), key-mask (key padding: a [B, 1, 1, S] mask keeping S, 7S/8, S/2,
S/4 keys of the batch rows in turn), bias-grad (a [1, H, T, S] bias, differentiated),
dropout (p=0.1), non-aligned (N = 8191), packed (causal, 8 documents per row as segment ids), window
(causal, a left window of min(1024, N/4)), softcap (cap 50), sinks (attention sinks: one
logit per query head), paged-decode (decode over a KV cache in shuffled pages of
--page-size keys, forward only), context-parallel (causal, the sequence split over
--devices devices, default all, in --context-layout by --context-strategy in a shard_map;
TF/s of the whole call, peak memory of one device). With no shape option a GPU runs the
issue's target shapes (see `cases.gpu_preset`, or `--list`); any shape option runs a grid
instead.

Peers: cudnn (jax.nn.dot_product_attention(implementation="cudnn")), xla (jax.nn's XLA
path, or ffpa_jax's own where jax.nn has no equivalent: dropout, causal with T != S),
pallas-mha (JAX's Pallas attention, Triton), pallas-mgpu (JAX's Mosaic GPU attention,
Hopper), tokamax-mosaic / tokamax-triton (tokamax's attention, where it is installed),
pallas-decode (JAX's Pallas decode kernel; decode rows only), naive-chunked (queries
in chunks of 2048, einsums), ffpa-pallas / ffpa-chunked (one tier forced), and in the
paged-decode rows only ffpa-contiguous (ffpa_jax on the same cache, contiguous) and
pallas-paged (JAX's Pallas paged attention); in the context-parallel rows only
ffpa-one-device (the whole sequence on one device). A peer that cannot
run a case is named under it, with the reason in a note; one that runs no case at all
(a GPU-only peer on a CPU) is listed once.

Columns (the output ends with this legend): ms = median time of a warm call (compile
excluded); TF/s = 4·B·Hq·T·S·D for the forward (D the mean of D and Dv), halved when
causal, x3.5 for forward+backward; GB/s = the forward's fewest bytes (q, k, v, out,
bias, mask once) over its time; err = max |out - ref| / max |ref| on sampled query rows
against the float64 reference (dq err likewise, forward+backward); peak MiB = peak
device memory of the compiled call (XLA's memory analysis); comp s = trace + compile of
the first call; ffpa is = ffpa's time against the row's ("2.00x faster": half its time).
The text fits 100 columns; --json keeps every figure.

Without a GPU it runs small shapes through the Pallas interpreter and XLA on the CPU,
and says so: rows that ran in the interpreter are marked "i", and TF/s, GB/s and the
comparisons are left out, as those times mean nothing but that the code runs.
"""

from ffpa_jax.bench.cases import KINDS, BenchCase, make_case
from ffpa_jax.bench.cli import main
from ffpa_jax.bench.measure import make_inputs, sampled_errors, time_samples
from ffpa_jax.bench.peers import FFPA, PEERS, Impl, Unsupported
from ffpa_jax.bench.report import load, merge, plot_tflops

__all__ = ["KINDS", "BenchCase", "make_case", "main", "make_inputs",
           "sampled_errors", "time_samples", "FFPA", "PEERS", "Impl", "Unsupported", "load",
           "merge", "plot_tflops"]
