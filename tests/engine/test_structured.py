"""Structured outputs (SamplingParams.structured_outputs, engine/sampling/structured.py) on the tiny random
model: whatever the weights, the output follows the grammar and ends when it does. Bounded schemas (an enum,
a small integer, a short string) and compact JSON, so that a random model must finish within max_tokens."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading

import pytest

from engine import LLMEngine, RequestError, SamplingParams, StructuredOutputsParams

KW = dict(max_model_len=256)          # and testkit.ENGINE_DEFAULTS
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tag": {"type": "string", "maxLength": 2}},
          "required": ["color", "n", "tag"]}
PROMPTS = ["Give me a color", "x y z"]
SPECIAL = re.compile(r"<\|[a-z_]+\|>$")


def set_overlap(engine: LLMEngine, on: bool) -> None:
    """Config's options are read-only (engine/args.py): the idle engine gets new args with overlap set."""
    engine.config.args = dataclasses.replace(engine.config.args, overlap=on)


@pytest.fixture(scope="module")
def shared(engine_factory) -> LLMEngine:
    return engine_factory(**KW)


@pytest.fixture
def engine(request, shared):
    """The module's engine with Config.overlap as the test's parameter says (step() reads it per call; the engine
    is idle here), so both loops run without building (and loading the grammar compiler for) a second one."""
    set_overlap(shared, request.param)
    yield shared
    set_overlap(shared, False)


def text_of(out: dict) -> str:
    """The completion without its final EOS token's text (generate() keeps special tokens)."""
    return SPECIAL.sub("", out["text"])


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"color", "n", "tag"}, obj
    assert obj["color"] in ("red", "green", "blue") and isinstance(obj["n"], int) and 0 <= obj["n"] <= 9, obj
    assert isinstance(obj["tag"], str) and len(obj["tag"]) <= 3, obj


def samples(out: dict) -> list[dict]:
    return out.get("outputs", [out])


@pytest.mark.parametrize("engine, temperature, n", [(False, 0.0, 1), (True, 1.0, 2)], indirect=["engine"],
                         ids=["step-greedy", "overlap-sampled-n2"])
def test_json_schema_output_parses_and_validates(engine, temperature, n):
    sp = SamplingParams(temperature=temperature, max_tokens=40, n=n, seed=7,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    outs = [s for out in engine.generate(PROMPTS[:3 - n], sp) for s in samples(out)]
    assert len(outs) == 2
    for s in outs:
        assert s["finish_reason"] == "stop", s
        check_schema(text_of(s))


def test_regex_choice_grammar_and_a_plain_neighbour(shared):
    """One overlapped batch: a regex, a choice, an EBNF grammar, a structural tag, and an unconstrained request
    whose greedy tokens are the same as when it runs alone (the mask touches only its own rows; the batch runs
    step by step while a constrained row is in it, then the plain row goes on overlapped)."""
    engine = shared
    set_overlap(engine, True)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = engine.generate(["plain neighbour"], plain)[0]["token_ids"]
    call = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"enum": [1, 2]}},
            "required": ["name", "arguments"]}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<v>"], "at_least_one": True,
                                                "stop_after_first": True, "tags": [
                                                    {"type": "tag", "begin": "<v>", "end": "</v>",
                                                     "content": {"type": "json_schema", "json_schema": call}}]}}
    sps = [SamplingParams(temperature=1.0, max_tokens=30, structured_outputs={"regex": r"[a-c]{2}-\d{1,3}"}),
           SamplingParams(temperature=1.0, max_tokens=30, structured_outputs={"choice": ["alpha", "beta \"q\""]}),
           SamplingParams(temperature=1.0, max_tokens=30, structured_outputs={"grammar": 'root ::= "yes" | "no" [0-9]'}),
           SamplingParams(temperature=1.0, max_tokens=40,      # (its JSON: at most one blank between tokens)
                          structured_outputs={"structural_tag": json.dumps(tag), "disable_any_whitespace": True}),
           plain]
    outs = engine.generate(["a", "b", "c", "d", "plain neighbour"], sps)
    assert all(o["finish_reason"] == "stop" for o in outs[:4]), outs
    assert re.fullmatch(r"[a-c]{2}-\d{1,3}", text_of(outs[0])), outs[0]
    assert text_of(outs[1]) in ("alpha", "beta \"q\""), outs[1]
    assert re.fullmatch(r"yes|no[0-9]", text_of(outs[2])), outs[2]
    m = re.fullmatch(r"<v>(.*)</v>", text_of(outs[3]), re.S)
    assert m and json.loads(m.group(1))["arguments"] in (1, 2), outs[3]
    assert outs[4]["token_ids"] == alone
    set_overlap(engine, False)


