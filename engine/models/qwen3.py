"""The decoder every family builds (Qwen3's, whose names it keeps): GQA attention with RoPE, q/k RMSNorm where
the family has it (Qwen3), SiLU-gated MLP, tied or untied head. What a family changes (q/k norm, the q/k/v, o
and MLP biases) is declared in engine/families.py and read here once per layer."""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelShape, RopeScaling
from engine.distributed import SINGLE, ParallelContext
from engine.layers.activation import SiluAndMul
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.rotary import RotaryEmbedding
from engine.families import family_for


class Attention(nn.Module):
    """Stores this layer's new K/V in its paged cache and attends through the chosen backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q, k, v, meta: AttentionMetadata, stored: bool = False):
        """stored: the q/k-norm + RoPE kernel already wrote k and v to the cache."""
        if self.k_cache.numel() and not stored:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict, backend: AttentionBackend, tp: ParallelContext):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.total_heads = cfg["num_attention_heads"]
        self.total_kv_heads = cfg["num_key_value_heads"]
        self.head_dim = ModelShape.from_hf(cfg).head_dim
        self.num_heads = self.total_heads // tp.world_size
        self.num_kv_heads = self.total_kv_heads // tp.world_size
        family = family_for(cfg)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, self.total_heads, self.total_kv_heads,
                                          family.bias(cfg, "qkv"), tp)
        self.o_proj = RowParallelLinear(self.total_heads * self.head_dim, hidden, family.bias(cfg, "o"), tp)
        rope = RopeScaling.from_hf(cfg)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.get("max_position_embeddings", 40960), rope.theta, rope)
        eps = cfg.get("rms_norm_eps", 1e-6)
        if family.qk_norm:          # Qwen3: RMSNorm over each q and k head before RoPE
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)
        self._fused = False
        # decode steps: q/k norm + RoPE + KV store inside the attention kernel ("prefetch": its first K/V tile read
        # before the PDL wait, "plain": after it; "": off); the runner sets it (engine/levers.py: decode_prologue_mode)
        self.decode_prologue = ""
        # weights the decode prologue's attention kernel asks L2 for (engine/l2_prefetch.py; CausalLM.set_l2_prefetch)
        self.l2_prefetch: tuple = ()

    @property
    def fused(self) -> bool:
        """q/k norm + RoPE + KV store in one Triton kernel (the runner turns it on, CUDA). The kernel is Qwen3's
        q/k norm: a family without q/k norm stays on the plain route (torch RoPE, backend.store_kv) whatever
        the runner asks."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = bool(value) and self.q_norm is not None

    def forward(self, positions, x, meta, qkv=None):
        """qkv: the packed projection already made (the decoder layer's normed GEMV; x is then unused),
        else qkv_proj(x)."""
        if qkv is None:
            qkv = self.qkv_proj(x)
        if self.fused and self.decode_prologue and not meta.is_prefill and self.attn.k_cache.numel():
            return self.o_proj(self._decode_prologue(qkv, positions, meta).flatten(1, -1))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        stored = False
        if self.fused:
            from engine.layers.fused_kernels import qk_norm_rope
            cache = {}
            if self.attn.k_cache.numel():       # the kernel also stores k and v in the paged cache
                cache = dict(k_cache=self.attn.k_cache, v_cache=self.attn.v_cache, slot_mapping=meta.slot_mapping)
                stored = True
            q, k = qk_norm_rope(qkv, positions, self.q_norm.weight, self.k_norm.weight, self.rotary_emb.cos,
                                self.rotary_emb.sin, self.num_heads, self.num_kv_heads, self.head_dim,
                                self.q_norm.eps, **cache)
        else:
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta, stored=stored)
        return self.o_proj(o.flatten(1, -1))

    def _decode_prologue(self, qkv, positions, meta):
        """A decode step's attention with the q/k norm, RoPE and the new K/V's store done by the attention kernel
        (the Triton backend's decode_new; the runner turns it on: engine/model_runner.py)."""
        from engine.attention.triton_kernels import NewTokens

        new = NewTokens(qkv, positions, self.q_norm.weight, self.k_norm.weight, self.rotary_emb.cos,
                        self.rotary_emb.sin, self.q_norm.eps, meta.slot_mapping, self.num_heads,
                        prefetch=self.decode_prologue == "prefetch", l2=self.l2_prefetch)
        return self.attn.backend.decode_new(new, self.attn.k_cache, self.attn.v_cache, meta, self.attn.scale)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict, tp: ParallelContext):
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = family_for(cfg).bias(cfg, "mlp")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x, gate_up=None):
        """gate_up: the projection already made (the decoder layer's normed GEMV; x is then unused),
        else gate_up_proj(x)."""
        if gate_up is None:
            gate_up = self.gate_up_proj(x)
        if self.down_proj.takes_gemv(gate_up):          # one token: the GEMV applies the activation
            return self.down_proj(gate_up, silu_mul=True)
        return self.down_proj(self.act_fn(gate_up))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, backend: AttentionBackend, tp: ParallelContext):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Qwen3Attention(cfg, backend, tp)
        self.mlp = Qwen3MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        # a batch-1 decode step's layer as one persistent kernel (engine/layers/decode_layer.py): the max model
        # length its attention splits are sized for, 0 off; the runner sets it (engine/levers.py: decode_layer_on)
        self.decode_layer = 0

    def decode_layer_ok(self, x, meta) -> bool:
        """The case the layer kernel takes: the runner turned it on; one token of a decode step on the GEMV path
        (fused ops, no bias); Qwen3's q/k norm (fused); no MLP or o bias; one rank; a cache in the model's dtype."""
        attn, mlp = self.self_attn, self.mlp
        cache = attn.attn.k_cache
        return (self.decode_layer > 0 and not meta.is_prefill and attn.fused and attn.qkv_proj.takes_gemv(x)
                and x.shape[0] == 1 and cache.numel() > 0 and cache.dtype == x.dtype
                and attn.o_proj.bias is None and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None
                and attn.o_proj.tp.world_size == 1)

    def forward(self, positions, x, residual, meta):
        if self.decode_layer_ok(x, meta):
            return self._decode_layer(positions, x, residual, meta)
        qkv_proj, gate_up_proj = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        qkv = None
        if qkv_proj.takes_gemv(x):          # one token: the norm runs inside the qkv GEMV
            qkv, new_residual = qkv_proj.normed(x, self.input_layernorm, residual)
            residual = x if residual is None else new_residual
        elif residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, qkv=qkv)
        if gate_up_proj.takes_gemv(x):      # and this one inside the gate_up GEMV
            gate_up, residual = gate_up_proj.normed(x, self.post_attention_layernorm, residual)
            return self.mlp(x, gate_up=gate_up), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _decode_layer(self, positions, x, residual, meta):
        """The whole layer in one kernel (engine/layers/decode_layer.py): the same math as the route above takes
        at one token (normed qkv GEMV, the decode prologue, o GEMV, normed gate_up GEMV, SiLU down GEMV)."""
        from engine.layers.decode_layer import decode_layer

        attn, mlp = self.self_attn, self.mlp
        return decode_layer(
            x, residual, in_norm=self.input_layernorm.weight, qkv_w=attn.qkv_proj.weight, q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight, cos=attn.rotary_emb.cos, sin=attn.rotary_emb.sin, o_w=attn.o_proj.weight,
            post_norm=self.post_attention_layernorm.weight, gate_up_w=mlp.gate_up_proj.weight,
            down_w=mlp.down_proj.weight, k_cache=attn.attn.k_cache, v_cache=attn.attn.v_cache,
            block_tables=meta.block_tables, context_lens=meta.context_lens, positions=positions,
            slot_mapping=meta.slot_mapping, eps=self.input_layernorm.eps, qk_eps=attn.q_norm.eps,
            max_len=self.decode_layer, sm_count=attn.attn.backend.sm_count)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: dict, backend: AttentionBackend, tp: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, backend, tp) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    """The causal LM of any family (engine/families.py), built by ``engine.models.build_model``;
    ``Qwen3ForCausalLM`` is the same class under the name the lab's lessons use."""
    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict, backend: AttentionBackend, tp: ParallelContext = SINGLE):
        super().__init__()
        self.family = family_for(cfg)
        self.architecture = (cfg.get("architectures") or [self.family.architectures[0]])[0]
        self.model = Qwen3Model(cfg, backend, tp)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], tp)
        self._cfg = cfg
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.l2_prefetch_mode = "0"     # LAB_L2_PREFETCH's mode (set_l2_prefetch; each attention holds its weights)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def set_l2_prefetch(self, mode: str, budget: int | None = None) -> None:
        """Which weights each layer's decode-prologue attention asks L2 for (engine/l2_prefetch.py): "mlp" the
        layer's o, gate_up and down weights; "layer" those and the next layer's qkv weight; "0" none. budget: the
        most bytes a layer asks for (None: no limit); the weights are taken in that order while they fit."""
        layers = self.model.layers
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            regions = (attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight) if mode != "0" else ()
            if mode == "layer" and i + 1 < len(layers):
                regions += (layers[i + 1].self_attn.qkv_proj.weight,)
            taken, total = [], 0
            for w in regions:
                total += w.numel() * w.element_size()
                if budget is not None and total > budget:
                    break
                taken.append(w.data)
            attn.l2_prefetch = tuple(taken)
        self.l2_prefetch_mode = mode

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def describe(self) -> dict:
        """The family, what its layers hold and the route the q/k-norm + RoPE + KV-store fusion took:
        "fused" (the Triton kernel, Qwen3 on CUDA with fused ops), "plain" (torch RoPE and the backend's
        store; the families without q/k norm always), "decode-prologue" (the Triton kernel for prefills; a decode
        step does it inside the attention kernel, "decode-prologue-noprefetch" with its first K/V tile read after the
        PDL wait). decode_layer: a batch-1 decode step runs each layer as one kernel (LAB_DECODE_LAYER). l2_prefetch:
        the weights a layer's decode attention asks L2 for (LAB_L2_PREFETCH's mode; "0": none)."""
        attn = [layer.self_attn for layer in self.model.layers]
        route = "plain"
        if any(a.fused for a in attn):
            mode = next((a.decode_prologue for a in attn if a.fused and a.decode_prologue), "")
            route = {"": "fused", "prefetch": "decode-prologue"}.get(mode, "decode-prologue-noprefetch")
        return {"architecture": self.architecture, **self.family.summary(self._cfg), "qk_norm_rope_kv": route,
                "decode_layer": any(layer.decode_layer for layer in self.model.layers),
                "l2_prefetch": self.l2_prefetch_mode}


Qwen3ForCausalLM = CausalLM
