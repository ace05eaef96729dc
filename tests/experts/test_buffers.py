"""BufferPool: a buffer is handed out again only once nothing references it; spare buffers are bounded."""

from moeswap.experts.buffers import BufferPool


def test_a_buffer_is_reused_only_when_nothing_holds_it():
    pool = BufferPool(spare_bytes=0)
    a = pool.take(4096)
    view = a[100:200].view(10, 10)  # what an expert keeps: views into its read buffer
    del a
    b = pool.take(4096)
    assert b.data_ptr() != view.data_ptr() - 100  # still in use through the view: a new buffer
    del view
    c = pool.take(4096)
    assert pool.reused == 1 and pool.allocated == 2
    assert c.numel() == 4096 and len({c.data_ptr(), b.data_ptr()}) == 2
    arr = b.numpy()  # a numpy view counts too
    del b, c
    d = pool.take(4096)
    assert d.data_ptr() != arr.ctypes.data


def test_other_sizes_are_not_reused_and_spares_are_released():
    pool = BufferPool(spare_bytes=3000)
    held = [pool.take(1000) for _ in range(5)]
    ptrs = {t.data_ptr() for t in held}
    del held
    big = pool.take(2000)  # no free buffer of this size; 5000 spare bytes > 3000: two are let go
    assert big.data_ptr() not in ptrs and pool.allocated == 6
    assert len(pool._buffers) == 4  # big + 3 spares of 1000
    again = pool.take(1000)
    assert again.data_ptr() in ptrs and pool.reused == 1
    pool.clear()
    assert len(pool._buffers) == 0 and again.numel() == 1000  # the caller's buffer stays valid
    again.fill_(7)
    assert int(again.sum()) == 7000
