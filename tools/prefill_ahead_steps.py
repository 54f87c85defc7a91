"""The steps nano-vllm's step model takes, overlapped, with each LAB_PREFILL_AHEAD setting, while requests
arrive: how the lookahead changes which step comes next, not only when it is launched.

One engine per setting, the same greedy requests (``--requests`` random prompts of ``--prompt`` tokens, ``--output``
tokens each), ``--per-call`` of them added before every ``step()`` call until all are in. Prints, per setting, the
steps by kind and the mean sequences per prefill step. With 1, the lookahead decides the step after a prefill
before the next request arrives (a decode), where the step model one step at a time would prefill that request
first: decodes interleave with smaller prefills. With "prefill" only a waiting prefill is launched early, behind
the decode in flight: the steps are the step model's; with "prefills" also one behind a prefill in flight.

    python tools/prefill_ahead_steps.py --model DIR [--per-call 1] [--requests 64] [--json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random


def run(model: str, mode: str, per_call: int, requests: int, prompt: int, output: int, seed: int = 0) -> dict:
    """mode: LAB_PREFILL_AHEAD's value (engine/levers.py's PREFILL_AHEAD_MODES)."""
    from engine import LLMEngine, SamplingParams
    from engine.levers import PREFILL_AHEAD_ENV

    old = os.environ.get(PREFILL_AHEAD_ENV)
    os.environ[PREFILL_AHEAD_ENV] = mode
    try:
        engine = LLMEngine(model, device="cpu", attention_backend="torch", enforce_eager=True, overlap=True,
                           mixed_batches=False, max_num_seqs=requests, max_num_batched_tokens=max(2048, prompt),
                           max_model_len=prompt + output + 16, kvcache_block_size=16,
                           num_kvcache_blocks=requests * ((prompt + output) // 16 + 2))
    finally:
        if old is None:
            os.environ.pop(PREFILL_AHEAD_ENV)
        else:
            os.environ[PREFILL_AHEAD_ENV] = old
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 5000) for _ in range(prompt)] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    added, kinds, sizes = 0, collections.Counter(), []
    try:
        while added < requests or not engine.is_finished():
            for _ in range(min(per_call, requests - added)):
                engine.add_request(prompts[added], params)
                added += 1
            out = engine.step()
            if out.seqs:
                kinds[out.kind] += 1
                if out.kind == "prefill":
                    sizes.append(len(out.seqs))
        d = engine.describe()
        return {"prefill_ahead": d["prefill_ahead"], "decode_behind_prefill": d["decode_behind_prefill"],
                "mode": mode, "steps": dict(kinds),
                "mean_prefill_seqs": round(sum(sizes) / max(1, len(sizes)), 2)}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (the tiny synthetic model will do)")
    ap.add_argument("--per-call", type=int, default=1, help="requests added before each step() call")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens")
    ap.add_argument("--output", type=int, default=24, help="output tokens")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from engine.levers import PREFILL_AHEAD_MODES

    rows = [run(a.model, mode, a.per_call, a.requests, a.prompt, a.output) for mode in PREFILL_AHEAD_MODES]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"LAB_PREFILL_AHEAD={r['mode']:8}  steps {r['steps']}  "
              f"mean sequences per prefill step {r['mean_prefill_seqs']}")


if __name__ == "__main__":
    main()
