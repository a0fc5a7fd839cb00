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

/// The tile configuration every product here uses: `tmm0` the 16 x 16 sums (`C`, 32-bit), `tmm4` sixteen
/// activation rows of one block (`A`, 32 bytes each), `tmm6` the block's weights (`B`, see [`B_BYTES`]).
///
/// It is candle's configuration, tile for tile (`tmm0`-`tmm3` C-shaped, `tmm4`-`tmm5` A-shaped, `tmm6`-`tmm7`
/// B-shaped, in its `repack_x86` AMX kernel): candle's Q4_K product runs on our pool's threads
/// ([`CandleRows`](super::CandleRows)), and each side loads its configuration once per thread, so with two
/// configurations the one loaded last would give the other's tiles the wrong shapes (a tile product of mismatched
/// shapes faults: SIGILL). With one, either side's load serves both.
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
    for t in 0..4 {
        (config.rows[t], config.colsb[t]) = (TILE_ROWS as u8, 64);
    }
    for t in 4..6 {
        (config.rows[t], config.colsb[t]) = (TILE_ROWS as u8, 32);
    }
    for t in 6..8 {
        (config.rows[t], config.colsb[t]) = (8, 64);
    }
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
                "tileloadd tmm4, [{a} + {a_stride}*1]",
                "tileloadd tmm6, [{b} + {row}*1]",
                concat!($product, " tmm0, tmm4, tmm6"),
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::super::q4_1::{Kernel, Q4_1Matrix};
    use super::super::{candle_product, cpu_features, test_matrix, Repacked};
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::Module;

    /// Candle's AMX product (Q4_K, 32 rows and more) and ours run on the same threads (candle's kernels run on our
    /// pool, `CandleRows`), and each side loads its tile configuration once per thread: whichever ran last, the
    /// other's tiles must still have the shapes it expects.
    #[test]
    fn our_tiles_and_candles_take_turns_on_one_thread() {
        if !cpu_features().amx {
            // Neither side uses tiles on this CPU.
            return;
        }
        let q4_1 = QTensor::quantize(&test_matrix(32, 256, 1), GgmlDType::Q4_1).unwrap();
        let ours = Q4_1Matrix::from_qtensor(&q4_1).unwrap().unwrap();
        let candle_q4_1 = QMatMul::from_qtensor(q4_1).unwrap();
        let q4k = QMatMul::from_qtensor(
            QTensor::quantize(&test_matrix(32, 256, 2), GgmlDType::Q4K).unwrap(),
        )
        .unwrap();
        let x = test_matrix(32, 256, 3);
        let (want_ours, xs) = candle_product(&candle_q4_1, &x);
        let candle_k = || {
            q4k.forward(&x)
                .and_then(|y| y.flatten_all())
                .and_then(|y| y.to_vec1::<f32>())
                .unwrap()
        };
        // One pool of one thread, the calling one: every product below runs on it.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .use_current_thread()
            .build()
            .unwrap();
        pool.install(|| {
            let want_k = candle_k();
            for turn in 0..2 {
                assert_eq!(
                    ours.matmul_with(Kernel::Amx, &xs, 32),
                    want_ours,
                    "ours, turn {turn}"
                );
                assert_eq!(candle_k(), want_k, "candle's, turn {turn}");
            }
        });
    }
}
