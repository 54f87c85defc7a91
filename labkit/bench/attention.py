"""`labkit bench --workload attention`: paged decode attention alone, per backend, as achieved bandwidth.

Decode attention reads every cached K and V of every sequence once per step, so its floor is bytes read
over memory bandwidth. Each shape (batch, context) is timed with CUDA events for every available backend (median
of the repeats; each call's GPU time with a cold L2 and its host launch hidden, :func:`kernel_ms`), next to two
baselines measured in the same run: a device-to-device copy (the bandwidth roof actually reachable here) and
PyTorch's fused SDPA on the same K/V laid out densely (no paging). With `--sweep` the Triton kernel's knobs (positions per tile, warps, stages, split waves) are
timed too, so a tuning choice comes with its evidence; :func:`sweep_kernel` adds the decode
variants (kv heads per program, one block-table load per tile) on five shapes with the share of roof.

A fast wrong kernel is no result: before a kernel is timed its output is compared with dense SDPA in
float32 on the same K/V gathered through the block table (:func:`decode_reference`,
:func:`prefill_reference`), and the max abs error of every case is recorded; the checkpoint fails a
kernel whose error exceeds :data:`OUTPUT_TOL`. The reference functions are plain PyTorch and run on
the CPU too (tests).
"""
from __future__ import annotations

import itertools

from labkit.bench.timing import KERNEL_TIMING, copy_roof_gbs, kernel_ms

SHAPES = ((1, 1024), (1, 4096), (16, 1024), (64, 1024), (256, 1024), (256, 2048))
# prefill: (sequences, cached prefix per sequence, new tokens per sequence)
PREFILL_SHAPES = ((30, 0, 540), (16, 512, 512), (118, 512, 128))
PREFILL_SWEEP = {"block_m": (32, 64, 128), "block_n": (32, 64), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3), "waves": (1, 2, 4)}
SWEEP_SHAPES = ((1, 4096), (256, 1024))
# the kernel sweep (sweep_kernel): the decode variants (kv heads per program, one block-table load per
# tile) with the tile / warps / stages / waves knobs, on the wide, long, batch-1 and mid shapes
KERNEL_SWEEP_SHAPES = ((256, 1024), (256, 2048), (1, 4096), (64, 1024), (32, 512))
# (kv_per_prog, page_tile, block_n): the tile is kv_per_prog * block_n rows of head_dim
KERNEL_SWEEP_TILES = ((1, False, 64), (1, False, 32), (1, True, 32), (1, True, 64), (1, True, 128),
                      (2, True, 32), (2, True, 64), (2, False, 32), (4, True, 16), (4, True, 32))
KERNEL_SWEEP = {"num_warps": (4, 8), "num_stages": (2, 3, 4), "waves": (2, 4, 16)}
# an e4m3 cache's sweep: the knobs that set how many bytes an SM keeps in flight (tools/kernel_resources.py: at the
# bf16 knobs the FP8 build holds 3 programs an SM to bf16's 4, each buffering half the bytes), the V scale's place
# and a register cap, at the default waves (engine/attention/splits.py's DECODE_FP8_* knobs)
KERNEL_SWEEP_FP8_TILES = ((1, True, 32), (1, False, 64), (1, True, 64), (1, True, 128))
KERNEL_SWEEP_FP8 = {"num_warps": (4, 8), "num_stages": (3, 4, 5), "fp8_v_in_tile": (False, True),
                    "max_registers": (0, 128)}
KNOBS = ("kv_per_prog", "page_tile", "block_n", "num_warps", "num_stages", "waves", "fp8_v_in_tile", "max_registers")
#: what the evidence's shape line adds for each cache dtype
CACHE_NOTE = {"auto": "", "fp8": ", KV cache e4m3 at scale 1.0"}
#: Max abs error a bf16 kernel output may have against the float32 dense reference (outputs are
#: softmax-weighted means of N(0, 1) values; bf16 rounding of the output alone is up to ~8e-3 here).
OUTPUT_TOL = 3e-2


def _paged_rows(cache, block_tables, length: int):
    """[N, length, Hk, D]: each sequence's first ``length`` positions read through its block table (an FP8
    cache dequantized by its scale to the model's dtype, as the kernels read it)."""
    from engine.attention import kv_quant

    return kv_quant.read(cache, block_tables.long()).flatten(1, 2)[:, :length]


