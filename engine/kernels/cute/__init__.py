"""CuTe DSL GEMMs: FP8 on Hopper WGMMA (fp8_gemm_sm90) and Blackwell tcgen05 (fp8_gemm_sm100),
NVFP4 (nvfp4_*). Modules here import CuTe DSL at import time; import them lazily from dispatchers.
"""
