"""The model's layers (Qwen3): linear (tensor-parallel shards), rotary, RMSNorm, SiLU-mul, embedding and LM
head, and the Triton kernels that fuse them on CUDA (fused_kernels.py, gemv.py). Sampling is engine/sampling/."""

#: the most rows (tokens) the GEMV kernels of gemv.py take (LAB_GEMV_ROWS at most this): here, where the runner's
#: check of LAB_GEMV_ROWS reads it without importing triton
MAX_GEMV_ROWS = 8
#: the most rows the split-K GEMM of skinny_gemm.py takes (LAB_SKINNY_GEMM at most this), read here for the same reason
MAX_SKINNY_ROWS = 64
