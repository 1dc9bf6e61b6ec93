"""strata.io.AIOHandle: DeepNVMe's verbs round-trip tensors of any size, dtype and offset, on
pinned and ordinary memory, and its errors name the file and the operation."""

import pytest
import torch

from strata.io import AIOHandle

SIZES = [1, 7, 1024, 1025, 4096 // 4 * 3 + 1, (3 << 20) // 4 + 5]


@pytest.fixture(params=["auto", "posix"])
def handle(request):
    return AIOHandle(block_size=64 << 10, queue_depth=8, engine=request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_tensors_of_any_size_round_trip(handle, tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    written = [torch.randn(n, generator=g).to(dtype) if dtype.is_floating_point
               else torch.randint(0, 256, (n,), generator=g, dtype=dtype) for n in SIZES]
    for i, t in enumerate(written):
        assert handle.async_pwrite(t, tmp_path / f"t{i}") == 0
    assert handle.wait() == len(SIZES)
    back = [torch.empty_like(t) for t in written]
    for i, t in enumerate(back):
        handle.async_pread(t, str(tmp_path / f"t{i}"))
    assert handle.wait() == len(SIZES)
    for i, (a, b) in enumerate(zip(written, back)):
        assert torch.equal(a, b), f"tensor {i} of {a.numel()} elements"
        assert (tmp_path / f"t{i}").stat().st_size == a.numel() * a.element_size()


def test_offsets_and_pinned_tensors(handle, tmp_path):
    pinned = handle.new_pinned_tensor(1 << 20, torch.float32)
    assert pinned.data_ptr() % 4096 == 0
    pinned.copy_(torch.arange(1 << 20, dtype=torch.float32))
    path = tmp_path / "big.bin"
    assert handle.sync_pwrite(pinned, path, 8192) == 1
    small = torch.full((3,), 7.0)
    assert handle.sync_pwrite(small, path, 13) == 1  # unaligned, inside the first block
    whole = handle.new_pinned_tensor(((1 << 22) + 8192) // 4, torch.float32)
    assert handle.sync_pread(whole, path) == 1
    assert torch.equal(whole[2048:], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(whole.view(torch.uint8)[13:25], small.view(torch.uint8))
    assert handle.free_pinned_tensor(pinned)
    assert handle.free_cpu_locked_tensor(whole)
    with pytest.raises(ValueError, match="not one new_pinned made"):
        handle.free_pinned_tensor(pinned)


def test_errors_name_the_file_and_the_operation(handle, tmp_path):
    missing = tmp_path / "missing.bin"
    with pytest.raises(FileNotFoundError, match=f"cannot open {missing} for reading"):
        handle.async_pread(torch.empty(4), missing)
    short = tmp_path / "short.bin"
    handle.sync_pwrite(torch.zeros(10), short)
    handle.async_pread(torch.empty(4096), short)
    with pytest.raises(OSError, match=f"read of .* from {short} failed: unexpected end of file"):
        handle.wait()
    assert handle.wait() == 0  # the failure was reported once
    with pytest.raises(ValueError, match="not contiguous"):
        handle.async_pwrite(torch.zeros(4, 4).t(), tmp_path / "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        handle.async_pwrite(b"bytes", tmp_path / "x")
    with pytest.raises(ValueError, match="block_size 1000"):
        AIOHandle(block_size=1000)
    with pytest.raises(ValueError, match="engine 'fast'"):
        AIOHandle(engine="fast")


def test_deepnvme_getters():
    h = AIOHandle(block_size=1 << 20, queue_depth=16, single_submit=True, overlap_events=False,
                  intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == (1 << 20, 16, True, False, 2)
    assert h.engine in ("io_uring", "posix")
