//! The stories260K tokenizer in its three forms: llama2.c `tok512.bin`, Hugging Face `hf/tokenizer.json`, and a
//! GGUF "llama" vocabulary built from the same pieces. All must give identical ids, and model-path discovery
//! must find them.
mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use petal_model::text::tokenizer::Tokenizer;
use petal_model::ModelError;

fn stories_dir() -> PathBuf {
    common::shared_model("stories260K")
}

const TEXTS: &[&str] = &[
    "Once upon a time",
    "Once upon a time, there was a little girl named Lily. She loved to play outside!",
    "",
    " ",
    "  two leading spaces and trailing  ",
    "Hello, world! How are you? \"Quoted\" (parens) [brackets] {braces}",
    "Digits: 0 1 22 333 4444 3.14159 -42",
    "line one\nline two\n\nline four\r\nwindows\ttab",
    "café ☃",
    "日本語のテキスト and emoji 😀👍",
    "<s> is text here, not BOS",
    "It's a dog's life; they'll say \"no\" — wasn't it?",
    "UPPER lower MiXeD",
];

#[test]
fn tok512_bin_matches_hf_tokenizer_json() {
    let bin = Tokenizer::from_file(&stories_dir().join("tok512.bin")).unwrap();
    let hf = Tokenizer::from_file(&stories_dir().join("hf/tokenizer.json")).unwrap();
    assert_eq!(bin.vocab_size(), 512);
    assert_eq!(hf.vocab_size(), 512);
    for text in TEXTS {
        let a = bin.encode(text, false).unwrap();
        let b = hf.encode(text, false).unwrap();
        assert_eq!(a, b, "ids differ for {text:?}");
        // The literal text "<s>" is the special token in both (HF added-token matching).
        assert_eq!(
            bin.decode(&a, false).unwrap(),
            hf.decode(&b, false).unwrap(),
            "{text:?}"
        );
        if !text.contains("<s>") {
            assert_eq!(
                bin.decode(&a, true).unwrap(),
                *text,
                "round trip of {text:?}"
            );
        }
    }
    assert_eq!(bin.encode("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn known_ids_for_once_upon_a_time() {
    let tok = Tokenizer::from_file(&stories_dir().join("tok512.bin")).unwrap();
    let ids = tok.encode("Once upon a time", true).unwrap();
    assert_eq!(ids[0], 1);
    let pieces: Vec<String> = ids[1..]
        .iter()
        .map(|&id| tok.id_to_token(id).unwrap())
        .collect();
    assert_eq!(pieces.concat(), "▁Once▁upon▁a▁time");
    // Unicode outside the vocabulary falls back to UTF-8 byte pieces <0xE2><0x98><0x83>.
    let snowman = tok.encode("☃", false).unwrap();
    let snowman: Vec<String> = snowman
        .iter()
        .map(|&id| tok.id_to_token(id).unwrap())
        .collect();
    assert_eq!(snowman, ["▁", "<0xE2>", "<0x98>", "<0x83>"]);
}

#[test]
fn special_tokens_and_bos() {
    for tok in [
        Tokenizer::from_file(&stories_dir().join("tok512.bin")).unwrap(),
        Tokenizer::from_file(&stories_dir().join("hf/tokenizer.json")).unwrap(),
    ] {
        assert!(tok.add_bos_default());
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.eos_ids(), &[2]);
        assert_eq!(tok.token_to_id("<s>"), Some(1));
        assert_eq!(tok.token_to_id("</s>"), Some(2));
        assert!(tok.chat_template().is_none());
        let plain = tok.encode("Once upon a time", false).unwrap();
        let with_bos = tok.encode("Once upon a time", true).unwrap();
        assert_eq!(with_bos[0], 1);
        assert_eq!(&with_bos[1..], &plain[..]);
        // BOS is added once, even when the text starts with it.
        let explicit = tok.encode("<s>Once upon a time", true).unwrap();
        assert_eq!(explicit.iter().filter(|&&id| id == 1).count(), 1);
        assert_eq!(tok.encode("", true).unwrap(), [1]);
        // Ids past the vocabulary (models may pad their embedding) decode to nothing rather than failing.
        assert_eq!(tok.decode(&[100_000], true).unwrap(), "");
        assert_eq!(tok.decode(&with_bos, true).unwrap(), "Once upon a time");
        assert_eq!(
            tok.decode(&with_bos, false).unwrap(),
            "<s> Once upon a time"
        );
    }
}

#[test]
fn for_model_finds_every_form() {
    let dir = stories_dir();
    let reference = Tokenizer::from_file(&dir.join("hf/tokenizer.json"))
        .unwrap()
        .encode("The cat sat. 42!", false)
        .unwrap();
    let cases: Vec<(PathBuf, Option<PathBuf>)> = vec![
        (dir.join("stories260K.bin"), None),
        (dir.join("hf"), None),
        (dir.join("hf/model.safetensors"), None),
        (
            dir.join("stories260K.bin"),
            Some(dir.join("hf/tokenizer.json")),
        ),
        (dir.join("stories260K.bin"), Some(dir.join("tok512.bin"))),
        (dir.join("hf"), Some(dir.join("tok512.bin"))),
    ];
    for (model, override_path) in cases {
        let tok = Tokenizer::for_model(&model, override_path.as_deref())
            .unwrap_or_else(|e| panic!("{} / {override_path:?}: {e}", model.display()));
        assert_eq!(tok.vocab_size(), 512, "{}", model.display());
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.eos_ids(), &[2]);
        assert!(tok.add_bos_default());
        let ids = tok.encode("The cat sat. 42!", true).unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(
            &ids[1..],
            &reference[..],
            "{} / {override_path:?}",
            model.display()
        );
    }
}

