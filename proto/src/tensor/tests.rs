use super::*;

const DTYPES: [pb::WireDType; 3] = [pb::WireDType::F32, pb::WireDType::F16, pb::WireDType::Bf16];

fn tensor(dtype: i32, shape: &[u64], data_len: usize) -> pb::Tensor {
    pb::Tensor {
        dtype,
        shape: shape.to_vec(),
        data: vec![0; data_len],
    }
}

#[test]
fn dtype_sizes_and_names() {
    assert_eq!(pb::WireDType::F32.element_size(), Some(4));
    assert_eq!(pb::WireDType::F16.element_size(), Some(2));
    assert_eq!(pb::WireDType::Bf16.element_size(), Some(2));
    assert_eq!(pb::WireDType::Unspecified.element_size(), None);
    for d in DTYPES {
        assert_eq!(parse_dtype(d.name()), Some(d));
    }
    assert_eq!(parse_dtype("BF16"), Some(pb::WireDType::Bf16));
    assert_eq!(parse_dtype("unspecified"), None);
    assert_eq!(parse_dtype("f64"), None);
    assert_eq!(parse_dtype(""), None);
}

#[test]
fn round_trip_each_dtype() {
    // Values exactly representable in every dtype, so the round trip is exact.
    let values = [0.0f32, 1.0, -2.5, 0.15625, 1024.0, -0.0078125];
    for d in DTYPES {
        let t = from_f32(&values, &[1, 2, 3], d);
        assert_eq!(t.data.len(), values.len() * d.element_size().unwrap());
        assert_eq!(validate(&t, 6).unwrap(), (d, vec![1, 2, 3]));
        assert_eq!(to_f32(&t).unwrap(), values, "{}", d.name());
    }
}

#[test]
fn encoding_is_little_endian_and_rounds() {
    assert_eq!(
        encode_values(&[1.0], pb::WireDType::F32),
        1.0f32.to_le_bytes()
    );
    assert_eq!(encode_values(&[1.0], pb::WireDType::F16), [0x00, 0x3C]);
    assert_eq!(encode_values(&[1.0], pb::WireDType::Bf16), [0x80, 0x3F]);
    // 1/3 is not representable in f16/bf16: the round trip lands within half an ulp.
    let third = 1.0f32 / 3.0;
    let back = to_f32(&from_f32(&[third], &[1], pb::WireDType::F16)).unwrap()[0];
    assert!((back - third).abs() < 1e-3);
    let back = to_f32(&from_f32(&[third], &[1], pb::WireDType::Bf16)).unwrap()[0];
    assert!((back - third).abs() < 1e-2);
}

#[test]
fn validate_refuses_bad_dtypes() {
    assert_eq!(
        validate(&tensor(0, &[1], 4), 10),
        Err(TensorError::UnknownDType(0))
    );
    assert_eq!(
        validate(&tensor(99, &[1], 4), 10),
        Err(TensorError::UnknownDType(99))
    );
    assert_eq!(
        validate(&tensor(-1, &[1], 4), 10),
        Err(TensorError::UnknownDType(-1))
    );
}

#[test]
fn validate_refuses_bad_shapes() {
    let f32 = pb::WireDType::F32 as i32;
    assert!(matches!(
        validate(&tensor(f32, &[], 0), 10),
        Err(TensorError::Shape { .. })
    ));
    assert!(matches!(
        validate(&tensor(f32, &[2, 0, 3], 0), 10),
        Err(TensorError::Shape { .. })
    ));
    // Product overflows usize.
    let huge = 1u64 << 40;
    assert!(matches!(
        validate(&tensor(f32, &[huge, huge, 2], 0), usize::MAX),
        Err(TensorError::Shape { .. })
    ));
    assert!(matches!(
        validate(&tensor(f32, &[u64::MAX, 2], 0), usize::MAX),
        Err(TensorError::Shape { .. })
    ));
    // Element count fits but byte length overflows.
    let elems = (usize::MAX / 2) as u64;
    assert!(matches!(
        validate(&tensor(f32, &[elems], 0), usize::MAX),
        Err(TensorError::Shape { .. })
    ));
}

