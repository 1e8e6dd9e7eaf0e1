//! The scoring functions of task evaluation: pure functions from a model's output, a reference
//! and a few numbers to a score. No model, no I/O.
//!
//! A score is only worth reporting if it can be set beside a published one, so each function
//! follows the implementation those numbers come from and says which:
//!
//! - [`normalize`], [`exact_match`], [`contains`]: `normalize_answer` of SQuAD's evaluation
//!   script, with Unicode punctuation removed as well as ASCII.
//! - [`Extractor`], [`answers_agree`], [`extracted_match`]: final answers pulled out of free text
//!   (GSM8K's `#### 42`, the last number, `\boxed{...}`, a user's pattern) and compared as numbers
//!   where both are numbers.
//! - [`rouge_l`]: Google's `rouge-score` package, `RougeScorer(["rougeL"])`.
//! - [`sentence_bleu`], [`corpus_bleu`]: sacrebleu 2.x with its defaults (tokenizer 13a).
//! - [`pick_choice`]: lm-evaluation-harness 0.4's `acc` and `acc_norm` for multiple choice.
//! - [`perplexity`]: `exp` of the mean negative log-likelihood.
//!
//! The Python references split text with `str.split()`, which breaks on a slightly wider set of
//! characters than Rust's `split_whitespace`; `is_py_space` is that set, used wherever a
//! reference splits, so token counts agree with theirs on any input.
//!
//! Every function takes any text without panicking: degenerate input (empty, punctuation only,
//! no answer) scores 0, and only misuse of the API (mismatched lengths, NaN) is an error.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::LazyLock;

use regex::{Regex, RegexBuilder};

use crate::error::{Error, Result};

/// Python's `str.isspace`, the separator set of `str.split()` and `str.rstrip()`: Unicode
/// White_Space plus the ASCII information separators U+001C to U+001F, which Python counts as
/// space and Rust does not.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `text.split()`: the non-empty runs between [`is_py_space`] characters.
fn py_split(text: &str) -> impl Iterator<Item = &str> {
    text.split(is_py_space).filter(|word| !word.is_empty())
}

fn score(hit: bool) -> f64 {
    if hit { 1.0 } else { 0.0 }
}

// ---------------------------------------------------------------------------------------------
// Normalised text: SQuAD's exact match and containment.

/// ASCII punctuation as Python's `string.punctuation` lists it (which SQuAD removes; it includes
/// symbols such as `$`, `+` and `|`) and every Unicode punctuation character (general category
/// P: dashes, curly quotes, `¿`, `。`). Compiled once; `None` only if the pattern itself were
/// wrong, which a test rules out.
static PUNCTUATION: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"[[:punct:]\p{P}]").ok());

