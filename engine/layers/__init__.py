"""The model's layers (Qwen3): linear (tensor-parallel shards), rotary, RMSNorm, SiLU-mul, embedding and LM
head, and the Triton kernels that fuse them on CUDA (fused_kernels.py, gemv.py). Sampling is engine/sampling/."""