#[test]
fn validate_enforces_element_limit_and_byte_length() {
    let bf16 = pb::WireDType::Bf16 as i32;
    assert_eq!(
        validate(&tensor(bf16, &[2, 3, 4], 48), 23),
        Err(TensorError::TooManyElements {
            elements: 24,
            max: 23
        })
    );
    assert_eq!(
        validate(&tensor(bf16, &[2, 3, 4], 47), 24),
        Err(TensorError::ByteLength {
            expected: 48,
            actual: 47
        })
    );
    assert_eq!(
        validate(&tensor(bf16, &[2, 3, 4], 96), 24),
        Err(TensorError::ByteLength {
            expected: 48,
            actual: 96
        })
    );
    assert_eq!(
        validate(&tensor(bf16, &[2, 3, 4], 48), 24),
        Ok((pb::WireDType::Bf16, vec![2, 3, 4]))
    );
}

#[test]
fn non_finite_detected_in_each_dtype() {
    for d in DTYPES {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut values = vec![1.0f32; 8];
            values[5] = bad;
            values[7] = bad;
            let data = encode_values(&values, d);
            assert_eq!(
                check_finite(d, &data),
                Err(TensorError::NonFinite { index: 5 }),
                "{} {bad}",
                d.name()
            );
        }
        let ok = encode_values(&[0.0, -0.0, 1e-30, 3.0e4, -3.0e4], d);
        assert_eq!(check_finite(d, &ok), Ok(()), "{}", d.name());
        assert_eq!(check_finite(d, &[]), Ok(()));
    }
}

#[test]
fn overflow_to_infinity_on_conversion_is_caught() {
    // 1e5 is finite in f32 but overflows f16 (max 65504): the sender's conversion makes it Inf.
    let data = encode_values(&[1.0, 1e5], pb::WireDType::F16);
    assert_eq!(
        check_finite(pb::WireDType::F16, &data),
        Err(TensorError::NonFinite { index: 1 })
    );
    // bf16 has f32's range.
    let data = encode_values(&[1.0, 1e5], pb::WireDType::Bf16);
    assert_eq!(check_finite(pb::WireDType::Bf16, &data), Ok(()));
}

#[test]
fn check_finite_refuses_partial_elements_and_unspecified() {
    assert_eq!(
        check_finite(pb::WireDType::F32, &[0; 6]),
        Err(TensorError::ByteLength {
            expected: 4,
            actual: 6
        })
    );
    assert_eq!(
        check_finite(pb::WireDType::F16, &[0; 3]),
        Err(TensorError::ByteLength {
            expected: 2,
            actual: 3
        })
    );
    assert_eq!(
        check_finite(pb::WireDType::Unspecified, &[0; 4]),
        Err(TensorError::UnknownDType(0))
    );
    assert_eq!(
        decode_values(pb::WireDType::Unspecified, &[]),
        Err(TensorError::UnknownDType(0))
    );
}

#[test]
fn to_f32_validates_first() {
    let mut t = from_f32(&[1.0, 2.0], &[1, 3], pb::WireDType::F32);
    assert_eq!(
        to_f32(&t),
        Err(TensorError::ByteLength {
            expected: 12,
            actual: 8
        })
    );
    t.shape = vec![1, 2];
    assert_eq!(to_f32(&t).unwrap(), vec![1.0, 2.0]);
    // NaN passes through to_f32 (tools may want to see it).
    let t = from_f32(&[f32::NAN], &[1], pb::WireDType::F32);
    assert!(to_f32(&t).unwrap()[0].is_nan());
    let t = from_f32(&[1.0], &[1], pb::WireDType::Unspecified);
    assert_eq!(to_f32(&t), Err(TensorError::UnknownDType(0)));
}

#[test]
fn errors_map_to_wire_codes() {
    assert_eq!(
        TensorError::UnknownDType(0).error_code(),
        pb::ErrorCode::DtypeMismatch
    );
    assert_eq!(
        TensorError::ByteLength {
            expected: 1,
            actual: 2
        }
        .error_code(),
        pb::ErrorCode::DtypeMismatch
    );
    assert_eq!(
        TensorError::Shape {
            reason: String::new()
        }
        .error_code(),
        pb::ErrorCode::ShapeMismatch
    );
    assert_eq!(
        TensorError::TooManyElements {
            elements: 2,
            max: 1
        }
        .error_code(),
        pb::ErrorCode::ShapeMismatch
    );
    assert_eq!(
        TensorError::NonFinite { index: 0 }.error_code(),
        pb::ErrorCode::NonFinite
    );
}
