"""tools/kernel_resources.py: the programs an sm_90 SM holds, and the paged decode's compiled variants read on the
CPU (Triton's sm_90 build, registers from cuobjdump). The decode prologue must not cost the bf16 decode an SM
program: its first build kept the new token's tiles live through the context loop (156 registers a thread against
105, three programs an SM instead of four). The persistent decode layer (--layer) must fit one program an SM and load its
first weight tile before its PDL wait."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from interp import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from kernel_resources import programs_per_sm  # noqa: E402


@pytest.mark.parametrize("registers, shared, warps, programs", [
    (105, 39168, 4, 4),      # 112 registers a thread (the granule) x 128 threads: 4 programs in 65,536
    (157, 22784, 4, 3),      # 160 x 128: 3
    (64, 21504, 4, 8),       # registers allow 8, shared memory 10
    (80, 140288, 8, 1),      # shared memory allows 1
    (32, 0, 1, 32),          # the SM's program limit
])
def test_programs_per_sm(registers, shared, warps, programs):
    assert programs_per_sm(registers, shared, warps) == programs


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_resources.py"), "--json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    if proc.returncode == 1 and "cannot compile for sm_90 here" in proc.stderr:
        pytest.skip(proc.stderr.strip()[:200])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {(r["cache"], r["route"]): r for r in json.loads(proc.stdout)}


def test_every_default_variant_compiles_and_reads_its_registers(rows):
    assert set(rows) == {("bf16", "plain"), ("bf16", "prologue"), ("fp8", "plain"), ("fp8", "prologue"),
                         ("fp8", "bf16-knobs"), ("fp8", "v_t")}, sorted(rows)
    for r in rows.values():
        assert "error" not in r and r["registers"] > 0 and r["shared_bytes"] > 0 and r["programs_per_sm"] >= 1, r
        assert r["sass_instructions"] > 100 and len(r["sass_sha"]) == 12, r


def test_the_fp8_defaults_keep_about_as_many_bytes_in_flight_as_bf16(rows):
    """An e4m3 cache's knobs (engine/attention/splits.py's DECODE_FP8_*, chosen from timings) keep what the first
    ones were chosen for: at the bf16 knobs its build held 3 programs an SM of half the bytes (67 KB in flight to
    bf16's 153); its own hold as many programs as bf16's, buffering within 5% of bf16's bytes (152 KB to 153)."""
    fp8, bf16 = rows["fp8", "plain"], rows["bf16", "plain"]
    assert fp8["programs_per_sm"] >= bf16["programs_per_sm"], (fp8, bf16)
    assert fp8["buffered_kb_per_sm"] >= 0.95 * bf16["buffered_kb_per_sm"], (fp8, bf16)
    at_bf16_knobs = rows["fp8", "bf16-knobs"]
    assert (at_bf16_knobs["num_stages"], at_bf16_knobs["fp8_v_in_tile"]) == (3, False), at_bf16_knobs
    assert fp8["buffered_kb_per_sm"] > at_bf16_knobs["buffered_kb_per_sm"], (fp8, at_bf16_knobs)


def test_the_v_t_layout_reads_v_in_runs_not_bytes(rows):
    """LAB_FP8_V_T (engine/attention/kv_quant.py: v_t): with each head's positions contiguous in a V block the e4m3
    tile reaches the P.V dot without the byte-at-a-time shared-memory gathers of the position-major layout: its
    context loop compiles to under 80% of the instructions (482 against 662 when this was written) and its
    shared-memory loads to under half, with at least as many programs an SM."""
    vt, plain = rows["fp8", "v_t"], rows["fp8", "plain"]
    assert vt["loop_instructions"] < 0.8 * plain["loop_instructions"], (vt["loop_instructions"], plain)
    assert vt["loop_mix"].get("LDS", 0) < 0.5 * plain["loop_mix"].get("LDS", 0), (vt["loop_mix"], plain["loop_mix"])
    assert vt["programs_per_sm"] >= plain["programs_per_sm"], (vt, plain)


def test_the_prologue_keeps_the_plain_decodes_programs_per_sm(rows):
    for cache in ("bf16", "fp8"):
        assert rows[cache, "prologue"]["programs_per_sm"] >= rows[cache, "plain"]["programs_per_sm"], \
            (rows[cache, "prologue"], rows[cache, "plain"])


@pytest.fixture(scope="module")
def layer_rows():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_resources.py"), "--layer", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    if proc.returncode == 1 and "cannot compile for sm_90 here" in proc.stderr:
        pytest.skip(proc.stderr.strip()[:200])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {r["preset"]: r for r in json.loads(proc.stdout)}


def test_the_layer_kernel_fits_an_sm_and_loads_its_first_tile_before_the_wait(layer_rows):
    """The persistent decode layer's grid barriers need all its programs resident at once (one an SM, the grid the
    SM count): its build must leave room for one; and its first qkv tile is loaded before the PDL wait."""
    assert set(layer_rows) == {"qwen3-0.6b", "qwen3-8b"}, sorted(layer_rows)
    for r in layer_rows.values():
        assert "error" not in r and r["programs_per_sm"] >= 1, r
        assert r["weight_loads_before_wait"] >= 1, r


def test_the_context_loop_is_found_with_its_dots_and_tile_loads(rows):
    """The loop read off the SASS is the context loop: it holds the tile loads and the dots, and on an e4m3 cache
    the conversions of its values (the issue slots a byte of cache costs)."""
    for key in (("bf16", "plain"), ("fp8", "plain")):
        r = rows[key]
        assert r["loop_mix"].get("HMMA", 0) > 0 and r["loop_instructions"] < r["sass_instructions"], r
        assert r["loop_instructions_per_kb"] > 0, r
    assert rows["fp8", "plain"]["loop_mix"].get("F2FP", 0) > 0, rows["fp8", "plain"]
