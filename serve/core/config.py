"""A worker's configuration: the engine's arguments (the engine's own ``engine.EngineArgs``, whole) and the
worker's own options (:class:`WorkerConfig`).

``WorkerConfig(engine=lab_args(...), max_active=...)``, or the engine's options by name:
``WorkerConfig(model=..., max_num_seqs=8, max_active=8)`` puts each one into ``engine`` (over
:func:`worker_args`, the practice preset of engine/args.py). ``dataclasses.replace(config, max_model_len=n)``
changes an engine option the same way. ``build_engine(config.engine)`` is the one way they reach the engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from engine import EngineArgs
from engine.args import OPTION_NAMES, preset
from serve.errors import ServeError
from serve.protocol.requests import REQUEST_ID_RE

#: The engine options by name (``engine.EngineArgs``' fields): the only names WorkerConfig takes for them.
ENGINE_FIELDS = frozenset(OPTION_NAMES)
#: The engine options a worker's record shows (``flat()``: /config, evidence), under the names it always had:
#: the record's ``attention`` is ``EngineArgs.attention_backend`` (RECORD_NAMES).
RECORDED = ("model", "device", "attention", "scheduling_policy", "max_consecutive_prefill", "max_num_batched_tokens",
            "max_num_seqs", "max_model_len", "gpu_memory_utilization", "enforce_eager", "num_kvcache_blocks",
            "tensor_parallel_size", "dist_init", "shm_name", "enable_prefix_caching", "overlap", "mixed_batches")
RECORD_NAMES = {"attention": "attention_backend"}


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ServeError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")


#: The engine preset ``labkit serve`` starts from per device (engine/args.py's PRESETS): on CUDA a server that
#: serves (vLLM's scale), on CPU the handbook's practice settings. Beside the engine's options a server chooses
#: its admission limit (as many requests as a step holds) and where its engine runs (on CUDA in a process of its
#: own, which the serve bench measured faster than one process on an H200).
SERVE_PRESETS = {"cuda": "serve-cuda", "cpu": "practice"}
#: The engine options a server's defaults show (``serve_defaults``), beside the worker's.
SERVE_CHOICES = ("enforce_eager", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "overlap")


def serve_defaults(device: str) -> dict:
    """The defaults of ``labkit serve`` on a resolved device (``cpu``, ``cuda``, ``cuda:N``)."""
    cuda = device.startswith("cuda")
    args = preset(SERVE_PRESETS["cuda" if cuda else "cpu"])
    return {**{k: getattr(args, k) for k in SERVE_CHOICES}, "max_active": args.max_num_seqs, "engine_process": cuda}


def engine_args(**given) -> EngineArgs:
    """The engine's arguments: each option ``given`` (engine names; one given as None keeps the engine's default,
    engine/args.py)."""
    return EngineArgs(**{k: v for k, v in given.items() if v is not None})


def worker_args(**given) -> EngineArgs:
    """A worker's engine when none is given: the practice preset (``labkit serve``'s CPU choice), then each
    engine option ``given``."""
    return preset("practice", **given)


def recorded(args: EngineArgs) -> dict:
    """The engine options of :data:`RECORDED` as a worker's record shows them (an unset pool size as None)."""
    out = {}
    for key in RECORDED:
        value = getattr(args, RECORD_NAMES.get(key, key))
        out[key] = None if key == "num_kvcache_blocks" and value == -1 else value
    return out


