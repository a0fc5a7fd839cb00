//! The spec's parsing rules: HF configs of each family, validation.
use super::*;

const STORIES: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":512,
    "hidden_size":64,"intermediate_size":172,"num_hidden_layers":5,"num_attention_heads":8,
    "num_key_value_heads":4,"max_position_embeddings":512,"rms_norm_eps":1e-05,"rope_theta":10000.0,
    "tie_word_embeddings":true,"bos_token_id":1,"eos_token_id":2,"rope_scaling":null}"#;

#[test]
fn parses_hf_config() {
    let s = ModelSpec::from_hf_config("stories", STORIES).unwrap();
    assert_eq!(
        (
            s.num_blocks,
            s.hidden_size,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim
        ),
        (5, 64, 8, 4, 8)
    );
    assert!(s.tie_embeddings);
    assert_eq!(s.eos_token_ids, vec![2]);
    assert_eq!(s.rope_style, RopeStyle::Half);
}

#[test]
fn llama3_rope_scaling() {
    let json = STORIES.replace(
        r#""rope_scaling":null"#,
        r#""rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
           "original_max_position_embeddings":8192,"rope_type":"llama3"},"eos_token_id":[2,3]"#,
    );
    let json = json.replace(r#""eos_token_id":2,"#, "");
    let s = ModelSpec::from_hf_config("l3", &json).unwrap();
    assert_eq!(s.rope_scaling.unwrap().factor, 8.0);
    assert_eq!(s.eos_token_ids, vec![2, 3]);
}

#[test]
fn unknown_architecture_is_an_error() {
    let json = STORIES.replace("\"llama\"", "\"gpt_neox\"");
    assert!(matches!(
        ModelSpec::from_hf_config("x", &json),
        Err(ModelError::UnknownArchitecture(a)) if a == "gpt_neox"
    ));
}

#[test]
fn inconsistent_heads_are_an_error() {
    let json = STORIES.replace("\"num_key_value_heads\":4", "\"num_key_value_heads\":3");
    assert!(matches!(
        ModelSpec::from_hf_config("x", &json),
        Err(ModelError::Config(_))
    ));
}

/// Qwen2.5-0.5B-Instruct's config.json (abridged to the fields read).
const QWEN25: &str = r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":896,
    "intermediate_size":4864,"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,
    "max_position_embeddings":32768,"max_window_layers":21,"rms_norm_eps":1e-06,"rope_theta":1000000.0,
    "sliding_window":32768,"tie_word_embeddings":true,"use_sliding_window":false,"vocab_size":151936,
    "hidden_act":"silu","bos_token_id":151643,"eos_token_id":151645}"#;

#[test]
fn qwen2_has_biases_and_no_window_unless_enabled() {
    let s = ModelSpec::from_hf_config("qwen", QWEN25).unwrap();
    assert_eq!(s.architecture, "qwen2");
    assert!(s.options.qkv_bias && !s.options.qk_norm);
    assert_eq!(s.options.sliding_window, None);
    assert_eq!(s.head_dim, 64);
    let on = QWEN25.replace(
        "\"use_sliding_window\":false",
        "\"use_sliding_window\":true",
    );
    let s = ModelSpec::from_hf_config("qwen", &on).unwrap();
    let w = s.options.sliding_window.clone().unwrap();
    assert_eq!(
        (w.size, w.layers.first(), w.layers.len()),
        (32768, Some(&21), 3)
    );
    assert_eq!(s.window(20), None);
    assert_eq!(s.window(21), Some(32768));
}