/// SQuAD-style normalisation, as `normalize_answer` in SQuAD's evaluation script: lowercase,
/// punctuation removed (not replaced by a space, so "don't" is "dont"), the articles "a", "an"
/// and "the" removed as whole words, whitespace collapsed to single spaces, trimmed.
///
/// Beyond SQuAD, Unicode punctuation is removed too (model outputs carry em dashes and curly
/// quotes that ASCII-only removal would keep), and words are whitespace-separated, which after
/// punctuation is gone is what SQuAD's `\b(a|an|the)\b` amounts to for ordinary text.
pub fn normalize(text: &str) -> String {
    let lower = text.to_lowercase();
    let unpunctuated = match PUNCTUATION.as_ref() {
        Some(punctuation) => punctuation.replace_all(&lower, ""),
        None => Cow::Owned(lower.chars().filter(|c| !c.is_ascii_punctuation()).collect()),
    };
    py_split(&unpunctuated)
        .filter(|word| !matches!(*word, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// 1.0 when `normalize(output) == normalize(reference)`, else 0.0. As in SQuAD, two texts that
/// both normalise to nothing are equal.
pub fn exact_match(output: &str, reference: &str) -> f64 {
    score(normalize(output) == normalize(reference))
}

/// 1.0 when the normalised reference appears in the normalised output as whole words ("4" is
/// not in "42", "new york" is in "i love new york city"), else 0.0. A reference that normalises
/// to nothing scores 0.0: the empty string is in every output, so it would reward anything.
pub fn contains(output: &str, reference: &str) -> f64 {
    let reference = normalize(reference);
    if reference.is_empty() {
        return 0.0;
    }
    // Both sides are single-space separated, so padding them makes the search word-aligned.
    score(format!(" {} ", normalize(output)).contains(&format!(" {reference} ")))
}

// ---------------------------------------------------------------------------------------------
// Extracted answers.

/// The most a user's answer pattern may compile to. The regex crate matches in time linear in
/// the text, so a hostile pattern can only cost memory and compile time, both bounded by this.
const ANSWER_PATTERN_SIZE_LIMIT: usize = 1 << 20;

/// How a final answer is pulled out of a model's output.
#[derive(Debug, Clone)]
pub enum Extractor {
    /// GSM8K's `#### 42` line: the text after the last `####`, up to the end of its line,
    /// trimmed. GSM8K's references end this way, and models trained on it answer this way.
    Gsm8k,
    /// The last number in the text: digits with an optional `-` sign, `,` thousands separators
    /// (`1,234,567`, groups of exactly three digits) and an optional decimal part (`3.5`). The
    /// number is returned as written; [`answers_agree`] reads it.
    LastNumber,
    /// The contents of the last `\boxed{...}`, trimmed, with braces counted so nested groups
    /// (`\boxed{\frac{1}{2}}`) are kept whole. Braces are counted as written, escaped or not, as
    /// lm-evaluation-harness's `last_boxed_only_string` does; unlike it, `\fbox{}` and the
    /// brace-less `\boxed 5` are not read.
    Boxed,
    /// A user's regular expression: its first capture group if it has one, else the whole
    /// match. The last match in the text wins, since models tend to state the final answer last.
    Regex(Regex),
}

impl Extractor {
    /// Compiles a user's answer pattern. An invalid one, or one that compiles to more than 1 MiB
    /// (a hostile pattern), is [`Error::Invalid`] naming the setting.
    pub fn regex(pattern: &str) -> Result<Extractor> {
        RegexBuilder::new(pattern)
            .size_limit(ANSWER_PATTERN_SIZE_LIMIT)
            .build()
            .map(Extractor::Regex)
            .map_err(|e| {
                Error::invalid(format!(
                    "answer_pattern: the regular expression does not compile: {e}"
                ))
            })
    }

    /// An extractor from its setting word: `gsm8k`, `last_number` or `boxed` (a pattern goes
    /// through [`Extractor::regex`]).
    pub fn named(name: &str) -> Result<Extractor> {
        match name {
            "gsm8k" => Ok(Extractor::Gsm8k),
            "last_number" => Ok(Extractor::LastNumber),
            "boxed" => Ok(Extractor::Boxed),
            _ => Err(Error::invalid(format!(
                "answer extractor {name:?}: expected one of gsm8k, last_number, boxed"
            ))),
        }
    }

    /// The answer in `text`, or `None` when it has none (no `####`, no number, no complete
    /// `\boxed{}`, no match, or an empty one for the first three).
    pub fn extract(&self, text: &str) -> Option<String> {
        match self {
            Extractor::Gsm8k => gsm8k_answer(text),
            Extractor::LastNumber => last_number(text),
            Extractor::Boxed => last_boxed(text),
            Extractor::Regex(pattern) => {
                let captures = pattern.captures_iter(text).last()?;
                let group = if pattern.captures_len() > 1 { 1 } else { 0 };
                // An optional group that did not take part in the last match gives no answer.
                captures.get(group).map(|m| m.as_str().to_string())
            }
        }
    }
}

fn non_empty(text: &str) -> Option<String> {
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

fn gsm8k_answer(text: &str) -> Option<String> {
    let (_, after) = text.rsplit_once("####")?;
    let line = after.find(['\n', '\r']).and_then(|end| after.get(..end)).unwrap_or(after);
    non_empty(line)
}

/// The last number of `text` as written, found by a scan over its bytes (every byte a number is
/// made of is ASCII, so each boundary found is a character boundary).
fn last_number(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let digit_at = |i: usize| bytes.get(i).is_some_and(u8::is_ascii_digit);
    let digits_from = |mut i: usize| {
        while digit_at(i) {
            i += 1;
        }
        i
    };
    let mut last = None;
    let mut i = 0;
    while i < bytes.len() {
        if !digit_at(i) {
            i += 1;
            continue;
        }
        let start = i;
        let mut end = digits_from(start);
        // Thousands groups only after a lead of one to three digits, each of exactly three
        // digits: "1,234,567" is one number, "1,2,3" and "2020,100" are several.
        if end - start <= 3 {
            while bytes.get(end) == Some(&b',')
                && (end + 1..end + 4).all(digit_at)
                && !digit_at(end + 4)
            {
                end += 4;
            }
        }
        if bytes.get(end) == Some(&b'.') && digit_at(end + 1) {
            end = digits_from(end + 1);
        }
        // A `-` is a sign unless it joins two words or numbers ("3-5", "x-1").
        let signed = start >= 1
            && bytes.get(start - 1) == Some(&b'-')
            && !(start >= 2 && bytes.get(start - 2).is_some_and(u8::is_ascii_alphanumeric));
        last = Some((if signed { start - 1 } else { start }, end));
        i = end;
    }
    let (from, to) = last?;
    text.get(from..to).map(str::to_string)
}

fn last_boxed(text: &str) -> Option<String> {
    const OPEN: &str = "\\boxed{";
    let start = text.rfind(OPEN)? + OPEN.len();
    let inside = text.get(start..)?;
    let mut depth = 1usize;
    for (i, c) in inside.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return non_empty(inside.get(..i)?);
                }
            }
            _ => {}
        }
    }
    // Unbalanced: the output was cut inside its answer, which is no answer.
    None
}

/// `text` as a plain decimal number after stripping `$`, `,`, surrounding spaces and one
/// trailing `.` (the end of a sentence). Only digits with an optional sign and decimal point
/// count: Rust's float parser would also take "inf", "NaN" and "1e5", which are not answers
/// written as numbers.
fn as_number(text: &str) -> Option<f64> {
    let cleaned: String = text.chars().filter(|c| !matches!(c, '$' | ',')).collect();
    let cleaned = cleaned.trim();
    let cleaned = cleaned.strip_suffix('.').unwrap_or(cleaned);
    let unsigned = cleaned.strip_prefix(['-', '+']).unwrap_or(cleaned);
    let (whole, fraction) = unsigned.split_once('.').unwrap_or((unsigned, ""));
    let plain = !(whole.is_empty() && fraction.is_empty())
        && whole.bytes().all(|b| b.is_ascii_digit())
        && fraction.bytes().all(|b| b.is_ascii_digit());
    if !plain {
        return None;
    }
    cleaned.parse::<f64>().ok().filter(|x| x.is_finite())
}

/// Whether two extracted answers agree: numerically when both read as numbers ("42", "42.0",
/// "42.00", "$42" and "42." are all 42; every `$` and `,` is dropped, so "1,234" is 1234), with a
/// relative tolerance of 1e-9 as Python's `math.isclose`; else as equal [`normalize`]d text.
/// Text that normalises to nothing agrees with nothing: two empty answers are no evidence of a
/// right one.
pub fn answers_agree(a: &str, b: &str) -> bool {
    if let (Some(x), Some(y)) = (as_number(a), as_number(b)) {
        return x == y || (x - y).abs() <= 1e-9 * x.abs().max(y.abs());
    }
    let a = normalize(a);
    !a.is_empty() && a == normalize(b)
}

