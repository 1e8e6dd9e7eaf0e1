//! Chat templates rendered in Hugging Face's dialect: ChatML, Qwen3 and Llama 3 templates,
//! the assistant spans they yield, and a template's own `raise_exception`.

use super::*;
use crate::data::tokenizer::tiny_tokenizer;

fn user(s: &str) -> Message {
    Message::new(Role::User, s)
}
fn assistant(s: &str) -> Message {
    Message::new(Role::Assistant, s)
}
fn system(s: &str) -> Message {
    Message::new(Role::System, s)
}

pub(crate) fn qwen3_tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../.cache/test-assets/tokenizer-qwen3/package/models");
    assert!(
        dir.join("tokenizer_config.json").is_file(),
        "missing {}: run scripts/fetch_test_assets.sh",
        dir.display()
    );
    Tokenizer::from_dir(dir).unwrap()
}

fn template(source: &str, bos: Option<&str>, eos: Option<&str>) -> ChatTemplate {
    let tokens = SpecialTokens {
        bos_token: bos.map(str::to_owned),
        eos_token: eos.map(str::to_owned),
        ..SpecialTokens::default()
    };
    ChatTemplate::new(source, tokens, "test-template").unwrap()
}

/// The text of each assistant span.
fn span_texts(rendered: &Rendered) -> Vec<&str> {
    rendered.assistant_spans.iter().map(|s| &rendered.text[s.clone()]).collect()
}

#[test]
fn tiny_chatml_renders_and_spans_assistant_turns() {
    let tok = tiny_tokenizer().unwrap();
    let t = ChatTemplate::from_tokenizer(&tok).unwrap().unwrap();
    let conversation =
        [user("What is 2 + 2?"), assistant("4."), user("And 3 + 3?"), assistant("6.")];
    let rendered = t.render_with_spans(&conversation).unwrap();
    assert_eq!(
        rendered.text,
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n\
         <|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n6.<|im_end|>\n"
    );
    assert_eq!(span_texts(&rendered), vec!["4.<|im_end|>\n", "6.<|im_end|>\n"]);

    // System message optional: none is invented, one given is rendered first.
    assert_eq!(
        t.render(&[system("Be brief."), user("Hi")], true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn qwen3_template_multi_turn_with_and_without_system() {
    let tok = qwen3_tokenizer();
    let t = ChatTemplate::from_tokenizer(&tok).unwrap().unwrap();

    assert_eq!(
        t.render(&[user("Hi")], true).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t.render(&[user("Hi")], false).unwrap(), "<|im_start|>user\nHi<|im_end|>\n");

    let with_system = [system("S"), user("U1"), assistant("A1"), user("U2"), assistant("A2")];
    let rendered = t.render_with_spans(&with_system).unwrap();
    // Qwen3 writes an empty think block only into the last assistant turn.
    assert_eq!(
        rendered.text,
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n\
         <|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n"
    );
    assert_eq!(
        span_texts(&rendered),
        vec!["A1<|im_end|>\n", "<think>\n\n</think>\n\nA2<|im_end|>\n"]
    );

    let without_system = [user("U1"), assistant("A1"), user("U2"), assistant("A2")];
    let rendered = t.render_with_spans(&without_system).unwrap();
    assert!(rendered.text.starts_with("<|im_start|>user\nU1<|im_end|>\n"));
    assert_eq!(
        span_texts(&rendered),
        vec!["A1<|im_end|>\n", "<think>\n\n</think>\n\nA2<|im_end|>\n"]
    );
}

#[test]
fn qwen3_drops_earlier_reasoning_and_spans_still_follow_the_final_text() {
    let t = ChatTemplate::from_tokenizer(&qwen3_tokenizer()).unwrap().unwrap();
    let conversation = [
        user("U1"),
        assistant("<think>\nfirst I add\n</think>\n\nA1"),
        user("U2"),
        assistant("<think>\ncarry the one\n</think>\n\nA2"),
    ];
    let rendered = t.render_with_spans(&conversation).unwrap();
    assert!(!rendered.text.contains("first I add"), "{}", rendered.text);
    assert_eq!(
        span_texts(&rendered),
        vec!["A1<|im_end|>\n", "<think>\ncarry the one\n</think>\n\nA2<|im_end|>\n"]
    );

    // The reply also appears in the user's message before it: the span is still the reply's.
    let echo = [user("Say: ok"), assistant("ok"), user("Again"), assistant("ok")];
    let rendered = t.render_with_spans(&echo).unwrap();
    assert_eq!(
        span_texts(&rendered),
        vec!["ok<|im_end|>\n", "<think>\n\n</think>\n\nok<|im_end|>\n"]
    );
    let first = rendered.assistant_spans[0].start;
    assert!(rendered.text[..first].ends_with("<|im_start|>assistant\n"), "{}", rendered.text);

    // A reply the template does not write at all is an error, not a wrong mask.
    let hiding = template(
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}",
        None,
        None,
    );
    let err = hiding
        .render_with_spans(&[user("q"), assistant("secret"), user("q2"), assistant("a2")])
        .unwrap_err();
    assert!(
        err.to_string().contains("assistant message 2 is not in the rendered chat template"),
        "{err}"
    );
}

const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}\
{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

#[test]
fn llama3_style_template() {
    let t = template(LLAMA3, Some("<|begin_of_text|>"), Some("<|eot_id|>"));
    let rendered =
        t.render_with_spans(&[system("Sys"), user(" Hi "), assistant("Hello!\n")]).unwrap();
    assert_eq!(
        rendered.text,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nSys<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    );
    assert_eq!(span_texts(&rendered), vec!["Hello!<|eot_id|>"]);
}

#[test]
fn raise_exception_surfaces_the_templates_message() {
    let t = template(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m.content }}{% endfor %}",
        None,
        None,
    );
    assert_eq!(t.render(&[user("fine")], false).unwrap(), "fine");
    let err = t.render(&[system("no"), user("x")], false).unwrap_err().to_string();
    assert!(err.contains("System role not supported"), "{err}");
    let err =
        t.render_with_spans(&[system("no"), user("x"), assistant("y")]).unwrap_err().to_string();
    assert!(err.contains("System role not supported"), "{err}");
}

