"""Model shapes, presets and the KV arithmetic (pure functions, no I/O but YAML loading).

bytes per token (MHA/GQA/MQA) = 2 x layers x kv_heads x head_dim x dtype_bytes   (K and V)
bytes per token (MLA)         = layers x (kv_lora_rank + rope_dim) x dtype_bytes  (one latent)
  + layers x indexer_bytes    (a sparse-attention indexer's key cache, DeepSeek-V3.2: its own format)
request bytes                 = bytes per token x (prompt tokens - prefix-hit tokens)

A hybrid model mixes three kinds of layer (layers.py holds their order and arithmetic):
full attention (the above, per token), sliding-window attention (the same per token, for at
most ``window`` tokens) and linear attention / state space (a fixed state per request).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvbench.model import layers as L
from kvbench.model.dtypes import DTYPES, dtype_bytes  # noqa: F401 - re-exported: M.DTYPES, M.dtype_bytes
from kvbench.model.yamlfile import read

ATTENTION = ("mha", "gqa", "mqa", "mla")


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model that decide the size of its KV cache."""

    name: str
    layers: int
    kv_heads: int = 0  # MHA/GQA/MQA
    head_dim: int = 0
    attention: str = "gqa"
    kv_lora_rank: int = 0  # MLA latent width
    rope_dim: int = 0  # MLA decoupled RoPE key width
    params_b: float = 0.0  # parameters in billions
    q_heads: int = 0
    active_params_b: float = 0.0  # parameters a token passes through (MoE: fewer than params_b); 0 = params_b
    source: str = ""
    context: int = 0  # the longest prompt it takes (max_position_embeddings), in tokens; 0 = not known
    sliding_layers: int = 0  # of ``layers``: sliding-window attention, KV of the last ``window`` tokens
    window: int = 0  # tokens a sliding layer keeps
    linear_layers: int = 0  # of ``layers``: linear attention / state space, a fixed state per request
    state_heads: int = 0  # recurrent state: state_heads x state_k_dim x state_v_dim (heads split by TP)
    state_k_dim: int = 0
    state_v_dim: int = 0
    state_dtype: str = "fp32"
    conv_kernel: int = 0  # convolution state: (conv_kernel - 1) x conv_dim (channels split by TP)
    conv_dim: int = 0
    conv_dtype: str = "bf16"
    # a sparse-attention indexer's key cache (DeepSeek-V3.2's lightning indexer): bytes per token per layer, a
    # region of its own beside the latent, stored in its own format whatever the KV dtype; 0 = none
    indexer_bytes: int = 0

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention '{self.attention}' is not one of: {', '.join(ATTENTION)}")
        if self.layers <= 0:
            raise ValueError("layers must be a positive integer")
        L.check_kinds(self)
        if self.attn_layers == 0:
            return  # all layers linear: no KV heads to check
        if self.attention == "mla":
            if self.kv_lora_rank <= 0:
                raise ValueError("an MLA model needs kv_lora_rank > 0 (and usually rope_dim)")
            if self.rope_dim < 0:  # it adds to the latent's width: a negative one shrinks every token's bytes
                raise ValueError(f"rope_dim {self.rope_dim} is negative")
        elif self.kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError("kv_heads and head_dim must be positive integers")
        if self.context < 0:
            raise ValueError(f"context {self.context} is negative (0: not known)")
        if self.indexer_bytes < 0 or (self.indexer_bytes and self.hybrid):
            raise ValueError(f"indexer_bytes {self.indexer_bytes}: a non-negative count, and no indexer beside "
                             "sliding or linear layers")

    @property
    def regions(self) -> int:
        """Regions per layer in the pool: 2 (K, V) or 1 (MLA latent)."""
        return 1 if self.attention == "mla" else 2

    @property
    def full_layers(self) -> int:
        """Layers of full attention (all of them in an attention-only model)."""
        return self.layers - self.sliding_layers - self.linear_layers

    @property
    def attn_layers(self) -> int:
        """Layers that hold KV per token: full and sliding attention."""
        return self.layers - self.linear_layers

    @property
    def hybrid(self) -> bool:
        return bool(self.sliding_layers or self.linear_layers)

    @property
    def row_elems(self) -> int:
        """Elements of one token in one region of one layer."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.rope_dim
        return self.kv_heads * self.head_dim


# Presets: each with the config it comes from.
PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        # meta-llama/Llama-2-70b-hf config.json: 80 layers, 64 heads, 8 KV heads, hidden 8192; max_position_embeddings 4096
        ModelShape("llama-2-70b", 80, 8, 128, "gqa", params_b=69.0, q_heads=64, context=4096, source="meta-llama/Llama-2-70b-hf config.json"),
        # meta-llama/Meta-Llama-3-8B config.json: 32 layers, 32 heads, 8 KV heads, hidden 4096; max_position_embeddings 8192
        ModelShape("llama-3-8b", 32, 8, 128, "gqa", params_b=8.0, q_heads=32, context=8192, source="meta-llama/Meta-Llama-3-8B config.json"),
        # meta-llama/Meta-Llama-3-70B config.json: 80 layers, 64 heads, 8 KV heads; max_position_embeddings 8192
        ModelShape("llama-3-70b", 80, 8, 128, "gqa", params_b=70.6, q_heads=64, context=8192, source="meta-llama/Meta-Llama-3-70B config.json"),
        # meta-llama/Llama-3.1-405B config.json: 126 layers, 128 heads, 8 KV heads, hidden 16384; max_position_embeddings 131072
        ModelShape("llama-3.1-405b", 126, 8, 128, "gqa", params_b=405.0, q_heads=128, context=131072, source="meta-llama/Llama-3.1-405B config.json"),
        # Qwen/Qwen2.5-7B config.json: 28 layers, 28 heads, 4 KV heads, hidden 3584 (head_dim 128); max_position_embeddings 131072
        ModelShape("qwen2.5-7b", 28, 4, 128, "gqa", params_b=7.6, q_heads=28, context=131072, source="Qwen/Qwen2.5-7B config.json"),
        # Qwen/Qwen2.5-72B config.json: 80 layers, 64 heads, 8 KV heads, hidden 8192; max_position_embeddings 131072
        ModelShape("qwen2.5-72b", 80, 8, 128, "gqa", params_b=72.7, q_heads=64, context=131072, source="Qwen/Qwen2.5-72B config.json"),
        # mistralai/Mixtral-8x7B-v0.1 config.json: 32 layers, 32 heads, 8 KV heads, hidden 4096; max_position_embeddings 32768
        ModelShape("mixtral-8x7b", 32, 8, 128, "gqa", params_b=46.7, q_heads=32, active_params_b=12.9, context=32768, source="mistralai/Mixtral-8x7B-v0.1 config.json"),
        # deepseek-ai/DeepSeek-V3 config.json: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64; max_position_embeddings 163840
        ModelShape("deepseek-v3", 61, attention="mla", kv_lora_rank=512, rope_dim=64, params_b=671.0, q_heads=128, active_params_b=37.0, context=163840, source="deepseek-ai/DeepSeek-V3 config.json"),
        # deepseek-ai/DeepSeek-V3.2 config.json: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64 (the V3 latent),
        # index_head_dim 128; max_position_embeddings 163840.  Its lightning indexer keeps a key cache per layer:
        # vLLM's Indexer (model_executor/models/deepseek_v2.py) allocates it as DeepseekV32IndexerCache of
        # head_dim = index_head_dim + index_head_dim // quant_block_size (128) x 4 = 128 fp8 keys + one fp32 scale
        # = 132 B per token per layer (uint8), whatever the latent's dtype.  The latent in fp8 is --dtype
        # fp8-ds-mla: FlashMLA sparse's get_kv_cache_shape (v1/attention/backends/mla/flashmla_sparse.py)
        # gives (num_blocks, block_size, 656) bytes: 512 fp8-e4m3 + 4 fp32 scales + 64 bf16 RoPE (formats.py)
        ModelShape("deepseek-v3.2", 61, attention="mla", kv_lora_rank=512, rope_dim=64, params_b=671.0, q_heads=128,
                   active_params_b=37.0, context=163840, indexer_bytes=132,
                   source="deepseek-ai/DeepSeek-V3.2 config.json; vLLM flashmla_sparse.py, deepseek_v2.py Indexer"),
        # facebook/opt-66b config.json: 64 layers, 72 heads x 128 (MHA, hidden 9216); max_position_embeddings 2048
        ModelShape("opt-66b", 64, 72, 128, "mha", params_b=66.0, q_heads=72, context=2048, source="facebook/opt-66b config.json"),
        # Qwen/Qwen3-235B-A22B config.json: 94 layers, 64 heads, 4 KV heads x 128 (docs/models.md)
        ModelShape("qwen3-235b-a22b", 94, 4, 128, "gqa", params_b=235.0, q_heads=64, active_params_b=22.0,
                   context=40960, source="Qwen/Qwen3-235B-A22B config.json"),
        # openai/gpt-oss-120b config.json: 36 layers alternating sliding (window 128) and full, 8 KV heads x 64
        ModelShape("gpt-oss-120b", 36, 8, 64, "gqa", params_b=116.8, q_heads=64, active_params_b=5.1,
                   sliding_layers=18, window=128, context=131072, source="openai/gpt-oss-120b config.json"),
        # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, 3 of 4 Gated DeltaNet (32 value heads, 128 x 128
        # state, conv kernel 4 over 2 x 16 x 128 + 32 x 128 channels), 1 of 4 full attention (2 KV heads x 256);
        # the recurrent state in float32, the convolution state in the model's bf16 (docs/models.md)
        ModelShape("qwen3-next-80b-a3b", 48, 2, 256, "gqa", params_b=80.0, q_heads=16, active_params_b=3.0,
                   linear_layers=36, state_heads=32, state_k_dim=128, state_v_dim=128, state_dtype="fp32",
                   conv_kernel=4, conv_dim=8192, conv_dtype="bf16", context=262144,
                   source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json"),
    ]
}


def get_model(name: str) -> ModelShape:
    """A preset (or a registered model) by name, or a model from a YAML file path (``*.yaml``/``*.yml``)."""
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith((".yaml", ".yml")):
        return load_model_yaml(name)
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model '{name}' is not one of: {', '.join(PRESETS)} (or a model .yaml file)") from None


class ModelFile(BaseModel):
    """A model YAML file: the fields of ModelShape, each of its type (no 32.5 layers, no "many")."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: str | None = None
    layers: int = Field(gt=0)
    kv_heads: int = Field(0, ge=0)
    head_dim: int = Field(0, ge=0)
    attention: Literal["mha", "gqa", "mqa", "mla"] = "gqa"
    kv_lora_rank: int = Field(0, ge=0)
    rope_dim: int = Field(0, ge=0)
    params_b: float = Field(0.0, ge=0)
    q_heads: int = Field(0, ge=0)
    active_params_b: float = Field(0.0, ge=0)
    source: str = ""
    context: int = Field(0, ge=0)
    kinds: dict[Literal["full", "sliding", "linear"], int] | None = None  # layers of each kind; they sum to layers
    window: int = 0  # sliding layers: tokens kept
    state_heads: int = 0  # linear layers: recurrent state heads x state_k_dim x state_v_dim
    state_k_dim: int = 0
    state_v_dim: int = 0
    state_dtype: str = "fp32"
    conv_kernel: int = 0  # linear layers: convolution state (conv_kernel - 1) x conv_dim
    conv_dim: int = 0
    conv_dtype: str = "bf16"
    indexer_bytes: int = Field(0, ge=0)  # a sparse-attention indexer's key cache, bytes per token per layer