def _gather(cache, block_tables, length: int):
    """:func:`_paged_rows` in float32 (the references' inputs)."""
    return _paged_rows(cache, block_tables, length).float()


def decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    """Decode attention in float32 with dense SDPA on the gathered K/V: q [N, Hq, D] -> [N, Hq, D]."""
    import torch
    import torch.nn.functional as F

    length = int(context_lens.max())
    k, v = _gather(k_cache, block_tables, length), _gather(v_cache, block_tables, length)
    mask = torch.arange(length, device=q.device)[None, :] < context_lens.long()[:, None]
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)


def prefill_reference(q, k_cache, v_cache, block_tables, seqs: int, prefix: int, new: int, scale: float):
    """Causal prefill attention in float32, dense SDPA on the gathered K/V: ``seqs`` sequences of ``prefix``
    cached plus ``new`` positions (all already in the cache); q [seqs*new, Hq, D] -> [seqs*new, Hq, D]."""
    import torch
    import torch.nn.functional as F

    length = prefix + new
    k, v = _gather(k_cache, block_tables, length), _gather(v_cache, block_tables, length)
    qs = q.float().view(seqs, new, *q.shape[1:]).transpose(1, 2)             # [seqs, Hq, new, D]
    q_pos = torch.arange(prefix, length, device=q.device)
    mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]   # [new, length]
    out = F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(seqs * new, *q.shape[1:])


def max_abs_error(out, ref) -> float:
    """Max abs difference of a kernel's output from the reference; inf when the shape or a value is off."""
    if out is None or out.numel() != ref.numel():
        return float("inf")
    err = (out.float().reshape(ref.shape) - ref).abs().max().item()
    return err if err == err else float("inf")      # NaN -> inf


class PagedCase:
    """Random paged K/V for `batch` sequences of `ctx` positions, pages scattered through the pool.
    kv_cache_dtype fp8: the caches hold the same values as e4m3 at scale 1.0 (engine/attention/kv_quant.py), and
    the reference reads them dequantized, so an output's error is the kernel's, not the quantization's."""

    def __init__(self, batch: int, ctx: int, hq: int = 16, hk: int = 8, d: int = 128, page: int = 256,
                 dtype=None, seed: int = 0, device: str = "cuda", kv_cache_dtype: str = "auto"):
        import torch
        from engine.attention import kv_quant

        dtype = dtype or torch.bfloat16
        g = torch.Generator(device=device).manual_seed(seed)
        pages = (ctx + page - 1) // page
        num_blocks = batch * pages
        self.device = device
        self.k_cache = torch.randn(num_blocks, page, hk, d, dtype=dtype, device=device, generator=g)
        self.v_cache = torch.randn(num_blocks, page, hk, d, dtype=dtype, device=device, generator=g)
        if kv_cache_dtype == "fp8":
            self.k_cache, self.v_cache = (kv_quant.mark(kv_quant.quantize(c, kv_quant.DEFAULT_SCALE),
                                                        kv_quant.DEFAULT_SCALE, dtype)
                                          for c in (self.k_cache, self.v_cache))
        perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
        self.block_tables = perm.view(batch, pages)
        self.context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, hq, d, dtype=dtype, device=device, generator=g)
        self.batch, self.ctx, self.hq, self.hk, self.d = batch, ctx, hq, hk, d
        self.scale = d ** -0.5
        self.bytes = 2 * batch * ctx * hk * d * self.k_cache.element_size()    # K and V, read once

    def meta(self):
        from engine.attention import AttentionMetadata
        return AttentionMetadata(is_prefill=False, slot_mapping=None, block_tables=self.block_tables,
                                 context_lens=self.context_lens, max_seqlen_q=1, max_seqlen_k=self.ctx)

    def reference(self):
        return decode_reference(self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale)

    def triton_decode(self, sm_count: int, **knobs):
        """Our Triton paged decode of this case, with paged_decode's knobs (the sweeps' settings)."""
        from engine.attention import triton_kernels as tk
        return tk.paged_decode(self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale,
                               self.ctx, sm_count, **knobs)

    def dense(self):
        """The same K/V gathered into [batch, hk, ctx, d] for the unpaged SDPA baseline (an FP8 cache's values
        in the model's dtype)."""
        return tuple(_paged_rows(c, self.block_tables, self.ctx).transpose(1, 2).contiguous()
                     for c in (self.k_cache, self.v_cache))


