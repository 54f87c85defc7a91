"""Smoke: one chat-template prompt through the engine, exactly two output tokens.

That the prompt went through the chat template is shown by its tokens, not claimed: the evidence
holds the token ids the model's first forward received (the runner's ``inputs`` event), and the
checkpoint asserts that they open a user turn and end with the generation prompt of Qwen3's
template (``<|im_start|>assistant\n`` plus the empty think block of ``enable_thinking=False``).
"""
from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from labkit.evidence import write_evidence
from labkit.paths import default_out
from labkit.lab_engine import build_engine, install_env_trace, synthetic_note

SMOKE_MESSAGES = [{"role": "user", "content": "In one sentence, what does a KV cache store?"}]
IM_START_ID, IM_END_ID = 151644, 151645        # <|im_start|>, <|im_end|> (labkit/assets/tokenizer.py)
#: <|im_start|> assistant \n <think> \n\n </think> \n\n: the template's generation prompt, thinking off
GENERATION_PROMPT = (151644, 77091, 198, 151667, 271, 151668, 271)


def run_smoke(out: Path | None = None, model: str | None = None, device: str = "auto",
              attention: str = "auto") -> dict:
    built = build_engine(model, device, attention)
    engine = built.engine
    install_env_trace(engine)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    fed: list[list[int]] = []          # input_ids of every prefill forward, as the runner built them
    engine.events.subscribe(lambda e: fed.append(e.data["input_ids"])
                            if e.name == "inputs" and e.phase == "prefill" else None)
    results = engine.generate([SMOKE_MESSAGES], params)
    prompt_ids = [t for ids in fed for t in ids]
    facts = {
        "prompt_messages": SMOKE_MESSAGES,
        "prompt_tokens": len(prompt_ids),
        "prompt_token_ids": prompt_ids,
        "prompt_head": prompt_ids[:3],
        "prompt_tail": prompt_ids[-len(GENERATION_PROMPT):],
        "prompt_im_start_count": prompt_ids.count(IM_START_ID),
        "prompt_im_end_count": prompt_ids.count(IM_END_ID),
        "prefill_forwards": len(fed),
        "num_results": len(results),
        "output_token_counts": [len(r["token_ids"]) for r in results],
        "output_token_ids": [r["token_ids"] for r in results],
        "text": [r["text"] for r in results],
        "kv_blocks": engine.stats().num_blocks,
        "steps": engine.num_steps,
        "note": synthetic_note(built.model),
    }
    record = write_evidence(out or default_out("setup-smoke.json"), checkpoint="setup.smoke", kind=built.kind,
                            facts=facts, device=built.device, model=built.model, seed=engine.config.seed,
                            engine=built.describe())
    engine.close()
    return record
