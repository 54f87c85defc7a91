"""`labkit generate`: offline generation through the engine (like `LLM.generate`), with evidence."""
from __future__ import annotations

from pathlib import Path

from engine import RequestError, SamplingParams
from labkit.errors import UserError
from labkit.evidence import write_evidence
from labkit.paths import default_out
from labkit.lab_engine import build_engine, install_env_trace, synthetic_note


def parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def run_generate(prompts: list[str] | None = None, token_ids: str | None = None, chat: bool = False,
                 max_tokens: int = 32, temperature: float = 0.0, ignore_eos: bool = False, seed: int | None = None,
                 out: Path | None = None, model: str | None = None, device: str = "auto", attention: str = "auto",
                 max_model_len: int = 1024, block_size: int = 256, eager: bool = True,
                 max_consecutive_prefill: int | None = None, fused_ops: bool = True, kv_cache_dtype: str = "auto") -> dict:
    if bool(prompts) == bool(token_ids):
        raise UserError("give either --prompt (one or more) or --token-ids")
    if chat and token_ids:
        raise UserError("--chat applies to --prompt text, not to --token-ids")
    try:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos, seed=seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    inputs = [parse_token_ids(token_ids)] if token_ids else (
        [[{"role": "user", "content": p}] for p in prompts] if chat else list(prompts))
    built = build_engine(model, device, attention, max_model_len=max_model_len, kvcache_block_size=block_size,
                         enforce_eager=eager, max_consecutive_prefill=max_consecutive_prefill, fused_ops=fused_ops,
                         kv_cache_dtype=kv_cache_dtype)
    engine = built.engine
    install_env_trace(engine)
    try:
        try:
            results = engine.generate(inputs, params, use_progress=True)
        except RequestError as exc:
            raise UserError(f"request rejected: {exc}") from None
        facts = {
            "requests": [{"prompt": p if isinstance(p, str) else None, "chat": chat,
                          "prompt_tokens": r["num_prompt_tokens"], "output_token_ids": r["token_ids"],
                          "text": r["text"], "finish_reason": r["finish_reason"]}
                         for p, r in zip(prompts or [None], results)],
            "sampling": {"temperature": temperature, "max_tokens": max_tokens, "ignore_eos": ignore_eos, "seed": seed},
            "steps": engine.num_steps,
            "note": synthetic_note(built.model),
        }
        return write_evidence(out or default_out("generate.json"), checkpoint=None, kind=built.kind, facts=facts,
                              device=built.device, model=built.model, seed=seed, engine=built.describe())
    finally:
        engine.close()
