"""vLLM's /metrics names on this server, checked as vLLM's own metrics test checks them
(tests/entrypoints/openai/test_metrics.py in vLLM): after a completion every name of vLLM's expected list is
in /metrics, with vLLM's type and labels; after N sequential completions of one prompt
every family moved by vLLM's expected values; the n parameter is counted once per prompt; docs/METRICS.md
names every vLLM series, served or not. Both worker kinds (in this process, and the engine in its own)."""
from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_fixtures import MODES, post, serving, settle_after

from labkit.load.trace import token_ids

DOC = Path(__file__).resolve().parents[3] / "docs" / "METRICS.md"

# vLLM's expected series (its metrics test, v1 engine, hidden deprecated ones aside), by family and type
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
}
# in vLLM's list too, but hidden there unless --show-hidden-metrics-for-version (deprecated names)
VLLM_HIDDEN = ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
               "vllm:time_per_output_token_seconds")
SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_sum", "_bucket", "_count")}


def expected_names() -> list[str]:
    """The sample names vLLM's test looks for (its 50 less the 6 hidden ones: 44), each histogram and counter with
    every sample suffix (46: vLLM names iteration_tokens_total once, and the two prefix-cache counters bare)."""
    return [fam + sfx for fam, kind in VLLM_FAMILIES.items() for sfx in SUFFIXES[kind]]


@pytest.fixture(scope="module", params=MODES)
def server(request, tiny_model_dir):
    yield from serving(tiny_model_dir, request.param, record=False, max_active=4, queue_size=8, max_model_len=256,
                       worker_id="vllm-metrics")


_idle = settle_after("server")


def scrape(server) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """({family: type}, {(sample name, labels other than le, model_name, engine, worker_id): value})."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    types, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:"):
            continue
        types[fam.name] = fam.type
        for s in fam.samples:
            if "le" in s.labels:
                continue
            if fam.name != "vllm:cache_config_info":
                assert s.labels["model_name"] and s.labels["engine"] == "0" and s.labels["worker_id"], s
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine", "worker_id", "le")))
            samples[(s.name, labels)] = s.value
    return types, samples


def sample_names(server) -> set[str]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        return {s.name for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples}


def test_every_vllm_name_is_served_with_vllms_type(server):
    status, out = post(server, "/v1/completions", {"prompt": "Hello, my name is", "max_tokens": 5, "temperature": 0})
    assert status == 200, out
    names = sample_names(server)
    missing = [n for n in expected_names() if n not in names]
    assert not missing, f"{len(missing)} of vLLM's {len(expected_names())} names missing: {missing}"
    types, samples = scrape(server)
    assert {f: types.get(f) for f in VLLM_FAMILIES} == VLLM_FAMILIES
    info = [labels for (name, labels) in samples if name == "vllm:cache_config_info"]
    assert len(info) == 1 and samples[("vllm:cache_config_info", info[0])] == 1.0
    info = dict(info[0])
    assert info["block_size"] == str(server.worker.served.config.kvcache_block_size)
    assert info["num_gpu_blocks"] == str(server.worker.served.num_blocks) and info["enable_prefix_caching"] == "True"


def test_counts_move_as_vllms_test_expects(server):
    prompt, n_req, max_tokens = token_ids(4, "vllm-metrics", 9), 3, 5
    _, before = scrape(server)
    for _ in range(n_req):
        status, out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        assert status == 200, out
    _, after = scrape(server)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    p = len(prompt)
    expected = {            # vLLM's expected values for N requests of a P-token prompt and M tokens each
        "vllm:time_to_first_token_seconds_count": n_req,
        "vllm:inter_token_latency_seconds_count": n_req * (max_tokens - 1),
        "vllm:e2e_request_latency_seconds_count": n_req, "vllm:request_queue_time_seconds_count": n_req,
        "vllm:request_inference_time_seconds_count": n_req, "vllm:request_prefill_time_seconds_count": n_req,
        "vllm:request_decode_time_seconds_count": n_req,
        "vllm:request_prompt_tokens_sum": n_req * p, "vllm:request_prompt_tokens_count": n_req,
        "vllm:request_generation_tokens_sum": n_req * max_tokens, "vllm:request_generation_tokens_count": n_req,
        "vllm:request_params_n_count": n_req, "vllm:request_params_n_sum": n_req,
        "vllm:request_params_max_tokens_sum": n_req * max_tokens, "vllm:request_params_max_tokens_count": n_req,
        "vllm:iteration_tokens_total_sum": n_req * (p + max_tokens),
        "vllm:iteration_tokens_total_count": n_req * max_tokens,
        "vllm:prompt_tokens_total": n_req * p, "vllm:generation_tokens_total": n_req * max_tokens,
    }
    assert {k: moved(k) for k in expected} == expected
    assert moved("vllm:request_success_total", finished_reason="length") == n_req
    # the phases add up as vLLM defines them: TTFT = queue + prefill, inference = prefill + decode, and
    # queue + inference ends at the last token, before the request's end
    queue, prefill, decode, inference, ttft, e2e = (moved(f"vllm:{n}_seconds_sum") for n in (
        "request_queue_time", "request_prefill_time", "request_decode_time", "request_inference_time",
        "time_to_first_token", "e2e_request_latency"))
    assert prefill > 0 and decode > 0
    assert ttft == pytest.approx(queue + prefill, abs=1e-6) and inference == pytest.approx(prefill + decode, abs=1e-6)
    assert queue + inference <= e2e + 1e-6
    # per request, its decode time over the tokens after the first
    assert moved("vllm:request_time_per_output_token_seconds_count") == n_req
    assert moved("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode / (max_tokens - 1), abs=1e-6)


def test_n_is_counted_once_per_prompt(server):
    _, before = scrape(server)
    status, out = post(server, "/v1/completions", {"prompt": [token_ids(4, "n-a", 6), token_ids(4, "n-b", 7)],
                                                   "n": 3, "max_tokens": 2, "ignore_eos": True, "temperature": 1.0})
    assert status == 200 and len(out["choices"]) == 6, out
    _, after = scrape(server)

    def moved(name):
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    assert (moved("vllm:request_params_n_count"), moved("vllm:request_params_n_sum")) == (2, 6)
    assert (moved("vllm:request_params_max_tokens_count"), moved("vllm:request_params_max_tokens_sum")) == (6, 12)
    assert moved("vllm:e2e_request_latency_seconds_count") == 6


def test_metrics_doc_names_every_vllm_series():
    doc = DOC.read_text()
    named = set(re.findall(r"`(vllm:[a-z0-9_]+)`", doc))
    for fam, kind in VLLM_FAMILIES.items():
        shown = fam + ("_total" if kind == "counter" else "")
        assert shown in named, f"docs/METRICS.md does not name {shown}"
    for fam in VLLM_HIDDEN:
        assert fam in named, f"docs/METRICS.md does not say why {fam} is not served"