def _kinds(path: str, fields: dict) -> dict:
    """A model file's ``kinds`` mapping as ModelShape's counts; one line when they do not add up to ``layers``."""
    kinds = fields.pop("kinds")
    if kinds is None:
        return fields
    if any(n < 0 for n in kinds.values()) or sum(kinds.values()) != fields["layers"]:
        given = " + ".join(f"{n} {k}" for k, n in kinds.items())
        raise ValueError(f"model file {path}: field 'kinds': {given} = {sum(kinds.values())} layers, not the "
                         f"model's {fields['layers']} (layers): each layer is one of full, sliding, linear")
    return dict(fields, sliding_layers=kinds.get("sliding", 0), linear_layers=kinds.get("linear", 0))


def load_model_yaml(path: str) -> ModelShape:
    """Read a model from YAML with the fields of ModelShape (layers required); one-line errors naming the field."""
    try:
        data = read(path)
    except ValueError as exc:
        raise ValueError(f"model file {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model file {path}: expected a mapping of ModelShape fields (name, layers, kv_heads, ...)")
    try:
        m = ModelFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(ModelFile.model_fields)})"
        elif err["type"] == "missing":
            msg = "required"
        raise ValueError(f"model file {path}: field '{field}': {msg}") from None
    fields = _kinds(path, m.model_dump())
    fields["name"] = fields["name"] or path
    try:
        return ModelShape(**fields)
    except ValueError as exc:
        raise ValueError(f"model file {path}: {exc}") from None


