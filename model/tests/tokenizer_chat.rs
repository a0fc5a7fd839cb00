//! Chat templates as real models ship them, and how a Hugging Face directory's side files (tokenizer_config.json,
//! chat_template.jinja, config.json) decide BOS, EOS and the template.
mod common;

use std::path::{Path, PathBuf};

use petal_model::text::chat::{ChatMessage, ChatTemplate};
use petal_model::text::tokenizer::Tokenizer;
use petal_model::ModelError;

const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";

/// TinyLlama / Zephyr: relies on Jinja2's trim_blocks + lstrip_blocks, as transformers renders it.
const ZEPHYR: &str = "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}";

/// Python-isms HF templates use: namespace, slicing, str methods; booleans print as Python prints them.
const PYTHONIC: &str = "{%- set ns = namespace(system='') -%}{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content.strip() -%}{%- set rest = messages[1:] -%}{%- else -%}{%- set rest = messages -%}{%- endif -%}SYS={{ ns.system.upper() }}|{%- for m in rest -%}{{ m.role.title() }}:{{ m.content.split(' ') | length }}:{{ m.content.startswith('Hi') }};{%- endfor -%}";

fn user(text: &str) -> ChatMessage {
    ChatMessage::user(text)
}

#[test]
fn llama3_template() {
    let tpl = ChatTemplate::new(
        LLAMA3,
        Some("<|begin_of_text|>".into()),
        Some("<|eot_id|>".into()),
    )
    .unwrap();
    assert!(tpl.renders_bos());
    let text = tpl
        .render(&[ChatMessage::system("  Be kind.  "), user("Hi")], true)
        .unwrap();
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn mistral_template_and_raise_exception() {
    let tpl = ChatTemplate::new(MISTRAL, Some("<s>".into()), Some("</s>".into())).unwrap();
    assert!(tpl.renders_bos());
    let text = tpl
        .render(
            &[user("Hi"), ChatMessage::assistant("Hello!"), user("Bye")],
            false,
        )
        .unwrap();
    assert_eq!(text, "<s>[INST] Hi [/INST]Hello!</s>[INST] Bye [/INST]");
    let err = tpl.render(&[user("a"), user("b")], false).unwrap_err();
    match err {
        ModelError::ChatTemplate(message) => {
            assert!(message.contains("must alternate"), "{message}")
        }
        other => panic!("expected a chat template error, got {other:?}"),
    }
}

#[test]
fn zephyr_template_whitespace_matches_transformers() {
    let tpl = ChatTemplate::new(ZEPHYR, Some("<s>".into()), Some("</s>".into())).unwrap();
    assert!(!tpl.renders_bos());
    let text = tpl
        .render(&[ChatMessage::system("You are a bot."), user("Hi")], true)
        .unwrap();
    assert_eq!(
        text,
        "<|system|>\nYou are a bot.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    );
}

#[test]
fn python_methods_work() {
    let tpl = ChatTemplate::new(PYTHONIC, None, None).unwrap();
    let text = tpl
        .render(
            &[
                ChatMessage::system(" rules "),
                user("Hi there you"),
                ChatMessage::assistant("ok"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(text, "SYS=RULES|User:3:True;Assistant:1:False;");
}

#[test]
fn chat_message_serde() {
    let m: ChatMessage = serde_json::from_str(r#"{"role":"user","content":"Hi"}"#).unwrap();
    assert_eq!(m, user("Hi"));
    assert_eq!(
        serde_json::to_string(&m).unwrap(),
        r#"{"role":"user","content":"Hi"}"#
    );
}

/// A copy of stories260K's hf/ directory (tokenizer.json only) to add side files to.
fn stories_dir_copy() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let json = common::shared_model("stories260K/hf/tokenizer.json");
    std::fs::copy(json, tmp.path().join("tokenizer.json")).unwrap();
    let dir = tmp.path().to_path_buf();
    (tmp, dir)
}

fn write_json(path: &Path, value: serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
}

#[test]
fn tokenizer_config_template_and_special_tokens() {
    let (_tmp, dir) = stories_dir_copy();
    write_json(
        &dir.join("tokenizer_config.json"),
        serde_json::json!({
            "add_bos_token": true,
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": ZEPHYR,
        }),
    );
    let tok = Tokenizer::for_model(&dir, None).unwrap();
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    assert!(tok.add_bos_default());
    let tpl = tok.chat_template().unwrap();
    assert_eq!(tpl.eos_token(), Some("</s>"));
    let prompt = tpl.render(&[user("Hi")], true).unwrap();
    assert_eq!(prompt, "<|user|>\nHi</s>\n<|assistant|>\n");
    let ids = tok.encode(&prompt, !tpl.renders_bos()).unwrap();
    assert_eq!(ids[0], 1);
    assert!(
        ids.contains(&2),
        "</s> in the prompt is the EOS id: {ids:?}"
    );
}

#[test]
fn template_files_and_model_config_ids() {
    let (_tmp, dir) = stories_dir_copy();
    // Named templates (older transformers): the "default" one is used.
    write_json(
        &dir.join("tokenizer_config.json"),
        serde_json::json!({
            "add_bos_token": false,
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "DEFAULT {{ messages[0]['content'] }}"},
            ],
        }),
    );
    write_json(
        &dir.join("config.json"),
        serde_json::json!({"bos_token_id": 1, "eos_token_id": [2, 0]}),
    );
    let tok = Tokenizer::for_model(&dir, None).unwrap();
    assert!(!tok.add_bos_default());
    assert_eq!(
        tok.encode("Hi", true).unwrap(),
        tok.encode("Hi", false).unwrap()
    );
    assert_eq!(tok.eos_ids(), &[2, 0]);
    assert_eq!(
        tok.chat_template()
            .unwrap()
            .render(&[user("x")], false)
            .unwrap(),
        "DEFAULT x"
    );

    // chat_template.jinja is used when tokenizer_config.json has none.
    write_json(&dir.join("tokenizer_config.json"), serde_json::json!({}));
    std::fs::write(dir.join("chat_template.jinja"), "J {{ messages | length }}").unwrap();
    let tok = Tokenizer::for_model(&dir.join("tokenizer.json"), None).unwrap();
    assert_eq!(
        tok.chat_template()
            .unwrap()
            .render(&[user("x")], true)
            .unwrap(),
        "J 1"
    );
}

/// Without add_bos_token, a tokenizer.json whose post-processor prepends BOS (Llama 3 style) means "add BOS".
#[test]
fn post_processor_decides_bos_when_config_is_silent() {
    let (_tmp, dir) = stories_dir_copy();
    let json_path = dir.join("tokenizer.json");
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    let tok = Tokenizer::from_file(&json_path).unwrap();
    assert!(
        !tok.add_bos_default(),
        "no config and no post-processor: no BOS"
    );
    assert_eq!(tok.bos_id(), Some(1), "<s> is found by name");

    spec["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    });
    write_json(&json_path, spec);
    let tok = Tokenizer::from_file(&json_path).unwrap();
    assert!(tok.add_bos_default());
    let ids = tok.encode("Hi", true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1);
    assert_eq!(&ids[1..], &tok.encode("Hi", false).unwrap()[..]);
}

#[test]
fn broken_template_is_dropped_not_fatal() {
    let (_tmp, dir) = stories_dir_copy();
    write_json(
        &dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": "{% for m in messages %}unterminated"}),
    );
    let tok = Tokenizer::for_model(&dir, None).unwrap();
    assert!(tok.chat_template().is_none());
    assert_eq!(
        tok.decode(&tok.encode("still works", false).unwrap(), true)
            .unwrap(),
        "still works"
    );
}
