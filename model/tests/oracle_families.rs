//! Every supported family, as a random-weight model in HF format, run by our spans split in three and by
//! candle-transformers' monolithic model of that family: logits within 1e-4 and 64 greedy tokens identical.
//!
//! The reference recomputes the whole sequence at every step (its cache cleared): that is the one path where each
//! of candle's models applies its own attention mask, so sliding windows are compared as the model defines them
//! rather than as a cache happens to hold them. Where candle departs from Hugging Face the test says how it is
//! kept out of the comparison.
mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_transformers::models::{
    deepseek2, gemma2, gemma3, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe,
};
use common::*;
use petal_model::synthetic::{
    deepseek2_metadata, override_metadata, write_model, SyntheticFamily, SyntheticShape,
    WeightDType, MINI,
};
use petal_model::ModelSource;
use std::path::Path;

/// Small enough to run 64 full recomputations per family in a second, with GQA, six blocks (two of them global
/// in Gemma 3's pattern of three) and a context (prompt + 64 steps) well inside `max_position`.
const SHAPE: SyntheticShape = MINI;
const SEED: u64 = 16;
const PROMPT: [u32; 8] = [1, 17, 42, 99, 5, 200, 3, 77];

/// Writes the family's model, runs ours against `reference` (a monolithic model whose `forward(all tokens, 0)`
/// gives the last position's logits), and returns the greedy tokens.
fn check(
    shape: SyntheticShape,
    reference: impl Fn(
        &Path,
        &serde_json::Value,
        &candle_nn::VarBuilder<'static>,
    ) -> Box<dyn FnMut(&Tensor) -> Tensor>,
) -> Vec<u32> {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &shape, WeightDType::F32, SEED).unwrap();
    let source = ModelSource::open(dir.path()).unwrap();
    assert_eq!(
        source.spec().architecture,
        shape.family.name().trim_end_matches("_text")
    );
    let mut ours = Composed::new(&source, &[(0, 2), (2, 4), (4, 6)]);
    let dev = Device::Cpu;
    let (config, vb) = hf_files(dir.path());
    let mut forward = reference(dir.path(), &config, &vb);
    let mut all: Vec<u32> = vec![];
    let oracle = |ids: &[u32], _pos: usize| {
        all.extend_from_slice(ids);
        let x = Tensor::new(all.as_slice(), &dev)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        forward(&x).flatten_all().unwrap()
    };
    compare(&mut ours, oracle, &PROMPT)
}

/// A reference model fed token by token: `(token, position)` to logits.
type Incremental = Box<dyn FnMut(&Tensor, usize) -> Tensor>;

/// A candle model as a reference that recomputes the whole sequence: its cache cleared, then all tokens at 0.
macro_rules! recomputing {
    ($model:expr) => {{
        let mut m = $model;
        Box::new(move |x: &Tensor| {
            m.clear_kv_cache();
            m.forward(x, 0).unwrap()
        })
    }};
}

/// The HF model in `dir` as candle's references read it: its config and its weights, in f32 on the CPU.
fn hf_files(dir: &Path) -> (serde_json::Value, candle_nn::VarBuilder<'static>) {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    // SAFETY: the test's own temporary file, not modified while mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .unwrap();
    (serde_json::from_str(&text).unwrap(), vb)
}

fn config<T: serde::de::DeserializeOwned>(json: &serde_json::Value) -> T {
    serde_json::from_value(json.clone()).unwrap()
}

#[test]
fn qwen2_biases_match_candle_qwen2() {
    check(SHAPE.with_family(SyntheticFamily::Qwen2), |_, json, vb| {
        recomputing!(qwen2::ModelForCausalLM::new(&config(json), vb.clone()).unwrap())
    });
}

#[test]
fn qwen3_qk_norms_match_candle_qwen3() {
    check(SHAPE.with_family(SyntheticFamily::Qwen3), |_, json, vb| {
        recomputing!(qwen3::ModelForCausalLM::new(&config(json), vb.clone()).unwrap())
    });
}

/// Eight experts of half the dense width, two per token, their weights renormalised, after Qwen3's q/k norms.
#[test]
fn qwen3_moe_experts_match_candle_qwen3_moe() {
    check(
        SHAPE.with_family(SyntheticFamily::Qwen3Moe),
        |_, json, vb| {
            recomputing!(qwen3_moe::ModelForCausalLM::new(&config(json), vb.clone()).unwrap())
        },
    );
}

