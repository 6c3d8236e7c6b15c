"""A Pre-LN decoder-only transformer in the Llama style: RMSNorm, RoPE, grouped-query attention,
SwiGLU (or GELU) MLP, no biases (q/k/v biases as an option: Qwen2), token embedding tied to the
LM head; RoPE plain or with Llama 3.1's frequency scaling.

Options from the modded-nanogpt / nanochat recipe, each off by default (measured one by one:
bench/results/recipe_*.txt): QK-norm, a squared-ReLU MLP, logit softcapping, zero-initialised
residual outputs and head, and value embeddings.

Dimension key, used in tensor names (x_BTD, q_BHTK, logits_BTV):
    B batch          T time (query positions)     S key positions (KV-cache length)
    D d_model        H n_head                     G n_kv_head
    K head_dim       V vocab (padded in the LM head, real in returned logits)
    F mlp hidden     L n_layer

Parallelism, compilation, checkpoint I/O and logging live outside this file (pipeline/).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

# rope_inv_freq: the frequencies the model rotates by, as exporters (GGUF's rope_freqs) read them.
from lmforge.model.rope import apply_rope, rope_inv_freq, rope_tables  # noqa: F401

VOCAB_MULTIPLE = 64  # the LM-head matmul is faster when V is a multiple of 64
MLP_KINDS = ("swiglu", "gelu", "relu2")
IGNORE_INDEX = -100  # a target the loss skips (eval padding rows); cross_entropy's default
MAX_SEQ_LEN = 2**20
RECIPE_OPTIONS = ("qk_norm", "logit_softcap", "zero_init", "value_embeds")  # off = falsy
ROPE_SCALINGS = ("", "llama3")


@dataclass
class ModelConfig:
    vocab_size: int = 0
    """Real vocabulary size; 0 means "not set yet" (the pipeline fills it from the dataset)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Query heads; d_model / n_head is the head dimension (even, for RoPE) unless d_head says."""
    n_kv_head: int = 4
    """Key/value heads: n_head = MHA, fewer = GQA, 1 = MQA. Must divide n_head."""
    d_model: int = 256
    """Width of the residual stream (and of the tied token embedding)."""
    d_head: int | None = None
    """Per-head dimension; None = d_model / n_head. Set apart from it only to load a model that
    does so (Qwen3-0.6B: 128 at d_model 1024 with 16 heads)."""
    d_mlp: int | None = None
    """MLP hidden size; None = 8/3·d_model rounded up to a multiple of 64 (SwiGLU) or 4·d_model (GELU)."""
    mlp: str = "swiglu"
    """"swiglu" (Llama, exportable to Hugging Face), "gelu" (GPT-2 style) or "relu2" (squared ReLU,
    two matrices 3/2 as wide as SwiGLU's three, so the parameters match; not exportable)."""
    rope_theta: float = 10000.0
    """RoPE base: larger stretches the rotary wavelengths for longer contexts."""
    rope_scaling: str = ""
    """"" = plain RoPE; "llama3" = Llama 3.1/3.2's scaling of the frequencies (model/rope.py)."""
    rope_scaling_factor: float = 8.0
    """llama3: the longest wavelengths' stretch (8 in Llama 3.1, 32 in 3.2 1B/3B)."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths over rope_original_max_len / this are stretched whole."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths under rope_original_max_len / this are kept; between, interpolated."""
    rope_original_max_len: int = 8192
    """llama3: the context the model was pretrained at before its extension."""
    max_seq_len: int = 1024
    """Longest sequence the RoPE tables and the KV cache are built for (training and sampling)."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    tie_embeddings: bool = True
    """The LM head reuses the token embedding matrix (GPT-2 / nanoGPT style, fewer parameters)."""
    init_std: float = 0.02
    """Std of every weight matrix; residual-output projections get init_std / sqrt(2·n_layer)."""
    qk_norm: bool = False
    """RMSNorm (with a learned gain per head dimension) on each head's queries and keys before
    RoPE: bounded attention logits (Qwen3, modded-nanogpt). Exports as Qwen3."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2, Qwen2.5). Exports as Qwen2."""
    logit_softcap: float = 0.0
    """c > 0 caps the logits to c·tanh(logits / c) in the loss and in sampling; 0 = off. Not
    exportable (no Llama-family model caps its logits)."""
    zero_init: bool = False
    """Zero-initialise the residual output projections (attention out, MLP down) and, when
    untied, the LM head: each block starts as the identity (modded-nanogpt)."""
    value_embeds: bool = False
    """Per-layer value-embedding tables (V x n_kv_head·head_dim) added to the values of every
    other layer, the last included (nanochat). Not exportable."""

    def __post_init__(self) -> None:
        sizes = ("n_layer", "n_head", "n_kv_head", "d_model", "max_seq_len", "rope_original_max_len")
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.max_seq_len > MAX_SEQ_LEN:  # its RoPE tables are built whole, up front
            raise ValueError(f"model.max_seq_len must be <= {MAX_SEQ_LEN:,}, got {self.max_seq_len:,}")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size must be >= 0 (0 = set later), got {self.vocab_size}")
        if self.d_head is not None and self.d_head <= 0:
            raise ValueError(f"model.d_head must be positive or None, got {self.d_head}")
        if self.d_mlp is not None and self.d_mlp <= 0:
            raise ValueError(f"model.d_mlp must be positive or None, got {self.d_mlp}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"model.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.d_head is None and self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                "pick sizes where d_model % n_head == 0"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}; "
                "n_kv_head must divide n_head (n_head for MHA, 1 for MQA)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = d_model / n_head = {self.head_dim} is odd; RoPE rotates pairs, "
                "so choose d_model and n_head giving an even head_dim"
            )
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"model.rope_scaling must be one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:  # the band's width divides
            raise ValueError("model.rope_high_freq_factor must be above model.rope_low_freq_factor, "
                             f"got {self.rope_high_freq_factor} <= {self.rope_low_freq_factor}")
        for name in ("rope_theta", "norm_eps", "init_std", "rope_scaling_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # NaN fails every comparison: test it
                raise ValueError(f"model.{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.logit_softcap) and self.logit_softcap >= 0):
            raise ValueError(f"model.logit_softcap must be a finite number >= 0 (0 = off), "
                             f"got {self.logit_softcap}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head if self.d_head is None else self.d_head

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def mlp_hidden(self) -> int:
        if self.d_mlp is not None:
            return self.d_mlp
        if self.mlp == "gelu":
            return 4 * self.d_model
        swiglu = -(-8 * self.d_model // (3 * 64)) * 64  # Llama's 8/3·d, rounded up to 64
        return swiglu * 3 // 2 if self.mlp == "relu2" else swiglu

    def value_embed_layers(self) -> list[int]:
        """The layers given a value embedding: every other one, counted back from the last."""
        if not self.value_embeds:
            return []
        return [i for i in range(self.n_layer) if (self.n_layer - 1 - i) % 2 == 0]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown model config key {key!r}; known keys: {sorted(known)}")
        return cls(**d)


def cap_logits(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap·tanh(logits / cap): smooth, keeps small logits, bounds large ones to (-cap, cap)."""
    return cap * torch.tanh(logits / cap)


def head_norm(norm: nn.RMSNorm, x_BTNK: torch.Tensor) -> torch.Tensor:
    """`norm` over each head's K features. Its fp32 gain is cast to the activations' dtype: under
    bf16 autocast, mixed dtypes would leave torch's fused RMSNorm kernel for the unfused ops."""
    return F.rms_norm(x_BTNK, norm.normalized_shape, norm.weight.to(x_BTNK.dtype), norm.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # One fused GEMM for q, k and v: fewer, larger matmuls are faster than three small ones.
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim,
                             bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # Qwen3's layout: one gain over the head dimension, shared by all heads (q and k apart).
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x_BTD, cos, sin, kv_cache=None, attend=F.scaled_dot_product_attention,
                ve_BTGK=None, attn_mask=None):
        B, T, _ = x_BTD.shape
        H, G, K = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x_BTD)
        qk_BTNK = qkv[..., : (H + G) * K].view(B, T, H + G, K)
        if self.q_norm is not None:
            qk_BTNK = torch.cat((head_norm(self.q_norm, qk_BTNK[:, :, :H]),
                                 head_norm(self.k_norm, qk_BTNK[:, :, H:])), dim=2)
        # RoPE on the q and k heads together, (B, T, H+G, K): one rotation instead of two.
        qk_BTNK = apply_rope(qk_BTNK, cos, sin)
        q_BHTK = qk_BTNK[:, :, :H].transpose(1, 2)
        k_BGTK = qk_BTNK[:, :, H:].transpose(1, 2)
        v_BTGK = qkv[..., (H + G) * K :].view(B, T, G, K)
        if ve_BTGK is not None:  # before the cache, so cached and recomputed values agree
            v_BTGK = v_BTGK + ve_BTGK
        v_BGTK = v_BTGK.transpose(1, 2)
        if kv_cache is None:
            is_causal = attn_mask is None
            k_BGSK, v_BGSK = k_BGTK, v_BGTK
        else:
            attn_mask, is_causal = kv_cache.attn_mask, kv_cache.is_causal
            k_BGSK, v_BGSK = kv_cache.update(self.layer_idx, k_BGTK, v_BGTK)
        # enable_gqa lets SDPA read the G shared K/V heads directly instead of materialising
        # H/G copies with repeat_interleave. On CUDA the flash kernel (bf16/fp16) supports it
        # natively (torch documents flash + math only); on CPU the flash kernel measured faster
        # than repeat_interleave, forward + backward (a bench removed in 517bfd5; no figure was
        # filed in bench/results).
        y_BHTK = attend(q_BHTK, k_BGSK, v_BGSK, attn_mask=attn_mask, is_causal=is_causal,
                        enable_gqa=G != H)
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, H * K))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        self.swiglu = cfg.mlp == "swiglu"
        hidden = cfg.mlp_hidden
        # SwiGLU's gate and up projections fused into one GEMM (first half gate, second half up).
        self.up = nn.Linear(cfg.d_model, 2 * hidden if self.swiglu else hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x_BTD):
        h_BTF = self.up(x_BTD)
        if self.swiglu:
            gate_BTF, up_BTF = h_BTF.chunk(2, dim=-1)
            h_BTF = F.silu(gate_BTF) * up_BTF
        elif self.kind == "relu2":
            h_BTF = F.relu(h_BTF).square()
        else:
            h_BTF = F.gelu(h_BTF)
        return self.down(h_BTF)


class Block(nn.Module):
    """Pre-LN block; self-contained so the pipeline can FSDP-wrap and checkpoint it alone."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x_BTD, cos, sin, kv_cache=None, attend=F.scaled_dot_product_attention,
                ve_BTGK=None, attn_mask=None):
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin, kv_cache, attend, ve_BTGK,
                                  attn_mask)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))

    @torch.no_grad()
    def init_weights(self, std: float, resid_std: float) -> None:
        nn.init.normal_(self.attn.qkv.weight, std=std)
        nn.init.normal_(self.mlp.up.weight, std=std)
        # Outputs added to the residual stream: scaled by depth so its variance stays ~constant.
        nn.init.normal_(self.attn.proj.weight, std=resid_std)
        nn.init.normal_(self.mlp.down.weight, std=resid_std)
        if self.attn.qkv.bias is not None:
            nn.init.zeros_(self.attn.qkv.bias)
        for norm in (self.attn_norm, self.mlp_norm, self.attn.q_norm, self.attn.k_norm):
            if norm is not None:
                norm.reset_parameters()


def cross_entropy(h_BTD, w_VD, targets_BT, vocab_size, reduction="mean", ignore_index=IGNORE_INDEX,
                  softcap: float = 0.0):
    """F.cross_entropy of the full logits h_BTD @ w_VDᵀ over the first vocab_size columns, in
    fp32 whatever the matmul dtype: the plain reference loss. A loss of the same signature can
    replace it (GPT.forward's loss_fn): one that never builds the B×T×V logits, for instance.
    softcap > 0 caps the logits first (model.logit_softcap)."""
    logits_NV = F.linear(h_BTD.flatten(0, 1), w_VD)[:, :vocab_size].float()
    if softcap:
        logits_NV = cap_logits(logits_NV, softcap)
    loss = F.cross_entropy(logits_NV, targets_BT.flatten(), ignore_index=ignore_index,
                           reduction=reduction)
    return loss.view(targets_BT.shape) if reduction == "none" else loss


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size is not set (0); set it to the tokenizer's vocabulary size")
        self.cfg = cfg
        V, D = cfg.padded_vocab_size, cfg.d_model
        self.tok_emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(D, V, bias=False)
        # Lookups like tok_emb, outside the blocks: AdamW's under optim.name = "muon".
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(V, cfg.n_kv_head * cfg.head_dim) for i in cfg.value_embed_layers()})
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Derived from the config, so not saved (persistent=False); init_weights() fills them.
        empty = torch.empty(cfg.max_seq_len, cfg.head_dim)
        self.register_buffer("rope_cos", empty, persistent=False)
        self.register_buffer("rope_sin", empty.clone(), persistent=False)
        if self.tok_emb.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables in place.

        Works after `to_empty(device=...)` of a meta-built model, and on FSDP2-sharded parameters."""
        cfg = self.cfg
        if cfg.tie_embeddings and self.lm_head.weight is not self.tok_emb.weight:
            self.lm_head.weight = self.tok_emb.weight  # a module.to_empty() may have split the tie
        nn.init.normal_(self.tok_emb.weight, std=cfg.init_std)
        for table in self.value_embeds.values():
            nn.init.normal_(table.weight, std=cfg.init_std)
        if not cfg.tie_embeddings:
            # Zero: the first steps' logits are uniform and the head learns from there.
            head_std = 0.0 if cfg.zero_init else cfg.init_std
            nn.init.normal_(self.lm_head.weight, std=head_std)
        resid_std = 0.0 if cfg.zero_init else cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for block in self.blocks:
            block.init_weights(cfg.init_std, resid_std)
        self.norm_f.reset_parameters()
        cos, sin = rope_tables(cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self,
        idx_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        *,
        reduction: str = "mean",
        ignore_index: int = IGNORE_INDEX,
        loss_fn=cross_entropy,
        kv_cache=None,
        attend=F.scaled_dot_product_attention,
        pos_BT: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size) without targets; with targets only the loss: "mean" over
        tokens whose target != ignore_index, "sum", or "none" → (B, T), computed by
        loss_fn(h_BTD, head weight, targets_BT, vocab_size, reduction, ignore_index) from the
        final hidden states (`cross_entropy`, the full logits, unless the caller passes another).

        kv_cache (model.generate.KVCache) appends this chunk's keys/values and attends over the
        cache, using its per-row positions and padding mask. attend: the attention, SDPA or a
        function of its signature (q, k, v, attn_mask=, is_causal=, enable_gqa=); which kernel a
        run attends with is the caller's choice (pipeline.attention).

        Without a cache: pos_BT, each token's RoPE position (default 0..T-1), and attn_mask, SDPA's
        (B, 1, T, T) mask of the keys each query sees (default causal), let one row hold several
        sequences that share a prefix (pipeline/tasks/score.py)."""
        h_BTD = self.hidden(idx_BT, kv_cache, attend, pos_BT, attn_mask)
        if targets_BT is None:
            return self.logits(h_BTD)
        cap = self.cfg.logit_softcap
        # Only when set: a loss_fn without the keyword still runs every uncapped model.
        capped = {"softcap": cap} if cap else {}
        return loss_fn(h_BTD, self.lm_head.weight, targets_BT, self.cfg.vocab_size,
                       reduction=reduction, ignore_index=ignore_index, **capped)

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states (..., D) -> (..., vocab_size), capped where set: a caller
        that needs few positions' logits (a prompt's last) runs it on those alone."""
        logits_BTV = self.lm_head(h_BTD)[..., : self.cfg.vocab_size]  # V padded
        cap = self.cfg.logit_softcap
        return cap_logits(logits_BTV, cap) if cap else logits_BTV

    def hidden(self, idx_BT: torch.Tensor, kv_cache=None, attend=F.scaled_dot_product_attention,
               pos_BT: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The final-normed hidden states h_BTD the LM head (`lm_head.weight`, V padded x D)
        turns into logits."""
        B, T = idx_BT.shape
        if kv_cache is not None:
            pos_BT = kv_cache.begin(T)
        if pos_BT is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
            cos, sin = self.rope_cos[:T, None], self.rope_sin[:T, None]  # (T, 1, K)
        else:
            cos, sin = self.rope_cos[pos_BT, None], self.rope_sin[pos_BT, None]  # (B, T, 1, K)
        x_BTD = self.tok_emb(idx_BT)
        G, K = self.cfg.n_kv_head, self.cfg.head_dim
        for i, block in enumerate(self.blocks):
            table = self.value_embeds[str(i)] if str(i) in self.value_embeds else None
            ve_BTGK = None if table is None else table(idx_BT).view(B, T, G, K)
            x_BTD = block(x_BTD, cos, sin, kv_cache, attend, ve_BTGK, attn_mask)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm_f(x_BTD)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once). exclude_embeddings drops the vocabulary
        matrices (token and value embeddings, LM head, tied or not), leaving blocks + final norm."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel() + sum(p.numel() for p in self.value_embeds.parameters())
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at sequence length T = seq_len:

            6·N + 12·L·H·K·T

        N = weights used in a matmul for every token: all block parameters (+ the final norm,
        negligible) plus the LM head (D × padded V, the matmul actually run). The token and value
        embeddings are lookups and cost no FLOPs; when tied, the shared matrix is counted once, as
        the LM head. 6 = 2 (multiply-add) × 3 (forward + two backward matmuls).
        Attention: per layer and token, QKᵀ and AV each take 2·H·K·T FLOPs forward, ×3 for
        forward + backward → 12·L·H·K·T. The full T×T square is counted although causal masking
        skips half of it, as PaLM and nanoGPT do, so MFU figures stay comparable."""
        cfg = self.cfg
        n = self.num_params(exclude_embeddings=True) + self.lm_head.weight.numel()
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len

    def summary(self) -> str:
        cfg = self.cfg
        mha = {cfg.n_head: "MHA", 1: "MQA"}.get(cfg.n_kv_head, "GQA")
        return (
            f"GPT {self.num_params() / 1e6:.2f}M params ({self.num_params(True) / 1e6:.2f}M non-embedding): "
            f"L={cfg.n_layer} D={cfg.d_model} H={cfg.n_head} G={cfg.n_kv_head} ({mha}) K={cfg.head_dim} "
            f"{cfg.mlp} F={cfg.mlp_hidden} V={cfg.vocab_size} (padded {cfg.padded_vocab_size}) "
            f"ctx={cfg.max_seq_len} tied={cfg.tie_embeddings}" + "".join(
                f" {name}={getattr(cfg, name)}" for name in RECIPE_OPTIONS if getattr(cfg, name))
        )


def state_shapes(cfg: ModelConfig, most: int) -> dict[str, tuple[int, ...]] | None:
    """Each tensor of GPT(cfg)'s state_dict with its shape, read off a one-block model on the meta
    device: nothing sized by n_layer is built before the count is known. None when they would
    number more than `most` (a config claiming 10^6 layers beside a file of a few tensors), or one
    would hold more elements than int64 counts (a width of 2^40)."""
    if cfg.n_layer > most:  # every block holds a tensor at least
        return None
    try:
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in GPT(replace(cfg, n_layer=1)).state_dict().items()}
    except RuntimeError:  # a tensor of more elements than int64 counts: no file holds one
        return None
    block = {k.removeprefix("blocks.0."): s for k, s in shapes.items() if k.startswith("blocks.0.")}
    ve = {f"value_embeds.{i}.weight": shapes["value_embeds.0.weight"] for i in cfg.value_embed_layers()}
    rest = {k: s for k, s in shapes.items() if not k.startswith(("blocks.", "value_embeds."))}
    if len(rest) + len(ve) + cfg.n_layer * len(block) > most:
        return None
    return rest | ve | {f"blocks.{i}.{k}": s for i in range(cfg.n_layer) for k, s in block.items()}
