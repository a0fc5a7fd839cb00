//! The fifth bits of Q5_0 and Q5_1 blocks in an interleaved group, regrouped so that the kernels add them in place
//! for every row of the group at once: one 64-bit mask per part of a block (a part as in [`super::put_nibbles`]).
//! Bit `4k + t` of part `p`'s mask is the fifth bit of the value whose low four bits are byte `t` of row `k` in part
//! `p`: parts 0-3 hold the low nibbles (values `4p + t`), parts 4-7 the high ones (values `4(p - 4) + t + 16`).

/// Fifth-bit masks of one block of a group: one per part.
pub const BLOCK_MASKS: usize = 8;

/// Part and bit of the masks that value `j` (0..32) of row `k` goes to.
fn mask_bit(j: usize, k: usize) -> (usize, u32) {
    let (part, t) = if j < 16 {
        (j / 4, j % 4)
    } else {
        (4 + (j - 16) / 4, (j - 16) % 4)
    };
    (part, (4 * k + t) as u32)
}

/// Sets row `k`'s fifth bits in the masks of interleaved block `at` (`high`: [`BLOCK_MASKS`] masks a block) from
/// ggml's `qh` (bit `j` for value `j`).
pub fn put(high: &mut [u64], (at, k): (usize, usize), qh: u32) {
    for j in (0..32).filter(|j| qh >> j & 1 == 1) {
        let (part, bit) = mask_bit(j, k);
        high[at * BLOCK_MASKS + part] |= 1 << bit;
    }
}

/// Row `k`'s fifth bits in interleaved block `at`, as ggml's `qh` again ([`put`] undone).
pub fn get(high: &[u64], (at, k): (usize, usize)) -> u32 {
    (0..32).fold(0u32, |qh, j| {
        let (part, bit) = mask_bit(j, k);
        qh | (((high[at * BLOCK_MASKS + part] >> bit) & 1) as u32) << j
    })
}

/// The fifth bit (`0` or `0x10`) of byte `t` of row `k` in part `part` of a block whose masks are `masks`.
pub fn scalar(masks: &[u64], part: usize, (k, t): (usize, usize)) -> u8 {
    ((masks[part] >> (4 * k + t) & 1) << 4) as u8
}

/// AVX2 has no masked byte add: `0x10` in byte `i` of the vector where bit `i` of `bits` (32 bits of a mask: eight
/// rows' bytes of one part) is set, else 0, to be or-ed into the part's nibbles.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub unsafe fn spread_avx2(bits: u32) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // Byte i takes byte i / 8 of `bits`; or-ing every bit but bit i % 8 leaves all ones exactly where it is set.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_and_si256(
        _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1)),
        _mm256_set1_epi8(0x10),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bit_round_trips_and_lands_in_its_own_place() {
        let mut high = vec![0u64; 2 * BLOCK_MASKS];
        let qh = |k: usize| 0x9e37_79b9u32.rotate_left(k as u32);
        for k in 0..16 {
            put(&mut high, (1, k), qh(k));
        }
        assert!(high[..BLOCK_MASKS].iter().all(|&m| m == 0));
        for k in 0..16 {
            assert_eq!(get(&high, (1, k)), qh(k));
            for j in 0..32 {
                let (part, t) = (j % 16 / 4 + 4 * (j / 16), j % 4);
                let want = ((qh(k) >> j & 1) << 4) as u8;
                assert_eq!(scalar(&high[BLOCK_MASKS..], part, (k, t)), want);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_spread_puts_0x10_where_the_bits_are() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        for bits in [0u32, u32::MAX, 1, 1 << 31, 0x8421_1248, 0x0f0f_f0f0] {
            // SAFETY: AVX2 was checked above.
            let v = unsafe { spread_avx2(bits) };
            // SAFETY: a 256-bit vector is 32 bytes.
            let bytes: [u8; 32] = unsafe { std::mem::transmute(v) };
            for (i, b) in bytes.iter().enumerate() {
                assert_eq!(
                    *b,
                    if bits >> i & 1 == 1 { 0x10 } else { 0 },
                    "{bits:#x}, byte {i}"
                );
            }
        }
    }
}
