//! The model card: `README.md` in every saved checkpoint folder, in the Hugging Face Hub's
//! style (YAML front matter with `base_model`, `library_name` and `tags`, then prose and tables),
//! saying what the checkpoint was fine-tuned from, with which settings, and where its curves
//! ended.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use serde_json::Value;

use super::StepMetrics;
use super::run::{ModelSource, RunOptions};
use crate::error::Result;
use crate::eval::EvalMetric;
use crate::weights::write_file_atomically;

/// The file name the Hub shows as the model card.
pub const CARD_FILE: &str = "README.md";

/// Where a run's curves stand: the last step's values, the last evaluation, tokens counted.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Curves {
    /// The step the counts start from (0, or where a resumed run picked up).
    pub from_step: u64,
    pub step: u64,
    pub loss: Option<f64>,
    pub eval_loss: Option<f64>,
    pub tokens: u64,
    pub trained_tokens: u64,
    /// The task evaluation's metric, the base model's figure and the latest.
    pub task: Option<(EvalMetric, Option<f64>, f64)>,
}

impl Curves {
    pub fn from_step(step: u64) -> Curves {
        Curves { from_step: step, step, ..Curves::default() }
    }

    /// The curves after one more step.
    pub fn after(self, m: &StepMetrics) -> Curves {
        Curves {
            step: m.step,
            loss: Some(m.loss),
            eval_loss: m.eval_loss.or(self.eval_loss),
            tokens: self.tokens + m.tokens as u64,
            trained_tokens: self.trained_tokens + m.trained_tokens as u64,
            ..self
        }
    }

    /// The curves with a task evaluation's figure: `before` the base model's, `now` the latest.
    pub fn with_task(self, metric: EvalMetric, before: Option<f64>, now: f64) -> Curves {
        Curves { task: Some((metric, before, now)), ..self }
    }
}

/// Writes `dir/README.md` for a checkpoint of the run `options` at `curves`.
pub fn write_model_card(dir: &Path, options: &RunOptions, curves: &Curves) -> Result<()> {
    let text = model_card(dir, options, curves);
    write_file_atomically(&dir.join(CARD_FILE), |w| w.write_all(text.as_bytes()))
}

