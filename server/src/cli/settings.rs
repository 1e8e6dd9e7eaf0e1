//! `sluice train`'s settings flags, made from the engine's list of settings
//! ([`JobSettings::FIELDS`]): one flag per setting (`--warmup` for `warmup`), its help, its
//! choices and its default from the same entry, so a setting the engine gains is a flag here
//! without an edit. The batch shape and the moments policy are [`ShapeArgs`]' flags, which
//! `plan` and `bench train` share.
//!
//! A given flag is kept as the JSON value the appliance's API would receive, and the job's
//! settings are read from those values by [`JobSettings::from_json`], so the command line and
//! the API accept and refuse the same settings with the same messages.
//!
//! [`ShapeArgs`]: super::shape::ShapeArgs

use clap::builder::ValueParser;
use clap::{Arg, ArgAction, ArgGroup, ArgMatches, Command};
use serde_json::{Map, Value};
use sluice_engine::train::{JobSettings, Limits, SettingView};

/// Settings whose flags [`super::shape::ShapeArgs`] defines for every subcommand.
pub(crate) const SHAPE_SETTINGS: [&str; 4] = ["seq_len", "micro_batch", "grad_accum", "moments"];

/// The group every settings flag belongs to (`--resume` conflicts with it).
pub(crate) const GROUP: &str = "settings";

/// The settings flags given, as JSON fields.
#[derive(Debug, Clone, Default)]
pub(crate) struct SettingsFlags {
    pub given: Map<String, Value>,
}

/// The settings that get a flag here, with their defaults.
fn settings() -> impl Iterator<Item = SettingView> {
    JobSettings::guide(&Limits::ENGINE)
        .settings
        .into_iter()
        .filter(|v| !SHAPE_SETTINGS.contains(&v.doc.name))
}

/// A switch (no value) for a setting that is off unless given.
fn is_switch(view: &SettingView) -> bool {
    view.default == Value::Bool(false)
}

/// The flag of one setting.
fn flag(view: SettingView) -> Arg {
    let doc = view.doc;
    let mut help = doc.help.to_string();
    if !doc.choices.is_empty() {
        help = format!("{help} One of: {}.", doc.choices.join(", "));
    }
    let shown_default = match &view.default {
        Value::Null | Value::Bool(_) => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    };
    if let Some(default) = shown_default
        && !help.contains("[default")
    {
        help = format!("{help} [default: {default}]");
    }
    let arg = Arg::new(doc.name).long(doc.name.replace('_', "-")).help(help).group(GROUP);
    if is_switch(&view) {
        return arg.action(ArgAction::SetTrue);
    }
    let value_name = if doc.value.is_empty() { "VALUE" } else { doc.value };
    let (choices, free) = (doc.choices, doc.text);
    let parser = ValueParser::new(move |text: &str| -> Result<String, String> {
        if free {
            return Ok(text.to_string());
        }
        if choices.is_empty() {
            // A number: the engine checks its kind and range and names the field.
            return text
                .parse::<f64>()
                .map(|_| text.to_string())
                .map_err(|_| format!("{text:?} is not a number"));
        }
        // Dashes read as underscores (`host-bf16`), as the engine's own parsers allow.
        let word = text.replace('-', "_");
        if choices.contains(&word.as_str()) {
            Ok(word)
        } else {
            Err(format!("{text:?}: expected one of {}", choices.join(", ")))
        }
    });
    arg.value_name(value_name).action(ArgAction::Set).value_parser(parser)
}

impl clap::FromArgMatches for SettingsFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut given = Map::new();
        for view in settings() {
            let name = view.doc.name;
            if is_switch(&view) {
                if matches.get_flag(name) {
                    given.insert(name.to_string(), Value::Bool(true));
                }
                continue;
            }
            let Some(text) = matches.get_one::<String>(name) else { continue };
            let value = match view.doc.choices.is_empty() && !view.doc.text {
                // Parsed as JSON so a number stays a number (`2e-5`); the value parser let
                // only numbers through.
                true => serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone())),
                false => Value::String(text.clone()),
            };
            given.insert(name.to_string(), value);
        }
        Ok(SettingsFlags { given })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl clap::Args for SettingsFlags {
    fn group_id() -> Option<clap::Id> {
        Some(clap::Id::from(GROUP))
    }

    fn augment_args(cmd: Command) -> Command {
        let names: Vec<&'static str> = settings().map(|v| v.doc.name).collect();
        let cmd = cmd.group(ArgGroup::new(GROUP).multiple(true).required(false).args(names));
        settings().fold(cmd, |cmd, view| cmd.arg(flag(view)))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        settings: SettingsFlags,
    }

    fn parse(words: &[&str]) -> Result<Map<String, Value>, String> {
        let mut line = vec!["sluice"];
        line.extend_from_slice(words);
        Cli::try_parse_from(line).map(|c| c.settings.given).map_err(|e| e.to_string())
    }

    #[test]
    fn every_setting_but_the_shape_is_a_flag() {
        let cmd = <Cli as clap::CommandFactory>::command();
        for doc in JobSettings::FIELDS {
            let flag = cmd.get_arguments().find(|a| a.get_id() == doc.name);
            assert_eq!(flag.is_some(), !SHAPE_SETTINGS.contains(&doc.name), "{}", doc.name);
        }
    }

    #[test]
    fn flags_become_the_json_fields_the_api_takes() {
        let given = parse(&[
            "--lr",
            "2e-5",
            "--gradients",
            "host-bf16",
            "--train-on-prompt",
            "--schedule",
            "linear",
        ])
        .expect("parses");
        assert_eq!(given["lr"].as_f64(), Some(2e-5));
        assert_eq!(given["gradients"], "host_bf16");
        assert_eq!(given["train_on_prompt"], true);
        let settings = JobSettings::from_json(given).expect("settings");
        assert_eq!(settings.lr, Some(2e-5));
        for (bad, says) in [
            (["--lr", "fast"], "not a number"),
            (["--schedule", "steep"], "expected one of constant, linear, cosine"),
        ] {
            let e = parse(&bad).expect_err(bad[1]);
            assert!(e.contains(says), "{e}");
        }
        // A number of the wrong kind is the engine's to refuse, naming the field.
        let given = parse(&["--warmup", "1.5"]).expect("a number");
        let e = JobSettings::from_json(given).expect_err("not a count").to_string();
        assert!(e.contains("warmup: invalid type"), "{e}");
    }
}
