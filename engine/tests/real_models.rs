//! A real pretrained model end to end: SmolLM2-135M-Instruct as a Q4_1/Q8_0 GGUF file is
//! imported, its tokenizer rebuilt, its perplexity and a greedy continuation checked, and a
//! few fine-tuning steps on real competition math problems run on the CPU.
//!
//! The material is fetched (never committed) by `scripts/fetch_test_assets.sh`; every test here
//! fails, naming that script, when it is missing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;
use sluice_engine::backend::cpu::Cpu;
use sluice_engine::convert::import_gguf;
use sluice_engine::data::{DatasetSource, Tokenizer};
use sluice_engine::generate::{GenerateOptions, Generator, PromptStyle};
use sluice_engine::model::HostParams;
use sluice_engine::optim::Schedule;
use sluice_engine::train::{Devices, Event, Job, JobSettings, ModelSource, Observer, RunOptions};
use sluice_engine::weights::gguf::{GgufFile, MetaValue};

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/test-assets")
}

fn asset(relative: &str) -> PathBuf {
    let path = assets().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch_test_assets.sh to fetch the test assets",
        path.display()
    );
    path
}

fn gguf_path() -> PathBuf {
    asset("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The imported model folder, made once per test run.
fn imported() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, path) = DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().expect("temp dir");
        let out = tmp.path().join("smollm2");
        import_gguf(&gguf_path(), &out).expect("SmolLM2 imports");
        (tmp, out)
    });
    path
}

fn generator() -> &'static Generator {
    static GEN: OnceLock<Generator> = OnceLock::new();
    GEN.get_or_init(|| Generator::load_dir(imported()).expect("the imported folder loads"))
}

/// Plain English sentences for perplexity.
const SENTENCES: [&str; 4] = [
    "The sun rises in the east and sets in the west.",
    "Water is made of hydrogen and oxygen atoms.",
    "She opened the door and walked into the kitchen to make some tea.",
    "Many people enjoy reading books before they go to sleep at night.",
];

/// exp of the mean negative log-likelihood of every token after the first.
fn perplexity(g: &Generator, sentences: &[&str]) -> f64 {
    let tok = g.tokenizer().expect("tokenizer");
    let vocab = g.spec().vocab;
    let (mut nll, mut count) = (0.0f64, 0usize);
    for s in sentences {
        let ids = tok.encode(s).expect("encodes").ids;
        let logits = g.logits(&mut g.cache(), &ids).expect("forward");
        for (t, &next) in ids.iter().enumerate().skip(1) {
            let row = &logits[(t - 1) * vocab..t * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max as f64 + row.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln();
            nll += lse - row[next as usize] as f64;
            count += 1;
        }
    }
    (nll / count as f64).exp()
}

#[test]
fn imported_smollm2_has_low_perplexity_and_a_random_one_does_not() {
    let g = generator();
    let ppl = perplexity(g, &SENTENCES);
    println!("SmolLM2-135M-Instruct (Q4_1 GGUF, imported) perplexity: {ppl:.2}");
    assert!(ppl < 40.0, "perplexity {ppl} of the imported model is too high");

    let spec = g.spec().clone();
    let random = HostParams::random(&spec, 0);
    let tokenizer = Tokenizer::from_dir(imported()).expect("tokenizer");
    let r = Generator::new(spec.clone(), random, Some(tokenizer)).expect("generator");
    let random_ppl = perplexity(&r, &SENTENCES[..1]);
    println!("random model of the same shape: {random_ppl:.0} (vocabulary {})", spec.vocab);
    assert!(random_ppl > spec.vocab as f64 / 3.0, "random model perplexity {random_ppl}");
}

#[test]
fn greedy_continuation_of_the_capital_of_france_is_paris() {
    let g = generator();
    let prompt = g.prompt_ids("The capital of France is", PromptStyle::Plain).expect("prompt");
    let out = g.generate(&prompt, &GenerateOptions::greedy(4), &mut |_| true).expect("generates");
    let text = g.decode(&out.ids).expect("decodes");
    println!("continuation: {text:?}");
    assert!(text.starts_with(" Paris"), "continuation {text:?}");
}

#[test]
fn chat_generation_answers_and_stops_at_the_end_of_turn() {
    let g = generator();
    let prompt = g.prompt_ids("What is the capital of France?", PromptStyle::Chat).expect("chat");
    let text = g.decode(&prompt).expect("decodes");
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");
    let out = g.generate(&prompt, &GenerateOptions::greedy(40), &mut |_| true).expect("generates");
    let answer = g.decode(&out.ids).expect("decodes");
    println!("chat answer: {answer:?}");
    assert!(answer.contains("Paris"), "{answer:?}");
    assert!(out.stopped_at_eos, "no <|im_end|> within 40 tokens: {answer:?}");
}

#[test]
fn import_writes_config_and_tokenizer_files() {
    let dir = imported();
    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["num_hidden_layers"], 30);
    assert_eq!(config["hidden_size"], 576);
    assert_eq!(config["num_attention_heads"], 9);
    assert_eq!(config["num_key_value_heads"], 3);
    assert_eq!(config["vocab_size"], 49152);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["rms_norm_eps"], 1e-5);
    let tok = Tokenizer::from_dir(dir).expect("tokenizer");
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_id(), Some(2));
    assert!(tok.chat_template().is_some_and(|t| t.contains("<|im_start|>")));
    assert_eq!(tok.encode("<|im_start|>user").expect("encodes").ids[0], 1);
}

