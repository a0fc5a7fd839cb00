//! Tests of the synthetic GGUF writer: every format reads back through candle with weights near the init scale.
use super::*;
use candle_core::quantized::gguf_file::Content;
use candle_core::Device;

fn smollm_tokenizer() -> GgufTokenizer {
    let path =
        crate::models_dir::find_model("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
            .expect("the shared SmolLM2 model");
    GgufTokenizer::from_gguf(&path).expect("its tokenizer")
}

/// A 2-block Llama shape whose widths split into K-quant super-blocks.
fn small() -> SyntheticShape {
    SyntheticShape {
        name: "gguf-test",
        hidden_size: 256,
        num_blocks: 8,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: 512,
        vocab_size: 0,
        tie_embeddings: false,
        max_position: 1024,
        family: SyntheticFamily::Llama,
        sliding_window: None,
        head_size: None,
        latent: None,
        experts: None,
    }
}

#[test]
fn mixes_follow_llama_quantize() {
    let n = 32;
    let more: Vec<usize> = (0..n).filter(|&i| use_more_bits(i, n)).collect();
    assert_eq!(
        more,
        [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    );
    assert_eq!(
        GgufFormat::Q4KM.matrix_type(Role::MoreBits, Some((5, n))),
        GgmlDType::Q4K
    );
    assert_eq!(
        GgufFormat::Q5KM.matrix_type(Role::MoreBits, Some((6, n))),
        GgmlDType::Q6K
    );
    assert_eq!(
        GgufFormat::Q4_0.matrix_type(Role::Output, None),
        GgmlDType::Q6K
    );
    assert_eq!(
        GgufFormat::Q8_0.matrix_type(Role::Output, None),
        GgmlDType::Q8_0
    );
}

#[test]
fn every_format_reads_back_with_weights_near_the_init_scale() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tokenizer = smollm_tokenizer();
    for format in GgufFormat::ALL {
        let path = dir.path().join(format!("{}.gguf", format.name()));
        let written = write_gguf(&path, &small(), format, &tokenizer, 7).expect("written");
        assert!(written.written);
        let again = write_gguf(&path, &small(), format, &tokenizer, 7).expect("kept");
        assert!(!again.written, "an identical file is kept");
        assert_eq!(again.bytes, written.bytes);

        let mut file = File::open(&path).expect("open");
        let content = Content::read(&mut file).expect("a well-formed GGUF");
        assert_eq!(content.metadata["llama.block_count"].to_u32().ok(), Some(8));
        let expected = gguf_tensors(
            &SyntheticShape {
                vocab_size: tokenizer.vocab_size(),
                ..small()
            },
            format,
        );
        assert_eq!(content.tensor_infos.len(), expected.len());
        for t in &expected {
            let q = content
                .tensor(&mut file, &t.name, &Device::Cpu)
                .expect("tensor reads");
            assert_eq!(TensorType::Ggml(q.dtype()), t.dtype, "{}", t.name);
            let v: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .and_then(|x| x.flatten_all())
                .and_then(|x| x.to_vec1())
                .expect("dequantizes");
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
            let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
            if t.values == Values::Large {
                assert!(std > 1.0, "{} large values: std {std}", t.name);
            } else if t.values == Values::Small {
                assert!(std < 0.01, "{} small values: std {std}", t.name);
            } else if t.values != Values::Weight {
                assert!((mean - 1.0).abs() < 0.05, "{} norm mean {mean}", t.name);
            } else {
                assert!(
                    (0.014..0.028).contains(&std) && mean.abs() < std / 8.0,
                    "{} {:?}: mean {mean}, std {std}",
                    t.name,
                    t.dtype
                );
            }
        }
    }
}

#[test]
fn mxfp4_moe_stacks_experts_in_mxfp4_and_the_rest_in_q8_0() {
    use crate::compute::weights::{BlockTensor, GgufWeights, Weight, WeightSource};
    let dir = tempfile::tempdir().expect("temp dir");
    let shape = SyntheticShape::named("gpt-oss-tiny").expect("a shape");
    let path = dir.path().join("gpt-oss-mxfp4.gguf");
    write_gguf(&path, &shape, GgufFormat::Mxfp4Moe, &smollm_tokenizer(), 7).expect("written");
    let w = GgufWeights::open(&path).expect("opens");
    assert_eq!(w.quantization(), "mxfp4");
    for t in [BlockTensor::ExpertGate(5), BlockTensor::ExpertDown(0)] {
        let Ok(Weight::Mxfp4(m)) = w.load_block(1, t, &Device::Cpu) else {
            panic!("{t:?} is MXFP4");
        };
        let v = m.dequantize();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(
            (0.01..0.03).contains(&std) && mean.abs() < std / 8.0,
            "{t:?}: {mean} {std}"
        );
    }
    let Ok(Weight::Quantized(q)) = w.load_block(1, BlockTensor::Q, &Device::Cpu) else {
        panic!("attention stays quantized");
    };
    assert_eq!(q.dtype(), GgmlDType::Q8_0);
}