/// 1.0 when the answer extracted from `output` agrees ([`answers_agree`]) with the reference's.
/// The reference's answer is extracted the same way when that yields one (GSM8K references end
/// in `#### 72`), else the whole trimmed reference is the answer (a dataset's bare "72"). An
/// output with no answer scores 0.0.
pub fn extracted_match(extractor: &Extractor, output: &str, reference: &str) -> f64 {
    let Some(answer) = extractor.extract(output) else {
        return 0.0;
    };
    let expected = extractor.extract(reference).unwrap_or_else(|| reference.trim().to_string());
    score(answers_agree(&answer, &expected))
}

// ---------------------------------------------------------------------------------------------
// ROUGE-L.

/// rouge-score's default tokenizer (`tokenize.py`, no stemmer): lowercase, every character other
/// than `[a-z0-9]` is a separator. Lowercasing first matters beyond ASCII: the Kelvin sign
/// lowercases to `k` and `İ` to `i` plus a combining dot, in Python as in Rust.
fn rouge_tokens(lower: &str) -> Vec<&str> {
    lower
        .split(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit()))
        .filter(|token| !token.is_empty())
        .collect()
}

/// Length of the longest common subsequence of two token lists, by the usual table kept two
/// rows at a time.
fn lcs_len(a: &[&str], b: &[&str]) -> usize {
    let mut previous = vec![0usize; b.len() + 1];
    let mut current = vec![0usize; b.len() + 1];
    for x in a {
        for (j, y) in b.iter().enumerate() {
            current[j + 1] = if x == y { previous[j] + 1 } else { previous[j + 1].max(current[j]) };
        }
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

/// ROUGE-L F-measure as `rouge_score.rouge_scorer.RougeScorer(["rougeL"])` computes it (default
/// tokenizer, no stemming): the longest common subsequence of the token lists, precision over
/// the output's tokens, recall over the reference's, F = 2PR / (P + R). 0.0 when either side has
/// no tokens or they share none.
pub fn rouge_l(output: &str, reference: &str) -> f64 {
    let (output, reference) = (output.to_lowercase(), reference.to_lowercase());
    let (output, reference) = (rouge_tokens(&output), rouge_tokens(&reference));
    if output.is_empty() || reference.is_empty() {
        return 0.0;
    }
    let lcs = lcs_len(&reference, &output);
    if lcs == 0 {
        return 0.0;
    }
    let precision = lcs as f64 / output.len() as f64;
    let recall = lcs as f64 / reference.len() as f64;
    // In rouge-score's order of operations, so the result matches it to the last bit.
    2.0 * precision * recall / (precision + recall)
}

// ---------------------------------------------------------------------------------------------
// BLEU.

/// BLEU's n-gram orders, sacrebleu's `MAX_NGRAM_ORDER`.
const BLEU_ORDER: usize = 4;

/// The characters sacrebleu's first 13a rule pads with spaces: the class
/// `[\{-\~\[-\` -\&\(-\+\:-\@\/]` of `tokenizer_re.py`. It leaves out `'`, `-`, `.`, `,` and the
/// digits and letters, which the later rules or nothing handle.
fn is_13a_symbol(c: char) -> bool {
    matches!(c, '{'..='~' | '['..='`' | ' '..='&' | '('..='+' | ':'..='@' | '/')
}

/// One of sacrebleu's two-character rules (`re.sub(r'(X)(Y)', ...)`): wherever a character of
/// class `first` is followed by one of class `second`, spaces go before, between and after the
/// pair as the rule's replacement puts them. Matches do not overlap and are found left to right,
/// as `re.sub` finds them, so a matched second character never starts another match.
fn space_pairs(
    chars: &[char],
    first: impl Fn(char) -> bool,
    second: impl Fn(char) -> bool,
    [before, between, after]: [bool; 3],
) -> Vec<char> {
    let mut out = Vec::with_capacity(chars.len() + chars.len() / 2);
    let mut i = 0;
    while let Some(&a) = chars.get(i) {
        match chars.get(i + 1) {
            Some(&b) if first(a) && second(b) => {
                for (space, c) in [(before, Some(a)), (between, Some(b)), (after, None)] {
                    if space {
                        out.push(' ');
                    }
                    out.extend(c);
                }
                i += 2;
            }
            _ => {
                out.push(a);
                i += 1;
            }
        }
    }
    out
}

/// sacrebleu's default tokenizer, `Tokenizer13a` (mteval-v13a's, used by WMT), applied to a
/// segment as `BLEU._preprocess_segment` does (trailing whitespace stripped first).
fn tokenize_13a(segment: &str) -> Vec<String> {
    let mut line = segment
        .trim_end_matches(is_py_space)
        .replace("<skipped>", "")
        .replace("-\n", "")
        .replace('\n', " ");
    if line.contains('&') {
        line = line
            .replace("&quot;", "\"")
            .replace("&amp;", "&")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
    }
    // TokenizerRegexp's rules, in order, on the line padded with a space each side.
    let mut chars = Vec::with_capacity(line.len() * 2);
    for c in format!(" {line} ").chars() {
        if is_13a_symbol(c) {
            chars.extend([' ', c, ' ']);
        } else {
            chars.push(c);
        }
    }
    let not_digit = |c: char| !c.is_ascii_digit();
    let period_or_comma = |c: char| c == '.' || c == ',';
    // `([^0-9])([\.,])` -> `\1 \2 `: a period or comma not preceded by a digit.
    let chars = space_pairs(&chars, not_digit, period_or_comma, [false, true, true]);
    // `([\.,])([^0-9])` -> ` \1 \2`: a period or comma not followed by a digit.
    let chars = space_pairs(&chars, period_or_comma, not_digit, [true, true, false]);
    // `([0-9])(-)` -> `\1 \2 `: a dash after a digit.
    let chars =
        space_pairs(&chars, |c: char| c.is_ascii_digit(), |c| c == '-', [false, true, true]);
    let line: String = chars.into_iter().collect();
    py_split(&line).map(str::to_string).collect()
}

/// One segment's sufficient statistics, as `BLEU._compute_segment_statistics` returns them:
/// lengths and, per order, matched (clipped) and total n-grams of the output. Summed over a
/// corpus before the score is taken.
#[derive(Debug, Default, Clone, Copy)]
struct BleuStats {
    output_len: usize,
    reference_len: usize,
    correct: [usize; BLEU_ORDER],
    total: [usize; BLEU_ORDER],
}

fn ngram_counts(tokens: &[String]) -> HashMap<&[String], usize> {
    let mut counts = HashMap::new();
    for n in 1..=BLEU_ORDER {
        for ngram in tokens.windows(n) {
            *counts.entry(ngram).or_insert(0) += 1;
        }
    }
    counts
}

fn bleu_stats(output: &str, reference: &str) -> BleuStats {
    let (output, reference) = (tokenize_13a(output), tokenize_13a(reference));
    let reference_counts = ngram_counts(&reference);
    let mut stats = BleuStats {
        output_len: output.len(),
        reference_len: reference.len(),
        ..BleuStats::default()
    };
    for (ngram, count) in ngram_counts(&output) {
        let order = ngram.len() - 1;
        stats.total[order] += count;
        stats.correct[order] += count.min(reference_counts.get(ngram).copied().unwrap_or(0));
    }
    stats
}

/// `BLEU.compute_bleu` with smoothing "exp" (mteval's: the k-th order with no match counts as
/// 1 / 2^k matches), in sacrebleu's order of operations.
///
/// With `effective_order`, as `sentence_bleu` sets it, the geometric mean runs over the orders
/// the output is long enough to have (a 3-token output is scored on 1- to 3-grams); without it,
/// as `corpus_bleu` leaves it, a missing order has precision 0 and the score is 0.
fn bleu_score(stats: &BleuStats, effective_order: bool) -> f64 {
    let (output_len, reference_len) = (stats.output_len as f64, stats.reference_len as f64);
    let brevity_penalty = if stats.output_len >= stats.reference_len {
        1.0
    } else if stats.output_len > 0 {
        (1.0 - reference_len / output_len).exp()
    } else {
        0.0
    };
    if stats.correct.iter().all(|&c| c == 0) {
        return 0.0;
    }
    let mut precisions = [0.0f64; BLEU_ORDER];
    let mut smooth = 1.0f64;
    let mut orders = BLEU_ORDER;
    let counts = stats.correct.iter().zip(&stats.total);
    for (n, ((&correct, &total), precision)) in counts.zip(&mut precisions).enumerate() {
        if total == 0 {
            break;
        }
        if effective_order {
            orders = n + 1;
        }
        *precision = if correct == 0 {
            smooth *= 2.0;
            100.0 / (smooth * total as f64)
        } else {
            100.0 * correct as f64 / total as f64
        };
    }
    // sacrebleu's `my_log`: log 0 is floored to -9999999999, which drives the score to 0.
    let log_sum: f64 = precisions[..orders]
        .iter()
        .map(|&p| if p == 0.0 { -9_999_999_999.0 } else { p.ln() })
        .sum();
    brevity_penalty * (log_sum / orders as f64).exp()
}

/// Sentence BLEU on 0..100 as `sacrebleu.sentence_bleu(output, [reference])` computes it with
/// its defaults: tokenizer 13a, 1- to 4-grams, smoothing "exp", effective order on.
pub fn sentence_bleu(output: &str, reference: &str) -> f64 {
    bleu_score(&bleu_stats(output, reference), true)
}

/// Corpus BLEU on 0..100 as `sacrebleu.corpus_bleu(outputs, [references])` computes it with its
/// defaults: n-gram counts and lengths summed over the corpus before precisions and brevity
/// penalty are taken (so it is not the mean of sentence scores), smoothing "exp", effective order
/// off. Errors when the lists differ in length (sacrebleu would silently score the shorter
/// prefix) or are empty (sacrebleu raises).
pub fn corpus_bleu(outputs: &[&str], references: &[&str]) -> Result<f64> {
    if outputs.len() != references.len() {
        return Err(Error::invalid(format!(
            "corpus BLEU: {} outputs but {} references",
            outputs.len(),
            references.len()
        )));
    }
    if outputs.is_empty() {
        return Err(Error::invalid("corpus BLEU: no outputs to score"));
    }
    let mut sum = BleuStats::default();
    for (output, reference) in outputs.iter().zip(references) {
        let stats = bleu_stats(output, reference);
        sum.output_len += stats.output_len;
        sum.reference_len += stats.reference_len;
        for n in 0..BLEU_ORDER {
            sum.correct[n] += stats.correct[n];
            sum.total[n] += stats.total[n];
        }
    }
    Ok(bleu_score(&sum, false))
}

// ---------------------------------------------------------------------------------------------
// Multiple choice and perplexity.

/// The choices a multiple-choice question's two accuracies pick (indices into its choices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChoicePick {
    /// The choice with the highest log-likelihood (lm-evaluation-harness's `acc`).
    pub acc: usize,
    /// The choice with the highest log-likelihood per character (`acc_norm`), which stops long
    /// choices losing merely for having more tokens to pay for.
    pub acc_norm: usize,
}

/// `numpy.argmax`: the first maximum, or the first NaN if there is one (NumPy ranks NaN above
/// everything).
fn numpy_argmax(values: &[f64]) -> usize {
    if let Some(nan) = values.iter().position(|v| v.is_nan()) {
        return nan;
    }
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if values.get(best).is_some_and(|&b| v > b) {
            best = i;
        }
    }
    best
}

