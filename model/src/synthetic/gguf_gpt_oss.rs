//! A synthetic gpt-oss block and metadata as llama.cpp's converter writes them (`gpt-oss`): biases everywhere, one
//! sink per head, the attention's output norm as the feed-forward's input, experts stacked with their biases.
use super::gguf::GgufTensor;
use super::gguf_header::TensorType;
use super::values::Values;
use super::{SyntheticShape, WeightDType};
use candle_core::quantized::gguf_file::Value;

/// Block `p`'s tensors (`p` is `blk.{i}`); `matrix(name, rows, cols, more_bits)` types a matrix as the format
/// does.
pub(super) fn gpt_oss_block(
    shape: &SyntheticShape,
    format: super::GgufFormat,
    p: &str,
    matrix: &dyn Fn(String, usize, usize, bool) -> GgufTensor,
) -> Vec<GgufTensor> {
    let (h, hd) = (shape.hidden_size, shape.head_dim());
    let (q, kv) = (shape.num_heads * hd, shape.num_kv_heads * hd);
    let e = shape.expert_shape().unwrap_or(super::ExpertShape {
        count: 1,
        per_token: 1,
        size: shape.intermediate_size,
        shared: 0,
    });
    let f32_of = |name: &str, dims: Vec<usize>, values: Values| GgufTensor {
        name: format!("{p}.{name}"),
        dims,
        dtype: TensorType::F32,
        values,
    };
    // llama.cpp keeps the router and every bias in f32 and gives ffn_down_exps the bits ffn_down gets.
    let stacked = |name: &str, rows: usize, cols: usize, more_bits: bool| {
        format.stacked(
            matrix(format!("{p}.{name}"), rows, cols, more_bits),
            e.count,
        )
    };
    // As the checkpoint's: small down projections where they are f32 (random blocks are at the init scale).
    let down = GgufTensor {
        values: Values::Small,
        ..stacked("ffn_down_exps.weight", h, e.size, true)
    };
    vec![
        f32_of("attn_norm.weight", vec![h], Values::Norm),
        matrix(format!("{p}.attn_q.weight"), q, h, false),
        f32_of("attn_q.bias", vec![q], Values::Weight),
        matrix(format!("{p}.attn_k.weight"), kv, h, false),
        f32_of("attn_k.bias", vec![kv], Values::Weight),
        matrix(format!("{p}.attn_v.weight"), kv, h, true),
        f32_of("attn_v.bias", vec![kv], Values::Weight),
        matrix(format!("{p}.attn_output.weight"), h, q, false),
        f32_of("attn_output.bias", vec![h], Values::Weight),
        f32_of("attn_sinks.weight", vec![shape.num_heads], Values::Large),
        f32_of("post_attention_norm.weight", vec![h], Values::Norm),
        f32_of("ffn_gate_inp.weight", vec![h, e.count], Values::Weight),
        f32_of("ffn_gate_inp.bias", vec![e.count], Values::Weight),
        stacked("ffn_gate_exps.weight", e.size, h, false),
        f32_of("ffn_gate_exps.bias", vec![e.size, e.count], Values::Large),
        stacked("ffn_up_exps.weight", e.size, h, false),
        f32_of("ffn_up_exps.bias", vec![e.size, e.count], Values::Large),
        down,
        f32_of("ffn_down_exps.bias", vec![h, e.count], Values::Weight),
    ]
}

/// gpt-oss's keys from the shape's HF config: the window, YaRN, the experts' width and RoPE base. They replace
/// the common keys of the same names.
pub(super) fn gpt_oss_metadata(shape: &SyntheticShape) -> Vec<(String, Value)> {
    let k = |key: &str| format!("gpt-oss.{key}");
    let c = shape.config_json(WeightDType::F32);
    let count = |v: &serde_json::Value| Value::U32(v.as_u64().unwrap_or(0) as u32);
    let num = |v: &serde_json::Value| Value::F32(v.as_f64().unwrap_or(0.0) as f32);
    let yarn = &c["rope_scaling"];
    vec![
        (k("attention.sliding_window"), count(&c["sliding_window"])),
        (
            k("expert_feed_forward_length"),
            count(&c["intermediate_size"]),
        ),
        (k("rope.freq_base"), num(&c["rope_theta"])),
        (k("rope.scaling.type"), Value::String("yarn".into())),
        (k("rope.scaling.factor"), num(&yarn["factor"])),
        (
            k("rope.scaling.original_context_length"),
            count(&yarn["original_max_position_embeddings"]),
        ),
    ]
}

