//! A synthetic gpt-oss block and metadata as llama.cpp's converter writes them (`gpt-oss`): biases everywhere, one
//! sink per head, the attention's output norm as the feed-forward's input, experts stacked with their biases.
use super::gguf::GgufTensor;
use super::values::Values;
use super::{SyntheticShape, WeightDType};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;

/// Block `p`'s tensors (`p` is `blk.{i}`); `matrix(name, rows, cols, more_bits)` types a matrix as the format
/// does.
pub(super) fn gpt_oss_block(
    shape: &SyntheticShape,
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
        dtype: GgmlDType::F32,
        values,
    };
    // llama.cpp keeps the router and every bias in f32 and gives ffn_down_exps the bits ffn_down gets.
    let stacked = |name: &str, rows: usize, cols: usize, more_bits: bool| GgufTensor {
        dims: vec![cols, rows, e.count],
        ..matrix(format!("{p}.{name}"), rows, cols, more_bits)
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

/// Converts the gpt-oss checkpoint [`super::write_model`] wrote of `shape` in `hf_dir` to an f32 GGUF at `path`, as
/// llama.cpp's `convert_hf_to_gguf.py` lays it out: the stacked expert matrices transposed to `[experts, out, in]`
/// and gate and up de-interleaved (even and odd columns), biases alike. With `tokenizer`, its metadata (and so
/// its vocabulary, which must be the shape's) goes with it. The same weights in both formats: a test of the HF
/// loader against the GGUF one, and through the GGUF against llama.cpp.
pub fn gpt_oss_gguf_from_hf(
    shape: &SyntheticShape,
    hf_dir: &std::path::Path,
    path: &std::path::Path,
    tokenizer: Option<&super::GgufTokenizer>,
) -> std::io::Result<()> {
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::{Device, Tensor};
    let err = std::io::Error::other;
    if shape.family != super::SyntheticFamily::GptOss {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a gpt-oss shape", shape.name),
        ));
    }
    let hf = candle_core::safetensors::load(hf_dir.join("model.safetensors"), &Device::Cpu)
        .map_err(err)?;
    let get = |name: &str| -> std::io::Result<Tensor> {
        let t = hf
            .get(name)
            .ok_or_else(|| std::io::Error::other(format!("no tensor {name}")))?;
        t.to_dtype(candle_core::DType::F32).map_err(err)
    };
    // Columns `half` (0: gate, 1: up) of the interleaved last dimension.
    let half = |t: &Tensor, h: usize| -> candle_core::Result<Tensor> {
        let mut dims = t.dims().to_vec();
        let last = dims.pop().unwrap_or(0);
        let rank = dims.len();
        dims.extend([last / 2, 2]);
        t.reshape(dims)?.narrow(rank + 1, h, 1)?.squeeze(rank + 1)
    };
    let mut tensors: Vec<(String, Tensor)> = vec![
        (
            "token_embd.weight".into(),
            get("model.embed_tokens.weight")?,
        ),
        ("output_norm.weight".into(), get("model.norm.weight")?),
        ("output.weight".into(), get("lm_head.weight")?),
    ];
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
            tensors.push((format!("{p}.{to}"), get(&format!("{hf_p}.{from}"))?));
        }
        let gate_up = get(&format!("{hf_p}.mlp.experts.gate_up_proj"))?;
        let gate_up_bias = get(&format!("{hf_p}.mlp.experts.gate_up_proj_bias"))?;
        let down = get(&format!("{hf_p}.mlp.experts.down_proj"))?;
        let out_major = |t: Tensor| t.transpose(1, 2)?.contiguous();
        tensors.extend([
            (
                format!("{p}.ffn_gate_exps.weight"),
                out_major(half(&gate_up, 0).map_err(err)?).map_err(err)?,
            ),
            (
                format!("{p}.ffn_up_exps.weight"),
                out_major(half(&gate_up, 1).map_err(err)?).map_err(err)?,
            ),
            (
                format!("{p}.ffn_gate_exps.bias"),
                half(&gate_up_bias, 0).map_err(err)?,
            ),
            (
                format!("{p}.ffn_up_exps.bias"),
                half(&gate_up_bias, 1).map_err(err)?,
            ),
            (
                format!("{p}.ffn_down_exps.weight"),
                out_major(down).map_err(err)?,
            ),
        ]);
    }
    let tensors = tensors
        .into_iter()
        .map(|(name, t)| {
            let q = QTensor::quantize(&t.contiguous()?, GgmlDType::F32)?;
            Ok((name, q))
        })
        .collect::<candle_core::Result<Vec<_>>>()
        .map_err(err)?;
    let metadata = super::gguf::gguf_metadata(shape, super::GgufFormat::F32, tokenizer);
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, q)| (k.as_str(), q)).collect();
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    gguf_file::write(&mut out, &metadata, &tensors).map_err(err)?;
    std::io::Write::flush(&mut out)
}
