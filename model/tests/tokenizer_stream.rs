//! Incremental detokenisation with real tokenizers (SentencePiece byte fallback and byte-level BPE), and stop
//! strings over streamed text.
mod common;

use petal_model::text::stream::{StopMatcher, TextStream};
use petal_model::text::tokenizer::Tokenizer;

fn stories() -> Tokenizer {
    Tokenizer::from_file(&common::shared_model("stories260K/tok512.bin")).unwrap()
}

fn smollm() -> Tokenizer {
    let path = common::shared_model("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    Tokenizer::for_model(&path, None).unwrap()
}

/// Pushes every token, checking that no chunk carries half a character; returns the chunks.
fn stream_all(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    let mut stream = TextStream::new(tok);
    let mut chunks = Vec::new();
    for &id in ids {
        if let Some(chunk) = stream.push(id).unwrap() {
            assert!(
                !chunk.contains('\u{FFFD}'),
                "half a character emitted: {chunk:?}"
            );
            chunks.push(chunk);
        }
    }
    if let Some(rest) = stream.finish().unwrap() {
        chunks.push(rest);
    }
    assert_eq!(stream.text(), chunks.concat());
    chunks
}

const TEXTS: &[&str] = &[
    "Once upon a time, there was a little dog.",
    "café ☃ naïve 日本語 😀👍🏽 end",
    "  spaces\n\nnew paragraph\twith tab  ",
    "☃☃☃",
    "Numbers 1234 and symbols <>&|~",
];

#[test]
fn pushes_concatenate_to_full_decode() {
    for tok in [stories(), smollm()] {
        for text in TEXTS {
            let ids = tok.encode(text, true).unwrap();
            let chunks = stream_all(&tok, &ids);
            assert_eq!(chunks.concat(), tok.decode(&ids, true).unwrap(), "{text:?}");
            assert_eq!(chunks.concat(), *text);
        }
    }
}

#[test]
fn byte_fallback_characters_are_held_until_complete() {
    let tok = stories();
    let ids = tok.encode("a☃", false).unwrap();
    let pieces: Vec<String> = ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect();
    assert_eq!(pieces, ["▁a", "<0xE2>", "<0x98>", "<0x83>"]);
    let mut stream = TextStream::new(&tok);
    assert_eq!(stream.push(ids[0]).unwrap().as_deref(), Some("a"));
    assert_eq!(stream.push(ids[1]).unwrap(), None);
    assert_eq!(stream.push(ids[2]).unwrap(), None);
    assert_eq!(stream.push(ids[3]).unwrap().as_deref(), Some("☃"));
    assert_eq!(stream.finish().unwrap(), None);
    assert_eq!(stream.text(), "a☃");
}

#[test]
fn byte_level_characters_are_held_until_complete() {
    let tok = smollm();
    // Emoji with a skin-tone modifier: several byte-level tokens, some carrying partial UTF-8 sequences.
    let ids = tok.encode("👍🏽", false).unwrap();
    assert!(ids.len() > 1, "{ids:?}");
    let chunks = stream_all(&tok, &ids);
    assert_eq!(chunks.concat(), "👍🏽");
}

#[test]
fn sentencepiece_spaces_are_kept_between_tokens() {
    let tok = stories();
    let ids = tok.encode("Once upon a time", true).unwrap();
    let chunks = stream_all(&tok, &ids);
    assert_eq!(chunks, ["Once", " upon", " a", " time"]);
}

#[test]
fn context_keeps_the_first_generated_space() {
    let tok = stories();
    let prompt = tok.encode("Once upon a", true).unwrap();
    let time = tok.encode("Once upon a time", true).unwrap();
    assert_eq!(&time[..prompt.len()], &prompt[..]);
    let mut stream = TextStream::with_context(&tok, &prompt);
    let mut out = String::new();
    for &id in &time[prompt.len()..] {
        out.extend(stream.push(id).unwrap());
    }
    assert_eq!(out, " time");
    assert_eq!(stream.text(), " time");
    // Without context the stream cannot know the space belongs there.
    let mut bare = TextStream::new(&tok);
    assert_eq!(
        bare.push(time[prompt.len()]).unwrap().as_deref(),
        Some("time")
    );
}

#[test]
fn finish_releases_an_incomplete_character() {
    let tok = stories();
    let ids = tok.encode("☃", false).unwrap();
    let mut stream = TextStream::new(&tok);
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(stream.push(id).unwrap(), None);
    }
    let rest = stream.finish().unwrap().unwrap();
    assert!(rest.ends_with('\u{FFFD}'), "{rest:?}");
}

#[test]
fn special_tokens_are_not_emitted() {
    let tok = smollm();
    let ids = tok.encode("Hi<|im_end|>", false).unwrap();
    assert_eq!(stream_all(&tok, &ids).concat(), "Hi");
}

#[test]
fn stop_string_split_across_pushes() {
    let mut m = StopMatcher::new(vec!["<|user|>".into(), "\n\n".into()]);
    let mut shown = String::new();
    let mut stopped = false;
    for piece in ["Hello", " there", "<|", "us", "er|>", " ignored"] {
        let (text, stop) = m.push(piece);
        shown.push_str(&text);
        if stop {
            stopped = true;
            break;
        }
    }
    assert!(stopped);
    assert_eq!(shown, "Hello there");
    assert_eq!(m.flush(), "");
    assert!(m.stopped());
}

#[test]
fn held_text_that_is_not_a_stop_is_released() {
    let mut m = StopMatcher::new(vec!["STOP".into()]);
    assert_eq!(m.push("one ST"), ("one ".to_string(), false));
    assert_eq!(m.push("OP"), (String::new(), true));

    let mut m = StopMatcher::new(vec!["STOP".into()]);
    assert_eq!(m.push("a ST"), ("a ".to_string(), false));
    assert_eq!(m.push("AY"), ("STAY".to_string(), false));
    assert_eq!(m.push(" S"), (" ".to_string(), false));
    assert_eq!(m.flush(), "S");
}

#[test]
fn no_stop_means_everything_after_flush() {
    let mut m = StopMatcher::new(vec!["</answer>".into()]);
    let mut shown = String::new();
    for piece in ["The answer", " is 42", " </ans"] {
        let (text, stop) = m.push(piece);
        assert!(!stop);
        shown.push_str(&text);
    }
    shown.push_str(&m.flush());
    assert_eq!(shown, "The answer is 42 </ans");
    // No stop strings at all: text passes straight through.
    let mut m = StopMatcher::new(Vec::new());
    assert_eq!(m.push("abc"), ("abc".to_string(), false));
    assert_eq!(m.flush(), "");
}

#[test]
fn earliest_stop_wins_and_text_in_the_same_push_is_cut() {
    let mut m = StopMatcher::new(vec!["world".into(), "lo".into()]);
    assert_eq!(m.push("Hello world"), ("Hel".to_string(), true));
}

#[test]
fn streaming_into_a_stop_matcher() {
    let tok = stories();
    let ids = tok
        .encode("The cat sat. The end. More text", false)
        .unwrap();
    let mut stream = TextStream::new(&tok);
    let mut stops = StopMatcher::new(vec!["The end".into()]);
    let mut shown = String::new();
    for &id in &ids {
        if let Some(chunk) = stream.push(id).unwrap() {
            let (text, stop) = stops.push(&chunk);
            shown.push_str(&text);
            if stop {
                break;
            }
        }
    }
    assert_eq!(shown, "The cat sat. ");
}