// --- tokenizer against an independent byte-level BPE ------------------------------------------

/// GPT-2's byte-to-character table (`bytes_to_unicode` in openai/gpt-2's encoder.py).
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).expect("valid char")
        })
        .collect()
}

/// GPT-2's split `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
/// written out by hand.
fn gpt2_split(s: &str) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let class = |c: char| {
        if c.is_alphabetic() {
            0
        } else if c.is_numeric() {
            1
        } else if c.is_whitespace() {
            3
        } else {
            2
        }
    };
    while i < chars.len() {
        let rest: String = chars[i..].iter().collect();
        if let Some(c) =
            ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"].iter().find(|c| rest.starts_with(**c))
        {
            out.push(c.to_string());
            i += c.chars().count();
            continue;
        }
        let start = i;
        let body = if chars[i] == ' ' && i + 1 < chars.len() && class(chars[i + 1]) != 3 {
            i + 1
        } else {
            i
        };
        let k = class(chars[body]);
        if k != 3 {
            let mut j = body;
            while j < chars.len() && class(chars[j]) == k {
                j += 1;
            }
            out.push(chars[start..j].iter().collect());
            i = j;
            continue;
        }
        let mut j = i;
        while j < chars.len() && class(chars[j]) == 3 {
            j += 1;
        }
        // `\s+(?!\S)` leaves the last space to the word that follows.
        if j < chars.len() && j - i > 1 {
            j -= 1;
        }
        out.push(chars[i..j].iter().collect());
        i = j;
    }
    out
}

/// SmolLM2's pre-tokenization: every digit alone, then GPT-2's split of what is between.
fn smollm_split(s: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut current = String::new();
    for c in s.chars() {
        if c.is_numeric() {
            if !current.is_empty() {
                pieces.push(std::mem::take(&mut current));
            }
            pieces.push(c.to_string());
        } else {
            current.push(c);
        }
    }
    if !current.is_empty() {
        pieces.push(current);
    }
    pieces.iter().flat_map(|p| gpt2_split(p)).collect()
}

