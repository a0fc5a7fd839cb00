//! A peer that announces a large frame and then sends little (or nothing) must not make us allocate the announced
//! size. A counting global allocator records the largest single allocation; this file holds one test so nothing
//! else allocates concurrently in this process's test threads.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::executor::block_on;
use futures::io::Cursor;
use petal_proto::frame::{decode_frame, FrameError, FramedStream};
use petal_proto::pb;

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const MIB: usize = 1 << 20;

#[test]
fn announced_length_is_not_allocated_up_front() {
    let announced: u32 = 60 * MIB as u32;
    let mut bytes = announced.to_be_bytes().to_vec();
    bytes.extend_from_slice(&[0x0A; 10]);

    // Pure decoder: a body not yet there is Truncated, with no allocation for it.
    LARGEST.store(0, Ordering::Relaxed);
    let r = decode_frame::<pb::Request>(&bytes, 64 * MIB);
    assert!(matches!(r, Err(FrameError::Truncated { .. })), "{r:?}");
    assert!(LARGEST.load(Ordering::Relaxed) < MIB);

    // Over the limit: refused from the prefix, nothing allocated for the body.
    let mut s = FramedStream::new(Cursor::new(bytes.clone()), MIB);
    LARGEST.store(0, Ordering::Relaxed);
    let r = block_on(s.recv::<pb::Request>());
    assert!(matches!(r, Err(FrameError::TooLarge { .. })), "{r:?}");
    assert!(LARGEST.load(Ordering::Relaxed) < MIB);

    // Under the limit but the peer stops after 10 bytes: the body buffer stays at its first small chunk.
    let mut s = FramedStream::new(Cursor::new(bytes), 64 * MIB);
    LARGEST.store(0, Ordering::Relaxed);
    let r = block_on(s.recv::<pb::Request>());
    assert!(
        matches!(r, Err(FrameError::Truncated { got: 14, .. })),
        "{r:?}"
    );
    assert!(
        LARGEST.load(Ordering::Relaxed) < MIB,
        "largest allocation {}",
        LARGEST.load(Ordering::Relaxed)
    );
}