def bench_attention(backends: list[str], sweep: bool = False, shapes=SHAPES, kv_cache_dtype: str = "auto") -> dict:
    """kv_cache_dtype fp8: every case's cache in e4m3 (the backends that read one: triton, torch), its bytes and so
    its share of the copy roof counted at one byte a value; the dense SDPA baseline reads the same values in
    bf16 (twice the bytes, its figures over the bytes it reads); the Triton decode also with the V scale in its
    other place (:func:`fp8_v_variant`)."""
    import torch
    import torch.nn.functional as F
    from engine.attention import create_backend

    roof = copy_roof_gbs()
    rows = []
    for batch, ctx in shapes:
        case = PagedCase(batch, ctx, kv_cache_dtype=kv_cache_dtype)
        meta = case.meta()
        ref = case.reference()
        row = {"batch": batch, "context": ctx, "kv_bytes": case.bytes, "backends": {}}
        for name in backends:
            be = create_backend(name, case.k_cache.shape[1])
            err = max_abs_error(be.forward(case.q, None, None, case.k_cache, case.v_cache, meta, case.scale), ref)
            ms = kernel_ms(lambda: be.forward(case.q, None, None, case.k_cache, case.v_cache, meta, case.scale))
            row["backends"][name] = _figures(ms, case.bytes, roof) | {"max_abs_err": err}
        if kv_cache_dtype == "fp8" and "triton" in backends:
            name, run = fp8_v_variant(case)
            row["backends"][name] = _figures(kernel_ms(run), case.bytes, roof) | {"max_abs_err": max_abs_error(run(), ref)}
        k, v = case.dense()
        q4 = case.q.unsqueeze(2)
        err = max_abs_error(F.scaled_dot_product_attention(q4, k, v, scale=case.scale, enable_gqa=True), ref)
        ms = kernel_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=case.scale, enable_gqa=True))
        dense_bytes = 2 * k.numel() * k.element_size()
        row["sdpa_dense"] = _figures(ms, dense_bytes, roof) | {"max_abs_err": err}
        rows.append(row)
        del case, k, v, ref
        torch.cuda.empty_cache()
    prefill_rows = [bench_prefill(backends, *shape, kv_cache_dtype=kv_cache_dtype) for shape in PREFILL_SHAPES]
    big = rows[-1]                       # the largest decode shape: the one a throughput run lives in
    decode_errs = {f"{r['batch']}x{r['context']}:{b}": f["max_abs_err"] for r in rows for b, f in r["backends"].items()}
    prefill_errs = {f"{r['seqs']}x{r['prefix']}+{r['new']}:{b}": f["max_abs_err"]
                    for r in prefill_rows for b, f in r["backends"].items()}
    facts = {"copy_roof_gb_s": round(roof, 1), "kv_cache_dtype": kv_cache_dtype, "timing": KERNEL_TIMING,
             "shape": f"16 q heads, 8 kv heads, head_dim 128, page 256, bf16{CACHE_NOTE[kv_cache_dtype]}",
             "output_check": {"reference": "dense SDPA in float32 on the K/V gathered through the block table",
                              "tolerance": OUTPUT_TOL, "decode_max_abs_err": decode_errs,
                              "prefill_max_abs_err": prefill_errs,
                              "sdpa_dense_bf16_max_abs_err": max(r["sdpa_dense"]["max_abs_err"] for r in rows)},
             "rows": rows, "prefill_rows": prefill_rows,
             "summary": {"decode_shape": [big["batch"], big["context"]],
                         "decode_share_of_roof": {b: f["share_of_roof"] for b, f in big["backends"].items()},
                         "decode_worst_max_abs_err": max(decode_errs.values()),
                         "prefill_worst_max_abs_err": max(prefill_errs.values()),
                         "kernels_checked": len(decode_errs) + len(prefill_errs),
                         "prefill_shape": list(PREFILL_SHAPES[0]),
                         "prefill_tflop_s": {k: f["tflop_s"] for k, f in prefill_rows[0]["backends"].items()}}}
    if sweep and "triton" in backends:
        facts["triton_sweep"] = sweep_triton(kv_cache_dtype=kv_cache_dtype)
        facts["triton_prefill_sweep"] = sweep_prefill(kv_cache_dtype=kv_cache_dtype)
        facts["triton_kernel_sweep"] = sweep_kernel(kv_cache_dtype=kv_cache_dtype)
    return facts


