"""Smoke: one chat-template prompt through the engine, exactly two output tokens."""
from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from labkit.evidence import write_evidence
from labkit.paths import default_out
from labkit.lab_engine import build_engine, install_env_trace, synthetic_note

SMOKE_MESSAGES = [{"role": "user", "content": "In one sentence, what does a KV cache store?"}]


def run_smoke(out: Path | None = None, model: str | None = None, device: str = "auto",
              attention: str = "auto") -> dict:
    built = build_engine(model, device, attention)
    engine = built.engine
    install_env_trace(engine)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt_ids = engine.encode(SMOKE_MESSAGES)
    results = engine.generate([SMOKE_MESSAGES], params)
    facts = {
        "prompt_messages": SMOKE_MESSAGES,
        "prompt_tokens": len(prompt_ids),
        "chat_template": True,
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