/// The card's text. `write!` into a String cannot fail, hence the ignored results.
pub fn model_card(dir: &Path, options: &RunOptions, curves: &Curves) -> String {
    let job = &options.job;
    let config: Value = std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let model_type = config["model_type"].as_str().unwrap_or("llama");
    let (base, origin) = match &job.model {
        ModelSource::Dir(path) => {
            // A folder from the Hub keeps its repository id in `_name_or_path`.
            let name = config["_name_or_path"]
                .as_str()
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .or_else(|| path.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| path.display().to_string());
            (Some(name.clone()), format!("Fine-tuned from `{name}`"))
        }
        ModelSource::Preset(name) => {
            (None, format!("Trained from random initialisation (the `{name}` preset shape)"))
        }
    };
    let mut s = String::from("---\n");
    if let Some(b) = &base {
        let _ = writeln!(s, "base_model: {}", yaml_string(b));
    }
    // A multimodal checkpoint (Gemma3ForConditionalGeneration) stays an image-text model; only
    // its text model was trained.
    let multimodal = config.get("text_config").is_some_and(Value::is_object);
    let _ = writeln!(s, "library_name: transformers");
    let pipeline = if multimodal { "image-text-to-text" } else { "text-generation" };
    let _ = writeln!(s, "pipeline_tag: {pipeline}");
    let _ = writeln!(s, "tags:\n- sluice\n- fine-tuned\n- {}", yaml_string(model_type));
    s.push_str("---\n\n");
    let title = dir.file_name().map_or("checkpoint".into(), |n| n.to_string_lossy().into_owned());
    let _ = writeln!(s, "# {title}\n");
    let _ = writeln!(
        s,
        "{origin} with Sluice: full-precision training (f32 master weights and AdamW moments), \
         {} steps of {}.\n",
        curves.step,
        match &job.data {
            crate::data::DatasetSource::File(p) =>
                p.file_name().map_or("a dataset".into(), |n| format!("`{}`", n.to_string_lossy())),
            _ => "a dataset".into(),
        }
    );

    if multimodal {
        s.push_str(
            "Only the text model was trained: the vision tower and the projector are the base \
             model's, unchanged.\n\n",
        );
    }
    s.push_str("## Results\n\n| measure | value |\n| --- | --- |\n");
    let _ = writeln!(s, "| steps | {} |", curves.step);
    let since = if curves.from_step > 0 {
        format!(" (since the resume at step {})", curves.from_step)
    } else {
        String::new()
    };
    let _ = writeln!(s, "| tokens seen{since} | {} |", curves.tokens);
    let _ = writeln!(s, "| tokens trained on{since} | {} |", curves.trained_tokens);
    let number = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.4}"));
    let _ = writeln!(s, "| training loss (last step) | {} |", number(curves.loss));
    let _ = writeln!(s, "| eval loss (last evaluation) | {} |", number(curves.eval_loss));
    if let Some((metric, before, now)) = curves.task {
        let _ = writeln!(
            s,
            "| {metric} on the eval set, base model → this checkpoint | {} → {now:.4} |",
            number(before)
        );
    }

    s.push_str("\n## Training settings\n\n| setting | value |\n| --- | --- |\n");
    if let Value::Object(settings) = serde_json::to_value(&job.settings).unwrap_or(Value::Null) {
        for (key, value) in settings {
            let shown = match value {
                Value::Null => continue,
                Value::String(v) => v,
                other => other.to_string(),
            };
            let _ = writeln!(s, "| {key} | {shown} |");
        }
    }
    s.push_str(
        "\n## Use\n\nThe folder loads with transformers (`AutoModelForCausalLM.from_pretrained`) \
         and exports to GGUF for llama.cpp and Ollama with `sluice export-gguf`.\n",
    );
    s
}

/// A YAML scalar quoted when it could be read as something else.
fn yaml_string(v: &str) -> String {
    let plain = !v.is_empty()
        && v.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && !v.starts_with(['-', '.']);
    if plain { v.to_string() } else { serde_json::Value::from(v).to_string() }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::path::PathBuf;

    use super::*;
    use crate::data::DatasetSource;
    use crate::train::{Devices, Job, JobSettings};

    #[test]
    fn the_card_has_front_matter_settings_and_final_values() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "llama", "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}"#,
        )
        .unwrap();
        let job = Job {
            model: ModelSource::Dir(PathBuf::from("/models/smol")),
            data: DatasetSource::File(PathBuf::from("/data/qa.jsonl")),
            eval_data: None,
            devices: Devices::Cpu,
            settings: JobSettings { lr: Some(2e-5), ..JobSettings::default() },
        };
        let options = RunOptions::unplanned(job, dir.path().to_path_buf()).unwrap();
        let mut curves = Curves::from_step(0);
        curves.step = 12;
        curves.loss = Some(1.23456);
        curves.tokens = 3072;
        write_model_card(dir.path(), &options, &curves).unwrap();
        let card = std::fs::read_to_string(dir.path().join(CARD_FILE)).unwrap();
        assert!(
            card.starts_with("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n"),
            "{card}"
        );
        assert!(card.contains("library_name: transformers\n"), "{card}");
        assert!(card.contains("tags:\n- sluice\n"), "{card}");
        assert!(card.contains("| training loss (last step) | 1.2346 |"), "{card}");
        assert!(card.contains("| eval loss (last evaluation) | n/a |"), "{card}");
        assert!(card.contains("| tokens seen | 3072 |"), "{card}");
        assert!(card.contains("| lr | 0.0000199"), "{card}");
        assert!(card.contains("`qa.jsonl`"), "{card}");
        assert_eq!(yaml_string("a: b"), "\"a: b\"");
    }
}
