"""Device memory that stands in for a graph's memory while the graph is built ahead of it.

The driver builds a kernel node whatever its parameters point at (they are opaque bytes to it), but
it refuses a memset or memcpy node whose addresses it cannot resolve to mapped memory
(``cuGraphAddMemsetNode``: ``CUDA_ERROR_INVALID_VALUE``, measured on an H200 with driver 580). To
build and instantiate a graph before the engine has mapped its memory, its memory nodes are built
against a stand-in allocation and pointed at their own addresses once those are mapped
(``cuGraphExecMemsetNodeSetParams`` / ``cuGraphExecMemcpyNodeSetParams``). The driver only re-points
a node between allocations of the same kind, context and device mapping, so the stand-in is made
the way the region maps its memory (native/region.c): pinned device memory through the virtual
memory API, readable and writable from the one device.
"""

from __future__ import annotations

from .driver import call, cu

#: The most device memory a stand-in takes (it lives from the rebuild ahead until the LOAD has
#: re-pointed the graphs). A graph whose memory nodes need more is built after the mapping instead.
MAX_BYTES = 64 << 20


class StandIn:
    """``nbytes`` (rounded up to the allocation granularity) of device memory on the current
    context's device, from address :attr:`base`; :meth:`free` gives it back."""

    def __init__(self, nbytes: int):
        driver = cu()
        device = int(call(driver.cuCtxGetDevice))
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        granularity = int(
            call(
                driver.cuMemGetAllocationGranularity,
                prop,
                driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        )
        self.size = max(1, -(-int(nbytes) // granularity)) * granularity
        self._handle = call(driver.cuMemCreate, self.size, prop, 0)
        self.addr = None
        self._mapped = False
        try:
            self.addr = call(driver.cuMemAddressReserve, self.size, 0, 0, 0)
            call(driver.cuMemMap, self.addr, self.size, 0, self._handle, 0)
            self._mapped = True
            access = driver.CUmemAccessDesc()
            access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device
            access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            call(driver.cuMemSetAccess, self.addr, self.size, [access], 1)
        except BaseException:
            self.free()
            raise

    @property
    def base(self) -> int:
        return int(self.addr)

    def free(self) -> None:
        """Unmap and release it; only once the graphs built against it were re-pointed or destroyed."""
        driver = cu()
        if self._mapped:
            call(driver.cuMemUnmap, self.addr, self.size)
            self._mapped = False
        if self.addr is not None:
            call(driver.cuMemAddressFree, self.addr, self.size)
            self.addr = None
        if self._handle is not None:
            call(driver.cuMemRelease, self._handle)
            self._handle = None
