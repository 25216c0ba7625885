"""Stand-in only: the indexer-key byte layouts of DeepGEMM's paged MQA logits, in plain torch.

Written from the layout contract (deepseek-ai/DeepGEMM 54e22612, csrc/apis/attention.hpp
`fp8_fp4_paged_mqa_logits`, tests/test_attention.py `kv_cache_cast_to_fp{8,4}`); no code copied.

A page of P slots, one key of D = 128 values per slot, is stored as
  FP8: P rows of D e4m3 bytes, then P float32 scales            (D + 4 = 132 B per slot)
  FP4: P rows of D/2 bytes (two E2M1 codes per byte, the even element in the low nibble),
       then P int32 words of 4 UE8M0 exponents, byte i scaling elements 32i..32i+31
                                                                (D/2 + 4 = 68 B per slot)
Scales are powers of two (UE8M0, rounded up), as upstream's fused_cat_fp8(ue8m0) / fused_cat_fp4.
"""
import torch

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_MAX, FP4_MAX, FP4_BLOCK = 448.0, 6.0, 32


def ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0)."""
    mantissa, exponent = torch.frexp(x.float())
    exact = mantissa == 0.5
    return torch.ldexp(torch.ones_like(mantissa), torch.where(exact, exponent - 1, exponent))


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [M, D] -> (e4m3 [M, D], float32 scale [M]); one power-of-two scale per row."""
    x = x.float()
    scale = ue8m0_ceil(x.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX)
    return (x / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 or its bytes [M, D], float32 scale [M]) -> float [M, D]."""
    if data.dtype != torch.float8_e4m3fn:
        data = data.contiguous().view(torch.float8_e4m3fn)
    return data.float() * scale.float().reshape(-1, 1)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    # comparisons with Python floats, not a table copied to x's device: graph-capture safe
    values = E2M1_VALUES.tolist()
    mag = x.abs()
    code = torch.zeros_like(x, dtype=torch.uint8)
    for lo, hi in zip(values[:-1], values[1:]):
        code += (mag > (lo + hi) / 2).to(torch.uint8)
    return code | ((x < 0) & (code > 0)).to(torch.uint8) << 3


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [M, D] -> (packed uint8 [M, D/2], int32 [M * D/128] of 4 packed UE8M0 exponents)."""
    x = x.float()
    m, d = x.shape
    blocks = x.view(m, d // FP4_BLOCK, FP4_BLOCK)
    scale = ue8m0_ceil(blocks.abs().amax(dim=-1).clamp(min=1e-4) / FP4_MAX)     # [M, D/32]
    codes = _e2m1_codes(blocks / scale[..., None]).view(m, d)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    exps = (torch.frexp(scale)[1] - 1 + 127).to(torch.uint8)                   # 2^(e-127)
    return packed.contiguous(), exps.contiguous().view(torch.int32).view(-1)


def dequantize_fp4(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(packed bytes [M, D/2], int32 words [M, D/128] or their bytes) -> float [M, D]."""
    packed = packed.contiguous().view(torch.uint8)
    m, half = packed.shape
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(m, 2 * half)
    # E2M1 magnitudes from the bits (2 exponent, 1 mantissa), not a table copied to the device
    exp, man = ((codes & 0x7) >> 1).float(), (codes & 0x1).float()
    mag = torch.where(exp == 0, man * 0.5, torch.exp2(exp - 1) * (1 + man * 0.5))
    values = torch.where((codes & 0x8) > 0, -mag, mag)
    exps = sf.contiguous().view(torch.uint8).view(m, -1).float()               # [M, D/32]
    scale = torch.exp2(exps - 127.0)
    return (values.view(m, -1, FP4_BLOCK) * scale[..., None]).view(m, 2 * half)


def row_bytes(head_dim: int, fp4: bool) -> int:
    return (head_dim // 2 if fp4 else head_dim) + 4


def dequantize_pages(kv_cache: torch.Tensor, head_dim: int = 128) -> torch.Tensor:
    """uint8 pages [blocks, P, 1, 132 or 68] -> float keys [blocks, P, head_dim]."""
    blocks, slots, _, width = kv_cache.shape
    fp4 = width == row_bytes(head_dim, True)
    if not fp4 and width != row_bytes(head_dim, False):
        raise ValueError(f"indexer K pages: row of {width} B is neither FP8 "
                         f"({row_bytes(head_dim, False)}) nor FP4 ({row_bytes(head_dim, True)})")
    data_bytes = width - 4
    flat = kv_cache.reshape(blocks, slots * width)
    data = flat[:, :slots * data_bytes].reshape(blocks * slots, data_bytes)
    scales = flat[:, slots * data_bytes:].reshape(blocks * slots, 4)
    if fp4:
        keys = dequantize_fp4(data, scales)
    else:
        keys = dequantize_fp8(data, scales.contiguous().view(torch.float32).view(-1))
    return keys.view(blocks, slots, head_dim)