def fp8_v_variant(case: PagedCase):
    """The Triton decode on an e4m3 case with the V scale in its other place (engine/attention/splits.py's
    DECODE_FP8_V_IN_TILE: on each V tile or on the accumulator): its row name and a call."""
    import torch
    from engine.attention import splits

    sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    other = not splits.DECODE_FP8_V_IN_TILE

    def run():
        return case.triton_decode(sm, fp8_v_in_tile=other)
    return f"triton:fp8_v_in_tile={other}", run


class PrefillCase(PagedCase):
    """`seqs` sequences with `prefix` positions already cached and `new` positions in this step."""

    def __init__(self, seqs: int, prefix: int, new: int, **kw):
        import torch
        from engine.attention import kv_quant

        super().__init__(seqs, prefix + new, **kw)
        g = torch.Generator(device=self.device).manual_seed(1)
        dev, dt = self.device, self.q.dtype
        self.q = torch.randn(seqs * new, self.hq, self.d, dtype=dt, device=dev, generator=g)
        self.k = torch.randn(seqs * new, self.hk, self.d, dtype=dt, device=dev, generator=g)
        self.v = torch.randn(seqs * new, self.hk, self.d, dtype=dt, device=dev, generator=g)
        self.seqs, self.prefix, self.new = seqs, prefix, new
        self.flops = 4 * self.d * self.hq * seqs * (new * prefix + new * (new + 1) // 2)   # causal QK^T and PV
        # as in the engine, this step's K/V are stored in the cache before attention: every route (fresh
        # on the new K/V, paged through the block table) then sees the same keys and values
        page = self.k_cache.shape[1]
        pos = torch.arange(prefix, prefix + new, device=dev)
        blocks = self.block_tables[:, pos // page].long()                       # [seqs, new]
        slots = (blocks * page + pos % page).reshape(-1)
        kv_quant.write(self.k_cache, slots, self.k)                             # quantized in an FP8 cache
        kv_quant.write(self.v_cache, slots, self.v)

    def reference(self):
        return prefill_reference(self.q, self.k_cache, self.v_cache, self.block_tables, self.seqs, self.prefix,
                                 self.new, self.scale)

    def prefill_meta(self, paged: bool):
        import torch
        from engine.attention import AttentionMetadata
        cu_q = torch.arange(0, (self.seqs + 1) * self.new, self.new, dtype=torch.int32, device=self.device)
        cu_k = torch.arange(0, (self.seqs + 1) * (self.prefix + self.new), self.prefix + self.new,
                            dtype=torch.int32, device=self.device)
        return AttentionMetadata(is_prefill=True, slot_mapping=None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 max_seqlen_q=self.new, max_seqlen_k=self.prefix + self.new,
                                 block_tables=self.block_tables if paged else None,
                                 seqlens_q=[self.new] * self.seqs, seqlens_k=[self.prefix + self.new] * self.seqs)


def bench_prefill(backends: list[str], seqs: int, prefix: int, new: int, kv_cache_dtype: str = "auto") -> dict:
    """Prefill attention of one step; without a prefix (and with a cache in the model's dtype) also the fresh
    path (new K/V only, no block table)."""
    import torch
    from engine.attention import create_backend

    case = PrefillCase(seqs, prefix, new, kv_cache_dtype=kv_cache_dtype)
    ref = case.reference()
    row = {"seqs": seqs, "prefix": prefix, "new": new, "tflop": round(case.flops / 1e12, 4), "backends": {}}
    routes = [("paged", True)] + ([("fresh", False)] if prefix == 0 and kv_cache_dtype == "auto" else [])
    for name in backends:
        be = create_backend(name, case.k_cache.shape[1])
        for route, paged in routes:
            meta = case.prefill_meta(paged)
            err = max_abs_error(be.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, meta, case.scale), ref)
            ms = kernel_ms(lambda: be.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, meta, case.scale))
            row["backends"][f"{name}:{route}"] = {"us": round(ms * 1e3, 1),
                                                  "tflop_s": round(case.flops / (ms * 1e-3) / 1e12, 1),
                                                  "max_abs_err": err}
    del case, ref
    torch.cuda.empty_cache()
    return row


