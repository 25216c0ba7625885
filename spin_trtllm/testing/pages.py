"""Random FP8 pages in the indexer K-cache layout of TensorRT-LLM / DeepGEMM: per page, its
slots' fp8 rows of 128 bytes, then one fp32 scale per slot (uint8 [pages, slots, 1, 132])."""

import torch

HEAD_DIM = 128
SLOT_BYTES = HEAD_DIM + 4          # 128 fp8 key bytes and a 4-byte fp32 scale


def random_fp8_keys(num_pages: int, gen: torch.Generator, slots: int = 64):
    """fp8 key rows [num_pages, slots, 128] (randn x 2) and fp32 scales [num_pages, slots] in
    [0.005, 0.025), drawn from `gen` in that order, on gen's device."""
    dev = gen.device
    rows = (torch.randn(num_pages, slots * HEAD_DIM, generator=gen, device=dev) * 2).to(
        torch.float8_e4m3fn)
    scales = torch.rand(num_pages, slots, generator=gen, device=dev) * 0.02 + 0.005
    return rows.view(num_pages, slots, HEAD_DIM), scales


def pack_pages(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 pages [P, S, 1, 132] from fp8 rows [P, S, 128] and fp32 scales [P, S]: each page
    holds its S rows first, then its S scales."""
    P, S = scales.shape
    data = torch.cat([rows.contiguous().view(torch.uint8).reshape(P, -1),
                      scales.float().contiguous().view(torch.uint8).reshape(P, -1)], 1)
    return data.view(P, S, 1, SLOT_BYTES)


def make_cache(num_pages: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random FP8 pages: 64 rows of 128 fp8, then 64 fp32 scales (uint8 [num_pages, 64, 1, 132])."""
    return pack_pages(*random_fp8_keys(num_pages, gen)).to(device)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitudes of codes 0..7; bit 3: sign
FP4_SLOT_BYTES = HEAD_DIM // 2 + HEAD_DIM // 32


def random_mxfp4_pages(num_pages: int, gen: torch.Generator, slots: int = 64):
    """(uint8 pages [P, slots, 1, 68] in DeepGEMM's MXFP4 layout, float64 keys [P, slots, 128]
    they hold): random E2M1 codes and UE8M0 exponents in [120, 130], the values from a table.
    Per page: its slots' 64-byte rows (two codes a byte, the even element in the low nibble),
    then 4 exponent bytes per slot, byte i scaling elements 32 i .. 32 i + 31 by 2^(e - 127)."""
    P = num_pages
    codes = torch.randint(0, 16, (P, slots, HEAD_DIM), generator=gen)
    exps = torch.randint(120, 131, (P, slots, HEAD_DIM // 32), generator=gen)
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes & 7]
    sign = torch.where((codes & 8) > 0, -1.0, 1.0).double()
    keys = magnitude * sign * torch.pow(2.0, (exps - 127).double()).repeat_interleave(32, -1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    data = torch.cat([packed.reshape(P, -1), exps.to(torch.uint8).reshape(P, -1)], 1)
    return data.view(P, slots, 1, FP4_SLOT_BYTES), keys