def test_processed_path_with_logprobs_and_top_k(shared):
    """A constrained row that also takes the processed path (top_k, logprobs): its draw and log-probs see the mask."""
    sp = SamplingParams(temperature=1.0, top_k=5, logprobs=2, max_tokens=60,
                        structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    out = shared.generate(["processed"], sp)[0]
    assert out["finish_reason"] == "stop"
    check_schema(text_of(out))
    assert all(lp.logprob > float("-inf") for lp in out["logprobs"])


def test_legacy_structural_tag_form_compiles(shared):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}
    shared.validate([1, 2, 3], SamplingParams(structured_outputs={"structural_tag": tag}))


LENGTH_BOUNDED = {"type": "string", "maxLength": 3}


@pytest.mark.parametrize("so, wrap", [
    ({"json": LENGTH_BOUNDED}, "{}"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>", "content": {
        "type": "json_schema", "json_schema": LENGTH_BOUNDED}}}}, "<f>{}</f>"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "schema": LENGTH_BOUNDED, "end": "</f>"}],
                         "triggers": ["<f"]}}, "<f>{}</f>"),
], ids=["json", "tag", "legacy-tag"])
def test_length_bounded_strings_take_no_raw_control_characters(shared, so, wrap):
    """xgrammar 0.2.9 lets raw control characters into a string with maxLength (upstream issue 800)."""
    sp = SamplingParams(structured_outputs=so)
    assert shared.grammars.matcher(sp.structured_outputs).matcher.accept_string(wrap.format('"ab"'))
    assert not shared.grammars.matcher(sp.structured_outputs).matcher.accept_string(wrap.format('"a\tb"'))


PATTERN_BOUNDED = {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5}      # narrowed
TWO_PARTS = {"type": "string", "pattern": "^[a-z]+-[a-z]+$", "minLength": 4, "maxLength": 5}   # a grammar
CASES = {"narrowed": (PATTERN_BOUNDED, [("abc", True), ("abcde", True), ("ab", False), ("abcdef", False),
                                        ("ab1", False)]),
         "grammar": (TWO_PARTS, [("ab-c", True), ("a-bcd", True), ("a-b", False), ("abc-de", False),
                                 ("abcd", False), ("a-b-c", False)])}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("form", ["json", "tag", "legacy-tag"])
def test_a_pattern_keeps_its_length_bounds(shared, form, case):
    """xgrammar drops minLength / maxLength beside a pattern; they are written into the pattern, or the string
    gets a grammar of its own."""
    schema, texts = CASES[case]
    so, wrap = {
        "json": ({"json": schema}, "{}"),
        "tag": ({"structural_tag": {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                                         "content": {"type": "json_schema",
                                                                                     "json_schema": schema}}}},
                "<f>{}</f>"),
        "legacy-tag": ({"structural_tag": {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
                                           "triggers": ["<f"]}}, "<f>{}</f>")}[form]
    sp = SamplingParams(structured_outputs=so)
    for text, ok in texts:
        matcher = shared.grammars.matcher(sp.structured_outputs).matcher
        assert matcher.accept_string(wrap.format(f'"{text}"')) == ok, text


BAD = [({"json": '{"type": 3}'}, "json"), ({"json": "{not json"}, "json"), ({"regex": "(("}, "regex"),
       ({"grammar": "root ::= "}, "grammar"), ({"structural_tag": {"format": 1}}, "structural_tag"),
       ({"choice": []}, "choice"), ({"json": {}, "regex": "a"}, "exactly one"), ({"jsn": {}}, "unknown field")]


def test_bad_constraints_are_request_errors_at_admission(shared):
    for so, field in BAD:
        with pytest.raises(RequestError, match=field) as e:
            shared.add_request([1, 2, 3], SamplingParams(structured_outputs=so))
        assert e.value.code == "invalid_structured_outputs"
        assert shared.is_finished()              # nothing was queued


def test_unconstrained_batches_build_no_mask():
    """The sampler's walk over a batch with no constrained row does no grammar work: no mask is made, the ids
    are the plain path's."""
    import torch

    from engine.sampling.sampler import Sampler, sample_tensor

    class Seq:
        def __init__(self, i, t):
            self.seq_id, self.sampling_params, self.grammar = i, SamplingParams(temperature=t), None
            self.num_completion_tokens = 0

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    sampler = Sampler("cpu", seed=5)
    ids, lps = sampler([Seq(0, 0.0), Seq(1, 1.0), Seq(2, 0.7)], logits.clone())
    assert sampler._mask is None and lps is None
    gen = torch.Generator().manual_seed(5)
    assert ids.tolist() == sample_tensor(logits.clone(), [0.0, 1.0, 0.7], [gen] * 3).tolist()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_grammar_compiles_run_at_a_lower_cpu_priority_than_the_step_loop():
    """A long compile yields the CPU to the step loop and the event loop (a fuzz scenario's plain request went
    from about 1.5x to about 1.1x its idle latency on 2 cores while clients looped costly grammars)."""
    from engine.sampling.structured import DaemonWorkers

    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    there = DaemonWorkers(1, "nice-test", nice=10).submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert there.result(timeout=10) == here + 10
