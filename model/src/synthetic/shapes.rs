//! The named shapes synthetic models are written in: small ones for tests and benches, real-scale ones for GGUF.
use super::{SyntheticFamily, SyntheticShape};

/// The smallest shape with everything a family can vary: GQA, six blocks (so every family's window pattern has
/// windowed and global layers), norms and a vocabulary big enough for greedy ties to be rare. The family tests use
/// it (model/tests/oracle_families.rs, tests/tests/families.rs).
pub const MINI: SyntheticShape = SyntheticShape {
    name: "mini",
    hidden_size: 64,
    num_blocks: 6,
    num_heads: 4,
    num_kv_heads: 2,
    intermediate_size: 128,
    vocab_size: 256,
    tie_embeddings: true,
    max_position: 512,
    family: SyntheticFamily::Llama,
    sliding_window: None,
};

/// Named shapes: [`MINI`] and a tiny one for smoke tests, SmolLM2-135M's and llama-160m's, and a Llama-3.2-1B-like one
/// (its vocabulary cut to 32000 to keep the client's head small).
pub const SHAPES: &[SyntheticShape] = &[
    MINI,
    SyntheticShape {
        name: "tiny",
        hidden_size: 256,
        num_blocks: 4,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: 704,
        vocab_size: 4096,
        tie_embeddings: true,
        max_position: 2048,
        family: SyntheticFamily::Llama,
        sliding_window: None,
    },
    SyntheticShape {
        name: "135m",
        hidden_size: 576,
        num_blocks: 30,
        num_heads: 9,
        num_kv_heads: 3,
        intermediate_size: 1536,
        vocab_size: 49152,
        tie_embeddings: true,
        max_position: 2048,
        family: SyntheticFamily::Llama,
        sliding_window: None,
    },
    SyntheticShape {
        name: "160m",
        hidden_size: 768,
        num_blocks: 12,
        num_heads: 12,
        num_kv_heads: 12,
        intermediate_size: 3072,
        vocab_size: 32000,
        tie_embeddings: false,
        max_position: 2048,
        family: SyntheticFamily::Llama,
        sliding_window: None,
    },
    SyntheticShape {
        name: "1b",
        hidden_size: 2048,
        num_blocks: 16,
        num_heads: 32,
        num_kv_heads: 8,
        intermediate_size: 8192,
        vocab_size: 32000,
        tie_embeddings: true,
        max_position: 2048,
        family: SyntheticFamily::Llama,
        sliding_window: None,
    },
    // Real-scale shapes, for GGUF files in the formats users download ([`super::write_gguf`], which takes the
    // vocabulary of the tokenizer it copies): Llama-3-8B, a 14B (Qwen2.5-14B's widths as a Llama) and
    // Llama-3-70B.
    SyntheticShape {
        name: "8b",
        hidden_size: 4096,
        num_blocks: 32,
        num_heads: 32,
        num_kv_heads: 8,
        intermediate_size: 14336,
        vocab_size: 128256,
        tie_embeddings: false,
        max_position: 8192,
        family: SyntheticFamily::Llama,
        sliding_window: None,
    },
    SyntheticShape {
        name: "14b",
        hidden_size: 5120,
        num_blocks: 48,
        num_heads: 40,
        num_kv_heads: 8,
        intermediate_size: 13824,
        vocab_size: 152064,
        tie_embeddings: false,
        max_position: 8192,
        family: SyntheticFamily::Llama,
        sliding_window: None,
    },
    SyntheticShape {
        name: "70b",
        hidden_size: 8192,
        num_blocks: 80,
        num_heads: 64,
        num_kv_heads: 8,
        intermediate_size: 28672,
        vocab_size: 128256,
        tie_embeddings: false,
        max_position: 8192,
        family: SyntheticFamily::Llama,
        sliding_window: None,
    },
];
