//! The body of `POST /api/jobs` and `POST /api/plan` to the engine's [`Job`]: the model id,
//! dataset ids and device string are the appliance's; every other field is the engine's
//! [`JobSettings`], parsed and validated by the engine, so the API refuses exactly what
//! `sluice train` refuses, with the same message.

use serde_json::{Map, Value};
use sluice_engine::data::DatasetSource;
use sluice_engine::train::{Devices, Job, JobSettings};

use super::JobsError;
use crate::AppState;
use crate::datasets::{self, Dataset};
use crate::models::{self, ResolvedModel};
use crate::store::users::User;

/// A job as a request names it, before the names are looked up.
#[derive(Debug, Clone)]
pub struct JobRequest {
    pub model: String,
    pub dataset: Option<i64>,
    pub eval_dataset: Option<i64>,
    pub devices: Devices,
    pub settings: JobSettings,
    pub label: Label,
}

/// What a job's owner calls it and notes about it; not the engine's business.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Label {
    pub name: String,
    pub note: String,
}

impl Label {
    /// Longest name, in characters: a title, not a text.
    pub const MAX_NAME: usize = 100;
    /// Longest note, in characters.
    pub const MAX_NOTE: usize = 2000;

    /// Takes `name` and `note` out of `fields` (absent or `null`: empty), trimmed and checked.
    pub fn take(fields: &mut Map<String, Value>) -> Result<Label, JobsError> {
        Ok(Label {
            name: Self::name(fields.remove("name"))?.unwrap_or_default(),
            note: Self::note(fields.remove("note"))?.unwrap_or_default(),
        })
    }

    /// A name from JSON; `None` for absent.
    pub fn name(value: Option<Value>) -> Result<Option<String>, JobsError> {
        let Some(name) = text_field(value, "name")? else { return Ok(None) };
        let name = name.trim().to_string();
        if name.chars().count() > Self::MAX_NAME {
            return Err(JobsError::invalid(format!(
                "name is {} characters long; at most {} are allowed",
                name.chars().count(),
                Self::MAX_NAME
            )));
        }
        if name.chars().any(char::is_control) {
            return Err(JobsError::invalid("name must be one line without control characters"));
        }
        Ok(Some(name))
    }

    /// A note from JSON; `None` for absent.
    pub fn note(value: Option<Value>) -> Result<Option<String>, JobsError> {
        let Some(note) = text_field(value, "note")? else { return Ok(None) };
        let note = note.trim().to_string();
        if note.chars().count() > Self::MAX_NOTE {
            return Err(JobsError::invalid(format!(
                "note is {} characters long; at most {} are allowed",
                note.chars().count(),
                Self::MAX_NOTE
            )));
        }
        if note.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
            return Err(JobsError::invalid("note must not contain control characters"));
        }
        Ok(Some(note))
    }
}

/// A string field; `null` reads as empty, absent as `None`.
fn text_field(value: Option<Value>, name: &str) -> Result<Option<String>, JobsError> {
    match value {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(String::new())),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(JobsError::invalid(format!("{name} must be a string"))),
    }
}

impl JobRequest {
    /// Splits the appliance's fields off `body` and hands the rest to the engine.
    pub fn parse(body: Value) -> Result<JobRequest, JobsError> {
        let Value::Object(mut fields) = body else {
            return Err(JobsError::invalid("the body must be a JSON object"));
        };
        let model = match fields.remove("model") {
            Some(Value::String(m)) => m,
            Some(_) => return Err(JobsError::invalid("model must be a string")),
            None => return Err(JobsError::invalid("missing field `model`")),
        };
        let devices = match fields.remove("gpu") {
            Some(Value::String(g)) => {
                g.parse::<Devices>().map_err(|e| JobsError::invalid(e.to_string()))?
            }
            Some(_) => {
                return Err(JobsError::invalid("gpu must be a string such as \"cuda:0\""));
            }
            None => return Err(JobsError::invalid("missing field `gpu`")),
        };
        let dataset = id_field(&mut fields, "dataset")?;
        let eval_dataset = id_field(&mut fields, "eval_dataset")?;
        let label = Label::take(&mut fields)?;
        let settings =
            JobSettings::from_json(fields).map_err(|e| JobsError::invalid(e.to_string()))?;
        Ok(JobRequest { model, dataset, eval_dataset, devices, settings, label })
    }
}

/// An optional dataset id; `null` is the same as absent.
fn id_field(fields: &mut Map<String, Value>, name: &str) -> Result<Option<i64>, JobsError> {
    match fields.remove(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| JobsError::invalid(format!("{name} must be a dataset id"))),
    }
}

/// A request with its names looked up: the engine's job and what it was built from.
#[derive(Debug)]
pub struct Resolved {
    pub job: Job,
    pub model: ResolvedModel,
    pub dataset: Option<Dataset>,
    pub eval_dataset: Option<Dataset>,
    pub label: Label,
}

/// Looks up the model, datasets and devices of `request` for `user` and validates the job
/// against this appliance's limits. Without a dataset (a plan before one is chosen) the job's
/// data is a placeholder that is never read.
pub async fn resolve(
    state: &AppState,
    user: &User,
    request: JobRequest,
) -> Result<Resolved, JobsError> {
    let known = state.gpus().device_ids();
    if let Some(missing) = request.devices.members().into_iter().find(|d| !known.contains(d)) {
        return Err(JobsError::invalid(format!(
            "unknown GPU {missing:?} (this machine has: {})",
            known.join(", ")
        )));
    }
    // Another user's dataset is as unknown as a missing one (400, not 404: it is a field).
    let visible = |field: &'static str, id: Option<i64>| async move {
        let Some(id) = id else { return Ok(None) };
        match datasets::visible(state, user, id).await {
            Ok(dataset) => Ok(Some(dataset)),
            Err(datasets::DatasetsError::Database(err)) => Err(JobsError::Database(err)),
            Err(_) => Err(JobsError::invalid(format!("unknown {field} {id}"))),
        }
    };
    let dataset = visible("dataset", request.dataset).await?;
    let eval_dataset = visible("eval_dataset", request.eval_dataset).await?;
    let model_state = state.clone();
    let model_id = request.model.clone();
    let model = tokio::task::spawn_blocking(move || models::resolve(&model_state, &model_id))
        .await?
        .map_err(|unknown| JobsError::Invalid(unknown.0))?;
    let mut settings = request.settings;
    // Stored as used: the model's default learning rate is part of what the job ran with.
    settings.lr = Some(settings.lr_for(&model.source));
    let job = Job {
        model: model.source.clone(),
        data: dataset
            .as_ref()
            .map_or_else(|| DatasetSource::File("DATASET.jsonl".into()), |d| d.source(state)),
        eval_data: eval_dataset.as_ref().map(|d| d.source(state)),
        devices: request.devices,
        settings,
    };
    job.validate(&state.config().limits.engine()).map_err(|e| JobsError::invalid(e.to_string()))?;
    Ok(Resolved { job, model, dataset, eval_dataset, label: request.label })
}
