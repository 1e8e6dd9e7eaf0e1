//! The services' errors as the API's: the one place that decides which HTTP status a service's
//! failure gets. The services themselves know nothing of HTTP. Under `/v1/` the same failures
//! take OpenAI's shape ([`OpenAiError`]).

use super::openai::OpenAiError;
use crate::datasets::DatasetsError;
use crate::error::ApiError;
use crate::evaluation::EvalError;
use crate::jobs::JobsError;
use crate::models::UnknownModel;
use crate::serving::ServeError;
use crate::tryit::TryError;
use crate::webhooks::WebhookError;
use axum::http::StatusCode;

impl From<WebhookError> for ApiError {
    fn from(err: WebhookError) -> Self {
        match err {
            WebhookError::Url(_) => ApiError::bad_request(err.to_string()),
            WebhookError::Database(err) => err.into(),
        }
    }
}

impl From<DatasetsError> for ApiError {
    fn from(err: DatasetsError) -> Self {
        match err {
            DatasetsError::NotFound(_) => ApiError::not_found(err.to_string()),
            DatasetsError::InUse { .. } => ApiError::conflict(err.to_string()),
            DatasetsError::Unusable { message, problems, unlisted } => {
                ApiError::Unprocessable { message, problems, unlisted }
            }
            DatasetsError::Database(err) => err.into(),
        }
    }
}

impl From<UnknownModel> for ApiError {
    fn from(err: UnknownModel) -> Self {
        ApiError::bad_request(err.to_string())
    }
}

impl From<TryError> for ApiError {
    fn from(err: TryError) -> Self {
        match err {
            TryError::Unusable { .. } => ApiError::unprocessable(err.to_string()),
            TryError::NoBaseModel(message) => ApiError::unprocessable(message),
            TryError::Busy { message, .. } => ApiError::conflict(message),
            TryError::Internal(err) => ApiError::Internal(err),
        }
    }
}

impl From<JobsError> for ApiError {
    fn from(err: JobsError) -> Self {
        match err {
            JobsError::Invalid(message) => ApiError::bad_request(message),
            JobsError::Database(err) => err.into(),
            JobsError::Internal(err) => ApiError::Internal(err),
        }
    }
}

impl From<ServeError> for OpenAiError {
    fn from(err: ServeError) -> Self {
        match err {
            ServeError::Invalid { param, message } => OpenAiError::invalid(param, message),
            ServeError::Unusable(message) => OpenAiError {
                code: Some("model_unusable"),
                ..OpenAiError::new(StatusCode::UNPROCESSABLE_ENTITY, message, Some("model"))
            },
            ServeError::Busy { message, retry_after_s } => OpenAiError {
                code: Some("device_busy"),
                retry_after_s: Some(retry_after_s),
                ..OpenAiError::new(StatusCode::SERVICE_UNAVAILABLE, message, None)
            },
            ServeError::Internal(err) => OpenAiError::internal(err),
        }
    }
}

impl From<EvalError> for ApiError {
    fn from(err: EvalError) -> Self {
        match err {
            EvalError::Unfit(message) => ApiError::unprocessable(message),
            EvalError::NoReport(message) => ApiError::not_found(message),
            EvalError::Internal(err) => ApiError::Internal(err),
        }
    }
}