/// Converts the gpt-oss checkpoint in `hf_dir` ([`super::write_model`]'s, or its MXFP4 form,
/// [`super::gpt_oss_mxfp4_checkpoint`]) to a GGUF at `path`, as llama.cpp's `convert_hf_to_gguf.py` lays it out:
/// the stacked expert matrices as `[experts, out, in]`, gate and up de-interleaved (even and odd columns of a
/// dense checkpoint, rows of an MXFP4 one), biases alike; MXFP4 experts are kept in MXFP4 (repacked, not
/// requantized) and everything else written in f32. With `tokenizer`, its metadata (and so its vocabulary, which
/// must be the shape's) goes with it. The same weights in both formats: a test of the HF loader against the GGUF
/// one, and through the GGUF against llama.cpp.
pub fn gpt_oss_gguf_from_hf(
    shape: &SyntheticShape,
    hf_dir: &std::path::Path,
    path: &std::path::Path,
    tokenizer: Option<&super::GgufTokenizer>,
) -> std::io::Result<()> {
    use crate::compute::linear::mxfp4::{Mxfp4Matrix, QK_MXFP4};
    use candle_core::{DType, Device, Tensor};
    use std::io::Write;
    if shape.family != super::SyntheticFamily::GptOss {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a gpt-oss shape", shape.name),
        ));
    }
    let hf = candle_core::safetensors::load(hf_dir.join("model.safetensors"), &Device::Cpu)
        .map_err(std::io::Error::other)?;
    let get = |name: &str| -> std::io::Result<Tensor> {
        hf.get(name)
            .cloned()
            .ok_or_else(|| std::io::Error::other(format!("no tensor {name}")))
    };
    // A tensor in f32 under its GGUF name (GGUF's dimensions run innermost first).
    let f32_tensor = |name: String, t: Tensor| -> std::io::Result<(GgufTensor, Vec<u8>)> {
        let dims = t.dims().iter().rev().copied().collect();
        let values: Vec<f32> = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .map_err(std::io::Error::other)?;
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = GgufTensor {
            name,
            dims,
            dtype: TensorType::F32,
            values: Values::Weight,
        };
        Ok((t, bytes))
    };
    // Columns `half` (0: gate, 1: up) of the interleaved last dimension.
    let half = |t: &Tensor, h: usize| -> std::io::Result<Tensor> {
        let mut dims = t.dims().to_vec();
        let last = dims.pop().unwrap_or(0);
        let rank = dims.len();
        dims.extend([last / 2, 2]);
        t.reshape(dims)
            .and_then(|t| t.narrow(rank + 1, h, 1)?.squeeze(rank + 1))
            .map_err(std::io::Error::other)
    };
    let out_major = |t: Tensor| t.transpose(1, 2).map_err(std::io::Error::other);
    // An MXFP4 stack's experts, each (or each one's rows of `half`) as ggml's blocks.
    let mxfp4 = |name: String, hf_name: &str, half: Option<usize>| {
        let blocks = get(&format!("{hf_name}_blocks"))?;
        let scales = get(&format!("{hf_name}_scales"))?;
        let (experts, rows, groups, _) = blocks.dims4().map_err(std::io::Error::other)?;
        let (blocks, scales): (Vec<u8>, Vec<u8>) = (
            blocks
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .map_err(std::io::Error::other)?,
            scales
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .map_err(std::io::Error::other)?,
        );
        let cols = groups * QK_MXFP4;
        let mut bytes = vec![];
        for e in 0..experts {
            let m = Mxfp4Matrix::from_hf_stack(&blocks, &scales, (experts, rows, cols), e, half)
                .map_err(std::io::Error::other)?;
            bytes.extend(m.to_bytes());
        }
        let rows = if half.is_some() { rows / 2 } else { rows };
        let t = GgufTensor {
            name,
            dims: vec![cols, rows, experts],
            dtype: TensorType::Mxfp4,
            values: Values::Weight,
        };
        Ok::<_, std::io::Error>((t, bytes))
    };
    let mut tensors = vec![
        f32_tensor(
            "token_embd.weight".into(),
            get("model.embed_tokens.weight")?,
        )?,
        f32_tensor("output_norm.weight".into(), get("model.norm.weight")?)?,
        f32_tensor("output.weight".into(), get("lm_head.weight")?)?,
    ];
    let is_mxfp4 = hf.contains_key("model.layers.0.mlp.experts.gate_up_proj_blocks");
    for i in 0..shape.num_blocks {
        let (hf_p, p) = (format!("model.layers.{i}"), format!("blk.{i}"));
        for (from, to) in [
            ("input_layernorm.weight", "attn_norm.weight"),
            ("self_attn.q_proj.weight", "attn_q.weight"),
            ("self_attn.q_proj.bias", "attn_q.bias"),
            ("self_attn.k_proj.weight", "attn_k.weight"),
            ("self_attn.k_proj.bias", "attn_k.bias"),
            ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.v_proj.bias", "attn_v.bias"),
            ("self_attn.o_proj.weight", "attn_output.weight"),
            ("self_attn.o_proj.bias", "attn_output.bias"),
            ("self_attn.sinks", "attn_sinks.weight"),
            (
                "post_attention_layernorm.weight",
                "post_attention_norm.weight",
            ),
            ("mlp.router.weight", "ffn_gate_inp.weight"),
            ("mlp.router.bias", "ffn_gate_inp.bias"),
            ("mlp.experts.down_proj_bias", "ffn_down_exps.bias"),
        ] {
            tensors.push(f32_tensor(
                format!("{p}.{to}"),
                get(&format!("{hf_p}.{from}"))?,
            )?);
        }
        let gate_up_bias = get(&format!("{hf_p}.mlp.experts.gate_up_proj_bias"))?;
        tensors.extend([
            f32_tensor(format!("{p}.ffn_gate_exps.bias"), half(&gate_up_bias, 0)?)?,
            f32_tensor(format!("{p}.ffn_up_exps.bias"), half(&gate_up_bias, 1)?)?,
        ]);
        let experts = format!("{hf_p}.mlp.experts");
        if is_mxfp4 {
            tensors.extend([
                mxfp4(
                    format!("{p}.ffn_gate_exps.weight"),
                    &format!("{experts}.gate_up_proj"),
                    Some(0),
                )?,
                mxfp4(
                    format!("{p}.ffn_up_exps.weight"),
                    &format!("{experts}.gate_up_proj"),
                    Some(1),
                )?,
                mxfp4(
                    format!("{p}.ffn_down_exps.weight"),
                    &format!("{experts}.down_proj"),
                    None,
                )?,
            ]);
        } else {
            let gate_up = get(&format!("{experts}.gate_up_proj"))?;
            tensors.extend([
                f32_tensor(
                    format!("{p}.ffn_gate_exps.weight"),
                    out_major(half(&gate_up, 0)?)?,
                )?,
                f32_tensor(
                    format!("{p}.ffn_up_exps.weight"),
                    out_major(half(&gate_up, 1)?)?,
                )?,
                f32_tensor(
                    format!("{p}.ffn_down_exps.weight"),
                    out_major(get(&format!("{experts}.down_proj"))?)?,
                )?,
            ]);
        }
    }
    let format = if is_mxfp4 {
        super::GgufFormat::Mxfp4Moe
    } else {
        super::GgufFormat::F32
    };
    let metadata = super::gguf::gguf_metadata(shape, format, tokenizer);
    let (headers, data): (Vec<GgufTensor>, Vec<Vec<u8>>) = tensors.into_iter().unzip();
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    super::gguf_header::write_header(&mut out, &metadata, &headers)?;
    for bytes in data {
        out.write_all(&bytes)?;
        super::gguf::pad(&mut out)?;
    }
    out.flush()
}
