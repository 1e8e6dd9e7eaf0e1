//! `sluice generate`: placeholder until the generator lands.

#[derive(Debug, clap::Args)]
pub(crate) struct GenerateArgs {}

pub(crate) fn run(_args: GenerateArgs) -> anyhow::Result<()> {
    Ok(())
}
