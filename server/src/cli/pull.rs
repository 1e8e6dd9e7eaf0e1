//! `sluice pull`: bring a model from the Hugging Face Hub by name into the appliance's cache
//! (`DATA_DIR/hub`, where the server lists it as `hf:Org/Name@revision`), with a progress bar;
//! a pull cut short resumes where it stopped.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;
use crate::hub::{self, Hub, HubToken};

#[derive(Debug, clap::Args)]
pub(crate) struct PullArgs {
    /// The model's Hugging Face id, e.g. Qwen/Qwen2.5-7B-Instruct.
    #[arg(value_name = "REPO")]
    repo: String,

    /// Branch, tag or commit to pull.
    #[arg(long, default_value = "main")]
    revision: String,

    /// The appliance's data directory; the model lands in its hub/ folder [default:
    /// ./sluice-data].
    #[arg(long, env = "SLUICE_DATA_DIR")]
    data_dir: Option<PathBuf>,

    /// The Hugging Face Hub to pull from.
    #[arg(long, env = "HF_ENDPOINT", default_value = hub::DEFAULT_ENDPOINT, value_name = "URL")]
    hf_endpoint: String,

    /// Access token for gated and private repos (prefer the variable: a flag shows in the
    /// process list).
    #[arg(long, env = "HF_TOKEN", hide_env_values = true, value_name = "TOKEN")]
    hf_token: Option<String>,
}

pub(crate) fn run(args: PullArgs) -> anyhow::Result<()> {
    let data_dir = args.data_dir.unwrap_or_else(|| PathBuf::from(Config::DEFAULT_DATA_DIR));
    let root = Config::new(data_dir).hub_dir();
    let token = args.hf_token.as_deref().and_then(HubToken::new);
    let client = Hub::new(&args.hf_endpoint, token);
    let plan = hub::pull::plan(&client, args.repo.trim(), args.revision.trim())?;
    std::fs::create_dir_all(&root)
        .with_context(|| format!("cannot create the cache folder {}", root.display()))?;
    eprintln!(
        "pulling {} at {} (commit {}): {} files",
        plan.repo,
        plan.revision,
        plan.commit,
        plan.files.len()
    );
    let bar = ProgressBar::new(plan.total_bytes());
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let result = hub::pull(&client, &root, &plan, &mut |now| {
        bar.set_position(now.done);
        if let Some(file) = now.files.iter().find(|f| f.done < f.total) {
            bar.set_message(file.name.clone());
        }
    });
    bar.finish_and_clear();
    let model = result?;
    println!("pulled {} into {}", model.id(), model.dir.display());
    Ok(())
}
