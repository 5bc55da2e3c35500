"""Pallas attention kernels lowered to Triton (forward, backward, decode).

This package never imports `ffpa_jax`; its callers pass fully normalised inputs
(4-D q/k/v, 4-D bias/mask with broadcast dims of size 1) and a launch config.
"""

from pallas_kernels.bwd import (BWD_DBIAS, BWD_GENERIC_DKDV, BWD_GENERIC_DQ, BWD_PREPROC,
                                BwdConfig, bwd_dbias, bwd_exact_rows, bwd_generic_dkdv,
                                bwd_generic_dq, bwd_preproc, rows_in_one_tile)
from pallas_kernels.decode import (DECODE_FWD_STAGE1, DECODE_FWD_STAGE2, DecodeConfig,
                                   decode_attention, decode_fwd_stage1, decode_fwd_stage2,
                                   decode_num_splits, paged_decode_attention)
from pallas_kernels.descriptor import KernelDescriptor
from pallas_kernels.fwd import FWD_GENERIC, FwdConfig, fwd_generic

# Every kernel that takes tuned launch parameters (pallas_kernels.descriptor): the tuned-config
# registry, the built-in defaults, the autotuner's search space and runners derive from this.
KERNEL_DESCRIPTORS: tuple[KernelDescriptor, ...] = (
    FWD_GENERIC, DECODE_FWD_STAGE1, DECODE_FWD_STAGE2,
    BWD_PREPROC, BWD_GENERIC_DKDV, BWD_GENERIC_DQ, BWD_DBIAS,
)

__all__ = ["BwdConfig", "DecodeConfig", "FwdConfig", "KERNEL_DESCRIPTORS", "KernelDescriptor",
           "decode_attention", "decode_fwd_stage1", "decode_fwd_stage2", "decode_num_splits",
           "paged_decode_attention",
           "bwd_dbias", "bwd_exact_rows", "bwd_generic_dkdv", "bwd_generic_dq",
           "bwd_preproc", "fwd_generic", "rows_in_one_tile"]