/// Byte-level BPE straight from the GGUF vocabulary and merges: merge the adjacent pair of
/// lowest rank (leftmost first) until none is in the merge table.
fn reference_encode(
    text: &str,
    vocab: &HashMap<String, u32>,
    ranks: &HashMap<(String, String), usize>,
) -> Vec<u32> {
    let table = byte_chars();
    let mut ids = Vec::new();
    for piece in smollm_split(text) {
        let mut symbols: Vec<String> =
            piece.bytes().map(|b| table[b as usize].to_string()).collect();
        loop {
            let best = (0..symbols.len().saturating_sub(1))
                .filter_map(|i| {
                    ranks.get(&(symbols[i].clone(), symbols[i + 1].clone())).map(|r| (*r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let merged = format!("{}{}", symbols[i], symbols[i + 1]);
            symbols.splice(i..i + 2, [merged]);
        }
        ids.extend(
            symbols.iter().map(|s| *vocab.get(s).unwrap_or_else(|| panic!("{s:?} not in vocab"))),
        );
    }
    ids
}

#[test]
fn rebuilt_tokenizer_matches_bpe_run_directly_on_the_gguf_vocabulary() {
    let file = GgufFile::open(gguf_path()).expect("opens");
    let strings = |key: &str| -> Vec<String> {
        file.get(key)
            .and_then(MetaValue::as_array)
            .unwrap_or_else(|| panic!("{key}"))
            .iter()
            .map(|v| v.as_str().expect("string").to_string())
            .collect()
    };
    let vocab: HashMap<String, u32> = strings("tokenizer.ggml.tokens")
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i as u32))
        .collect();
    let ranks: HashMap<(String, String), usize> = strings("tokenizer.ggml.merges")
        .into_iter()
        .enumerate()
        .map(|(r, m)| {
            let (a, b) = m.split_once(' ').expect("merge is two tokens");
            ((a.to_string(), b.to_string()), r)
        })
        .collect();
    assert_eq!(file.get("tokenizer.ggml.pre").and_then(MetaValue::as_str), Some("smollm"));

    let tok = Tokenizer::from_dir(imported()).expect("tokenizer");
    let samples = [
        "Hello world",
        "The capital of France is Paris.",
        "I'll pay $1,234.56 for 3 apples, won't I?",
        "  leading spaces and\ttabs\n\nnew lines   ",
        "Café, naïve, résumé, Ærøskøbing, señor, Straße",
        "Emoji: 🎉🚀 and 👩‍👩‍👧 family, ❤️",
        "日本語のテキスト, 中文文本, Ελληνικά, русский",
        "def f(x):\n    return x**2 + 10",
    ];
    for s in samples {
        let want = reference_encode(s, &vocab, &ranks);
        let got = tok.encode(s).expect("encodes").ids;
        assert_eq!(got, want, "ids of {s:?}");
        assert_eq!(tok.decode(&got).expect("decodes"), s, "round trip of {s:?}");
    }
}

// --- a few fine-tuning steps on champ ---------------------------------------------------------

/// Champ problems as OpenAI `messages` records: the problem as the user turn, the solution
/// steps joined as the assistant turn. Keeps the `count` shortest problems (by text length) so
/// a 256-token row holds most of each.
fn champ_messages(count: usize) -> Vec<Value> {
    let path = asset("champ/v0.json");
    let root: Value = serde_json::from_slice(&std::fs::read(&path).expect("reads")).expect("json");
    let problems = root["problems"].as_object().expect("problems object");
    let mut records: Vec<(usize, Value)> = problems
        .values()
        .filter_map(|p| {
            let problem = p["_text"].as_str()?;
            let steps: Vec<&str> = p["solution"]["steps"]
                .as_array()?
                .iter()
                .filter_map(|s| s["_text"].as_str())
                .collect();
            let solution = steps.join("\n");
            let record = serde_json::json!({"messages": [
                {"role": "user", "content": problem},
                {"role": "assistant", "content": solution},
            ]});
            Some((problem.len() + solution.len(), record))
        })
        .collect();
    assert!(records.len() >= 200, "champ has {} problems", records.len());
    records.sort_by_key(|(len, r)| (*len, r.to_string()));
    records.into_iter().take(count).map(|(_, r)| r).collect()
}

struct Losses(Vec<f64>);

impl Observer for Losses {
    fn event(&mut self, event: &Event) {
        if let Event::Step(m) = event {
            self.0.push(m.loss);
        }
    }
    fn keep_going(&mut self) -> bool {
        true
    }
}

#[test]
fn fine_tuning_on_champ_lowers_the_training_loss() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let data = tmp.path().join("champ.jsonl");
    let lines: Vec<String> = champ_messages(3).iter().map(Value::to_string).collect();
    std::fs::write(&data, lines.join("\n") + "\n").expect("writes");
    let job = Job {
        model: ModelSource::Dir(imported().to_path_buf()),
        data: DatasetSource::File(data),
        eval_data: None,
        devices: Devices::Cpu,
        settings: JobSettings {
            seq_len: 256,
            micro_batch: 1,
            grad_accum: 1,
            steps: Some(4),
            lr: Some(1e-4),
            schedule: Schedule::Constant,
            ..JobSettings::default()
        },
    };
    let options =
        RunOptions::unplanned(job, tmp.path().join("run")).expect("a plan-free placement");
    let mut losses = Losses(Vec::new());
    let summary =
        sluice_engine::train::run(&Cpu::new(), &options, false, &mut losses).expect("trains");
    let l = &losses.0;
    println!("champ fine-tune losses: {l:?} over {} rows", summary.data.rows);
    assert_eq!(l.len(), 4);
    // Steps walk the rows and wrap around: a step that sees a row again must score it lower.
    let rows = summary.data.rows;
    assert!(rows < 4, "expected fewer rows than steps, got {rows}");
    for later in rows..4 {
        let earlier = later - rows;
        assert!(
            l[later] < l[earlier],
            "step {later} loss {} vs step {earlier} loss {}",
            l[later],
            l[earlier]
        );
    }
    assert!(summary.final_checkpoint.join("config.json").exists());
}
