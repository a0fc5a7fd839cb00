//! The inner loops of [`super::FlashAttention`]: dot products of a query with many keys, sums of weighted value
//! rows, and the softmax's shifted exponentials, in AVX2 where the CPU has it (detected at run time) with scalar
//! fallbacks.

use super::cache::Elems;

/// `out[j] = q . k_j` for the rows `k_j` of `keys` (each as long as `q`); f16 keys are widened as they are read,
/// exactly, so either kind gives the same sums for the same values.
pub(super) fn dots(q: &[f32], keys: Elems<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if q.len().is_multiple_of(8) && x86::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C; the lengths are checked by the kernels' asserts.
        return unsafe {
            match keys {
                Elems::F32(k) => x86::dots(q, k, out),
                Elems::F16(k) => x86::dots_f16(q, k, out),
            }
        };
    }
    match keys {
        Elems::F32(k) => dots_scalar(q, k, |x| *x, out),
        Elems::F16(k) => dots_scalar(q, k, |x| x.to_f32(), out),
    }
}

fn dots_scalar<E>(q: &[f32], keys: &[E], widen: impl Fn(&E) -> f32, out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
        *o = q.iter().zip(k).map(|(a, b)| a * widen(b)).sum();
    }
}

/// `acc += sum_j w_j v_j` over the rows `v_j` of `values` (each as long as `acc`), f16 widened as in [`dots`].
pub(super) fn weighted_sum(weights: &[f32], values: Elems<'_>, acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if acc.len().is_multiple_of(8) && x86::available() {
        // SAFETY: as in `dots`.
        return unsafe {
            match values {
                Elems::F32(v) => x86::weighted_sum(weights, v, acc),
                Elems::F16(v) => x86::weighted_sum_f16(weights, v, acc),
            }
        };
    }
    match values {
        Elems::F32(v) => weighted_sum_scalar(weights, v, |x| *x, acc),
        Elems::F16(v) => weighted_sum_scalar(weights, v, |x| x.to_f32(), acc),
    }
}

fn weighted_sum_scalar<E>(
    weights: &[f32],
    values: &[E],
    widen: impl Fn(&E) -> f32,
    acc: &mut [f32],
) {
    for (w, v) in weights.iter().zip(values.chunks_exact(acc.len())) {
        for (y, x) in acc.iter_mut().zip(v) {
            *y += w * widen(x);
        }
    }
}

/// Most query rows [`dots_rows`] and [`weighted_sums`] take at once: a decode step's group of query heads sharing
/// one KV head (3 for SmolLM2, 4 to 8 for most GQA models).
pub(super) const SHARED_ROWS: usize = 4;

/// [`dots`] for up to [`SHARED_ROWS`] query rows over the same keys: `outs[i][j] = qs[i] . k_j`, each key read (and
/// widened) once for every row instead of once per row, with each row's sums bit for bit what [`dots`] gives it.
pub(super) fn dots_rows(qs: &[&[f32]], keys: Elems<'_>, outs: &mut [&mut [f32]]) {
    assert!(qs.len() == outs.len() && qs.len() <= SHARED_ROWS);
    #[cfg(target_arch = "x86_64")]
    if let Some(d) = shared_width(qs, outs) {
        if d.is_multiple_of(8) && x86::available() {
            // SAFETY: the CPU has AVX2, FMA and F16C; every row is `d` long and every output as long as the first.
            return unsafe {
                match keys {
                    Elems::F32(k) => x86::dots_rows(qs, k, outs),
                    Elems::F16(k) => x86::dots_rows_f16(qs, k, outs),
                }
            };
        }
    }
    for (q, out) in qs.iter().zip(outs.iter_mut()) {
        dots(q, keys, out);
    }
}