@dataclass(init=False)
class WorkerConfig:
    """One worker: its engine (``engine.EngineArgs``) and its own admission, queue and stream limits."""
    engine: EngineArgs
    max_active: int = 8
    queue_size: int = 64                    # requests waiting (an n x prompts request is one; serve.core.fair)
    max_active_per_request: int | None = None   # running slots one request may hold (None: fair.per_request_cap)
    worker_id: str = "worker-0"
    stream_buffer: int = 512
    load_tokenizer: bool = True             # text prompts and detokenized output need it
    log_steps: bool = True                  # one "step" record per engine step in the log
    max_prompt_bytes: int | None = None     # longer text prompts are refused untokenized (None: 32 x max_model_len)
    special_tokens_in_content: bool = False  # True: special-token text inside chat messages becomes control tokens
    reasoning_parser: str | None = None     # "qwen3": chat answers' <think> part in the reasoning fields (vLLM's flag)
    enable_auto_tool_choice: bool = True    # tool_choice "auto" parses tool calls (vLLM needs the flag; here on)
    tool_call_parser: str = "hermes"        # how tool calls are read (Qwen3's <tool_call> JSON: hermes)
    grammar_cache_mb: int = 512             # compiled grammars kept, in MiB (engine/sampling/structured.py)
    grammar_compile_timeout: float = 10.0   # a grammar compile's time budget, seconds (then a 400)
    grammar_max_mb: int = 128               # one compiled grammar's size budget, MiB (then a 400)
    grammar_step_budget_ms: float = 10.0    # a request's mask work per step, CPU ms (then it finishes: abort)

    def __init__(self, engine: EngineArgs | None = None, **options) -> None:
        """The worker's fields by name; the engine's as ``engine``, by their names, or both (a name given
        changes that option of ``engine``: ``dataclasses.replace(config, max_model_len=n)`` works)."""
        mine = {f.name: f for f in fields(self) if f.name != "engine"}
        unknown = sorted(set(options) - set(mine) - ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"WorkerConfig got unknown option(s) {', '.join(unknown)}")
        engine_options = {k: v for k, v in options.items() if k in ENGINE_FIELDS}
        if engine is None:
            self.engine = worker_args(**engine_options)
        else:
            self.engine = dataclasses.replace(engine, **engine_options)
        for name, f in mine.items():
            setattr(self, name, options.get(name, f.default))
        self.__post_init__()

    def __post_init__(self) -> None:
        _positive(self, "max_active", "queue_size", "stream_buffer", "grammar_cache_mb", "grammar_max_mb")
        if not isinstance(self.grammar_compile_timeout, (int, float)) or isinstance(self.grammar_compile_timeout, bool) \
                or not self.grammar_compile_timeout > 0:
            raise ServeError(f"grammar-compile-timeout must be a positive number of seconds, "
                             f"got {self.grammar_compile_timeout!r}")
        if not isinstance(self.grammar_step_budget_ms, (int, float)) or isinstance(self.grammar_step_budget_ms, bool) \
                or not self.grammar_step_budget_ms > 0:
            raise ServeError(f"grammar-step-budget-ms must be a positive number, got {self.grammar_step_budget_ms!r}")
        if self.max_active_per_request is not None:
            _positive(self, "max_active_per_request")
        if self.max_prompt_bytes is None and self.max_model_len != "auto":   # "auto": set once the engine fitted it
            self.max_prompt_bytes = max(16 * 1024, 32 * self.max_model_len)
        if self.max_prompt_bytes is None:
            pass
        elif not isinstance(self.max_prompt_bytes, int) or isinstance(self.max_prompt_bytes, bool) \
                or self.max_prompt_bytes < 1:
            raise ServeError(f"max-prompt-bytes must be a positive integer, got {self.max_prompt_bytes!r}")
        if self.reasoning_parser not in (None, "qwen3"):
            raise ServeError(f"--reasoning-parser must be qwen3, got {self.reasoning_parser!r}")
        if self.tool_call_parser != "hermes":
            raise ServeError(f"--tool-call-parser must be hermes (Qwen3's format), got {self.tool_call_parser!r}")
        if not REQUEST_ID_RE.fullmatch(self.worker_id):
            raise ServeError(f"worker id must match {REQUEST_ID_RE.pattern}, got {self.worker_id!r}")

    @property
    def max_model_len(self) -> int | str:
        return self.engine.max_model_len

    def flat(self) -> dict:
        """The engine's options and the worker's fields in one flat dict (evidence, ``/config``)."""
        mine = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        return {**recorded(self.engine), **mine}
