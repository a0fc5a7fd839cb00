//! SmolLM2-135M-Instruct's tokenizer, which exists only in its GGUF metadata: byte-level BPE with the "smollm"
//! pre-tokenizer (single digits), ChatML special tokens and chat template.
mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use petal_model::text::chat::ChatMessage;
use petal_model::text::tokenizer::Tokenizer;

fn gguf_path() -> PathBuf {
    common::shared_model("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Built once: the vocabulary has 49,152 tokens and 48,900 merges.
fn smollm() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::for_model(&gguf_path(), None).unwrap())
}

#[test]
fn vocabulary_and_special_tokens() {
    let tok = smollm();
    assert_eq!(tok.vocab_size(), 49152);
    assert!(!tok.add_bos_default());
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!((im_start, im_end), (1, 2));
    assert_eq!(tok.bos_id(), Some(im_start));
    assert!(tok.eos_ids().contains(&im_end), "{:?}", tok.eos_ids());
    assert!(
        tok.eos_ids().contains(&0),
        "<|endoftext|> ends generation too: {:?}",
        tok.eos_ids()
    );
    assert_eq!(tok.encode("<|im_start|>", false).unwrap(), [im_start]);
    assert_eq!(tok.encode("<|im_end|>", false).unwrap(), [im_end]);
    assert_eq!(
        tok.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap(),
        tok.encode("<|im_start|>user\nHi<|im_end|>", true).unwrap(),
        "add_bos is false for SmolLM2: nothing is prepended"
    );
    assert_eq!(tok.decode(&[im_start, im_end], true).unwrap(), "");
    assert_eq!(
        tok.decode(&[im_start, im_end], false).unwrap(),
        "<|im_start|><|im_end|>"
    );
}

/// Ids worked out by hand from the GGUF's vocabulary and merge list (byte-level BPE, GPT-2 byte mapping).
#[test]
fn known_encodings() {
    let tok = smollm();
    assert_eq!(tok.encode("Hello world", false).unwrap(), [19556, 905]);
    assert_eq!(
        tok.encode("The capital of France is Paris.", false)
            .unwrap(),
        [504, 3575, 282, 4649, 314, 7042, 30]
    );
    // Digits are split one by one before byte-level BPE: "x", " =", " ", then 1 2 3 4 5, ";".
    assert_eq!(
        tok.encode("x = 12345;", false).unwrap(),
        [104, 446, 216, 33, 34, 35, 36, 37, 43]
    );
    assert_eq!(tok.encode("café", false).unwrap(), [83, 1939, 2756]);
}

#[test]
fn digits_are_single_tokens() {
    let tok = smollm();
    let ids = tok.encode("2024", false).unwrap();
    assert_eq!(ids.len(), 4);
    for (id, digit) in ids.iter().zip("2024".chars()) {
        assert_eq!(tok.decode(&[*id], false).unwrap(), digit.to_string());
    }
}

#[test]
fn round_trips_exactly() {
    let tok = smollm();
    let texts = [
        "",
        "Hello world",
        "  leading and trailing spaces  ",
        "Pi is 3.14159265358979 and 1,000,000 > 999",
        "café ☃ naïve 日本語 😀👍🏽",
        "fn main() {\n    let x = vec![1, 2, 3];\n\tprintln!(\"{x:?}\");\n}\n",
        "def f(a, b):\n    return a + b  # comment\n\n\nclass X: pass",
        "line\r\nwindows\n\n\n  \t mixed whitespace",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "It's 'quoted' and \"double\" — dashes–and…",
    ];
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "ids {ids:?}");
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
    }
}

#[test]
fn chat_template_renders_chatml() {
    let tok = smollm();
    let template = tok.chat_template().expect("SmolLM2 has a chat template");
    let messages = [ChatMessage::user("What is the capital of France?")];
    let prompt = template.render(&messages, true).unwrap();
    assert!(prompt.starts_with("<|im_start|>system\n"), "{prompt:?}");
    assert!(
        prompt.contains("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"),
        "{prompt:?}"
    );
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt:?}");
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let without = template.render(&messages, false).unwrap();
    assert!(without.ends_with("<|im_end|>\n"));
    // The template's first token is <|im_start|>, which is also SmolLM2's BOS id.
    assert!(template.renders_bos());

    let ids = tok.encode(&prompt, !template.renders_bos()).unwrap();
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == im_end).count(), 2);
    let tail = tok.encode("<|im_start|>assistant\n", false).unwrap();
    assert!(ids.ends_with(&tail), "{ids:?} should end with {tail:?}");
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);

    // A system message replaces the default one.
    let with_system = template
        .render(
            &[ChatMessage::system("Be brief."), ChatMessage::user("Hi")],
            true,
        )
        .unwrap();
    assert_eq!(
        with_system,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn from_file_on_the_gguf_itself() {
    let tok = Tokenizer::from_file(&gguf_path()).unwrap();
    assert_eq!(tok.encode("Hello world", false).unwrap(), [19556, 905]);
    assert_eq!(tok.vocab_size(), 49152);
}

/// A tokenizer.json beside a GGUF wins over the metadata, which still supplies what the directory lacks.
#[cfg(unix)]
#[test]
fn tokenizer_json_beside_gguf_wins() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model.gguf");
    std::os::unix::fs::symlink(gguf_path(), &model).unwrap();
    let stories_json = common::shared_model("stories260K/hf/tokenizer.json");
    std::fs::copy(stories_json, tmp.path().join("tokenizer.json")).unwrap();
    let tok = Tokenizer::for_model(&model, None).unwrap();
    assert_eq!(
        tok.vocab_size(),
        512,
        "the tokenizer.json beside the GGUF is used"
    );
    assert!(
        !tok.add_bos_default(),
        "add_bos_token from the GGUF metadata"
    );
    let template = tok
        .chat_template()
        .expect("chat template from the GGUF metadata");
    assert!(template.source().contains("<|im_start|>"));
}

/// A token's bytes, laid end to end, are the text: even where one character spans several tokens.
#[test]
fn token_bytes_concatenate_to_the_text() {
    let tok = smollm();
    for text in [
        "The capital of France is Paris.",
        "line one\nline two\ttab",
        "café ☃ 日本語 😀",
    ] {
        let bytes: Vec<u8> = tok
            .encode(text, false)
            .unwrap()
            .into_iter()
            .flat_map(|id| tok.token_bytes(id))
            .collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), text);
    }
    assert_eq!(tok.token_bytes(7042), b" Paris");
    assert_eq!(tok.token_bytes(2), b"<|im_end|>");
    assert!(tok.token_bytes(u32::MAX).is_empty());
}