def sweep_prefill(shape=(30, 0, 540), kv_cache_dtype: str = "auto") -> dict:
    """Every knob combination of the Triton paged prefill on one shape; the five fastest."""
    import torch
    from engine.attention import prefill_kernels as pk

    case = PrefillCase(*shape, kv_cache_dtype=kv_cache_dtype)
    meta = case.prefill_meta(True)
    ref = case.reference()
    results = []
    for block_m, block_n, warps, stages in itertools.product(*PREFILL_SWEEP.values()):
        knobs = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}

        def run():
            return pk.paged_prefill(case.q, case.k_cache, case.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                    meta.cu_seqlens_k, meta.max_seqlen_q, case.scale, **knobs)
        try:
            err = max_abs_error(run(), ref)
            ms = kernel_ms(run, repeats=5, warmups=1)
        except Exception as e:           # a configuration the compiler refuses (e.g. shared memory)
            results.append(knobs | {"error": str(e).splitlines()[0][:120]})
            continue
        results.append(knobs | {"us": round(ms * 1e3, 1), "tflop_s": round(case.flops / (ms * 1e-3) / 1e12, 1),
                                "max_abs_err": err, "output_ok": err <= OUTPUT_TOL})
    results.sort(key=lambda r: (not r.get("output_ok", False), r.get("us", float("inf"))))
    del case, ref
    torch.cuda.empty_cache()
    return {"seqs": shape[0], "prefix": shape[1], "new": shape[2], "best": results[:5], "tried": len(results)}


def _figures(ms: float, nbytes: int, roof: float) -> dict:
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {"us": round(ms * 1e3, 2), "gb_s": round(gbs, 1), "share_of_roof": round(gbs / roof, 3)}


def sweep_triton(shapes=SWEEP_SHAPES, kv_cache_dtype: str = "auto") -> list[dict]:
    """Every knob combination of the Triton paged decode on the sweep shapes; fastest first per shape."""
    import torch

    sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out = []
    for batch, ctx in shapes:
        case = PagedCase(batch, ctx, kv_cache_dtype=kv_cache_dtype)
        ref = case.reference()
        results = []
        for block_n, warps, stages, waves in itertools.product(*SWEEP.values()):
            def run():
                return case.triton_decode(sm, block_n=block_n, num_warps=warps, num_stages=stages, waves=waves)
            try:
                err = max_abs_error(run(), ref)
                ms = kernel_ms(run)
            except Exception as e:           # a configuration the compiler refuses (e.g. shared memory)
                results.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "waves": waves,
                                "error": str(e).splitlines()[0][:120]})
                continue
            results.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "waves": waves,
                            "us": round(ms * 1e3, 2), "gb_s": round(case.bytes / (ms * 1e-3) / 1e9, 1),
                            "max_abs_err": err, "output_ok": err <= OUTPUT_TOL})
        results.sort(key=lambda r: (not r.get("output_ok", False), r.get("us", float("inf"))))
        out.append({"batch": batch, "context": ctx, "best": results[:5], "tried": len(results),
                    "wrong_outputs": sum(1 for r in results if r.get("output_ok") is False)})
        del case, ref
        torch.cuda.empty_cache()
    return out


def kernel_sweep_settings(kv_cache_dtype: str = "auto") -> list[dict]:
    """Every setting sweep_kernel times: the tiles of KERNEL_SWEEP_TILES x warps x stages x waves; on an e4m3
    cache KERNEL_SWEEP_FP8_TILES x warps x stages x the V scale's place x the register cap, at the default waves."""
    if kv_cache_dtype == "fp8":
        from engine.attention import splits
        return [{"kv_per_prog": hpp, "page_tile": tile, "block_n": bn, "num_warps": w, "num_stages": st,
                 "waves": splits.DECODE_WAVES, "fp8_v_in_tile": vt, "max_registers": mr}
                for (hpp, tile, bn), w, st, vt, mr in itertools.product(KERNEL_SWEEP_FP8_TILES,
                                                                        *KERNEL_SWEEP_FP8.values())]
    return [{"kv_per_prog": hpp, "page_tile": tile, "block_n": bn, "num_warps": w, "num_stages": st, "waves": wv}
            for (hpp, tile, bn), w, st, wv in itertools.product(KERNEL_SWEEP_TILES, *KERNEL_SWEEP.values())]


def default_decode_setting(kv_cache_dtype: str = "auto") -> dict:
    """paged_decode's defaults (engine/attention/splits.py), as a sweep setting (on an e4m3 cache its own stages,
    V scale's place and register cap)."""
    from engine.attention import splits
    return {"kv_per_prog": splits.DECODE_KV_PER_PROG, "block_n": splits.DECODE_BLOCK_N, "waves": splits.DECODE_WAVES,
            **splits.decode_defaults(kv_cache_dtype == "fp8")}


