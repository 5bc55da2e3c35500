"""Pallas attention kernels lowered to Triton (forward, backward, decode).

This package never imports `ffpa_jax`; its callers pass fully normalised inputs
(4-D q/k/v, 4-D bias/mask with broadcast dims of size 1) and a launch config.
"""

from pallas_kernels.bwd import (BwdConfig, bwd_dbias, bwd_exact_rows, bwd_generic_dkdv,
                                bwd_generic_dq, bwd_preproc, rows_in_one_tile)
from pallas_kernels.decode import (DecodeConfig, decode_attention, decode_fwd_stage1,
                                   decode_fwd_stage2, decode_num_splits)
from pallas_kernels.fwd import FwdConfig, fwd_generic

__all__ = ["BwdConfig", "DecodeConfig", "FwdConfig", "decode_attention", "decode_fwd_stage1",
           "decode_fwd_stage2", "decode_num_splits", "bwd_dbias", "bwd_exact_rows",
           "bwd_generic_dkdv", "bwd_generic_dq",
           "bwd_preproc", "fwd_generic", "rows_in_one_tile"]