/// DeepSeek-V2: latent attention with low-rank queries, YaRN, eight experts of half the dense width (two per token,
/// weights scaled by 1.5 and not renormalised) beside a shared one, and a dense first block. Ours attends in the
/// latent, the cache holding the latent alone; candle expands every head's key and value.
#[test]
fn deepseek_v2_latent_attention_matches_candle_deepseek2() {
    check(
        SHAPE.with_family(SyntheticFamily::DeepseekV2),
        |_, json, vb| recomputing!(deepseek2::DeepSeekV2::new(&config(json), vb.clone()).unwrap()),
    );
}

/// A window of 5 positions, shorter than the 8-token prompt, over a 72-token context: the prompt's mask and every
/// decode step's cut of the cache are windowed. candle's Mistral mask lets a query see `window + 1` keys (`j + w <
/// i` masks) where HF sees `window` (`i - j < w`), so the reference is given `window - 1`.
#[test]
fn mistral_sliding_window_matches_candle_mistral() {
    let mut shape = SHAPE.with_family(SyntheticFamily::Mistral);
    shape.sliding_window = Some(5);
    check(shape, |_, json, vb| {
        let mut cfg: mistral::Config = config(json);
        cfg.sliding_window = Some(4);
        recomputing!(mistral::Model::new(&cfg, vb.clone()).unwrap())
    });
}

#[test]
fn mixtral_experts_match_candle_mixtral() {
    let mut shape = SHAPE.with_family(SyntheticFamily::Mixtral);
    // candle's config requires a window; one as long as the context leaves attention whole.
    shape.sliding_window = Some(SHAPE.max_position);
    check(shape, |_, json, vb| {
        let cfg: mixtral::Config = config(json);
        let vb = vb.clone();
        // candle's Mixtral cannot clear its cache: a fresh model per step (the weights are memory-mapped).
        Box::new(move |x| {
            let mut m = mixtral::Model::new(&cfg, vb.clone()).unwrap();
            m.forward(x, 0).unwrap()
        })
    });
}

#[test]
fn phi3_fused_projections_match_candle_phi3() {
    check(SHAPE.with_family(SyntheticFamily::Phi3), |_, json, vb| {
        recomputing!(phi3::Model::new(&config(json), vb.clone()).unwrap())
    });
}

/// candle's Gemma 2 windows every layer where HF windows the even ones, so its window is kept longer than the
/// context here (the Mistral test and `windowed_long_prefill_equals_stepwise` cover windowed attention, and the
/// Gemma 2 swarm test in tests/tests/families.rs runs with a window); soft-capping, GeGLU, the four
/// norms per block and scaled embeddings are all compared.
#[test]
fn gemma2_matches_candle_gemma2() {
    check(SHAPE.with_family(SyntheticFamily::Gemma2), |_, json, vb| {
        recomputing!(gemma2::Model::new(false, &config(json), vb.clone()).unwrap())
    });
}

/// Two RoPE bases (1,000 for the windowed layers, 10,000 for every third, global one) and q/k norms. candle's
/// Gemma 3 fails to cache a multi-token step (its keys are not contiguous), so it is fed one token at a time.
#[test]
fn gemma3_matches_candle_gemma3() {
    check(SHAPE.with_family(SyntheticFamily::Gemma3), |_, json, vb| {
        let mut m = gemma3::Model::new(false, &config(json), vb.clone()).unwrap();
        let mut done = 0;
        Box::new(move |x| {
            let total = x.dim(1).unwrap();
            let mut logits = None;
            for pos in done..total {
                logits = Some(m.forward(&x.narrow(1, pos, 1).unwrap(), pos).unwrap());
            }
            done = total;
            logits.unwrap()
        })
    });
}