/// lm-evaluation-harness 0.4's multiple choice (`ConfigurableTask.process_results`, output type
/// `multiple_choice`). `logprobs[i]` is the summed log-likelihood of choice `i`'s continuation,
/// `choices[i]` the choice's text as the task lists it (`doc_to_choice`), without the target
/// delimiter (the leading " ") that the scored continuation carries: lm-eval divides by the
/// length of that text.
///
/// `acc` is `argmax(logprobs)`, `acc_norm` is `argmax(logprobs[i] / len(choices[i]))` with the
/// length in characters (Python's `len`, Unicode scalar values); both take the first of equal
/// maxima, as `numpy.argmax` does. An empty choice divides by zero as NumPy does (-inf, or NaN
/// for a log-likelihood of 0, which `argmax` then picks).
///
/// Errors when there are no choices, the lists differ in length, or a log-likelihood is NaN.
pub fn pick_choice(logprobs: &[f64], choices: &[&str]) -> Result<ChoicePick> {
    if logprobs.is_empty() {
        return Err(Error::invalid("multiple choice: no choices"));
    }
    if logprobs.len() != choices.len() {
        return Err(Error::invalid(format!(
            "multiple choice: {} log-likelihoods for {} choices",
            logprobs.len(),
            choices.len()
        )));
    }
    if let Some(i) = logprobs.iter().position(|ll| ll.is_nan()) {
        return Err(Error::invalid(format!(
            "multiple choice: the log-likelihood of choice {i} is NaN"
        )));
    }
    let per_char: Vec<f64> = logprobs
        .iter()
        .zip(choices)
        .map(|(&ll, choice)| ll / choice.chars().count() as f64)
        .collect();
    Ok(ChoicePick { acc: numpy_argmax(logprobs), acc_norm: numpy_argmax(&per_char) })
}