def shard(m: ModelShape, tp: int = 1, pp: int = 1) -> ModelShape:
    """The slice of ``m`` one rank holds under tensor (tp) and pipeline (pp) parallelism.

    TP divides KV heads across ranks; when there are fewer KV heads than ranks
    each rank holds one replicated head (vLLM's behaviour).  The MLA latent is
    not split by TP (every rank keeps it whole).  PP divides layers, the
    first stages taking the remainder (of a hybrid model, the first stage's
    layers in the model's order).  A linear layer's state heads and
    convolution channels are split by TP, never replicated.
    """
    if tp < 1 or pp < 1:
        raise ValueError("tp and pp must be >= 1")
    if pp > m.layers:
        raise ValueError(f"pp={pp} exceeds the model's {m.layers} layers")
    layers = math.ceil(m.layers / pp)
    kinds = {}
    if m.hybrid:
        first = L.layer_kinds(m)[:layers]
        kinds = dict(sliding_layers=first.count("sliding"), linear_layers=first.count("linear"))
        if m.linear_layers:
            if m.state_heads % tp or m.conv_dim % tp:
                raise ValueError(f"tp={tp} does not divide the model's {m.state_heads} state heads and "
                                 f"{m.conv_dim} convolution channels")
            kinds.update(state_heads=m.state_heads // tp, conv_dim=m.conv_dim // tp)
    if m.attention == "mla" or m.attn_layers == 0:
        return replace(m, layers=layers, **kinds)
    if m.kv_heads >= tp and m.kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide the model's {m.kv_heads} KV heads")
    heads = max(1, m.kv_heads // tp)
    return replace(m, layers=layers, kv_heads=heads, **kinds)


def replication(m: ModelShape, tp: int) -> float:
    """How many copies of each KV head a TP group of ``tp`` ranks holds: tp x max(1, kv_heads / tp) / kv_heads
    (1 when TP divides the heads; tp for an MLA latent, which every rank keeps whole)."""
    if m.attn_layers == 0:
        return 1.0
    if m.attention == "mla":
        return float(tp)
    return tp * max(1, m.kv_heads // tp) / m.kv_heads


def bytes_per_token(m: ModelShape, dtype: str) -> int:
    """KV bytes one token adds to the cache over the full-attention layers (all layers of an attention-only model;
    a sliding layer adds them only inside its window, a linear layer never: layers.py)."""
    return m.full_layers * layer_bytes_per_token(m, dtype)


def layer_bytes_per_token(m: ModelShape, dtype: str) -> int:
    """KV bytes one token adds to one layer (all regions, an indexer's keys too)."""
    return m.regions * m.row_elems * dtype_bytes(dtype) + m.indexer_bytes


def block_bytes(m: ModelShape, block_size: int, dtype: str) -> int:
    """Bytes of one block (``block_size`` tokens) of one region of one layer."""
    return block_size * m.row_elems * dtype_bytes(dtype)


def transferred_tokens(tokens: int, prefix_hit: int = 0) -> int:
    """Prompt tokens whose KV must move (prefix-cache hits stay put)."""
    if tokens <= 0:
        raise ValueError("tokens must be a positive integer")
    if not 0 <= prefix_hit <= tokens:
        raise ValueError(f"prefix_hit must be between 0 and tokens ({tokens})")
    return tokens - prefix_hit


def request_bytes(m: ModelShape, dtype: str, tokens: int, prefix_hit: int = 0) -> int:
    """Bytes of one request that cross the wire: full-attention KV, sliding windows and linear states."""
    return sum(L.parts(m, dtype, transferred_tokens(tokens, prefix_hit)).values())


def group_parts(m: ModelShape, dtype: str, ntok: int, tp: int) -> dict[str, int]:
    """layers.parts over the whole TP group (every PP stage too): one rank's KV and windows x tp (a replicated head
    counted on every rank that holds it), its states x tp = the model's states (TP splits them)."""
    one = L.parts(shard(m, tp, 1), dtype, ntok)
    return {k: v * tp for k, v in one.items()}


def num_blocks(tokens: int, block_size: int) -> int:
    """Blocks per layer that hold ``tokens`` (the last one may be partial)."""
    return -(-tokens // block_size)


def check_block_size(block_size: int) -> int:
    """Block sizes are positive powers of two (engines' kernels assume it)."""
    if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block size {block_size} is not a positive power of two (e.g. 16, 32, 64)")
    return block_size


def prefill_flops(m: ModelShape, tokens: int) -> float:
    """FLOPs of one prefill: 2 x active params x tokens + causal attention 2 x layers x tokens^2 x d_attn.

    d_attn = q_heads x head_dim (128 for MLA's attention heads).  The linear
    term is the weights; the quadratic term is QK^T and AV over a causal mask
    (half of the 4 x L x n^2 x d of full attention).
    """
    params = (m.active_params_b or m.params_b) * 1e9
    if params <= 0:
        raise ValueError(f"model '{m.name}' has no parameter count: give --prefill-ms instead of --prefill-tflops")
    d_attn = (m.q_heads or m.kv_heads) * (m.head_dim or 128)
    return 2.0 * params * tokens + 2.0 * m.layers * tokens * tokens * d_attn


def prefill_ms(m: ModelShape, tokens: int, tflops: float) -> float:
    """Prefill time in ms at an achieved ``tflops`` (10^12 FLOP/s)."""
    if tflops <= 0:
        raise ValueError("--prefill-tflops must be positive")
    return prefill_flops(m, tokens) / (tflops * 1e12) * 1e3


# Named link rates for `kvbench size`, in GB/s (10^9 B/s) of one-way payload at line rate.
LINKS: dict[str, float] = {
    "25GbE": 25 / 8,
    "100GbE": 100 / 8,
    "200G IB HDR": 200 / 8,
    "400G IB NDR": 400 / 8,
    "PCIe 5 x16": 64.0,
    "NVLink 4 (H100)": 450.0,
}
