"""KV storage formats with their scale planes: the bytes of values, block scales and tensor scales.

A plain dtype (fp32, fp16, bf16, fp8 without scales) is today's arithmetic
(model/shapes.py).  A scaled format stores, as engines keep them, its scales in
regions of their own beside the values, so they add bytes *and* descriptors:

    format              values              block scales                 tensor scales
    fp8-*, tensor       1 B/element         -                            one fp32 per layer and region (K, V)
    fp8-*, block:<n>    1 B/element         one fp32 per <n> values      -
    nvfp4               4 bits (e2m1),      one fp8-e4m3 per 16 values   one fp32 per layer and region
                        two per byte

MLA caches (DeepSeek): the latent (kv_lora_rank values) is quantized; the
decoupled RoPE key (rope_dim values) stays bf16, as FlashMLA's fp8_ds_mla
keeps it (512 B e4m3 latent + 4 fp32 scales per 128 + 128 B bf16 RoPE = 656
B per token and layer).  With ``scales: none`` an fp8 MLA cache is today's
plain arithmetic (the RoPE part in fp8 too), so existing results do not move.
``fp8-e4m3`` with ``block:128`` keeps those scales in a plane of their own (two
descriptors per block); dtype ``fp8-ds-mla`` is vLLM's packed row itself, the
scales between the latent and the RoPE key, one row per token (one descriptor
per block): FlashMLA sparse's get_kv_cache_shape is (blocks, block_size, 656).
Per tensor means per layer and region: vLLM's k_scale / v_scale per attention layer.

A model's indexer key cache (ModelShape.indexer_bytes, DeepSeek-V3.2) is a
region of its own beside the latent, in its own format whatever the dtype: its
bytes are ``parts``' "indexer" and one more descriptor per block and layer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvbench.model import shapes as M

SCALES_HELP = "none, tensor, or block:<n> (one fp32 scale per <n> values; n a power of two)"
QUANT = {"fp8-e4m3": 8, "fp8-e5m2": 8, "nvfp4": 4}  # value bits of the dtypes that take scales
PACKED = {"fp8-ds-mla": 128}  # MLA rows with their fp32 scales inside (values per scale): vLLM's fp8_ds_mla


def parse_scales(spec: str) -> tuple[str, int]:
    """'none' -> ('none', 0); 'tensor' -> ('tensor', 0); 'block:128' -> ('block', 128)."""
    m = re.fullmatch(r"none|tensor|block:(\d+)", spec)
    n = int(m.group(1)) if m and m.group(1) else 0
    if not m or (spec.startswith("block") and (n <= 0 or n & (n - 1))):
        raise ValueError(f"scales '{spec}' is not one of: {SCALES_HELP}")
    return (spec.split(":")[0], n)


@dataclass(frozen=True)
class Format:
    """How one layer's KV is stored: values, block scales, tensor scales (bytes per token and per request)."""

    dtype: str
    scales: str = "none"

    def __post_init__(self):
        kind, n = parse_scales(self.scales) if self.dtype != "nvfp4" or self.scales == "none" else ("?", 0)
        if self.dtype == "nvfp4" and self.scales != "none":
            raise ValueError("nvfp4 carries its own scales (fp8-e4m3 per 16 values, fp32 per tensor): "
                             "leave scales at 'none'")
        if self.dtype in PACKED and self.scales != "none":
            raise ValueError(f"{self.dtype} packs its own scales (one fp32 per {PACKED[self.dtype]} latent values, "
                             "inside each row): leave scales at 'none'")
        if kind != "none" and self.dtype not in QUANT:
            raise ValueError(f"scales '{self.scales}' apply to fp8-e4m3, fp8-e5m2 (and nvfp4 has its own), "
                             f"not {self.dtype}")
        if self.dtype not in QUANT and self.dtype not in M.DTYPES and self.dtype not in PACKED:
            raise ValueError(f"dtype '{self.dtype}' is not one of: {', '.join([*M.DTYPES, 'nvfp4', *PACKED])}")

    def check(self, shape: M.ModelShape) -> None:
        """One-line ValueError where this format cannot store ``shape``'s KV (a packed MLA row on another model)."""
        if self.dtype in PACKED and shape.attention != "mla":
            raise ValueError(f"dtype {self.dtype} is vLLM's packed MLA row (latent, scales, RoPE key): model "
                             f"'{shape.name}' has {shape.attention} attention; use it with an MLA model")

    def misfit(self, shape: M.ModelShape, workload: bool, inflight: int, codec: str) -> str | None:
        """Why a case of this format and ``shape`` cannot run, one line (None: it can): pools in planes run in
        bandwidth sweeps with inflight 1, and a packed row or an indexer cache without a codec."""
        if not self.plain and (workload or inflight > 1):
            return (f"{self.describe()}: formats with scale planes run in bandwidth sweeps with inflight 1 "
                    "(not yet in workloads)")
        if (shape.indexer_bytes or self.dtype in PACKED) and (workload or inflight > 1 or codec != "none"):
            what = self.dtype if self.dtype in PACKED else f"model '{shape.name}' (an indexer key cache)"
            return f"{what}: runs in bandwidth sweeps with inflight 1 and no codec (not yet in workloads)"
        return None

    @property
    def plain(self) -> bool:
        """Today's arithmetic: no scale planes."""
        return self.dtype != "nvfp4" and self.dtype not in PACKED and self.scales == "none"

    @property
    def block(self) -> tuple[int, int]:
        """(values per block scale, bytes per block scale); (0, 0) without block scales."""
        if self.dtype == "nvfp4":
            return 16, 1
        kind, n = parse_scales(self.scales)
        return (n, 4) if kind == "block" else (0, 0)

    @property
    def tensor_scale_bytes(self) -> int:
        """Bytes of the per-tensor scale of one region of one layer."""
        return 4 if self.dtype == "nvfp4" or self.scales == "tensor" else 0

    def describe(self) -> str:
        if self.dtype == "nvfp4":
            return "nvfp4 (4-bit e2m1 values, two per byte; one fp8-e4m3 scale per 16 values; one fp32 scale per tensor)"
        if self.dtype in PACKED:
            return (f"{self.dtype} (vLLM's fp8_ds_mla: per token and layer one row of the latent in fp8-e4m3, one "
                    f"fp32 scale per {PACKED[self.dtype]} of its values, the RoPE key in bf16)")
        if self.plain:
            return f"{self.dtype} ({M.dtype_bytes(self.dtype)} B/element)"
        n, _ = self.block
        return f"{self.dtype} with " + (f"one fp32 scale per {n} values" if n else "one fp32 scale per tensor")

    # ----- per token and layer, in bytes (one layer, all its regions) --------------------------
    def split(self, shape: M.ModelShape) -> tuple[int, int]:
        """(quantized elements, bf16 elements) of one token in one region: MLA keeps its RoPE part in bf16."""
        if shape.attention == "mla" and not self.plain:
            return shape.kv_lora_rank, shape.rope_dim
        return shape.row_elems, 0

    def value_bytes_token(self, shape: M.ModelShape) -> int:
        """Value bytes of one token in one region (rounded up to whole bytes per token row)."""
        q, keep = self.split(shape)
        if self.plain:
            return q * M.dtype_bytes(self.dtype)
        if self.dtype in PACKED:  # fp8 values, their fp32 scales, the bf16 RoPE key: one row
            self.check(shape)
            return q + -(-q // PACKED[self.dtype]) * 4 + 2 * keep
        return -(-q * QUANT[self.dtype] // 8) + 2 * keep

    def block_scale_bytes_token(self, shape: M.ModelShape) -> int:
        n, b = self.block
        return -(-self.split(shape)[0] // n) * b if n else 0

    def parts(self, shape: M.ModelShape, tokens: int) -> dict[str, int]:
        """Bytes of one request of ``tokens`` tokens: values, block scales, tensor scales."""
        r, L = shape.regions, shape.layers
        out = {"values": L * r * tokens * self.value_bytes_token(shape),
               "block_scales": L * r * tokens * self.block_scale_bytes_token(shape),
               "tensor_scales": L * r * self.tensor_scale_bytes}
        if shape.indexer_bytes:
            out["indexer"] = L * tokens * shape.indexer_bytes
        return out

    def descriptors(self, shape: M.ModelShape, nblocks: int, layout: str = "auto") -> int:
        """Uncoalesced descriptors of one request: per block and region its values (and block-scale plane), per
        block its indexer keys, per layer one for its regions' tensor scales (kept side by side).  ``cross-layer``
        posted at once: one per block and plane (a page of every layer), the tensor scales' rows beside them."""
        per_block = 1 + (self.block[0] > 0)
        index, tensor = shape.indexer_bytes > 0, shape.layers * (self.tensor_scale_bytes > 0)
        if layout == "cross-layer":
            return (per_block + index) * nblocks + tensor
        return shape.layers * (shape.regions * per_block + index) * nblocks + tensor


def token_lines(shape: M.ModelShape, fmt: Format) -> list[str]:
    """`kvbench size`'s bytes per token of a format: in all, per layer, and the indexer's share apart."""
    per_layer = shape.regions * (fmt.value_bytes_token(shape) + fmt.block_scale_bytes_token(shape))
    apart = "; tensor scales apart, once per request" if fmt.tensor_scale_bytes else ""
    out = [f"{shape.layers * (per_layer + shape.indexer_bytes):>16,} B per token ({shape.layers} layers{apart})",
           f"{per_layer + shape.indexer_bytes:>16,} B per token per layer"]
    if shape.indexer_bytes:
        share = shape.indexer_bytes / (per_layer + shape.indexer_bytes)
        out.append(f"{shape.layers * shape.indexer_bytes:>16,} B per token of them the indexer's keys "
                   f"({shape.indexer_bytes} B per layer, {share:.1%}; the latent {per_layer} B per layer)")
    return out


def descriptor_lines(shape: M.ModelShape, fmt: Format, nb: int, layout: str) -> list[str]:
    """`kvbench size`'s descriptor counts of a format (``cross-layer``: posted at once, and layer by layer)."""
    what = "planes: values" + ", block scales" * (fmt.block[0] > 0) + ", indexer keys" * (shape.indexer_bytes > 0)
    if layout != "cross-layer":
        return [f"{fmt.descriptors(shape, nb):>16,} descriptors per request uncoalesced ({what})"]
    return [f"{fmt.descriptors(shape, nb, layout):>16,} descriptors per request uncoalesced (cross-layer: one page "
            f"per block and plane; {what}; fewer once adjacent blocks coalesce)",
            f"{fmt.descriptors(shape, nb):>16,} descriptors per request streamed layer by layer (a layer of a page "
            "is a strided run: one per block, region and plane of each layer)"]


def size_lines(shape: M.ModelShape, fmt: Format, ntok: int, block_size: int, layout: str = "auto") -> list[str]:
    """The `kvbench size` lines of a scaled format: values, block scales and tensor scales apart."""
    p = fmt.parts(shape, ntok)
    total = sum(p.values())
    nb = M.num_blocks(ntok, block_size)
    q, keep = fmt.split(shape)
    lines = [f"# format: {fmt.describe()}"]
    if keep:
        lines.append(f"# MLA: the {q}-value latent is quantized, the {keep}-value RoPE key stays bf16")
    lines += token_lines(shape, fmt)
    lines += [
        f"{p['values']:>16,} B values ({fmt.value_bytes_token(shape):,} B per token per region per layer)",
        f"{p['block_scales']:>16,} B block scales ({fmt.block_scale_bytes_token(shape):,} B per token per region per layer)",
        f"{p['tensor_scales']:>16,} B tensor scales ({fmt.tensor_scale_bytes} B per region per layer)",
        f"{total:>16,} B per request ({total / 1e9:.3f} GB, {total / 2**30:.3f} GiB)",
        f"{block_size * fmt.value_bytes_token(shape):>16,} B per value block ({block_size} tokens, one region)",
        f"{block_size * fmt.block_scale_bytes_token(shape):>16,} B per block-scale block ({block_size} tokens, one region)",
    ]
    if shape.indexer_bytes:
        lines += [f"{p['indexer']:>16,} B indexer keys ({shape.indexer_bytes:,} B per token per layer)",
                  f"{block_size * shape.indexer_bytes:>16,} B per indexer block ({block_size} tokens)"]
    lines += [
        f"{nb:>16,} blocks per layer",
        *descriptor_lines(shape, fmt, nb, layout),
        "# transfer time at line rate (GB = 10^9 B; achieved bandwidth is lower: measure it with kvbench run)",
    ]
    for link, gbps in M.LINKS.items():
        lines.append(f"  {link:<18} {gbps:8.1f} GB/s {total / (gbps * 1e9) * 1e3:12.2f} ms")
    return lines
