//! gpt-oss as OpenAI ships it on Hugging Face: the expert matrices in MXFP4 (`*_blocks` and `*_scales`,
//! output-major), every other tensor as it was, and a `quantization_config` saying so.
use crate::compute::linear::mxfp4::{quantize_ggml, Mxfp4Matrix, QK_MXFP4};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::io;
use std::path::Path;

/// Rewrites the gpt-oss checkpoint in `hf_dir` (as [`super::write_model`] wrote it) into `out_dir` with its
/// experts quantized to MXFP4 as ggml's reference quantizer rounds them. Other files in `hf_dir` (a tokenizer)
/// are copied.
pub fn gpt_oss_mxfp4_checkpoint(hf_dir: &Path, out_dir: &Path) -> io::Result<()> {
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf_dir.join("config.json"))?)
            .map_err(std::io::Error::other)?;
    if config["model_type"] != "gpt_oss" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a gpt-oss checkpoint", hf_dir.display()),
        ));
    }
    let tensors = candle_core::safetensors::load(hf_dir.join("model.safetensors"), &Device::Cpu)
        .map_err(std::io::Error::other)?;
    let mut out = HashMap::new();
    for (name, t) in tensors {
        if !(name.ends_with(".mlp.experts.gate_up_proj")
            || name.ends_with(".mlp.experts.down_proj"))
        {
            out.insert(name, t);
            continue;
        }
        // Stored `[experts, in, out]`; MXFP4 blocks run along `in`.
        let (experts, cols, rows) = t.dims3().map_err(std::io::Error::other)?;
        let values: Vec<f32> = t
            .to_dtype(DType::F32)
            .and_then(|t| t.transpose(1, 2)?.contiguous()?.flatten_all()?.to_vec1())
            .map_err(std::io::Error::other)?;
        let m = Mxfp4Matrix::from_ggml_bytes(&quantize_ggml(&values, cols), experts * rows, cols)
            .map_err(std::io::Error::other)?;
        let (blocks, scales) = m.to_hf_blocks();
        let groups = cols / QK_MXFP4;
        let blocks = Tensor::from_vec(blocks, (experts, rows, groups, QK_MXFP4 / 2), &Device::Cpu);
        let scales = Tensor::from_vec(scales, (experts, rows, groups), &Device::Cpu);
        out.insert(
            format!("{name}_blocks"),
            blocks.map_err(std::io::Error::other)?,
        );
        out.insert(
            format!("{name}_scales"),
            scales.map_err(std::io::Error::other)?,
        );
    }
    std::fs::create_dir_all(out_dir)?;
    candle_core::safetensors::save(&out, out_dir.join("model.safetensors"))
        .map_err(std::io::Error::other)?;
    config["quantization_config"] = serde_json::json!({
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"
        ],
    });
    let config = serde_json::to_string_pretty(&config).map_err(std::io::Error::other)?;
    std::fs::write(out_dir.join("config.json"), config)?;
    for entry in std::fs::read_dir(hf_dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let skip = ["model.safetensors", "config.json", super::MARKER];
        if entry.file_type()?.is_file() && !skip.iter().any(|s| name == *s) {
            std::fs::copy(entry.path(), out_dir.join(&name))?;
        }
    }
    Ok(())
}
