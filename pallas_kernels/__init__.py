"""Pallas attention kernels lowered to Triton (forward, backward, decode), the Mosaic GPU
kernels of the sm90 tier (`pallas_kernels.mosaic`, reached through the tier registry
`tiers`, not exported here), the chunked tier, the dense reference, the registry of those
tiers, and the records they share (`problem.Problem`, `plan.Plan`).

This package never imports `ffpa_jax` or `tuning`; its callers pass fully normalised inputs
(batched q/k/v, 4-D bias/mask with broadcast dims of size 1: `problem.Inputs`) and a plan.
"""

from pallas_kernels.bwd import (bwd_dbias, bwd_exact_rows, bwd_generic_dkdv, bwd_generic_dq,
                                bwd_preproc)
from pallas_kernels.bwd_descriptors import (BWD_DBIAS, BWD_GENERIC_DKDV, BWD_GENERIC_DQ,
                                            BWD_PREPROC)
from pallas_kernels.bwd_tile import BackwardRows, BwdConfig, rows_in_one_tile
from pallas_kernels.decode import (DECODE_FWD_STAGE1, DECODE_FWD_STAGE2, DecodeConfig, PagedKV,
                                   decode_attention, decode_fwd_stage1, decode_fwd_stage2,
                                   decode_num_splits, paged_decode_attention)
from pallas_kernels.descriptor import KernelDescriptor
from pallas_kernels.fwd import FWD_GENERIC, FwdConfig, fwd_generic
from pallas_kernels.plan import KernelChoice, Plan, Target
from pallas_kernels.problem import Cotangents, FeatureArrays, Inputs, Problem, Saved

# Every kernel that takes tuned launch parameters (pallas_kernels.descriptor): the tuned-config
# registry, the built-in defaults, the autotuner's search space and runners derive from this.
KERNEL_DESCRIPTORS: tuple[KernelDescriptor, ...] = (
    FWD_GENERIC, DECODE_FWD_STAGE1, DECODE_FWD_STAGE2,
    BWD_PREPROC, BWD_GENERIC_DKDV, BWD_GENERIC_DQ, BWD_DBIAS,
)

__all__ = ["BackwardRows", "BwdConfig", "Cotangents", "DecodeConfig", "FeatureArrays",
           "FwdConfig", "Inputs", "KERNEL_DESCRIPTORS", "KernelChoice", "KernelDescriptor",
           "PagedKV", "Plan", "Problem", "Saved", "Target", "bwd_dbias", "bwd_exact_rows",
           "bwd_generic_dkdv", "bwd_generic_dq", "bwd_preproc", "decode_attention",
           "decode_fwd_stage1", "decode_fwd_stage2", "decode_num_splits", "fwd_generic",
           "paged_decode_attention", "rows_in_one_tile"]