#[test]
fn hf_dialect_filters_functions_and_whitespace() {
    // trim_blocks and lstrip_blocks: block tags leave no newline or indentation behind.
    let t = template(
        "{% for m in messages %}\n    {% if loop.index0 >= 2 %}{% break %}{% endif %}\n[{{ m.content }}]\n{% endfor %}",
        None,
        None,
    );
    assert_eq!(t.render(&[user("a"), user("b"), user("c")], false).unwrap(), "[a]\n[b]\n");

    let t = template(
        "{{ {'b': [1, 'é'], 'a': none} | tojson }}|{{ {'k': 1} | tojson(indent=2) }}",
        None,
        None,
    );
    assert_eq!(t.render(&[], false).unwrap(), "{\"b\": [1, \"é\"], \"a\": null}|{\n  \"k\": 1\n}");

    let t = template(
        "{{ messages[0].content.strip().upper().split(',')[-1] }}|{{ tools is none }}|{{ bos_token is defined }}",
        None,
        None,
    );
    assert_eq!(t.render(&[user("  x,yz ")], false).unwrap(), "YZ|True|False");

    let t = template("{{ strftime_now('%Y') | length }}", None, None);
    assert_eq!(t.render(&[], false).unwrap(), "4");

    let err =
        ChatTemplate::new("{% for %}", SpecialTokens::default(), "broken").unwrap_err().to_string();
    assert!(err.contains("does not compile"), "{err}");
}

#[test]
fn strftime_formats_known_instants() {
    assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
    // 2023-11-14 22:13:20 UTC, a Tuesday, day 318.
    assert_eq!(
        strftime("%A %a %B %-d %m %y %H:%M:%S %j %%", 1_700_000_000).unwrap(),
        "Tuesday Tue November 14 11 23 22:13:20 318 %"
    );
    // 2024-02-29, a leap day.
    assert_eq!(strftime("%Y-%m-%d", 1_709_164_800).unwrap(), "2024-02-29");
    assert!(strftime("%Q", 0).is_err());
}
