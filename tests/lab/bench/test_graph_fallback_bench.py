"""`labkit bench --workload graph-vs-eager`'s B.5 step 4 (the eager fallback of buckets that stop at 16, timed beside
the explicit eager engine and the covering bucket), with the engine runs stood in: the bench runs on CUDA only."""
from __future__ import annotations

from labkit.bench import run as bench_run
from labkit.checks import evaluate, get_checkpoint, verdict


def _facts(monkeypatch, fallback_routes=("eager",), fallback_tok_s=1000.0):
    calls = []

    def fake(model_dir, device, attention, eager, n, input_len, output_len, max_seqs, graph_buckets=None, **_):
        calls.append((eager, n, max_seqs, graph_buckets))
        fallback = graph_buckets is not None
        routes = ["eager"] if eager else list(fallback_routes) if fallback else [f"graph:{max_seqs if n > 16 else 16}"]
        tok_s = 1000.0 if eager else fallback_tok_s if fallback else 2500.0
        return {"median_tok_s": tok_s, "output_tokens_per_repeat": [n * output_len], "decode_routes": routes,
                "engine": {"init_seconds": 2.0 if eager else 5.0, "capture_seconds": 0 if eager else 3.0}}

    monkeypatch.setattr(bench_run, "_median_run", fake)
    return bench_run.bench_graph_vs_eager("m", "cuda", "triton"), calls


def _judge(facts):
    checks = [evaluate(a, {"facts": facts}) for a in get_checkpoint("cuda.graph-vs-eager").assertions]
    return verdict(checks), {c["name"] for c in checks if c.get("status") != "pass"}


def test_the_fallback_runs_17_requests_on_buckets_that_stop_at_16_beside_b5s_engines(monkeypatch):
    facts, calls = _facts(monkeypatch)
    assert calls[-1] == (False, 17, 20, (1, 2, 4, 8, 16))
    fb = facts["b5_fallback"]
    assert fb["graph_buckets"] == [1, 2, 4, 8, 16] and fb["fallback_over_eager"] == 1.0
    assert fb["fallback_over_covered"] == 0.4
    assert fb["startup_seconds"] == {"eager": {"init": 2.0, "capture": 0}, "covered": {"init": 5.0, "capture": 3.0},
                                     "fallback": {"init": 5.0, "capture": 3.0}}
    assert _judge(facts) == ("PASS", set())


def test_the_checkpoint_fails_a_fallback_that_replayed_a_graph_and_reviews_a_slow_one(monkeypatch):
    facts, _ = _facts(monkeypatch, fallback_routes=("eager", "graph:16"))
    v, failed = _judge(facts)
    assert v == "FAIL" and failed == {"facts.b5_fallback.graph.decode_routes"}
    facts, _ = _facts(monkeypatch, fallback_tok_s=700.0)
    v, failed = _judge(facts)
    assert v == "REVIEW" and failed == {"facts.b5_fallback.fallback_over_eager"}
    facts, _ = _facts(monkeypatch, fallback_tok_s=400.0)              # below the floor, half the target
    v, failed = _judge(facts)
    assert v == "FAIL" and failed == {"facts.b5_fallback.fallback_over_eager",
                                      "facts.b5_fallback.fallback_over_eager (floor)"}
