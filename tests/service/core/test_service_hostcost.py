"""The served path's host time: the engine's wait for its sampled ids (StepOutput.wait_s), the owner's time
between steps by part in the step records, and the cheaper host path (one decode per token, token log lines
written by hand, a step's events logged in one hand-off, one write per wake-up) giving the same bytes."""
from __future__ import annotations

import json
import random

import aiohttp
import asyncio
import pytest

from engine import SamplingParams
from labkit.load.trace import token_ids
from serve.observe.events import EventLog, MemorySink, dumps_line, fan_out, make_event, sink_many
from serve.entrypoints.api_server import ServerThread
from serve.entrypoints.detokenize import IncrementalText, text_decoder
from serve.entrypoints.http import json_bytes as _dumps
from serve.core.worker import Worker, WorkerConfig

PARTS = ("deliver_us", "wakes_us", "publish_us", "boundary_us", "other_us")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


# --------------------------------------------------------------------------- instrumentation


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_step_output_wait_is_within_the_step(engine_factory, overlap):
    engine = engine_factory(max_num_seqs=4, max_model_len=64, overlap=overlap, kvcache_block_size=256)
    try:
        outs = []
        engine.generate([token_ids(1, "w", 8), token_ids(2, "w", 12)], SamplingParams(max_tokens=6, ignore_eos=True),
                        on_step=outs.append)
    finally:
        engine.close()
    assert outs and all(0.0 <= o.wait_s <= o.seconds for o in outs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_step_records_carry_wait_and_the_owners_gap_by_part(tiny_model_dir, overlap):
    sink = MemorySink()
    cfg = WorkerConfig(model=str(tiny_model_dir), device="cpu", max_active=4, max_num_seqs=4, max_model_len=64,
                       max_num_batched_tokens=128, worker_id=f"hc-{overlap}", overlap=overlap)
    with Worker(cfg, sink=sink).start() as w:
        hs = [w.submit(token_ids(i, "hc", 10), SamplingParams(max_tokens=5, ignore_eos=True)) for i in range(3)]
        for h in hs:
            assert h.wait(60)["reason"] == "length"
    events = sink.snapshot()
    for h in hs:             # the log has every token, in order, before its request's finished event (one hand-off per step)
        mine = [e for e in events if e["request_id"] == h.request_id and e["event"] in ("token", "finished")]
        assert [e.get("index") for e in mine] == [1, 2, 3, 4, 5, None]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) >= 5
    for s in steps:
        assert 0.0 <= s["wait_s"] <= s["seconds"]
    # "ahead": launched behind a step in flight (the overlapped decode's lookahead); one step at a time never
    assert any(s["ahead"] for s in steps) == overlap and not steps[0]["ahead"]
    assert steps[0]["before"] == {}                           # no step before the first
    tokens_at = {e["round"] for e in events if e["event"] == "token"}
    for a, b in zip(steps, steps[1:]):
        parts = b["before"]
        assert set(parts) == set(PARTS)
        gap_us = (b["start_ns"] - a["t_ns"]) / 1e3
        assert sum(parts.values()) == pytest.approx(gap_us, abs=1.0)   # the parts cover the gap (µs, rounded)
        assert all(parts[p] >= 0 for p in PARTS if p != "other_us")
        if a["round"] in tokens_at:
            assert parts["deliver_us"] > 0, (a, b)            # tokens were delivered after step a