/// A llama2.c model with only `hf/tokenizer.json` below its directory, and one with nothing.
#[test]
fn llama2c_model_fallbacks_and_missing_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model.bin");
    std::fs::copy(stories_dir().join("stories260K.bin"), &model).unwrap();

    let err = Tokenizer::for_model(&model, None).unwrap_err();
    let ModelError::Tokenizer(message) = &err else {
        panic!("expected a tokenizer error, got {err:?}");
    };
    assert!(message.contains("--tokenizer"), "{message}");
    assert!(
        message.contains("tok512.bin"),
        "tries tok{{vocab}}.bin: {message}"
    );
    assert!(message.contains("tokenizer.json"), "{message}");

    std::fs::create_dir(tmp.path().join("hf")).unwrap();
    std::fs::copy(
        stories_dir().join("hf/tokenizer.json"),
        tmp.path().join("hf/tokenizer.json"),
    )
    .unwrap();
    let tok = Tokenizer::for_model(&model, None).unwrap();
    assert_eq!(tok.encode("Hi", true).unwrap()[0], 1);
    assert_eq!(tok.eos_ids(), &[2]);

    // A differently named llama2.c tokenizer beside the model wins over hf/.
    std::fs::copy(
        stories_dir().join("tok512.bin"),
        tmp.path().join("tokenizer.bin"),
    )
    .unwrap();
    let tok = Tokenizer::for_model(&model, None).unwrap();
    assert_eq!(tok.vocab_size(), 512);
}

#[test]
fn missing_and_corrupt_files_are_tokenizer_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let mut truncated = std::fs::read(stories_dir().join("tok512.bin")).unwrap();
    truncated.truncate(truncated.len() - 3);
    let cases = vec![
        tmp.path().join("missing.json"),
        tmp.path().join("missing.bin"),
        write("empty.json", b""),
        write("bad.json", b"{\"model\": 42}"),
        write("garbage.bin", &[0xff; 100]),
        write("empty.bin", b""),
        write("truncated.bin", &truncated),
        write("bad.gguf", b"GGUF\x03\x00\x00\x00 not really"),
        write("notgguf.gguf", b"hello"),
        stories_dir().join("stories260K.bin"),
        tmp.path().to_path_buf(),
    ];
    for path in &cases {
        match Tokenizer::from_file(path) {
            Err(ModelError::Tokenizer(message)) => assert!(!message.is_empty()),
            Err(other) => panic!(
                "{}: expected a tokenizer error, got {other:?}",
                path.display()
            ),
            Ok(_) => panic!("{}: loaded a tokenizer from garbage", path.display()),
        }
    }
    let err = Tokenizer::for_model(&tmp.path().join("nope.gguf"), None).unwrap_err();
    assert!(matches!(err, ModelError::Tokenizer(_)), "{err:?}");
    let err = Tokenizer::for_model(tmp.path(), None).unwrap_err();
    assert!(
        matches!(err, ModelError::Tokenizer(ref m) if m.contains("--tokenizer")),
        "{err:?}"
    );
    let bad_config = tempfile::tempdir().unwrap();
    std::fs::copy(
        stories_dir().join("hf/tokenizer.json"),
        bad_config.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        bad_config.path().join("tokenizer_config.json"),
        b"{not json",
    )
    .unwrap();
    let err = Tokenizer::for_model(bad_config.path(), None).unwrap_err();
    assert!(
        matches!(err, ModelError::Tokenizer(ref m) if m.contains("tokenizer_config.json")),
        "{err:?}"
    );
}