/// [`weighted_sum`] for up to [`SHARED_ROWS`] rows over the same values: `accs[i] += sum_j weights[i][j] v_j`, each
/// value row read (and widened) once for every row, each row's sums bit for bit what [`weighted_sum`] gives it.
pub(super) fn weighted_sums(weights: &[&[f32]], values: Elems<'_>, accs: &mut [&mut [f32]]) {
    assert!(weights.len() == accs.len() && weights.len() <= SHARED_ROWS);
    #[cfg(target_arch = "x86_64")]
    if let Some(d) = shared_width(accs, weights) {
        if d.is_multiple_of(8) && x86::available() {
            // SAFETY: as in `dots_rows`, with the accumulators `d` long and the weights equally many.
            return unsafe {
                match values {
                    Elems::F32(v) => x86::weighted_sums(weights, v, accs),
                    Elems::F16(v) => x86::weighted_sums_f16(weights, v, accs),
                }
            };
        }
    }
    for (w, acc) in weights.iter().zip(accs.iter_mut()) {
        weighted_sum(w, values, acc);
    }
}

/// The common length of `a`'s rows when they have one and `b`'s rows share theirs too (at least one row each).
#[cfg(target_arch = "x86_64")]
fn shared_width<A: AsRef<[f32]>, B: AsRef<[f32]>>(a: &[A], b: &[B]) -> Option<usize> {
    let (first_a, first_b) = (a.first()?.as_ref().len(), b.first()?.as_ref().len());
    let same = a.iter().all(|x| x.as_ref().len() == first_a)
        && b.iter().all(|x| x.as_ref().len() == first_b);
    same.then_some(first_a)
}