def test_a_worker_hands_its_admission_to_the_engine_with_admit_in_flight(tiny_model_dir, monkeypatch):
    """LAB_ADMIT_IN_FLIGHT (on unless 0): the worker's engine asks the worker's own admission for arrivals while a
    prefill is in flight (engine.arrivals); with 0 it asks nothing. Either way every request is served; the admission the hook
    runs takes what is queued into the engine and says whether it took any."""
    for on in ("1", "0"):
        monkeypatch.setenv("LAB_ADMIT_IN_FLIGHT", on)
        cfg = WorkerConfig(model=str(tiny_model_dir), device="cpu", max_active=4, max_num_seqs=4, max_model_len=64,
                           max_num_batched_tokens=128, worker_id=f"admit-{on}", overlap=True)
        with Worker(cfg, sink=MemorySink()).start() as w:
            assert (w.engine.arrivals == w._admit_pending) == (on == "1") and w.engine.describe()["admit_in_flight"] \
                == (on == "1")
            hs = [w.submit(token_ids(i, "ad", 10), SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(3)]
            assert all(h.wait(60)["reason"] == "length" for h in hs)
            assert w.run_on_owner(lambda engine: w._admit_pending()) is False      # nothing queued: nothing taken


def test_host_bench_counts_every_token_and_both_threads(tiny_model_dir, tmp_path):
    from labkit.bench.host import run_host_bench

    for api in ("native", "openai"):
        f = run_host_bench(str(tiny_model_dir), api=api, streams=16, max_tokens=8, log_dir=tmp_path)
        assert f["tokens"] == f["expected_tokens"] == 16 * 8
        assert f["owner_us_per_token"] > 0 and f["front_us_per_token"] > 0
        assert f["wide_steps"] >= 7 and f["wide_gap_ms"]["n"] >= 6           # every stream in every decode step
        assert f["wide_gap_parts"]["deliver"]["us_per_step"]["n"] == f["wide_gap_ms"]["n"]


# --------------------------------------------------------------------------- the same text and bytes, cheaper


class _TwoDecodes:
    """The previous IncrementalText (two decodes per token, window restarted at every emit): the reference."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def _d(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True) if ids else ""

    def push(self, t):
        self.ids.append(t)
        before, after = self._d(self.ids[self.prefix:self.read]), self._d(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self):
        if self.read == len(self.ids):
            return ""
        before, after = self._d(self.ids[self.prefix:self.read]), self._d(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else after


def _sequences(tokenizer):
    rng = random.Random(7)
    size = len(tokenizer)
    text = "naïve café ✓ 你好世界 🙂🙃 ok\n\tend"
    byte_level = tokenizer.encode(text)                        # multi-byte characters split across tokens
    yield byte_level
    yield byte_level[::-1]
    yield list(tokenizer.all_special_ids) + byte_level
    for n in (1, 3, 9, 40, 120):
        yield [rng.randrange(size) for _ in range(n)]


def test_incremental_text_is_the_two_decode_text_piece_by_piece(tokenizer):
    for ids in _sequences(tokenizer):
        new, old = IncrementalText(tokenizer), _TwoDecodes(tokenizer)
        got = [new.push(t) for t in ids] + [new.flush()]
        want = [old.push(t) for t in ids] + [old.flush()]
        assert got == want
        assert "".join(got) == tokenizer.decode(ids, skip_special_tokens=True) or "\ufffd" in "".join(got)


def test_incremental_text_decodes_once_per_token(tokenizer):
    calls = []

    class Counting:
        def __init__(self, tok):
            self.tok = tok

        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = IncrementalText(Counting(tokenizer))
    ids = [random.Random(3).randrange(1000, 20000) for _ in range(64)]
    for t in ids:
        text.push(t)
    assert len(calls) <= len(ids) * (1 + 1 / IncrementalText.WINDOW) + 1    # the old one: 2 per token
    assert max(calls) <= IncrementalText.WINDOW + 2


def test_text_decoder_matches_decode_or_falls_back(tokenizer):
    fast = text_decoder(tokenizer)
    rng = random.Random(11)
    for ids in [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))] for _ in range(300)]:
        assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=True)

    class Liar:                       # its Rust decode disagrees with its decode(): never trusted
        clean_up_tokenization_spaces = False
        all_special_ids = [0]

        class _tokenizer:
            @staticmethod
            def decode(ids, skip_special_tokens=False):
                return "x" * len(ids)

        def __len__(self):
            return 100

        def encode(self, text):
            return [1, 2, 3]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(65 + i % 26) for i in ids)

    liar = Liar()
    assert text_decoder(liar)([1, 2]) == "BC"


def _token_events():
    rng = random.Random(5)
    for i in range(50):
        yield make_event("token", f"r-{i}:x.{rng.randrange(10**6)}", rng.choice(["worker-0", "wörker-ü", 'w"q\\']),
                         rng.randrange(10**6), t_ns=rng.randrange(10**15), index=i + 1, token_id=rng.randrange(151936))


def test_token_lines_are_json_dumps_text():
    canonical = lambda r: json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n"   # noqa: E731
    for ev in _token_events():
        assert dumps_line(ev) == canonical(ev)
    odd = [make_event("token", "r", "w", 1, t_ns=2, index=True, token_id=3),          # bool is no int here
           make_event("token", "r", "w", 1, t_ns=2, index=1, token_id=3.0),
           {**make_event("token", "r", "w", 1, t_ns=2, index=1, token_id=3), "logprob": [3, -0.5, 1, []]},
           make_event("token", None, "w", 1, t_ns=2, index=1, token_id=3),
           make_event("finished", "r", "w", 1, t_ns=2, reason="stop")]
    for ev in odd:
        assert dumps_line(ev) == canonical(ev)


def test_write_many_writes_what_write_writes(tmp_path):
    events = list(_token_events()) + [make_event("finished", "r", "w", 3, reason="length")]
    a, b = EventLog(tmp_path / "a.jsonl", flush_every=7), EventLog(tmp_path / "b.jsonl", flush_every=7)
    for ev in events:
        a.write(ev)
    b.write_many(events[:20])
    sink_many(b, events[20:])
    assert a.count == b.count == len(events)
    a.close()
    b.close()
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    m1, m2, seen = MemorySink(), MemorySink(), []
    sink_many(fan_out(m1, m2), events)
    sink_many(seen.append, events)              # a plain callable: one call per record
    assert m1.snapshot() == m2.snapshot() == seen == events


def test_streams_carry_the_canonical_bytes_of_each_event(tiny_model_dir):
    """Batched writes and the OpenAI chunk template change no byte: each line is the compact JSON of what it holds."""
    cfg = WorkerConfig(model=str(tiny_model_dir), device="cpu", max_active=4, max_num_seqs=4, max_model_len=64,
                       max_num_batched_tokens=128, worker_id="hc-bytes")
    srv = ServerThread(Worker(cfg).start(), "127.0.0.1", 0).start()

    async def fetch(path, body):
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + path, json=body) as r:
                assert r.status == 200
                return await r.read()

    try:
        model = srv.service.limits.served_model_name
        native = asyncio.run(fetch("/generate", {"prompt": "héllo wörld", "max_tokens": 12, "ignore_eos": True}))
        comp = asyncio.run(fetch("/v1/completions", {"model": model, "prompt": "héllo ✓", "max_tokens": 12,
                                                     "ignore_eos": True, "stream": True}))
        chat = asyncio.run(fetch("/v1/chat/completions", {"model": model, "max_tokens": 12, "ignore_eos": True,
                                                          "stream": True, "stream_options": {"include_usage": True},
                                                          "messages": [{"role": "user", "content": "hi 🙂"}]}))
    finally:
        srv.close()
    lines = native.split(b"\n")
    assert lines[-1] == b"" and sum(b'"event":"token"' in x for x in lines) == 12
    for line in lines[:-1]:
        assert line == _dumps(json.loads(line))
    for body in (comp, chat):
        chunks = [x[len(b"data: "):] for x in body.split(b"\n\n") if x]
        assert chunks[-1] == b"[DONE]" and len(chunks) >= 13
        for c in chunks[:-1]:
            assert c == _dumps(json.loads(c))
