"""The weights a step streams, copied into transparent huge pages: a TLB miss every 4 KiB of a stream read at tens
of GB/s costs what docs/performance.md shows."""
import ctypes
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


class Region:
    """nbytes of private anonymous memory, 2 MiB-aligned and advised for transparent huge pages where the OS has them
    (Linux; a shared mapping would not get them), else plain memory; carve(offset, nbytes) gives a part of it as a
    uint8 tensor with a storage of its own (a compiled step refuses inputs that share one), which keeps the region
    alive."""

    def __init__(self, nbytes: int):
        self.size = nbytes
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.buffer.madvise(mmap.MADV_HUGEPAGE)
            self.start = -torch.frombuffer(self.buffer, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
        else:
            self.buffer, self.start = bytearray(nbytes), 0

    def carve(self, offset: int, nbytes: int) -> torch.Tensor:
        return torch.frombuffer(self.buffer, dtype=torch.uint8, count=nbytes, offset=self.start + offset)


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] in a region of its own (Region)."""
    return Region(nbytes).carve(0, nbytes)


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
        self.chunk, self.region, self.offset = chunk, None, 0

    def empty(self, shape, dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self.region is None or self.offset + nbytes > self.region.size:
            self.region, self.offset = Region(max(self.chunk, nbytes)), 0
        tensor = self.region.carve(self.offset, nbytes).view(dtype).view(shape)
        self.offset += -(-nbytes // 64) * 64
        return tensor