#[test]
fn gemma3_windows_five_layers_in_six_or_as_listed() {
    let json = r#"{"model_type":"gemma3_text","hidden_size":1152,"intermediate_size":6912,
        "num_hidden_layers":12,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":256,
        "vocab_size":262144,"rms_norm_eps":1e-06,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
        "sliding_window":512,"sliding_window_pattern":6,"query_pre_attn_scalar":256,
        "rope_scaling":{"rope_type":"linear","factor":8.0},"hidden_activation":"gelu_pytorch_tanh",
        "max_position_embeddings":32768}"#;
    let s = ModelSpec::from_hf_config("g", json).unwrap();
    let o = &s.options;
    assert!(o.qk_norm && o.norm_plus_one && o.sandwich_norms && o.scale_embeddings);
    assert!(s.tie_embeddings, "Gemma ties its LM head");
    assert_eq!(o.activation, Activation::GeluTanh);
    assert_eq!(o.rope_linear_factor, Some(8.0));
    assert_eq!(o.local_rope_theta, Some(10_000.0));
    let windowed: Vec<usize> = (0..12).filter(|&l| s.window(l).is_some()).collect();
    assert_eq!(windowed, vec![0, 1, 2, 3, 4, 6, 7, 8, 9, 10]);
    // An explicit layer_types list wins over the pattern.
    let listed = json.replace(
        "\"max_position_embeddings\":32768",
        "\"max_position_embeddings\":32768,\"layer_types\":[\"full_attention\",\"sliding_attention\"]",
    );
    let s = ModelSpec::from_hf_config("g", &listed).unwrap();
    assert_eq!(s.options.sliding_window.unwrap().layers, vec![1]);
}

#[test]
fn llama_keeps_its_serialised_form() {
    // Llama specs serialise without family options, so their model ids are what they were before families.
    let s = ModelSpec::from_hf_config("stories", STORIES).unwrap();
    assert!(s.options.is_llama());
    let json = serde_json::to_string(&s).unwrap();
    assert!(!json.contains("options"), "{json}");
    let q = ModelSpec::from_hf_config("qwen", QWEN25).unwrap();
    assert!(serde_json::to_string(&q).unwrap().contains("qkv_bias"));
}

#[test]
fn unsupported_rope_and_activation_are_errors() {
    let longrope = STORIES.replace(
        r#""rope_scaling":null"#,
        r#""rope_scaling":{"type":"longrope","long_factor":[1.0],"short_factor":[1.0]}"#,
    );
    let err = ModelSpec::from_hf_config("phi", &longrope.replace("\"llama\"", "\"phi3\""));
    assert!(matches!(err, Err(ModelError::Config(m)) if m.contains("longrope")));
    let relu = STORIES.replace(
        r#""model_type":"llama""#,
        r#""model_type":"llama","hidden_act":"relu""#,
    );
    assert!(matches!(
        ModelSpec::from_hf_config("x", &relu),
        Err(ModelError::Config(m)) if m.contains("relu")
    ));
}

