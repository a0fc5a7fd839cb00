//! The buffers a repacked matrix's weight bytes live in: a large one in its own anonymous mapping, which the
//! kernel is asked to back with transparent huge pages; a small one on the heap.
//!
//! Why: a kernel streams each weight block from memory once per tile of activation rows, and with 4 KiB pages it
//! meets a TLB miss every few blocks, with the hardware prefetcher stopping at every page's end. SmolLM2's LM head
//! (Q8_0, 49152 x 576, 28 MB) on one thread of a Zen 4, on the heap against here (alternated four times): one row
//! 0.89-1.02 ms against 0.64-0.69, sixteen rows 2.89-3.17 against 2.88-2.99 (already at the tile's in-cache rate).
//! A heap buffer gets them only by luck: the allocator hands out memory that earlier allocations (the file's own
//! tensors, read and freed while repacking) already touched page by page, so they came in one run out of three or
//! four; a mapping of its own is untouched until the repacking writes it. Buffers under one huge page (SmolLM2's
//! block matrices) could hold none, so they stay on the heap, beside each other.
use memmap2::MmapMut;
use std::ops::{Deref, DerefMut};

/// A transparent huge page on x86-64 and on aarch64 with 4 KiB pages: the smallest buffer worth a mapping.
const HUGE_PAGE: usize = 2 << 20;

/// What a weight buffer holds: bytes, signed or not.
pub(crate) trait WeightByte: Copy + Default + sealed::Sealed {}
impl WeightByte for u8 {}
impl WeightByte for i8 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for i8 {}
}

/// `len` bytes, zeroed when made ([`WeightBytes::zeroed`]), read and written as a slice.
pub(crate) struct WeightBytes<T: WeightByte> {
    storage: Storage<T>,
}

enum Storage<T> {
    Heap(Vec<T>),
    Mapped(MmapMut),
}

impl<T: WeightByte> WeightBytes<T> {
    /// `len` zero bytes: a mapping of their own, advised for huge pages, from [`HUGE_PAGE`] up (on the heap should
    /// the mapping fail), else on the heap.
    pub(crate) fn zeroed(len: usize) -> Self {
        if len >= HUGE_PAGE {
            if let Ok(map) = MmapMut::map_anon(len) {
                // Advice: a kernel without transparent huge pages, or with them off, refuses it, and the mapping
                // stays in small pages, as the heap would have given.
                #[cfg(target_os = "linux")]
                let _ = map.advise(memmap2::Advice::HugePage);
                return Self {
                    storage: Storage::Mapped(map),
                };
            }
        }
        Self {
            storage: Storage::Heap(vec![T::default(); len]),
        }
    }

    /// Whether the bytes are in a mapping of their own (tests).
    #[cfg(test)]
    fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped(_))
    }
}

impl<T: WeightByte> Deref for WeightBytes<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Heap(v) => v,
            // SAFETY: `T` is `u8` or `i8` (sealed): one byte, alignment one, every bit pattern valid; the mapping is
            // `len()` bytes long and lives as long as `self`.
            Storage::Mapped(m) => unsafe { std::slice::from_raw_parts(m.as_ptr().cast(), m.len()) },
        }
    }
}

impl<T: WeightByte> DerefMut for WeightBytes<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Heap(v) => v,
            // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
            Storage::Mapped(m) => unsafe {
                std::slice::from_raw_parts_mut(m.as_mut_ptr().cast(), m.len())
            },
        }
    }
}

impl<T: WeightByte> std::fmt::Debug for WeightBytes<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match self.storage {
            Storage::Heap(_) => "heap",
            Storage::Mapped(_) => "mapped",
        };
        write!(f, "WeightBytes({} bytes, {place})", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_stay_on_the_heap_large_ones_are_mapped_and_both_start_zeroed_and_hold_what_is_written(
    ) {
        for (len, mapped) in [
            (0, false),
            (100, false),
            (HUGE_PAGE - 1, false),
            (HUGE_PAGE + 5, true),
        ] {
            let mut signed = WeightBytes::<i8>::zeroed(len);
            assert_eq!(signed.len(), len);
            assert_eq!(signed.is_mapped(), mapped, "{len} bytes");
            assert!(signed.iter().all(|&b| b == 0));
            for (i, b) in signed.iter_mut().enumerate() {
                *b = (i % 251) as i8 - 100;
            }
            assert!(signed
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i % 251) as i8 - 100));
            let unsigned = WeightBytes::<u8>::zeroed(len);
            assert!(unsigned.iter().all(|&b| b == 0));
        }
    }
}
