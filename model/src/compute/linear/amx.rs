//! Intel AMX (Advanced Matrix Extensions): the integer products of a block of 32 values for sixteen activation
//! rows and sixteen weight rows in one tile instruction.
//!
//! A 512-bit VNNI kernel spends eight `dpbusd` per activation row and block on these sums; a tile multiply computes
//! all 256 of a 16 x 16 tile's sums at once on its own unit, leaving the vector pipes to the block's float terms
//! alone. Rust's AMX intrinsics are unstable, so the few instructions are written out with `asm!`. Linux gives a
//! process the tile registers only once it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and each thread must load a
//! tile configuration before its first tile instruction: both happen here, once.
use super::GROUP_ROWS;
#[cfg(target_arch = "x86_64")]
use std::arch::asm;
#[cfg(target_arch = "x86_64")]
use std::cell::Cell;

/// Activation rows in one tile: the tile's rows.
pub const TILE_ROWS: usize = 16;
/// Bytes of one block's weights in the layout a tile multiply takes (`B`): eight rows of 64 bytes, row `p` holding
/// values `4p..4p + 4` of each of the sixteen weight rows, weight row `k` at `4k`.
pub const B_BYTES: usize = 8 * 64;

/// Whether this CPU has AMX-INT8 and the kernel lets this process use it (asked once, for the whole process).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) fn usable() -> bool {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    let leaf7 = __cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 25) != 0);
    // Bit 27 of leaf 1's ecx: the OS enabled `xgetbv` (OSXSAVE).
    let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
    if !(tile && int8 && osxsave) {
        return false;
    }
    // SAFETY: OSXSAVE is set, so `xgetbv` is available. Bits 17 and 18: the OS saves the tile configuration and
    // data on context switches.
    let xcr0 = unsafe { _xgetbv(0) };
    if xcr0 & (0b11 << 17) != 0b11 << 17 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    const SYS_ARCH_PRCTL: i64 = 158;
    let ret: i64;
    // SAFETY: the `arch_prctl` system call with the request that asks for the tile data state; it touches no
    // memory of ours and clobbers only what the syscall ABI says (rcx, r11).
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub(crate) fn usable() -> bool {
    false
}

/// The tile configuration every product here uses: `tmm0` the 16 x 16 sums (`C`, 32-bit), `tmm1` sixteen
/// activation rows of one block (`A`, 32 bytes each), `tmm2` the block's weights (`B`, see [`B_BYTES`]).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static CONFIGURED: Cell<bool> = const { Cell::new(false) };
}

/// Loads the tile configuration on this thread if it has not been yet.
///
/// # Safety
/// [`usable`] must have returned true.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) unsafe fn configure_thread() {
    if CONFIGURED.with(Cell::get) {
        return;
    }
    // The process's permission is asked for when the features are first detected: make sure that has happened
    // (a kernel chosen by name rather than by `Kernel::detect` would otherwise fault on its first tile load).
    super::cpu_features();
    let mut config = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    (config.rows[0], config.colsb[0]) = (TILE_ROWS as u8, 64);
    (config.rows[1], config.colsb[1]) = (TILE_ROWS as u8, 32);
    (config.rows[2], config.colsb[2]) = (8, 64);
    asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
    CONFIGURED.with(|c| c.set(true));
}

/// Runs `tile(rows, stride, out)` on each whole tile of [`TILE_ROWS`] rows that lie evenly spaced (`at(row)`: where
/// a row's blocks start), and `other(rows, out)` on the rest: a tile not evenly spaced, and the last rows.
pub(crate) fn by_tiles<T>(
    rows: &[T],
    out: &mut [[f32; GROUP_ROWS]],
    at: impl Fn(&T) -> usize,
    mut tile: impl FnMut(&[T], usize, &mut [[f32; GROUP_ROWS]]),
    mut other: impl FnMut(&[T], &mut [[f32; GROUP_ROWS]]),
) {
    let mut i = 0;
    while i + TILE_ROWS <= rows.len() {
        let (rows, out) = (&rows[i..i + TILE_ROWS], &mut out[i..i + TILE_ROWS]);
        match even_stride(rows, &at) {
            Some(stride) => tile(rows, stride, out),
            None => other(rows, out),
        }
        i += TILE_ROWS;
    }
    if i < rows.len() {
        other(&rows[i..], &mut out[i..]);
    }
}

/// The distance in bytes between consecutive activation rows (`at(row)`: where a row's blocks start), if they lie
/// evenly spaced in one buffer, as a tile loads its rows at one stride.
fn even_stride<T>(rows: &[T], at: impl Fn(&T) -> usize) -> Option<usize> {
    let first = at(rows.first()?);
    let stride = at(rows.get(1)?).checked_sub(first)?;
    rows.iter()
        .enumerate()
        .all(|(i, r)| at(r) == first + i * stride)
        .then_some(stride)
}

/// `c[r][k] = sum over j of a[r][j] * b[k][j]` for sixteen activation rows `r` of one block (signed bytes, row `r`
/// at `a + r * a_stride`) and sixteen weight rows `k` in the [`B_BYTES`] layout, `$product` saying how the bytes
/// are signed.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_product {
    ($name:ident, $b:ty, $product:literal) => {
        /// # Safety
        /// [`configure_thread`] ran on this thread; `a` is readable for sixteen rows of 32 bytes at `a_stride`,
        /// `b` for [`B_BYTES`], `c` writable for 256 `i32`s.
        #[inline]
        pub(crate) unsafe fn $name(a: *const i8, a_stride: usize, b: *const $b, c: *mut i32) {
            asm!(
                "tilezero tmm0",
                "tileloadd tmm1, [{a} + {a_stride}*1]",
                "tileloadd tmm2, [{b} + {row}*1]",
                concat!($product, " tmm0, tmm1, tmm2"),
                "tilestored [{c} + {row}*1], tmm0",
                a = in(reg) a,
                a_stride = in(reg) a_stride,
                b = in(reg) b,
                c = in(reg) c,
                row = in(reg) 64usize,
                options(nostack),
            );
        }
    };
}

// Q4_1: unsigned nibbles against signed activations.
#[cfg(target_arch = "x86_64")]
tile_product!(signed_by_unsigned, u8, "tdpbsud");
// Q8_0: signed against signed.
#[cfg(target_arch = "x86_64")]
tile_product!(signed_by_signed, i8, "tdpbssd");