/// The two inner loops with AVX2: eight keys' dot products at once, reduced together (one horizontal reduction
/// per eight keys instead of per key), and values accumulated in registers 64 columns at a time. Each is written
/// once by a macro for f32 rows and for f16 rows (widened by `vcvtph2ps` as they are loaded).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }

    /// Eight elements from `$p` as f32.
    macro_rules! load8 {
        (f32, $p:expr) => {
            _mm256_loadu_ps($p)
        };
        (f16, $p:expr) => {
            _mm256_cvtph_ps(_mm_loadu_si128($p as *const __m128i))
        };
    }

    macro_rules! inner_loops {
        ($dots:ident, $weighted_sum:ident, $elem:ident) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $dots(q: &[f32], keys: &[$elem], out: &mut [f32]) {
                let d = q.len();
                let n = out.len();
                assert!(d.is_multiple_of(8) && keys.len() >= n * d);
                let (q, k) = (q.as_ptr(), keys.as_ptr());
                let mut j = 0;
                while j + 8 <= n {
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for c in (0..d).step_by(8) {
                        let qv = _mm256_loadu_ps(q.add(c));
                        for (jj, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(qv, load8!($elem, k.add((j + jj) * d + c)), *a);
                        }
                    }
                    _mm256_storeu_ps(out.as_mut_ptr().add(j), reduce8(&acc));
                    j += 8;
                }
                while j < n {
                    let mut a = _mm256_setzero_ps();
                    for c in (0..d).step_by(8) {
                        a = _mm256_fmadd_ps(
                            _mm256_loadu_ps(q.add(c)),
                            load8!($elem, k.add(j * d + c)),
                            a,
                        );
                    }
                    let r = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
                    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
                    out[j] = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
                    j += 1;
                }
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $weighted_sum(weights: &[f32], values: &[$elem], acc: &mut [f32]) {
                const BLOCK: usize = 64;
                let d = acc.len();
                let n = weights.len();
                assert!(d.is_multiple_of(8) && values.len() >= n * d);
                let v = values.as_ptr();
                let mut c0 = 0;
                while c0 < d {
                    // A constant number of vectors per block, so they stay in registers: with a run-time count
                    // LLVM kept them on the stack, a load and a store per vector and key.
                    let columns = (v.add(c0), acc.as_mut_ptr().add(c0));
                    match BLOCK.min(d - c0) / 8 {
                        8 => columns_block::<8>(weights, columns, d),
                        7 => columns_block::<7>(weights, columns, d),
                        6 => columns_block::<6>(weights, columns, d),
                        5 => columns_block::<5>(weights, columns, d),
                        4 => columns_block::<4>(weights, columns, d),
                        3 => columns_block::<3>(weights, columns, d),
                        2 => columns_block::<2>(weights, columns, d),
                        _ => columns_block::<1>(weights, columns, d),
                    }
                    c0 += BLOCK;
                }

                /// `acc[..8W] += sum_j w_j v[j * d..j * d + 8W]`.
                #[inline]
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn columns_block<const W: usize>(
                    weights: &[f32],
                    (v, acc): (*const $elem, *mut f32),
                    d: usize,
                ) {
                    let mut regs = [_mm256_setzero_ps(); W];
                    for (i, r) in regs.iter_mut().enumerate() {
                        *r = _mm256_loadu_ps(acc.add(8 * i));
                    }
                    for (j, w) in weights.iter().enumerate() {
                        let w = _mm256_set1_ps(*w);
                        for (i, r) in regs.iter_mut().enumerate() {
                            *r = _mm256_fmadd_ps(w, load8!($elem, v.add(j * d + 8 * i)), *r);
                        }
                    }
                    for (i, r) in regs.iter().enumerate() {
                        _mm256_storeu_ps(acc.add(8 * i), *r);
                    }
                }
            }
        };
    }

    inner_loops!(dots, weighted_sum, f32);
    inner_loops!(dots_f16, weighted_sum_f16, f16);

    /// The inner loops for several query rows at once ([`super::dots_rows`], [`super::weighted_sums`]): each key or
    /// value vector loaded (and widened) once and multiplied into every row's accumulators, with each row's
    /// operations exactly those of the one-row loops above, in their order: a key's products accumulate lane by
    /// lane over its columns, and its eight lanes are added as `reduce8` adds them; keys past the last whole eight
    /// go through the one-row loop's tail, as they would alone. Written once for f32 rows and once for f16 rows.
    macro_rules! shared_loops {
        ($dots_rows:ident, $weighted_sums:ident, $dots:ident, $weighted_sum:ident, $elem:ident) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $dots_rows(qs: &[&[f32]], keys: &[$elem], outs: &mut [&mut [f32]]) {
                // Keys a pass takes: their accumulators, the rows' query vectors and a key fill the registers.
                match qs.len() {
                    0 => {}
                    1 => $dots(qs[0], keys, outs[0]),
                    2 => dots_tile::<2, 4>(qs, keys, outs),
                    3 => dots_tile::<3, 4>(qs, keys, outs),
                    _ => dots_tile::<4, 2>(qs, keys, outs),
                }

                /// `R` rows, `K` keys a pass (2 or 4).
                #[inline]
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn dots_tile<const R: usize, const K: usize>(
                    qs: &[&[f32]],
                    keys: &[$elem],
                    outs: &mut [&mut [f32]],
                ) {
                    let (d, n) = (qs[0].len(), outs[0].len());
                    assert!(d.is_multiple_of(8) && keys.len() >= n * d);
                    assert!(qs.len() == R && outs.len() == R && qs.iter().all(|q| q.len() == d));
                    assert!(outs.iter().all(|o| o.len() == n));
                    let q: [*const f32; R] = std::array::from_fn(|r| qs[r].as_ptr());
                    let k = keys.as_ptr();
                    // The keys of whole eights, which the one-row loop reduces eight at a time.
                    let whole = n / 8 * 8;
                    let mut j = 0;
                    while j < whole {
                        let mut acc = [[_mm256_setzero_ps(); K]; R];
                        for c in (0..d).step_by(8) {
                            let qv: [__m256; R] =
                                std::array::from_fn(|r| _mm256_loadu_ps(q[r].add(c)));
                            for jj in 0..K {
                                let kv = load8!($elem, k.add((j + jj) * d + c));
                                for r in 0..R {
                                    acc[r][jj] = _mm256_fmadd_ps(qv[r], kv, acc[r][jj]);
                                }
                            }
                        }
                        for r in 0..R {
                            let sums = reduce_keys::<K>(&acc[r]);
                            let out = outs[r].as_mut_ptr().add(j);
                            if K == 4 {
                                _mm_storeu_ps(out, sums);
                            } else {
                                _mm_storel_epi64(out as *mut __m128i, _mm_castps_si128(sums));
                            }
                        }
                        j += K;
                    }
                    if whole < n {
                        for r in 0..R {
                            $dots(qs[r], &keys[whole * d..], &mut outs[r][whole..]);
                        }
                    }
                }
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $weighted_sums(
                weights: &[&[f32]],
                values: &[$elem],
                accs: &mut [&mut [f32]],
            ) {
                // Vectors of columns a pass takes: the rows' accumulators, their weights and a value vector fill the
                // registers.
                match weights.len() {
                    0 => {}
                    1 => $weighted_sum(weights[0], values, accs[0]),
                    2 => by_columns::<2, 4>(weights, values, accs),
                    3 => by_columns::<3, 4>(weights, values, accs),
                    _ => by_columns::<4, 2>(weights, values, accs),
                }

                /// `R` rows, in blocks of `W` vectors of columns, then single vectors.
                #[inline]
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn by_columns<const R: usize, const W: usize>(
                    weights: &[&[f32]],
                    values: &[$elem],
                    accs: &mut [&mut [f32]],
                ) {
                    let (d, n) = (accs[0].len(), weights[0].len());
                    assert!(d.is_multiple_of(8) && values.len() >= n * d);
                    assert!(
                        weights.len() == R
                            && accs.len() == R
                            && weights.iter().all(|w| w.len() == n)
                    );
                    assert!(accs.iter().all(|a| a.len() == d));
                    let w: [*const f32; R] = std::array::from_fn(|r| weights[r].as_ptr());
                    let mut acc: [*mut f32; R] = [std::ptr::null_mut(); R];
                    for (a, row) in acc.iter_mut().zip(accs.iter_mut()) {
                        *a = row.as_mut_ptr();
                    }
                    let v = values.as_ptr();
                    let mut c = 0;
                    while c + 8 * W <= d {
                        columns::<R, W>(w, n, v.add(c), acc.map(|a| a.add(c)), d);
                        c += 8 * W;
                    }
                    while c < d {
                        columns::<R, 1>(w, n, v.add(c), acc.map(|a| a.add(c)), d);
                        c += 8;
                    }
                }

                /// `acc_r[..8W] += sum_j w_r[j] v[j * d..j * d + 8W]` for each row `r`.
                #[inline]
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn columns<const R: usize, const W: usize>(
                    w: [*const f32; R],
                    n: usize,
                    v: *const $elem,
                    acc: [*mut f32; R],
                    d: usize,
                ) {
                    let mut regs = [[_mm256_setzero_ps(); W]; R];
                    for r in 0..R {
                        for i in 0..W {
                            regs[r][i] = _mm256_loadu_ps(acc[r].add(8 * i));
                        }
                    }
                    for j in 0..n {
                        let ws: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(*w[r].add(j)));
                        for i in 0..W {
                            let x = load8!($elem, v.add(j * d + 8 * i));
                            for r in 0..R {
                                regs[r][i] = _mm256_fmadd_ps(ws[r], x, regs[r][i]);
                            }
                        }
                    }
                    for r in 0..R {
                        for i in 0..W {
                            _mm256_storeu_ps(acc[r].add(8 * i), regs[r][i]);
                        }
                    }
                }
            }
        };
    }

    shared_loops!(dots_rows, weighted_sums, dots, weighted_sum, f32);
    shared_loops!(
        dots_rows_f16,
        weighted_sums_f16,
        dots_f16,
        weighted_sum_f16,
        f16
    );

    /// `K` (2 or 4) keys' lane vectors to their totals, in the first `K` lanes: each key's lanes added in the tree
    /// [`reduce8`] adds them in (pairs, then pairs of pairs, then the two halves), so a key's total is the same
    /// whichever of the two reduced it.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce_keys<const K: usize>(v: &[__m256; K]) -> __m128 {
        let s = if K == 4 {
            _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]))
        } else {
            let pairs = _mm256_hadd_ps(v[0], v[1]);
            _mm256_hadd_ps(pairs, pairs)
        };
        _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1))
    }

    /// Eight vectors to the vector of their eight totals.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce8(v: &[__m256; 8]) -> __m256 {
        let s01 = _mm256_hadd_ps(v[0], v[1]);
        let s23 = _mm256_hadd_ps(v[2], v[3]);
        let s45 = _mm256_hadd_ps(v[4], v[5]);
        let s67 = _mm256_hadd_ps(v[6], v[7]);
        let s0123 = _mm256_hadd_ps(s01, s23);
        let s4567 = _mm256_hadd_ps(s45, s67);
        // Each 128-bit half holds one half's sums of vectors 0..4 (then 4..8): add the halves.
        _mm256_add_ps(
            _mm256_permute2f128_ps(s0123, s4567, 0x20),
            _mm256_permute2f128_ps(s0123, s4567, 0x31),
        )
    }
}