/// The families differ from each other: the same seed and shape give different logits per family, so no family
/// silently runs as plain Llama.
#[test]
fn families_are_not_llama_in_disguise() {
    let prompt = PROMPT;
    let mut seen: Vec<(SyntheticFamily, Vec<f32>)> = vec![];
    for family in SyntheticFamily::ALL {
        let dir = tempfile::tempdir().unwrap();
        write_model(
            dir.path(),
            &SHAPE.with_family(family),
            WeightDType::F32,
            SEED,
        )
        .unwrap();
        let source = ModelSource::open(dir.path()).unwrap();
        let mut ours = Composed::new(&source, &[(0, 6)]);
        let logits = ours.logits(&prompt).to_vec1::<f32>().unwrap();
        for (other, l) in &seen {
            let diff = l
                .iter()
                .zip(&logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff > 1e-3, "{family:?} gives {other:?}'s logits");
        }
        seen.push((family, logits));
    }
}

/// A windowed prompt longer than one query chunk (256 rows) gives the same last logits in one step as fed in pieces
/// of 7 tokens: each chunk leaves out exactly the keys before its window.
#[test]
fn windowed_long_prefill_equals_stepwise() {
    let mut shape = SHAPE.with_family(SyntheticFamily::Mistral);
    shape.sliding_window = Some(100);
    shape.max_position = 1024;
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &shape, WeightDType::F32, SEED).unwrap();
    let source = ModelSource::open(dir.path()).unwrap();
    let prompt: Vec<u32> = (0..600u32).map(|i| (i * 37 + 11) % 256).collect();
    let mut whole = Composed::new(&source, &[(0, 3), (3, 6)]);
    let a = whole.logits(&prompt);
    let mut pieces = Composed::new(&source, &[(0, 6)]);
    let mut b = None;
    for piece in prompt.chunks(7) {
        b = Some(pieces.logits(piece));
    }
    let diff = max_abs_diff(&a, &b.unwrap());
    assert!(diff < TOLERANCE, "one step vs pieces: {diff}");
}

/// How a GGUF file holds a mixture's experts.
#[derive(Clone, Copy)]
enum Experts {
    /// One 3-D `ffn_{gate,up,down}_exps` tensor per matrix, as llama.cpp's converter writes them today.
    Stacked,
    /// `ffn_gate.{e}.weight` per expert, as older Mixtral conversions did (and candle's quantized Llama reads).
    PerExpert,
}

/// The GGUF architecture llama.cpp's converter names a HF family by.
fn gguf_arch(family: SyntheticFamily) -> &'static str {
    match family {
        SyntheticFamily::Mixtral => "llama",
        SyntheticFamily::Qwen3Moe => "qwen3moe",
        SyntheticFamily::DeepseekV2 | SyntheticFamily::DeepseekV3 => "deepseek2",
        f => f.name().trim_end_matches("_text"),
    }
}

