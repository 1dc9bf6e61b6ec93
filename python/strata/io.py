"""strata.io: DeepNVMe's aio_handle verbs over Strata's swap engine (io_uring with O_DIRECT
where the file system allows it, else pread/pwrite on threads).

    from strata.io import AIOHandle
    h = AIOHandle(block_size=1 << 20, queue_depth=32)
    buf = h.new_pinned_tensor(1 << 20, torch.float32)
    h.async_pwrite(buf, "/nvme/x.bin")
    h.wait()                                  # the number of operations that finished

Tensors are CPU tensors, contiguous, of any dtype and size: the part of a request whose
address, file offset and length are multiples of 4096 goes through O_DIRECT, the rest through
the page cache, so a tensor of any size round-trips. A tensor handed to an async_* call must not
be touched until wait().
"""

import os

import torch

from . import _core


def _bytes_of(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: the tensor is on {tensor.device}; expected a CPU tensor")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor of shape {tuple(tensor.shape)} is not contiguous")
    return tensor.numel() * tensor.element_size()


class AIOHandle:
    """DeepNVMe's aio_handle(block_size, queue_depth, single_submit, overlap_events, threads).

    block_size: requests are split into chunks of this many bytes (a multiple of 4096);
    queue_depth: chunks in the kernel at once per io_uring ring; threads (or
    intra_op_parallelism): rings, each with its driver thread (or, on the posix engine, worker
    threads). single_submit and overlap_events are libaio tuning DeepNVMe has: io_uring submits
    each request's chunks at once and overlaps always, so they are accepted and change nothing.
    engine: "auto" (io_uring where the kernel allows, else posix), "uring" or "posix"; direct:
    O_DIRECT where the file system allows it.
    """

    def __init__(self, block_size=1 << 20, queue_depth=32, single_submit=False,
                 overlap_events=True, threads=1, *, intra_op_parallelism=None, engine="auto",
                 direct=True):
        if intra_op_parallelism is not None:
            threads = intra_op_parallelism
        self._settings = dict(block_size=block_size, queue_depth=queue_depth,
                              single_submit=single_submit, overlap_events=overlap_events,
                              threads=threads)
        self._files = _core.FileIo(block_size=block_size, queue_depth=queue_depth,
                                   threads=threads, engine=engine, direct=direct)
        self._in_flight = []  # the tensors of requests not yet waited for

    @property
    def engine(self):
        """"io_uring" or "posix"."""
        return self._files.engine

    def get_block_size(self):
        return self._settings["block_size"]

    def get_queue_depth(self):
        return self._settings["queue_depth"]

    def get_single_submit(self):
        return self._settings["single_submit"]

    def get_overlap_events(self):
        return self._settings["overlap_events"]

    def get_intra_op_parallelism(self):
        return self._settings["threads"]

    get_thread_count = get_intra_op_parallelism

    def _start(self, transfer, what, buffer, filename, file_offset):
        n = _bytes_of(buffer, what)
        transfer(path=os.fspath(filename), offset=file_offset, buf=buffer.data_ptr(), size=n)
        self._in_flight.append(buffer)
        return 0

    def async_pread(self, buffer, filename, file_offset=0):
        """Starts reading buffer's bytes from the file at file_offset; 0 once queued."""
        return self._start(self._files.read, "async_pread", buffer, filename, file_offset)

    def async_pwrite(self, buffer, filename, file_offset=0):
        """Starts writing buffer's bytes to the file at file_offset (made when missing, never
        truncated); 0 once queued."""
        return self._start(self._files.write, "async_pwrite", buffer, filename, file_offset)

    def sync_pread(self, buffer, filename, file_offset=0):
        self.async_pread(buffer, filename, file_offset)
        return self.wait()

    def sync_pwrite(self, buffer, filename, file_offset=0):
        self.async_pwrite(buffer, filename, file_offset)
        return self.wait()

    def wait(self):
        """Blocks until every operation so far has finished; returns how many did. A failed one
        raises OSError (FileNotFoundError for a missing file) naming the operation and the
        file, after all of them have finished."""
        try:
            return self._files.wait()
        finally:
            self._in_flight.clear()

    def new_pinned_tensor(self, numel, dtype):
        """A CPU tensor of numel elements in Strata's pinned memory (2 MiB-aligned, huge pages
        where the kernel gives them, registered with io_uring): O_DIRECT at full speed."""
        size = numel * torch.empty((), dtype=dtype).element_size()
        buffer = self._files.new_pinned(size=size)
        return torch.frombuffer(buffer, dtype=dtype, count=numel)

    def free_pinned_tensor(self, tensor):
        """Unregisters a new_pinned_tensor's memory (freed once no tensor uses it)."""
        self._files.free_pinned(address=tensor.data_ptr())
        return True

    # DeepNVMe's names.
    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        return self.new_pinned_tensor(num_elem, example_tensor.dtype)

    free_cpu_locked_tensor = free_pinned_tensor
