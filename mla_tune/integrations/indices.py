"""Page-1 addressing (SGLang's): a cache addressed per token by kv_indptr + kv_indices,
turned on the device into the block table the serving kernels read.

SGLang's Triton and FlashInfer MLA backends address the cache one token at a time: the
cache is `(num_slots, 1, 576)` and sequence b's tokens are the slots
`kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`. That is the paged layout at page size 1, whose
block table row b is the same slots laid out from column 0:

    block_table[b, j] = kv_indices[kv_indptr[b] + j]    (j < seq_lens[b])
    seq_lens[b]       = kv_indptr[b + 1] - kv_indptr[b]

`indices_to_block_table` writes both into preallocated buffers with one Triton launch (no
host read of a device tensor, no allocation: capturable in a CUDA graph); `PageOneTable`
owns such buffers for batches up to max_batch, so a `DecodePlan` made with
`CallSpec(..., page_size=1)` reads SGLang's cache as it is. Entries past a sequence's length
are left as they were (the kernels read only the first seq_len).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # block-table columns per program


@triton.jit
def _indices_to_table_kernel(kv_indptr, kv_indices, table, seq_lens, table_stride, width,
                             BLOCK: tl.constexpr):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    start = tl.load(kv_indptr + b)
    length = tl.load(kv_indptr + b + 1) - start
    if chunk == 0:  # a longer sequence is cut to the row: no kernel reads past it
        tl.store(seq_lens + b, tl.minimum(length, width))
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    keep = (cols < length) & (cols < width)
    slots = tl.load(kv_indices + start + cols, mask=keep, other=0)
    tl.store(table + b.to(tl.int64) * table_stride + cols, slots.to(tl.int32), mask=keep)


def indices_to_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Write page-1 addressing into block_table[:batch] and seq_lens[:batch] on the device.

    kv_indptr: (batch + 1,) int32 or int64; kv_indices: (>= kv_indptr[-1],) int32 or int64
    slots of a (num_slots, 1, 576) cache; block_table: (>= batch, width) int32 whose width
    covers the longest sequence (a longer one is cut to its first width tokens, its length
    too, so no kernel reads another row: size the buffer for the engine's context length);
    seq_lens: (>= batch,) int32. Checks shapes and dtypes only."""
    batch = kv_indptr.shape[0] - 1
    if kv_indptr.dim() != 1 or batch < 1:
        raise ValueError(f"kv_indptr must be (batch + 1,) with batch >= 1, got {tuple(kv_indptr.shape)}")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if kv_indices.dim() != 1:
        raise ValueError(f"kv_indices must be 1-D, got {tuple(kv_indices.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < batch or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be a (>= {batch}, width) int32 buffer, got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table's rows must be contiguous")
    if seq_lens.dim() != 1 or seq_lens.shape[0] < batch or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be a (>= {batch},) int32 buffer, got "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    width = block_table.shape[1]
    grid = (batch, triton.cdiv(width, BLOCK))
    _indices_to_table_kernel[grid](kv_indptr, kv_indices, block_table, seq_lens,
                                   block_table.stride(0), width, BLOCK=BLOCK)


class PageOneTable:
    """Preallocated page-1 block table and lengths for batches up to max_batch sequences
    of up to max_len tokens; `update` fills them from kv_indptr + kv_indices on the device
    and returns the step's views (block_table[:batch], seq_lens[:batch]), the same storage
    every step (a CUDA graph may hold them)."""

    def __init__(self, max_batch: int, max_len: int, device=None):
        if not (isinstance(max_batch, int) and max_batch >= 1 and isinstance(max_len, int) and max_len >= 1):
            raise ValueError(f"max_batch and max_len must be positive ints, got {max_batch!r}, {max_len!r}")
        self.block_table = torch.zeros((max_batch, max_len), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros((max_batch,), dtype=torch.int32, device=device)

    def update(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens_host=None):
        """The step's (block_table, seq_lens) views. kv_lens_host, the lengths on the host
        where the engine has them, lets a sequence longer than max_len be refused here."""
        batch = kv_indptr.shape[0] - 1
        if batch > self.seq_lens.shape[0]:
            raise ValueError(f"a step of {batch} sequences, but the table holds {self.seq_lens.shape[0]}")
        if kv_lens_host is not None and len(kv_lens_host) and max(kv_lens_host) > self.block_table.shape[1]:
            raise ValueError(f"a sequence of {max(kv_lens_host)} tokens, but the page-1 table holds "
                             f"{self.block_table.shape[1]}; make it with a larger max_len")
        indices_to_block_table(kv_indptr, kv_indices, self.block_table, self.seq_lens)
        return self.block_table[:batch], self.seq_lens[:batch]


@triton.jit
def _req_to_table_kernel(req_to_token, req_pool_indices, lens_in, table, lens_out, row_stride,
                         table_stride, width, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    length = tl.minimum(tl.load(lens_in + b).to(tl.int32), width * PAGE)  # cut to the row, as above
    tl.store(lens_out + b, length)
    pages = (length + PAGE - 1) // PAGE
    for start in range(0, pages, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < pages
        slot = tl.load(req_to_token + row * row_stride + cols.to(tl.int64) * PAGE, mask=keep, other=0)
        tl.store(table + b.to(tl.int64) * table_stride + cols, (slot // PAGE).to(tl.int32), mask=keep)


def req_to_block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, page_size: int, block_table: torch.Tensor,
                       seq_lens_out: torch.Tensor) -> None:
    """SGLang's request-to-token map as a block table, on the device in one launch:
    block_table[b, j] = req_to_token[req_pool_indices[b], j * page_size] // page_size for the
    pages of seq_lens[b] tokens, and seq_lens_out[b] = seq_lens[b] as int32 (b < batch =
    len(req_pool_indices); a sequence longer than block_table's pages is cut to them, its
    length too). With page_size 1 a row is the request's token slots (the
    kv_indices SGLang's Triton backend builds from the same map). Only the pages each
    sequence uses are written; checks shapes and dtypes only."""
    batch = req_pool_indices.shape[0]
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token must be a (requests, context) map with contiguous rows, "
                         f"got {tuple(req_to_token.shape)}")
    if not (isinstance(page_size, int) and page_size >= 1 and page_size & (page_size - 1) == 0):
        raise ValueError(f"page_size must be a power of two, got {page_size!r}")
    if block_table.dim() != 2 or block_table.shape[0] < batch or block_table.dtype != torch.int32 \
            or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be a (>= {batch}, width) int32 buffer with contiguous rows, "
                         f"got {tuple(block_table.shape)} {block_table.dtype}")
    if seq_lens.shape[0] < batch or seq_lens_out.shape[0] < batch or seq_lens_out.dtype != torch.int32:
        raise ValueError(f"seq_lens must hold >= {batch} lengths and seq_lens_out be an int32 buffer "
                         f"of >= {batch}, got {tuple(seq_lens.shape)} and {tuple(seq_lens_out.shape)} "
                         f"{seq_lens_out.dtype}")
    if batch == 0:
        return
    _req_to_table_kernel[(batch,)](req_to_token, req_pool_indices, seq_lens, block_table, seq_lens_out,
                                   req_to_token.stride(0), block_table.stride(0), block_table.shape[1],
                                   PAGE=page_size, BLOCK=BLOCK)