/// `y += a * x`.
#[inline]
pub(super) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The largest of `xs` (negative infinity if empty), in eight independent lanes: a maximum does not depend on the
/// order it is taken in, and a scalar fold was a chain of dependent compares (a quarter of a decode step's
/// attention outside its dot products, in a profile of sixteen sessions).
pub(super) fn max(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for l in 0..8 {
            lanes[l] = lanes[l].max(c[l]);
        }
    }
    lanes.iter().copied().fold(tail, f32::max)
}

/// A sum in eight independent lanes (vectorised; the order differs from a sequential sum only by rounding).
pub(super) fn sum(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            lanes[l] += c[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `x = exp(x - max)` for scores at most `max`, in straight-line code the compiler vectorises: `2^n * p(r)` with
/// `x - max = n ln 2 + r`, `|r| <= ln 2 / 2`, and Cephes' degree-7 polynomial for `e^r` (within 2 ulp of `expf`).
/// Arguments below -87 (weights under 1e-38) give 0.
pub(super) fn exp_shifted(xs: &mut [f32], max: f32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two, so `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
    for x in xs.iter_mut() {
        let shifted = *x - max;
        let a = shifted.max(-87.0);
        let n = (a * LOG2E + 0.5).floor();
        let r = a - n * LN2_HI - n * LN2_LO;
        let mut p = P[0];
        for c in &P[1..] {
            p = p * r + *c;
        }
        let e = p * r * r + r + 1.0;
        let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
        *x = if shifted < -87.0 { 0.0 } else { e * scale };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn lanes_maximum_is_the_sequential_one() {
        for n in [0, 1, 7, 8, 9, 40, 67] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.5) * 0.7)
                .collect();
            let want = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&xs).to_bits(), want.to_bits(), "{n} values");
        }
    }

    #[test]
    fn f16_rows_read_in_place_give_the_widened_rows_results_bit_for_bit() {
        // 19 keys and values of 64 values: two groups of eight and a tail of three.
        let d = 64;
        let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        let halves: Vec<f16> = (0..19 * d)
            .map(|i| f16::from_f32((i as f32 * 0.11).cos() * 3.0))
            .collect();
        let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
        let (mut a, mut b) = (vec![0f32; 19], vec![0f32; 19]);
        dots(&q, Elems::F32(&widened), &mut a);
        dots(&q, Elems::F16(&halves), &mut b);
        assert_eq!(a, b);
        let weights: Vec<f32> = (0..19).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let (mut a, mut b) = (q.clone(), q.clone());
        weighted_sum(&weights, Elems::F32(&widened), &mut a);
        weighted_sum(&weights, Elems::F16(&halves), &mut b);
        assert_eq!(a, b);
        // And the scalar fallback agrees with itself the same way.
        let (mut a, mut b) = (vec![0f32; 19], vec![0f32; 19]);
        dots_scalar(&q, &widened, |x| *x, &mut a);
        dots_scalar(&q, &halves, |x| x.to_f32(), &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn rows_sharing_keys_get_each_rows_own_results_bit_for_bit() {
        // Every row count the shared loops take, key counts around whole eights (2 and 4 keys a pass, tails of one
        // to seven), head sizes of one vector to several blocks of columns, f32 and f16 alike.
        for d in [8, 24, 64, 128] {
            for n in [1, 3, 7, 8, 9, 13, 16, 19, 40] {
                let keys: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.113).cos() * 2.5).collect();
                let halves: Vec<f16> = keys.iter().map(|&x| f16::from_f32(x)).collect();
                for rows in 1..=SHARED_ROWS {
                    let qs: Vec<Vec<f32>> = (0..rows)
                        .map(|r| {
                            (0..d)
                                .map(|i| ((i * 7 + r * 13) as f32 * 0.29).sin())
                                .collect()
                        })
                        .collect();
                    let weights: Vec<Vec<f32>> = (0..rows)
                        .map(|r| (0..n).map(|j| 1.0 / ((j + r) as f32 + 1.5)).collect())
                        .collect();
                    let start: Vec<f32> = (0..d).map(|c| c as f32 * 0.03 - 1.0).collect();
                    for elems in [Elems::F32(&keys), Elems::F16(&halves)] {
                        let kind = matches!(elems, Elems::F16(_));
                        let what = format!("d {d}, {n} keys, {rows} rows, f16 {kind}");
                        let q: Vec<&[f32]> = qs.iter().map(|q| q.as_slice()).collect();
                        let mut got = vec![vec![f32::NAN; n]; rows];
                        let mut outs: Vec<&mut [f32]> =
                            got.iter_mut().map(|o| o.as_mut_slice()).collect();
                        dots_rows(&q, elems, &mut outs);
                        for (r, got) in got.iter().enumerate() {
                            let mut want = vec![0f32; n];
                            dots(&qs[r], elems, &mut want);
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(got), bits(&want), "dots, row {r}: {what}");
                        }
                        let w: Vec<&[f32]> = weights.iter().map(|w| w.as_slice()).collect();
                        let mut got = vec![start.clone(); rows];
                        let mut accs: Vec<&mut [f32]> =
                            got.iter_mut().map(|a| a.as_mut_slice()).collect();
                        weighted_sums(&w, elems, &mut accs);
                        for (r, got) in got.iter().enumerate() {
                            let mut want = start.clone();
                            weighted_sum(&weights[r], elems, &mut want);
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(got), bits(&want), "weighted sums, row {r}: {what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn weighted_sums_of_any_width_are_fused_multiply_adds_in_key_order() {
        #[cfg(target_arch = "x86_64")]
        if x86::available() {
            // One block of 64 columns and less (8, 24, 64), and more (96: 64 + 32; 136: 64 + 64 + 8).
            for d in [8, 24, 64, 96, 136] {
                let n = 13;
                let w: Vec<f32> = (0..n).map(|j| (j as f32 * 0.7).cos()).collect();
                let values: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.13).sin() * 2.0).collect();
                let start: Vec<f32> = (0..d).map(|c| c as f32 * 0.01).collect();
                let mut want = start.clone();
                for j in 0..n {
                    for c in 0..d {
                        want[c] = w[j].mul_add(values[j * d + c], want[c]);
                    }
                }
                let mut got = start;
                weighted_sum(&w, Elems::F32(&values), &mut got);
                assert_eq!(got, want, "d = {d}");
            }
        }
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_expf() {
        let mut xs: Vec<f32> = (0..=870_000).map(|i| -(i as f32) * 1e-4).collect();
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        exp_shifted(&mut xs, 0.0);
        for (i, (got, want)) in xs.iter().zip(&want).enumerate() {
            let err = (got - want).abs() / want;
            assert!(err < 5e-7, "exp({}): {got} vs {want}", -(i as f32) * 1e-4);
        }
        // Shifted by the maximum, and far below it: exactly 1, and 0.
        let mut xs = [3.5f32, -200.0];
        exp_shifted(&mut xs, 3.5);
        assert_eq!(xs, [1.0, 0.0]);
    }
}
