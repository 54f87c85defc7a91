"""Sampling: a step's logits -> its token ids (vLLM's v1/sample/).

``params.py``       SamplingParams: one request's settings, with vLLM's names, ranges and meanings
``sampler.py``      Sampler: what the runner calls once per step (owns the generators and the token history);
                    the plain path (temperature only) and the processed path
``processors.py``   the logits processors (min_tokens, logit_bias, penalties, temperature, min_p, top_k/top_p)
``gumbel_kernel.py`` the plain path's one-pass Gumbel-max draw on CUDA (Triton)
``logprobs.py``     log-probs of the drawn tokens and of the prompt
``structured.py``   structured outputs: StructuredOutputsParams, the xgrammar compiler and cache, per-sequence
                    matchers, the token bitmask the sampler applies
"""