/// Perplexity from a summed negative log-likelihood in nats over `tokens` predicted tokens:
/// `exp(nll / tokens)`. Errors when no token was predicted or the sum is NaN. A mean above ~709
/// nats overflows to infinity, which is what such a model's perplexity is for practical purposes.
pub fn perplexity(nll: f64, tokens: usize) -> Result<f64> {
    if tokens == 0 {
        return Err(Error::invalid("perplexity: no predicted tokens"));
    }
    if nll.is_nan() {
        return Err(Error::invalid("perplexity: the negative log-likelihood is NaN"));
    }
    Ok((nll / tokens as f64).exp())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn close(actual: f64, expected: f64) -> bool {
        (actual - expected).abs() <= 1e-9 * expected.abs().max(1.0)
    }

    #[track_caller]
    fn assert_close(actual: f64, expected: f64) {
        assert!(close(actual, expected), "got {actual}, expected {expected}");
    }

    #[test]
    fn the_punctuation_class_compiles() {
        assert!(PUNCTUATION.is_some());
    }

    #[test]
    fn normalize_lowercases_and_drops_punctuation_articles_and_extra_space() {
        for (text, expected) in [
            ("The  Cat!", "cat"),
            ("cat", "cat"),
            ("an apple.", "apple"),
            ("Apple", "apple"),
            ("  A man, a plan, a canal: Panama ", "man plan canal panama"),
            // Removed, not replaced by a space, as SQuAD does.
            ("Don't", "dont"),
            ("well-known", "wellknown"),
            // Articles only as whole words.
            ("Theater anthem", "theater anthem"),
            ("?!...", ""),
            ("", ""),
            ("the a an", ""),
            // Letters beyond ASCII stay (lowercased); the em dash is punctuation (Pd).
            ("Ünïcode — text", "ünïcode text"),
            ("«Bonjour», ¿qué?", "bonjour qué"),
            // ASCII symbols are in string.punctuation; other symbols are not punctuation.
            ("$5 + 3 = €8", "5 3 €8"),
            // Python's str.split() separators, U+001C included.
            ("x\u{1c}y\u{a0}z\n", "x y z"),
        ] {
            assert_eq!(normalize(text), expected, "normalize({text:?})");
        }
    }

    #[test]
    fn exact_match_compares_normalised_text() {
        assert_eq!(exact_match("The  Cat!", "cat"), 1.0);
        assert_eq!(exact_match("an apple.", "Apple"), 1.0);
        assert_eq!(exact_match("a cat", "cats"), 0.0);
        assert_eq!(exact_match("Paris, France", "Paris"), 0.0);
        // Both empty after normalisation: equal, as in SQuAD.
        assert_eq!(exact_match("...", "the"), 1.0);
    }

    #[test]
    fn contains_matches_whole_words_only() {
        assert_eq!(contains("The answer is 4.", "4"), 1.0);
        assert_eq!(contains("The answer is 42.", "4"), 0.0);
        assert_eq!(contains("I love New York City", "new york"), 1.0);
        assert_eq!(contains("I love New Yorkshire", "new york"), 0.0);
        assert_eq!(contains("Paris", "Paris"), 1.0);
        assert_eq!(contains("in Paris.", "the Paris!"), 1.0);
        // A reference with nothing left after normalisation matches nothing.
        assert_eq!(contains("anything at all", "the ..."), 0.0);
        assert_eq!(contains("", ""), 0.0);
        assert_eq!(contains("", "cat"), 0.0);
    }

    #[test]
    fn gsm8k_takes_the_rest_of_the_line_after_the_last_marker() {
        let e = Extractor::Gsm8k;
        assert_eq!(e.extract("so 1,234 in all\n#### 1,234\nThat's it."), Some("1,234".into()));
        assert_eq!(e.extract("#### 1,234\r\nmore"), Some("1,234".into()));
        assert_eq!(e.extract("#### 5\n#### 6 \n"), Some("6".into()));
        assert_eq!(e.extract("Janet has 3 eggs.#### 72"), Some("72".into()));
        assert_eq!(e.extract("no marker, 72"), None);
        assert_eq!(e.extract("#### \nnothing after it"), None);
        assert_eq!(e.extract(""), None);
    }

    #[test]
    fn last_number_finds_signed_decimal_and_grouped_numbers() {
        let e = Extractor::LastNumber;
        for (text, expected) in [
            ("It drops by -3.5 degrees.", Some("-3.5")),
            ("About 1,000,000 people.", Some("1,000,000")),
            ("First 7, then 12.", Some("12")),
            ("$1,234.50 total", Some("1,234.50")),
            ("x = -12", Some("-12")),
            // A dash between two numbers or words is not a sign.
            ("pages 3-5", Some("5")),
            ("item-7", Some("7")),
            // Groups are of exactly three digits after a short lead.
            ("1,2,3", Some("3")),
            ("in 2020,100 came", Some("100")),
            ("1,2345", Some("2345")),
            // A sentence's full stop is not a decimal point.
            ("The answer is 42.", Some("42")),
            ("no digits here", None),
            ("", None),
            ("-", None),
        ] {
            assert_eq!(e.extract(text).as_deref(), expected, "last number of {text:?}");
        }
    }

    #[test]
    fn boxed_takes_the_last_balanced_box() {
        let e = Extractor::Boxed;
        assert_eq!(e.extract(r"so $\boxed{\frac{1}{2}}$."), Some(r"\frac{1}{2}".into()));
        assert_eq!(e.extract(r"\boxed{3} or rather \boxed{ 4 }"), Some("4".into()));
        assert_eq!(e.extract(r"\boxed{\{1, 2\}}"), Some(r"\{1, 2\}".into()));
        // Cut inside its last box: no answer, even though an earlier box is complete.
        assert_eq!(e.extract(r"\boxed{3} then \boxed{\frac{1}{2}"), None);
        assert_eq!(e.extract(r"\boxed{"), None);
        assert_eq!(e.extract(r"\boxed{}"), None);
        assert_eq!(e.extract("no box"), None);
    }

    #[test]
    fn a_pattern_gives_its_first_group_or_whole_match_of_the_last_match() {
        let grouped = Extractor::regex(r"answer: (\w+)").expect("compiles");
        assert_eq!(grouped.extract("answer: B ... answer: C."), Some("C".into()));
        assert_eq!(grouped.extract("no answer here"), None);
        let whole = Extractor::regex(r"\([A-D]\)").expect("compiles");
        assert_eq!(whole.extract("(A) or (C), I pick (B)"), Some("(B)".into()));
        // An optional group absent from the last match: no answer.
        let optional = Extractor::regex(r"x(\d)?").expect("compiles");
        assert_eq!(optional.extract("x1 x"), None);
    }

    #[test]
    fn a_bad_or_oversized_pattern_is_refused_naming_the_setting() {
        let err = Extractor::regex("(unclosed").expect_err("invalid").to_string();
        assert!(err.contains("answer_pattern: the regular expression does not compile"), "{err}");
        // Unicode \w a few thousand times compiles far past the 1 MiB limit.
        let err = Extractor::regex(r"\w{5000}").expect_err("too large").to_string();
        assert!(err.contains("answer_pattern") && err.contains("size limit"), "{err}");
    }

    #[test]
    fn extractors_by_name() {
        assert!(matches!(Extractor::named("gsm8k"), Ok(Extractor::Gsm8k)));
        assert!(matches!(Extractor::named("last_number"), Ok(Extractor::LastNumber)));
        assert!(matches!(Extractor::named("boxed"), Ok(Extractor::Boxed)));
        let err = Extractor::named("GSM8K").expect_err("unknown").to_string();
        assert!(err.contains("\"GSM8K\"") && err.contains("gsm8k, last_number, boxed"), "{err}");
    }

    #[test]
    fn answers_agree_as_numbers_then_as_text() {
        assert!(answers_agree("42", "42.0"));
        assert!(answers_agree("42.00", "$42"));
        assert!(answers_agree(" 42. ", "42"));
        assert!(answers_agree("1,234", "1234"));
        assert!(answers_agree("-0.5", "-.5"));
        assert!(answers_agree("0", "-0"));
        assert!(answers_agree("1000000000", "1000000000.5"), "within 1e-9 relative");
        assert!(!answers_agree("1000000", "1000000.5"));
        assert!(!answers_agree("42", "43"));
        assert!(!answers_agree("42", "forty-two"));
        assert!(answers_agree("Forty-two", "fortytwo"));
        // Not plain decimals: compared as text.
        assert!(!answers_agree("inf", "1e999"));
        assert!(answers_agree("NaN", "nan"));
        // Nothing left after normalisation agrees with nothing.
        assert!(!answers_agree("", ""));
        assert!(!answers_agree("?", "!"));
    }

    #[test]
    fn extracted_match_reads_the_reference_the_same_way_or_whole() {
        let gsm = Extractor::Gsm8k;
        let reference = "She sells 16 - 3 - 4 = 9 eggs.\n#### 18";
        assert_eq!(extracted_match(&gsm, "9 * 2 = 18\n#### 18.00", reference), 1.0);
        assert_eq!(extracted_match(&gsm, "#### 17", reference), 0.0);
        assert_eq!(extracted_match(&gsm, "The answer is 18", reference), 0.0, "no marker");
        assert_eq!(extracted_match(&gsm, "#### $1,000", " 1000 "), 1.0, "bare reference");
        let last = Extractor::LastNumber;
        assert_eq!(extracted_match(&last, "so 3 + 4 = 7.", "7"), 1.0);
        assert_eq!(extracted_match(&last, "no number", "7"), 0.0);
        let boxed = Extractor::Boxed;
        assert_eq!(extracted_match(&boxed, r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"), 1.0);
        assert_eq!(extracted_match(&boxed, r"\boxed{0.50}", r"\boxed{.5}"), 1.0);
        let pattern = Extractor::regex(r"\(([A-D])\)").expect("compiles");
        assert_eq!(extracted_match(&pattern, "(A)? no: (C)", "C"), 1.0);
        assert_eq!(extracted_match(&pattern, "(A)? no: (C)", "(A)"), 0.0);
    }

    #[test]
    fn rouge_l_on_hand_computed_cases() {
        // Output tokens:    the cat sat on the mat   (6; "!" is a separator)
        // Reference tokens: the cat is on mat        (5)
        // LCS: the cat on mat (4). P = 4/6, R = 4/5, F = 2PR/(P+R) = (16/15)/(22/15) = 8/11.
        // rouge-score 0.1.2 gives 0.7272727272727272.
        assert_close(rouge_l("The cat sat on the mat!", "the cat is on mat"), 8.0 / 11.0);
        // "U.S.A." is three tokens u s a; "usa" is one. LCS: rocks (1).
        // P = 1/4, R = 1/2, F = 1/3; rouge-score gives 0.3333333333333333.
        assert_close(rouge_l("U.S.A. rocks", "usa rocks"), 1.0 / 3.0);
        // "Don't" is don t. LCS: stop. P = 1/3, R = 1/3, F = 1/3 (rouge-score agrees).
        assert_close(rouge_l("Don't stop", "do not stop"), 1.0 / 3.0);
        assert_eq!(rouge_l("Same words here", "same WORDS, here."), 1.0);
        assert_eq!(rouge_l("!!!", "cat"), 0.0, "no output tokens");
        assert_eq!(rouge_l("cat", ""), 0.0, "no reference tokens");
        assert_eq!(rouge_l("dog", "cat"), 0.0, "nothing shared");
    }

    #[test]
    fn the_13a_tokenizer_splits_as_sacrebleu_does() {
        // Each expected list is sacrebleu 2.6.0's Tokenizer13a()(line).split().
        for (line, expected) in [
            ("Hello, world!", &["Hello", ",", "world", "!"][..]),
            (
                "It's 3.5-4,000 &quot;units&quot; at 1,000.",
                &["It's", "3.5", "-", "4,000", "\"", "units", "\"", "at", "1,000", "."],
            ),
            (
                "well-known e.g. U.S. 12-3 a<skipped>b",
                &["well-known", "e", ".", "g", ".", "U", ".", "S", ".", "12", "-", "3", "ab"],
            ),
            ("x.y,z 3.x ,5 .5", &["x", ".", "y", ",", "z", "3", ".", "x", ",", "5", ".", "5"]),
            ("Tab\tand\u{1c}sep end.  ", &["Tab", "and", "sep", "end", "."]),
            ("", &[]),
        ] {
            assert_eq!(tokenize_13a(line), expected, "13a of {line:?}");
        }
    }

    #[test]
    fn sentence_bleu_on_a_hand_computed_case() {
        // Output    the cat sat on the mat   (6 tokens)
        // Reference the cat is  on the mat   (6 tokens), so BP = 1.
        // 1-grams: the x2, cat, on, mat match of 6      -> p1 = 5/6
        // 2-grams: the cat, on the, the mat of 5         -> p2 = 3/5
        // 3-grams: on the mat of 4                       -> p3 = 1/4
        // 4-grams: none of 3; "exp" smoothing counts the first order with no match as 1/2
        //          match                                  -> p4 = 1/(2*3) = 1/6
        // BLEU = 100 * (5/6 * 3/5 * 1/4 * 1/6)^(1/4) = 100 * (1/48)^(1/4) = 37.9917842...
        // sacrebleu 2.6.0 sentence_bleu and corpus_bleu both give 37.99178428257963.
        let hand = 100.0 * (1.0f64 / 48.0).powf(0.25);
        assert_close(hand, 37.99178428257963);
        let (output, reference) = ("the cat sat on the mat", "the cat is on the mat");
        assert_close(sentence_bleu(output, reference), hand);
        assert_close(corpus_bleu(&[output], &[reference]).expect("same lengths"), hand);
    }

    #[test]
    fn bleu_matches_sacrebleu() {
        // sacrebleu 2.6.0: counts [8, 6, 4, 2] of [10, 9, 8, 7] ("." is a token), BP 1.
        let (output, reference) = (
            "The quick brown fox jumps over the lazy dog.",
            "A quick brown fox jumped over the lazy dog.",
        );
        assert_close(sentence_bleu(output, reference), 52.53819788848316);
        assert_close(corpus_bleu(&[output], &[reference]).expect("ok"), 52.53819788848316);

        // The corpus score sums counts before taking precisions: sacrebleu 2.6.0 gives
        // 50.374558009105755 (counts [17, 12, 8, 5] of [22, 20, 18, 16]), not the mean of the
        // sentence scores 52.53819788848316 and 48.326978309062184.
        let outputs = [output, "It rained all day in Paris, so we stayed in."];
        let references = [reference, "It rained all day in Paris; we stayed inside."];
        assert_close(sentence_bleu(outputs[1], references[1]), 48.326978309062184);
        assert_close(corpus_bleu(&outputs, &references).expect("ok"), 50.374558009105755);
    }

    #[test]
    fn sentence_bleu_uses_the_orders_a_short_output_has_and_corpus_bleu_does_not() {
        // Output "the cat": 1-grams 2/2 and 2-grams 1/1 match, no 3- or 4-grams. Effective
        // order scores on two orders: 100 * BP, BP = exp(1 - 6/2) = exp(-2). sacrebleu 2.6.0
        // sentence_bleu gives 13.533528323661276; corpus_bleu gives 0.0 (missing orders count
        // as precision 0).
        let (output, reference) = ("the cat", "the cat sat on the mat");
        assert_close(sentence_bleu(output, reference), 100.0 * (-2.0f64).exp());
        assert_close(sentence_bleu(output, reference), 13.533528323661276);
        assert_eq!(corpus_bleu(&[output], &[reference]).expect("ok"), 0.0);
    }

    #[test]
    fn bleu_of_degenerate_inputs_is_zero_and_bad_lists_are_refused() {
        assert_eq!(sentence_bleu("no overlap here", "something else entirely"), 0.0);
        assert_eq!(sentence_bleu("", "the cat"), 0.0);
        assert_eq!(sentence_bleu("the cat", ""), 0.0);
        assert_eq!(sentence_bleu("", ""), 0.0);
        let err = corpus_bleu(&["a", "b"], &["a"]).expect_err("lengths differ").to_string();
        assert!(err.contains("2 outputs but 1 references"), "{err}");
        assert!(corpus_bleu(&[], &[]).is_err());
    }

    #[test]
    fn pick_choice_argmaxes_as_numpy_does() {
        // Raw: -4 > -6, so acc = 0. Per character: -4/5 = -0.8 < -6/16 = -0.375, so
        // acc_norm = 1 (numpy: argmax [-4, -6] = 0, argmax [-0.8, -0.375] = 1).
        let pick = pick_choice(&[-4.0, -6.0], &["Paris", "Washington, D.C."]).expect("valid");
        assert_eq!(pick, ChoicePick { acc: 0, acc_norm: 1 });
        // Ties go to the first maximum, in both.
        let pick = pick_choice(&[-3.0, -1.0, -1.0], &["a", "bb", "cc"]).expect("valid");
        assert_eq!(pick, ChoicePick { acc: 1, acc_norm: 1 });
        let pick = pick_choice(&[-2.0, -4.0], &["ab", "abcd"]).expect("valid");
        assert_eq!(pick, ChoicePick { acc: 0, acc_norm: 0 });
        // Length in characters, not bytes: "café" is 4 characters (5 bytes), so -4.4/4 = -1.1
        // loses to -4/4 = -1.0 (by bytes -0.88 would win).
        let pick = pick_choice(&[-4.4, -4.0], &["café", "abcd"]).expect("valid");
        assert_eq!(pick.acc_norm, 1);
        // An empty choice divides by zero as numpy does: 0/0 is NaN, which argmax picks; -2/0
        // is -inf, which it does not (numpy gives 1 and 0).
        assert_eq!(pick_choice(&[-1.0, 0.0], &["a", ""]).expect("valid").acc_norm, 1);
        assert_eq!(pick_choice(&[-1.0, -2.0], &["a", ""]).expect("valid").acc_norm, 0);
        // -inf is a valid log-likelihood (an impossible continuation).
        let pick = pick_choice(&[f64::NEG_INFINITY, -9.0], &["a", "b"]).expect("valid");
        assert_eq!(pick, ChoicePick { acc: 1, acc_norm: 1 });
    }

    #[test]
    fn pick_choice_refuses_empty_mismatched_or_nan_input() {
        assert!(pick_choice(&[], &[]).is_err());
        let err = pick_choice(&[-1.0], &["a", "b"]).expect_err("mismatch").to_string();
        assert!(err.contains("1 log-likelihoods for 2 choices"), "{err}");
        let err = pick_choice(&[-1.0, f64::NAN], &["a", "b"]).expect_err("NaN").to_string();
        assert!(err.contains("choice 1 is NaN"), "{err}");
    }

    #[test]
    fn perplexity_is_exp_of_the_mean_nll() {
        // Three tokens each at probability 1/8: nll = 3 ln 8, perplexity 8.
        assert_close(perplexity(3.0 * 8f64.ln(), 3).expect("valid"), 8.0);
        assert_eq!(perplexity(0.0, 5).expect("valid"), 1.0);
        assert!(perplexity(1.0, 0).is_err());
        assert!(perplexity(f64::NAN, 3).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Any text, however odd: every score is in range and nothing panics.
        #[test]
        fn any_text_scores_in_range(output in any::<String>(), reference in any::<String>()) {
            for s in [exact_match(&output, &reference), contains(&output, &reference),
                      rouge_l(&output, &reference)] {
                prop_assert!((0.0..=1.0).contains(&s));
            }
            let bleu = sentence_bleu(&output, &reference);
            prop_assert!((0.0..=100.0).contains(&bleu));
            let corpus = corpus_bleu(&[&output], &[&reference]).expect("same lengths");
            prop_assert!((0.0..=100.0).contains(&corpus));
            for e in [Extractor::Gsm8k, Extractor::LastNumber, Extractor::Boxed] {
                let s = extracted_match(&e, &output, &reference);
                prop_assert!(s == 0.0 || s == 1.0);
            }
            let _ = answers_agree(&output, &reference);
            let _ = normalize(&output);
        }
    }
}