/// Qwen3-MoE's dense layers: every layer not a multiple of `decoder_sparse_step` (counting from 1) and every
/// one in `mlp_only_layers`; their MLP is `intermediate_size` wide, the experts `moe_intermediate_size`.
#[test]
fn qwen3_moe_dense_layers_and_expert_width() {
    let json = STORIES
        .replace(r#""model_type":"llama""#, r#""model_type":"qwen3_moe""#)
        .replace(
            r#""rope_scaling":null"#,
            r#""rope_scaling":null,"num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,
            "moe_intermediate_size":32,"decoder_sparse_step":2,"mlp_only_layers":[3]"#,
        );
    let s = ModelSpec::from_hf_config("moe", &json).unwrap();
    let m = s.options.moe.clone().unwrap();
    assert_eq!(m.dense_layers, vec![0, 2, 3, 4]);
    assert!(m.is_sparse(1) && !m.is_sparse(3));
    assert_eq!(
        (m.expert_size, m.num_experts, m.normalize_top_k),
        (32, 8, true)
    );
    assert!(s.options.qk_norm);
    let attention = 2 * 64 * 64 + 2 * 64 * 32;
    assert_eq!(s.block_parameters(0), attention + 3 * 64 * 172);
    assert_eq!(s.block_parameters(1), attention + 8 * (3 * 64 * 32 + 64));
    let too_many = json.replace(r#""num_experts_per_tok":2"#, r#""num_experts_per_tok":9"#);
    assert!(matches!(
        ModelSpec::from_hf_config("moe", &too_many),
        Err(ModelError::Config(m)) if m.contains("9 experts per token of 8")
    ));
}

/// DeepSeek: one latent KV head (the cache half the latent wide), dense first blocks, V2 scaling only
/// unnormalised weights and V3 always, V3's groups and bias, interleaved RoPE, YaRN; an unknown method refused.
#[test]
fn deepseek_latent_attention_and_routing() {
    let v2 = STORIES
        .replace(r#""model_type":"llama""#, r#""model_type":"deepseek_v2""#)
        .replace(
            r#""rope_scaling":null"#,
            r#""rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":128,
            "mscale":1.0,"mscale_all_dim":0.8,"beta_fast":32,"beta_slow":1},
            "q_lora_rank":32,"kv_lora_rank":32,"qk_nope_head_dim":16,"qk_rope_head_dim":8,"v_head_dim":12,
            "n_routed_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":32,"n_shared_experts":2,
            "first_k_dense_replace":2,"moe_layer_freq":1,"routed_scaling_factor":1.5,"norm_topk_prob":false,
            "topk_method":"greedy","n_group":1,"topk_group":1"#,
        );
    let s = ModelSpec::from_hf_config("v2", &v2).unwrap();
    let (m, l) = (
        s.options.moe.clone().unwrap(),
        s.options.latent_attention.unwrap(),
    );
    assert_eq!(
        (s.num_kv_heads, s.head_dim, s.kv_dim(), s.rope_dim()),
        (1, 24, 20, 8)
    );
    assert_eq!(s.rope_style, RopeStyle::Interleaved);
    assert_eq!(s.kv_bytes_per_token_per_block(2), 2 * (32 + 8));
    assert_eq!(l.q_rank, Some(32));
    assert_eq!(m.dense_layers, vec![0, 1]);
    assert_eq!(
        (m.routed_scale, m.shared_size, m.groups),
        (1.5, Some(64), None)
    );
    assert_eq!(s.options.yarn.map(|y| y.factor), Some(4.0));
    let normalised = v2.replace(r#""norm_topk_prob":false"#, r#""norm_topk_prob":true"#);
    let s = ModelSpec::from_hf_config("v2", &normalised).unwrap();
    assert_eq!(s.options.moe.unwrap().routed_scale, 1.0);

    let v3 = normalised
        .replace("deepseek_v2", "deepseek_v3")
        .replace(
            r#""topk_method":"greedy","n_group":1"#,
            r#""topk_method":"noaux_tc","scoring_func":"sigmoid","n_group":4"#,
        )
        .replace(r#""topk_group":1"#, r#""topk_group":2"#);
    let m = ModelSpec::from_hf_config("v3", &v3)
        .unwrap()
        .options
        .moe
        .unwrap();
    assert_eq!(
        (m.scoring, m.groups, m.choice_bias, m.routed_scale),
        (
            ExpertScoring::Sigmoid,
            Some(ExpertGroups {
                count: 4,
                chosen: 2
            }),
            true,
            1.5
        )
    );
    let unknown = v3.replace("noaux_tc", "mystery");
    assert!(matches!(
        ModelSpec::from_hf_config("v3", &unknown),
        Err(ModelError::Config(m)) if m.contains("mystery")
    ));
    let too_few_groups = v3.replace(r#""topk_group":2"#, r#""topk_group":5"#);
    assert!(ModelSpec::from_hf_config("v3", &too_few_groups).is_err());
}

#[test]
fn quantized_checkpoints_other_than_gpt_oss_mxfp4_are_refused() {
    let awq = STORIES.replace(
        r#""rope_scaling":null"#,
        r#""rope_scaling":null,"quantization_config":{"quant_method":"awq","bits":4}"#,
    );
    let e = ModelSpec::from_hf_config("awq", &awq)
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"awq\"") && e.contains("GGUF"), "{e}");
    let mxfp4_llama = awq.replace("awq", "mxfp4");
    assert!(ModelSpec::from_hf_config("l", &mxfp4_llama).is_err());
    let shape = crate::synthetic::SHAPES
        .iter()
        .find(|s| s.name == "gpt-oss-tiny")
        .unwrap();
    let mut config = shape.config_json(crate::synthetic::WeightDType::BF16);
    config["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
    ModelSpec::from_hf_config("gpt-oss", &config.to_string()).unwrap();
}
