"""The weights a step streams, copied into transparent huge pages: a TLB miss every 4 KiB of a stream read at tens
of GB/s costs what docs/performance.md shows."""
import ctypes
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of private anonymous memory, 2 MiB-aligned and advised for transparent huge pages where the
    OS has them (Linux; a shared mapping would not get them), else plain memory."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the region alive as long as a view of it lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def give_back_heap():
    """Return the heap's free pages to the OS (glibc's malloc_trim): the layouts made at load on the heap are freed
    once copied into huge pages, but the heap keeps their pages (the 1.5B in bf16 held 0.95 GB more without this)."""
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except AttributeError:  # a C library other than glibc
            pass


class HugePages:
    """Tensors carved back to back, on cache-line boundaries, out of huge-page regions of 64 MiB (or one tensor's
    size): a model's layers then share whole 2 MiB pages, where a region per layer left each layer's tail in
    4 KiB pages. A region's unused end is never touched, so it costs no memory."""

    def __init__(self, chunk=64 << 20):
        self.chunk, self.memory, self.offset = chunk, None, 0

    def empty(self, shape, dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self.memory is None or self.offset + nbytes > self.memory.numel():
            self.memory, self.offset = huge_page_memory(max(self.chunk, nbytes)), 0
        tensor = self.memory[self.offset:self.offset + nbytes].view(dtype).view(shape)
        self.offset += -(-nbytes // 64) * 64
        return tensor


def move_to_huge_pages(products, pages: HugePages):
    """Copy what few_rows.cpp streams for these products (or stacks, in call order) into huge pages, and point them
    at the copies. The weights a step reads otherwise sit in 4 KiB pages, of the mapped file or of the heap: a TLB
    miss every 4 KiB of a stream that reads ~30 GB/s (docs/performance.md has what that cost). One tensor at a
    time, each old copy freed before the next is made: loading holds at most one tensor twice. -> products"""
    for p in products:
        for i in range(2):
            operands = list(p.operands()[:2])
            old = operands[i]
            if old is None:
                continue
            operands[i] = pages.empty(old.shape, old.dtype)
            operands[i].copy_(old)
            del old
            p.use_operands(*operands)
    return products