/// Reads tok512.bin as (piece, score) pairs, the way a GGUF converter sees the SentencePiece model.
fn tok512_pieces(path: &Path) -> Vec<(String, f32)> {
    let bytes = std::fs::read(path).unwrap();
    let mut pos = 4;
    let mut pieces = Vec::new();
    while pos < bytes.len() {
        let score = f32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap());
        let len = i32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap()) as usize;
        let text = String::from_utf8(bytes[pos + 8..pos + 8 + len].to_vec()).unwrap();
        pos += 8 + len;
        pieces.push((text, score));
    }
    pieces
}

/// A GGUF with a SentencePiece ("llama") vocabulary, written by candle's GGUF writer from the stories pieces as
/// llama.cpp's converter would (▁ restored, token types, scores), must tokenize like hf/tokenizer.json.
#[test]
fn gguf_llama_vocabulary_matches_hf() {
    let pieces = tok512_pieces(&stories_dir().join("tok512.bin"));
    let tokens: Vec<gguf_file::Value> = pieces
        .iter()
        .enumerate()
        .map(|(id, (text, _))| {
            let text = match id {
                0 => "<unk>".to_string(),
                1 => "<s>".to_string(),
                2 => "</s>".to_string(),
                _ if text.starts_with("<0x") && text.len() == 6 => text.clone(),
                _ => text.replace(' ', "\u{2581}"),
            };
            gguf_file::Value::String(text)
        })
        .collect();
    let scores = pieces
        .iter()
        .map(|(_, s)| gguf_file::Value::F32(*s))
        .collect();
    let types = (0..pieces.len())
        .map(|id| {
            gguf_file::Value::I32(match id {
                0 => 2,
                1 | 2 => 3,
                3..=258 => 6,
                _ => 1,
            })
        })
        .collect();
    let template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}";
    let metadata = vec![
        (
            "general.architecture",
            gguf_file::Value::String("llama".into()),
        ),
        (
            "tokenizer.ggml.model",
            gguf_file::Value::String("llama".into()),
        ),
        ("tokenizer.ggml.tokens", gguf_file::Value::Array(tokens)),
        ("tokenizer.ggml.scores", gguf_file::Value::Array(scores)),
        ("tokenizer.ggml.token_type", gguf_file::Value::Array(types)),
        ("tokenizer.ggml.bos_token_id", gguf_file::Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", gguf_file::Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id", gguf_file::Value::U32(0)),
        (
            "tokenizer.chat_template",
            gguf_file::Value::String(template.into()),
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("stories-vocab.gguf");
    let mut file = std::fs::File::create(&path).unwrap();
    let refs: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut file, &refs, &[]).unwrap();
    drop(file);

    let gguf = Tokenizer::for_model(&path, None).unwrap();
    let hf = Tokenizer::from_file(&stories_dir().join("hf/tokenizer.json")).unwrap();
    assert_eq!(gguf.vocab_size(), 512);
    assert!(
        gguf.add_bos_default(),
        "SentencePiece GGUFs add BOS unless they say otherwise"
    );
    assert_eq!(gguf.bos_id(), Some(1));
    assert_eq!(gguf.eos_ids(), &[2]);
    for text in TEXTS {
        let ids = gguf.encode(text, false).unwrap();
        assert_eq!(ids, hf.encode(text, false).unwrap(), "{text:?}");
        if !text.contains("<s>") {
            assert_eq!(gguf.decode(&ids, true).unwrap(), *text);
        }
    }
    let chat = gguf.chat_template().expect("template from GGUF metadata");
    assert!(chat.renders_bos());
    let prompt = chat
        .render(&[petal_model::text::chat::ChatMessage::user("Hi")], true)
        .unwrap();
    assert_eq!(prompt, "<s>[user] Hi</s>");
    let ids = gguf.encode(&prompt, !chat.renders_bos()).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1);
    assert_eq!(ids.last(), Some(&2));
}

/// SentencePiece pieces: `▁` is a space and `<0xHH>` a byte, so a token's bytes laid end to end are the text
/// (with the space SentencePiece puts before it).
#[test]
fn token_bytes_concatenate_to_the_text() {
    let tok = Tokenizer::from_file(&stories_dir().join("tok512.bin")).unwrap();
    // A special token's text (`<s>` here) becomes its id, whose bytes are its text, with no space before it.
    for text in TEXTS
        .iter()
        .filter(|t| !t.is_empty() && !t.starts_with("<s>"))
    {
        let bytes: Vec<u8> = tok
            .encode(text, false)
            .unwrap()
            .into_iter()
            .flat_map(|id| tok.token_bytes(id))
            .collect();
        let decoded = String::from_utf8(bytes).unwrap();
        assert_eq!(decoded.strip_prefix(' '), Some(*text), "{text:?}");
    }
    assert_eq!(tok.token_bytes(1), b"<s>");
}
