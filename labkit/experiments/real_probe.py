"""`labkit model probe smollm2`: the engine on real weights against transformers at one prompt.

"The capital of France is" -> " Paris" is SmolLM2-135M-Instruct's sturdiest probe (p = 0.77; the chat question's
first token wins by 0.08 logits only). The engine (eager, float32 on the CPU, the lab's engine options otherwise)
completes the prompt greedily and gives its next-token logits; transformers gives its own on the same directory in
float32. The evidence (runs/models-real-probe.json) holds both top-5s, the max abs logit difference and the
completion, with its own assertions: the completion starts with " Paris", transformers' argmax is " Paris" too, the
two top-5s are the same ids in the same order, and the logits agree within 1e-3 (measured: 2e-5 on bf16 weights,
3e-5 on float32 ones). Not fetched: one line naming ``labkit model fetch smollm2`` and no evidence.
"""
from __future__ import annotations

from pathlib import Path

PROMPT = "The capital of France is"
EXPECTED = " Paris"
LOGITS_TOL = 1e-3
CHECKPOINT = "models.real-paris"     # the probe's default prompt on smollm2 (checkpoints/models.json)


def run_probe(name: str = "smollm2", prompt: str = PROMPT, expected: str = EXPECTED, out: Path | None = None,
              max_tokens: int = 4) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import SamplingParams
    from labkit.checks import run_assertion
    from labkit.evidence import write_evidence
    from labkit.lab_engine import build_engine
    from labkit.paths import default_out

    built = build_engine(name, "cpu", "torch", max_model_len=512, enforce_eager=True, dtype="float32")
    engine = built.engine
    path = built.model["path"]
    try:
        tok = engine.tokenizer
        ids = tok(prompt).input_ids
        text = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]["text"]
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
        seqs, is_prefill = engine.schedule()
        row = engine.forward_logits(seqs, is_prefill)[0][0].float()
        engine.postprocess(seqs, [int(row.argmax())], is_prefill)
        describe = built.describe()
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()

    def top5(logits):
        top = logits.topk(5)
        return [{"id": i, "token": tok.decode([i]), "logit": round(v, 4)}
                for v, i in zip(top.values.tolist(), top.indices.tolist())]

    facts = {
        "prompt": prompt, "prompt_token_ids": ids, "expected": expected, "completion": text,
        "completion_starts_with_expected": text.startswith(expected),
        "engine_top5": top5(row), "transformers_top5": top5(ref),
        "same_top5": row.topk(5).indices.tolist() == ref.topk(5).indices.tolist(),
        "transformers_argmax_is_expected": tok.decode([int(ref.argmax())]) == expected,
        "max_abs_logit_diff": (row - ref).abs().max().item(),
        "p_expected": torch.softmax(row, -1)[int(row.argmax())].item(),
        "dtype": "float32", "family": describe["model"]["family"],
    }
    checks = [
        run_assertion("facts.completion_starts_with_expected", "is_true",
                      why=f"the engine completes {prompt!r} greedily with {expected!r}"),
        run_assertion("facts.transformers_argmax_is_expected", "is_true",
                      why="transformers' next token on the same directory is the expected one too"),
        run_assertion("facts.same_top5", "is_true", why="the engine's five best next tokens are transformers', in order"),
        run_assertion("facts.max_abs_logit_diff", "le", LOGITS_TOL,
                      why="float32 on the CPU: the engine's next-token logits within 1e-3 of transformers'"),
    ]
    claimed = (name.lower(), prompt, expected) == ("smollm2", PROMPT, EXPECTED)
    # the default probe is the checkpoint's command (its assertions are the same four, as data); another prompt
    # judges itself by the run assertions above
    return write_evidence(out or default_out("models-real-probe.json"), checkpoint=CHECKPOINT if claimed else None,
                          kind=built.kind, facts=facts, device=built.device, model=built.model, engine=describe,
                          run_assertions=None if claimed else checks)