def compile_kernel_sweep(part: int = 0, parts: int = 1, kv_cache_dtype: str = "auto",
                         shapes=KERNEL_SWEEP_SHAPES) -> int:
    """Compile every `parts`-th sweep setting from `part` by running it once on each sweep shape (the variants
    sweep_kernel meets: its split count and reduce follow the shape): run in parallel processes before
    sweep_kernel (tools/gpu/decode_sweep.py), so its timing loop loads compiled kernels from Triton's cache
    instead of compiling them one after another. Returns the number of settings run."""
    import torch

    sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    mine = [k for i, k in enumerate(kernel_sweep_settings(kv_cache_dtype)) if i % parts == part]
    for batch, ctx in shapes:
        case = PagedCase(batch, ctx, kv_cache_dtype=kv_cache_dtype)
        for knobs in mine:
            try:
                case.triton_decode(sm, **knobs)
            except Exception:                    # noqa: BLE001 (the sweep records the error itself)
                pass
        del case
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return len(mine)


def rank_kernel_sweep(shapes: list[dict]) -> dict:
    """The setting whose worst share of each shape's best is highest (robust across shapes), and the
    default's share of roof per shape, from sweep_kernel's per-shape results."""
    def key(r):
        return tuple((k, r[k]) for k in KNOBS if k in r)
    best = {}
    for sh in shapes:
        ok = [r for r in sh["results"] if r.get("output_ok")]
        top = max((r["share_of_roof"] for r in ok), default=0.0)
        for r in ok:
            best.setdefault(key(r), {})[f"{sh['batch']}x{sh['context']}"] = r["share_of_roof"] / top if top else 0.0
    complete = {k: v for k, v in best.items() if len(v) == len(shapes)}
    if not complete:
        return {"robust": None}
    k, ratios = max(complete.items(), key=lambda kv: min(kv[1].values()))
    robust = dict(k) | {"worst_share_of_best": round(min(ratios.values()), 3),
                                    "share_of_roof": {f"{sh['batch']}x{sh['context']}": r["share_of_roof"]
                                                      for sh in shapes for r in sh["results"] if key(r) == k}}
    return {"robust": robust}


def sweep_kernel(shapes=KERNEL_SWEEP_SHAPES, settings: list[dict] | None = None, repeats: int = 10,
                 kv_cache_dtype: str = "auto") -> dict:
    """The kernel sweep: every decode setting on every shape, each as a share of the copy roof measured in
    this run and with its max abs error against the float32 reference (a wrong output never ranks)."""
    import torch

    sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    settings = settings or kernel_sweep_settings(kv_cache_dtype)
    default = default_decode_setting(kv_cache_dtype)
    roof = copy_roof_gbs()
    out = []
    for batch, ctx in shapes:
        case = PagedCase(batch, ctx, kv_cache_dtype=kv_cache_dtype)
        ref = case.reference()
        results = []
        for knobs in settings:
            def run():
                return case.triton_decode(sm, **knobs)
            try:
                err = max_abs_error(run(), ref)
                ms = kernel_ms(run, repeats=repeats)
            except Exception as e:           # a configuration the compiler refuses (e.g. shared memory)
                results.append(knobs | {"error": str(e).splitlines()[0][:120]})
                continue
            results.append(knobs | _figures(ms, case.bytes, roof) | {"max_abs_err": err, "output_ok": err <= OUTPUT_TOL})
        results.sort(key=lambda r: (not r.get("output_ok", False), r.get("us", float("inf"))))
        at_default = [r for r in results if all(r.get(k) == v for k, v in default.items())]
        out.append({"batch": batch, "context": ctx, "kv_bytes": case.bytes, "best": results[:5],
                    "default": at_default[0] if at_default else None, "tried": len(results),
                    "wrong_outputs": sum(1 for r in results if r.get("output_ok") is False),
                    "errors": sum(1 for r in results if "error" in r), "results": results})
        del case, ref
        torch.cuda.empty_cache()
    return {"copy_roof_gb_s": round(roof, 1), "timing": KERNEL_TIMING, "default": default, "settings": len(settings),
            "shape": f"16 q heads, 8 kv heads, head_dim 128, page 256, bf16{CACHE_NOTE[kv_cache_dtype]}",
            "shapes": out} | rank_kernel_sweep(out)