/// The synthetic model of `family` converted to GGUF the way llama.cpp's converter lays it out (its tensor names
/// and metadata keys; Gemma's norms stored with their 1 added; DeepSeek's latent expansion split per head into
/// `attn_k_b` (transposed) and `attn_v_b`), matrices in `matrices`, vectors, routers and 3-D tensors in f32,
/// experts laid out as `experts` says.
fn write_gguf(
    hf: &Path,
    family: SyntheticFamily,
    matrices: GgmlDType,
    experts: Experts,
    out: &Path,
) {
    use candle_core::quantized::{gguf_file, QTensor};
    let arch = gguf_arch(family);
    let mut st =
        candle_core::safetensors::load(hf.join("model.safetensors"), &Device::Cpu).unwrap();
    let gemma = arch.starts_with("gemma");
    let shape = SHAPE.with_family(family);
    let (_, kv_rank, nope, _, value) = shape.latent_dims();
    let kv_ups: Vec<(String, Tensor)> = st
        .iter()
        .filter(|(name, _)| name.ends_with("self_attn.kv_b_proj.weight"))
        .map(|(name, t)| (name.clone(), t.clone()))
        .collect();
    let mut split_tensors: Vec<(String, Tensor)> = vec![];
    for (name, kv_up) in kv_ups {
        st.remove(&name);
        let block = name
            .strip_prefix("model.layers.")
            .unwrap()
            .split('.')
            .next()
            .unwrap();
        let w = kv_up
            .reshape((shape.num_heads, nope + value, kv_rank))
            .unwrap();
        let k_b = w
            .narrow(1, 0, nope)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap();
        let v_b = w.narrow(1, nope, value).unwrap().contiguous().unwrap();
        split_tensors.push((format!("blk.{block}.attn_k_b.weight"), k_b));
        split_tensors.push((format!("blk.{block}.attn_v_b.weight"), v_b));
    }
    // Experts, by (block, GGUF matrix name), in expert order.
    let mut expert_mats: std::collections::BTreeMap<(usize, &str), Vec<(usize, Tensor)>> =
        Default::default();
    st.retain(|name, t| {
        let Some(rest) = name.strip_prefix("model.layers.") else {
            return true;
        };
        let (block, leaf) = rest.split_once('.').unwrap();
        let Some(leaf) = leaf
            .strip_prefix("block_sparse_moe.experts.")
            .or_else(|| leaf.strip_prefix("mlp.experts."))
        else {
            return true;
        };
        let (e, w) = leaf.split_once('.').unwrap();
        let matrix = match w {
            "w1.weight" | "gate_proj.weight" => "gate",
            "w3.weight" | "up_proj.weight" => "up",
            "w2.weight" | "down_proj.weight" => "down",
            other => panic!("no GGUF name for expert matrix {other}"),
        };
        expert_mats
            .entry((block.parse().unwrap(), matrix))
            .or_default()
            .push((e.parse().unwrap(), t.clone()));
        false
    });
    let rename = |name: &str| -> String {
        let leaf = |l: &str| -> &str {
            match l {
                "input_layernorm.weight" => "attn_norm.weight",
                "self_attn.q_proj.weight" => "attn_q.weight",
                "self_attn.k_proj.weight" => "attn_k.weight",
                "self_attn.v_proj.weight" => "attn_v.weight",
                "self_attn.q_proj.bias" => "attn_q.bias",
                "self_attn.k_proj.bias" => "attn_k.bias",
                "self_attn.v_proj.bias" => "attn_v.bias",
                "self_attn.qkv_proj.weight" => "attn_qkv.weight",
                "self_attn.q_norm.weight" => "attn_q_norm.weight",
                "self_attn.k_norm.weight" => "attn_k_norm.weight",
                "self_attn.o_proj.weight" => "attn_output.weight",
                "post_attention_layernorm.weight" if gemma => "post_attention_norm.weight",
                "post_attention_layernorm.weight" => "ffn_norm.weight",
                "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
                "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
                "mlp.gate_proj.weight" => "ffn_gate.weight",
                "mlp.up_proj.weight" | "mlp.gate_up_proj.weight" => "ffn_up.weight",
                "mlp.down_proj.weight" => "ffn_down.weight",
                "block_sparse_moe.gate.weight" | "mlp.gate.weight" => "ffn_gate_inp.weight",
                "mlp.gate.e_score_correction_bias" => "exp_probs_b.bias",
                "mlp.shared_experts.gate_proj.weight" => "ffn_gate_shexp.weight",
                "mlp.shared_experts.up_proj.weight" => "ffn_up_shexp.weight",
                "mlp.shared_experts.down_proj.weight" => "ffn_down_shexp.weight",
                "self_attn.q_a_proj.weight" => "attn_q_a.weight",
                "self_attn.q_a_layernorm.weight" => "attn_q_a_norm.weight",
                "self_attn.q_b_proj.weight" => "attn_q_b.weight",
                "self_attn.kv_a_proj_with_mqa.weight" => "attn_kv_a_mqa.weight",
                "self_attn.kv_a_layernorm.weight" => "attn_kv_a_norm.weight",
                other => panic!("no GGUF name for {other}"),
            }
        };
        match name {
            "model.embed_tokens.weight" => "token_embd.weight".into(),
            "model.norm.weight" => "output_norm.weight".into(),
            "lm_head.weight" => "output.weight".into(),
            _ => {
                let rest = name.strip_prefix("model.layers.").unwrap();
                let (i, l) = rest.split_once('.').unwrap();
                format!("blk.{i}.{}", leaf(l))
            }
        }
    };
    let mut tensors: Vec<(String, QTensor)> = st
        .iter()
        .map(|(name, t)| {
            let t = if gemma && name.ends_with("norm.weight") {
                (t + 1.0).unwrap()
            } else {
                t.clone()
            };
            let name = rename(name);
            // llama.cpp keeps expert routers in f32.
            let dtype = if t.rank() == 2 && !name.ends_with("ffn_gate_inp.weight") {
                matrices
            } else {
                GgmlDType::F32
            };
            (name, QTensor::quantize(&t, dtype).unwrap())
        })
        .collect();
    tensors.extend(
        split_tensors
            .into_iter()
            .map(|(name, t)| (name, QTensor::quantize(&t, GgmlDType::F32).unwrap())),
    );
    for ((block, matrix), mut mats) in expert_mats {
        mats.sort_by_key(|(e, _)| *e);
        match experts {
            Experts::Stacked => {
                let all: Vec<Tensor> = mats.into_iter().map(|(_, t)| t).collect();
                let stacked = Tensor::stack(&all, 0).unwrap();
                tensors.push((
                    format!("blk.{block}.ffn_{matrix}_exps.weight"),
                    QTensor::quantize(&stacked, matrices).unwrap(),
                ));
            }
            Experts::PerExpert => tensors.extend(mats.into_iter().map(|(e, t)| {
                (
                    format!("blk.{block}.ffn_{matrix}.{e}.weight"),
                    QTensor::quantize(&t, matrices).unwrap(),
                )
            })),
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let s = SHAPE;
    let hd = s.hidden_size / s.num_heads;
    let u = |v: usize| gguf_file::Value::U32(v as u32);
    let k = |key: &str| format!("{arch}.{key}");
    let mut md: Vec<(String, gguf_file::Value)> = vec![
        (
            "general.architecture".into(),
            gguf_file::Value::String(arch.into()),
        ),
        // candle's quantized Qwen3 computes in this dtype (f16 unless told 0: f32).
        ("general.dtype".into(), u(0)),
        (k("block_count"), u(s.num_blocks)),
        (k("embedding_length"), u(s.hidden_size)),
        (k("feed_forward_length"), u(s.intermediate_size)),
        (k("attention.head_count"), u(s.num_heads)),
        (k("attention.head_count_kv"), u(s.num_kv_heads)),
        (k("attention.key_length"), u(hd)),
        (k("attention.value_length"), u(hd)),
        (k("rope.dimension_count"), u(hd)),
        (k("context_length"), u(s.max_position)),
        (k("rope.freq_base"), gguf_file::Value::F32(10_000.0)),
        (
            k("attention.layer_norm_rms_epsilon"),
            gguf_file::Value::F32(1e-5),
        ),
    ];
    if let Some(ex) = shape.expert_shape() {
        md.extend([
            (k("expert_count"), u(ex.count)),
            (k("expert_used_count"), u(ex.per_token)),
        ]);
        if matches!(arch, "qwen3moe" | "deepseek2") {
            md.push((k("expert_feed_forward_length"), u(ex.size)));
        }
    }
    if arch == "deepseek2" {
        // As llama.cpp's converter writes an MLA file (the same keys the real-scale writer writes).
        override_metadata(&mut md, deepseek2_metadata(&shape));
    }
    if arch == "gemma2" {
        md.extend([
            (k("attention.sliding_window"), u(s.max_position)),
            (k("attn_logit_softcapping"), gguf_file::Value::F32(50.0)),
            (k("final_logit_softcapping"), gguf_file::Value::F32(30.0)),
        ]);
    }
    if arch == "gemma3" {
        md.extend([
            (k("attention.sliding_window"), u(s.max_position)),
            (k("attention.sliding_window_type"), u(3)),
            (k("rope.local_freq_base"), gguf_file::Value::F32(1000.0)),
        ]);
    }
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(a, b)| (a.as_str(), b)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(a, b)| (a.as_str(), b)).collect();
    let mut f = std::fs::File::create(out).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// The synthetic model of `family` written in `dir` and converted to GGUF (matrices in `matrices`), opened as
/// our source, which names the architecture llama.cpp's converter would.
fn gguf_fixture(
    dir: &Path,
    family: SyntheticFamily,
    matrices: GgmlDType,
    experts: Experts,
) -> (std::path::PathBuf, ModelSource) {
    write_model(dir, &SHAPE.with_family(family), WeightDType::F32, SEED).unwrap();
    let gguf = dir.join("model.gguf");
    write_gguf(dir, family, matrices, experts, &gguf);
    let source = ModelSource::open(&gguf).unwrap();
    assert_eq!(source.spec().architecture, gguf_arch(family));
    (gguf, source)
}

/// Our GGUF spans against candle's quantized model of the family, on the same Q8_0 file.
fn check_gguf(
    family: SyntheticFamily,
    reference: impl FnOnce(&Path) -> Box<dyn FnMut(&Tensor) -> Tensor>,
) {
    check_gguf_with(family, GgmlDType::Q8_0, Experts::Stacked, reference)
}

/// Our GGUF spans (matrices in `matrices`) against `reference`, given the GGUF file's path, recomputing the whole
/// sequence at every step.
fn check_gguf_with(
    family: SyntheticFamily,
    matrices: GgmlDType,
    experts: Experts,
    reference: impl FnOnce(&Path) -> Box<dyn FnMut(&Tensor) -> Tensor>,
) {
    let dir = tempfile::tempdir().unwrap();
    let (gguf, source) = gguf_fixture(dir.path(), family, matrices, experts);
    let mut ours = Composed::new(&source, &[(0, 2), (2, 4), (4, 6)]);
    let mut forward = reference(&gguf);
    let dev = Device::Cpu;
    let mut all: Vec<u32> = vec![];
    let oracle = |ids: &[u32], _pos: usize| {
        all.extend_from_slice(ids);
        let x = Tensor::new(all.as_slice(), &dev)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        forward(&x).flatten_all().unwrap()
    };
    compare(&mut ours, oracle, &PROMPT);
}

fn gguf_content(path: &Path) -> (candle_core::quantized::gguf_file::Content, std::fs::File) {
    let mut file = std::fs::File::open(path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    (content, file)
}

#[test]
fn qwen2_gguf_matches_candle_quantized_qwen2() {
    use candle_transformers::models::quantized_qwen2 as q;
    check_gguf(SyntheticFamily::Qwen2, |path| {
        let (content, mut file) = gguf_content(path);
        recomputing!(q::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap())
    });
}

#[test]
fn qwen3_gguf_matches_candle_quantized_qwen3() {
    use candle_transformers::models::quantized_qwen3 as q;
    check_gguf(SyntheticFamily::Qwen3, |path| {
        let (content, mut file) = gguf_content(path);
        recomputing!(q::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap())
    });
}

/// candle's quantized Llama reads Mixtral's experts one tensor each (the older layout); the same Q8_0 bytes
/// stacked the way llama.cpp writes them today give the same tokens, each expert's slab read on its own.
fn check_mixtral_gguf(experts: Experts) {
    use candle_transformers::models::quantized_llama as q;
    check_gguf_with(SyntheticFamily::Mixtral, GgmlDType::Q8_0, experts, |path| {
        let per_expert = path.with_file_name("per-expert.gguf");
        write_gguf(
            path.parent().unwrap(),
            SyntheticFamily::Mixtral,
            GgmlDType::Q8_0,
            Experts::PerExpert,
            &per_expert,
        );
        let (content, mut file) = gguf_content(&per_expert);
        let mut m = q::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        Box::new(move |x| m.forward(x, 0).unwrap())
    });
}

#[test]
fn mixtral_gguf_stacked_experts_match_candle_quantized_llama() {
    check_mixtral_gguf(Experts::Stacked);
}

#[test]
fn mixtral_gguf_per_expert_tensors_match_candle_quantized_llama() {
    check_mixtral_gguf(Experts::PerExpert);
}

/// A `qwen3moe` GGUF in f32 against candle's HF Qwen3-MoE on the same weights (candle's quantized Qwen3-MoE runs
/// on CUDA only): the stacked experts, their own width from `expert_feed_forward_length`, the router and the
/// renormalised top-k all have to be read right.
#[test]
fn qwen3moe_gguf_matches_candle_qwen3_moe() {
    let family = SyntheticFamily::Qwen3Moe;
    check_gguf_with(family, GgmlDType::F32, Experts::Stacked, |path| {
        let source = ModelSource::open(path).unwrap();
        assert_eq!(source.spec().options.moe.as_ref().unwrap().expert_size, 64);
        let (json, vb) = hf_files(path.parent().unwrap());
        recomputing!(qwen3_moe::ModelForCausalLM::new(&config(&json), vb).unwrap())
    });
}

/// A `deepseek2` GGUF in f32 as llama.cpp's converter writes an MLA file (one latent KV head, the expansion split
/// per head with the key's transposed, YaRN's temperature as a log multiplier) against candle's HF DeepSeek-V2.
#[test]
fn deepseek2_gguf_matches_candle_deepseek2() {
    check_gguf_with(
        SyntheticFamily::DeepseekV2,
        GgmlDType::F32,
        Experts::Stacked,
        |path| {
            let (json, vb) = hf_files(path.parent().unwrap());
            recomputing!(deepseek2::DeepSeekV2::new(&config(&json), vb).unwrap())
        },
    );
}

/// DeepSeek-V3's routing from GGUF metadata (sigmoid gating, groups, the `exp_probs_b` bias, renormalised and
/// scaled weights) and one query projection: the same logits as the HF original it was converted from, run by
/// our HF path (which the routing's unit tests and candle's V2 check).
#[test]
fn deepseek2_gguf_of_v3_equals_its_hf_original() {
    check_gguf_with(
        SyntheticFamily::DeepseekV3,
        GgmlDType::F32,
        Experts::Stacked,
        |path| {
            let source = ModelSource::open(path).unwrap();
            let m = source.spec().options.moe.clone().unwrap();
            assert!(
                m.choice_bias && m.groups.is_some() && m.normalize_top_k,
                "{m:?}"
            );
            // Fed only the tokens it has not seen: its own cache holds the rest.
            let hf = ModelSource::open(path.parent().unwrap()).unwrap();
            let mut model = Composed::new(&hf, &[(0, 6)]);
            let mut seen = 0;
            Box::new(move |x| {
                let ids = x.flatten_all().unwrap().to_vec1::<u32>().unwrap();
                let logits = model.logits(&ids[seen..]);
                seen = ids.len();
                logits
            })
        },
    );
}

#[test]
fn phi3_gguf_matches_candle_quantized_phi3() {
    use candle_transformers::models::quantized_phi3 as q;
    check_gguf(SyntheticFamily::Phi3, |path| {
        let (content, mut file) = gguf_content(path);
        let mut m = q::ModelWeights::from_gguf(false, content, &mut file, &Device::Cpu).unwrap();
        Box::new(move |x| m.forward(x, 0).unwrap())
    });
}

/// Our GGUF spans of a Gemma model, stored in f32 so that no quantization stands between them, against candle's
/// HF model of the family on the same weights: names, metadata, the norms' added 1, soft-caps, the window pattern
/// and the local RoPE base all have to be read right. (candle's quantized Gemma 3 gates its MLP with SiLU where
/// Gemma, HF and llama.cpp alike, uses GELU, so it cannot be the reference; candle has no quantized Gemma 2.)
fn check_gemma_gguf(family: SyntheticFamily) {
    let dir = tempfile::tempdir().unwrap();
    let (_, source) = gguf_fixture(dir.path(), family, GgmlDType::F32, Experts::Stacked);
    let mut ours = Composed::new(&source, &[(0, 2), (2, 4), (4, 6)]);
    let dev = Device::Cpu;
    let (json, vb) = hf_files(dir.path());
    // One token at a time: candle's Gemma 3 cannot cache a multi-token step.
    let mut forward: Incremental = match family {
        SyntheticFamily::Gemma2 => {
            let mut m = gemma2::Model::new(false, &config(&json), vb).unwrap();
            Box::new(move |x, pos| m.forward(x, pos).unwrap())
        }
        _ => {
            let mut m = gemma3::Model::new(false, &config(&json), vb).unwrap();
            Box::new(move |x, pos| m.forward(x, pos).unwrap())
        }
    };
    let oracle = |ids: &[u32], pos: usize| {
        let mut logits = None;
        for (i, &id) in ids.iter().enumerate() {
            let x = Tensor::new(&[id], &dev).unwrap().unsqueeze(0).unwrap();
            logits = Some(forward(&x, pos + i));
        }
        logits.unwrap().flatten_all().unwrap()
    };
    compare(&mut ours, oracle, &PROMPT);
}

#[test]
fn gemma2_gguf_matches_candle_gemma2() {
    check_gemma_gguf(SyntheticFamily::Gemma2);
}

#[test]
fn gemma3_gguf_matches_candle_gemma3() {
    check_gemma_gguf(SyntheticFamily::Gemma3);
}
