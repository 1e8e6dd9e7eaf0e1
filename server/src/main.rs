//! The `sluice` binary. Everything lives in the library so that tests can reach it.

fn main() -> std::process::ExitCode {
    sluice::cli::main()
}
