"""The service's seams without an engine: the worker configuration (engine options declared once), serve's
defaults, the one mapping of engine refusals to HTTP 400, and the rule that the HTTP front reads the served
engine's record, never the engine."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from engine import ConfigError, EngineArgs, RequestError, SamplingParams
from serve.errors import ServeError
from labkit.lab_engine import lab_args
from serve.core.config import RECORDED, WorkerConfig
from serve.entrypoints.launch import serve_args
from serve.protocol.requests import GenRequest
from serve.entrypoints.serving import refusal

SERVE = Path(__file__).resolve().parents[3] / "serve"
#: the HTTP front and launch: they talk to a WorkerFront and read its ServedEngine record
FRONT_MODULES = tuple(f"entrypoints/{m}" for m in ("api_server", "http", "serving", "serving_native", "serving_openai",
                                                     "detokenize", "launch")) + ("core/front",)


def test_engine_options_by_name_go_into_one_engine_args():
    cfg = WorkerConfig(model="m", max_num_seqs=3, max_model_len=256, max_active=2, worker_id="w")
    assert cfg.engine == lab_args(model="m", max_num_seqs=3, max_model_len=256)
    assert isinstance(cfg.engine, EngineArgs)
    assert (cfg.max_active, cfg.worker_id, cfg.max_model_len) == (2, "w", 256)
    assert cfg.max_prompt_bytes == max(16 * 1024, 32 * 256)
    wider = dataclasses.replace(cfg, max_model_len=4096, max_prompt_bytes=None)
    assert wider.engine.max_model_len == 4096 and wider.engine.max_num_seqs == 3 and wider.max_active == 2
    assert wider.max_prompt_bytes == 32 * 4096
    flat = cfg.flat()
    assert set(flat) == set(RECORDED) | {f.name for f in dataclasses.fields(cfg)} - {"engine"}
    assert flat["max_num_seqs"] == 3 and flat["queue_size"] == cfg.queue_size


def test_worker_config_refuses_what_it_does_not_know():
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        WorkerConfig(max_num_seq=3)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        WorkerConfig(max_num_seqs=0)
    with pytest.raises(ServeError, match="max-active"):
        WorkerConfig(max_active=0)


def test_serve_args_fill_what_is_unset_and_tensor_parallel_keeps_overlap_off():
    cpu, worker = serve_args("cpu", 1, max_num_seqs=None, max_active=3, overlap=None)
    assert worker["max_active"] == 3 and cpu.max_num_seqs == 8 and cpu.max_model_len == 1024
    cuda, worker = serve_args("cuda:1", 1, overlap=None, engine_process=None, max_model_len=None)
    assert cuda.overlap is True and worker["engine_process"] is True and cuda.max_model_len == "auto"
    tp, worker = serve_args("cuda", 2, overlap=None, engine_process=None)
    assert tp.overlap is False and worker["engine_process"] is False and tp.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="overlap needs tensor_parallel_size 1"):   # given: the engine judges it
        serve_args("cuda", 2, overlap=True)
    assert serve_args("cpu", 1, max_model_len=None)[0].max_model_len == 1024
    assert serve_args("cpu", 1, attention_backend="torch")[0].attention_backend == "torch"
    with pytest.raises(TypeError):
        serve_args("cpu", 1, max_num_seq=4)


@pytest.mark.parametrize("code,param,http_code", [
    ("invalid_stop_token_ids", "stop_token_ids", "invalid_value"),    # a stop id outside the vocabulary
    ("invalid_logit_bias", "logit_bias", "invalid_value"),
    ("token_out_of_vocabulary", "prompt", "token_out_of_vocabulary"),   # the prompt's ids: the engine's code
    ("invalid_request_id", "request_id", "invalid_request_id"),
])
def test_engine_refusals_are_one_400_naming_the_parameter(code, param, http_code):
    req = GenRequest("completions", "hi", SamplingParams())
    err = refusal(RequestError("the engine says no", code), req)
    assert (err.status, err.code, err.param) == (400, http_code, param)


def _attribute_reads(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.name}:{n.lineno} .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in names]


def test_the_http_front_never_reads_the_engine():
    """The server, launch and the shared front read ``worker.served`` (a ServedEngine), never ``worker.engine``
    or ``worker.built``: what lets the engine live in another process without stand-ins."""
    found = [hit for mod in FRONT_MODULES for hit in _attribute_reads(SERVE / f"{mod}.py", {"engine", "built"})]
    assert not found, found
