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
