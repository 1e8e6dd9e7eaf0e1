//! The `sluice` command line.
//!
//! One file per subcommand, each with an `Args` struct and a synchronous `run` (a subcommand that
//! needs async builds its own runtime, so the engine's subcommands stay free of it). Adding a
//! subcommand is a variant in [`Command`] and an arm in [`run`].

mod bench;
mod bench_attention;
mod bench_train;
mod device;
mod eval;
mod export_gguf;
mod generate;
mod import_gguf;
mod plan;
mod pull;
mod serve;
mod settings;
mod shape;
pub(crate) mod train;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "Full-precision LLM fine-tuning on one GPU: web appliance and command line",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    // `sluice` alone serves, so it takes `serve`'s options too.
    #[command(flatten)]
    serve: serve::ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the web appliance (what `sluice` with no subcommand does).
    Serve(serve::ServeArgs),
    /// Train a model on a dataset from the terminal and write Hugging Face checkpoints.
    // Boxed: its many options would make every other variant as large.
    Train(Box<train::TrainArgs>),
    /// Convert a llama.cpp GGUF file into a Hugging Face model folder (f32 weights).
    ImportGguf(import_gguf::ImportGgufArgs),
    /// Generate text from a model folder on the CPU or a GPU (greedy or sampled, KV-cached).
    Generate(generate::GenerateArgs),
    /// Score a model folder on an eval set by a metric (batched; resident or streamed).
    Eval(eval::EvalArgs),
    /// Plan a training job: memory per tier, placement and predicted step time, or why it does
    /// not fit.
    Plan(plan::PlanArgs),
    /// Measure parts of the engine on this machine.
    Bench(bench::BenchArgs),
    /// Download a model from the Hugging Face Hub by name into the appliance's cache
    /// (resumes a pull cut short).
    Pull(pull::PullArgs),
    /// Write a checkpoint folder as a GGUF file for llama.cpp and Ollama (F16 or Q8_0).
    ExportGguf(export_gguf::ExportGgufArgs),
}

/// Parses the command line, runs the subcommand and turns its error into one line on stderr
/// and a failing exit code. Usage errors are clap's own (exit code 2).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` prints the whole chain of causes on one line: "outer: inner: os error".
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let command = cli.command.unwrap_or(Command::Serve(cli.serve));
    if !matches!(command, Command::Serve(_)) {
        quiet_on_closed_pipe();
    }
    match command {
        Command::Serve(args) => serve::run(args),
        Command::Train(args) => train::run(*args),
        Command::ImportGguf(args) => import_gguf::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Pull(args) => pull::run(args),
        Command::ExportGguf(args) => export_gguf::run(args),
    }
}

/// A subcommand whose output is piped into a reader that stops early (`sluice plan | head`)
/// ends quietly, as command-line tools do, rather than panicking in `println!`. Not for `serve`,
/// whose socket writes must see EPIPE as an error.
fn quiet_on_closed_pipe() {
    // SAFETY: `signal` with SIG_DFL only changes this process's disposition of SIGPIPE; it is
    // called before the subcommand starts any thread.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Logs go to stderr so that a subcommand's stdout stays machine-readable. `RUST_LOG` selects
/// what is logged; the default is `info`.
fn init_logging() {
    let filter = match EnvFilter::try_from_default_env() {
        Ok(filter) => filter,
        Err(err) => {
            if std::env::var_os(EnvFilter::DEFAULT_ENV).is_some() {
                eprintln!("warning: ignoring RUST_LOG ({err}); logging at info");
            }
            EnvFilter::new("info")
        }
    };
    // `try_init` only fails if a subscriber is already installed, which leaves logging working.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
