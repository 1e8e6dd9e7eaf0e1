//! The caller's own account: personal API tokens (made, listed, revoked) and the webhook their
//! jobs' ends are posted to. Everyone manages only their own; an admin's tokens act as admin.
//!
//! - `GET /api/account/tokens`: the caller's tokens, newest first (never the tokens themselves).
//! - `POST /api/account/tokens` `{"name"}`: 201 with the new token, shown this once; only
//!   through a password session (403 for an API token), so a stolen token cannot mint
//!   successors that outlive its revocation.
//! - `DELETE /api/account/tokens/{id}`: 204; the token stops working at once.
//! - `GET /api/account/webhook`: `{"webhook": null}` or the URL and the latest delivery.
//! - `PUT /api/account/webhook` `{"url"}`: sets it (`""` or `null` removes it).
//! - `POST /api/account/webhook/test`: one delivery of a sample body, waited for.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::AppState;
use crate::auth::tokens;
use crate::auth::{CurrentUser, SessionUser};
use crate::error::{ApiError, ApiJson, ApiPath, ApiResult};
use crate::webhooks;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/account/tokens", get(list_tokens).post(create_token))
        .route("/api/account/tokens/{id}", delete(revoke_token))
        .route("/api/account/webhook", get(get_webhook).put(set_webhook))
        .route("/api/account/webhook/test", post(test_webhook))
}

async fn list_tokens(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
) -> ApiResult<Json<Vec<tokens::TokenView>>> {
    Ok(Json(tokens::list(&state, user.id).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewToken {
    name: String,
}

async fn create_token(
    State(state): State<AppState>,
    SessionUser(user): SessionUser,
    ApiJson(body): ApiJson<NewToken>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let (view, token) = tokens::create(&state, user.id, &body.name).await?;
    let mut reply = serde_json::to_value(&view).map_err(ApiError::internal)?;
    reply["token"] = json!(token);
    Ok((StatusCode::CREATED, Json(reply)))
}

async fn revoke_token(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<StatusCode> {
    if tokens::revoke(&state, user.id, id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("no API token {id}")))
    }
}

async fn get_webhook(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
) -> ApiResult<Json<Value>> {
    Ok(Json(json!({ "webhook": webhooks::get(&state, user.id).await? })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SetWebhook {
    url: Option<String>,
}

async fn set_webhook(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
    ApiJson(body): ApiJson<SetWebhook>,
) -> ApiResult<Json<Value>> {
    webhooks::set(&state, user.id, body.url.as_deref()).await?;
    Ok(Json(json!({ "webhook": webhooks::get(&state, user.id).await? })))
}

/// A sample of what a job's end sends, marked as a test.
async fn test_webhook(
    State(state): State<AppState>,
    CurrentUser(user): CurrentUser,
) -> ApiResult<Json<Value>> {
    let body = json!({
        "event": "test",
        "id": 0,
        "name": "a test from your account page",
        "status": "completed",
        "final_loss": null,
        "duration_s": 0,
        "owner": user.username,
        "url": crate::announce::job_url(&state, 0),
    });
    let Some(delivery) = webhooks::send_now(&state, user.id, &body).await? else {
        return Err(ApiError::conflict("set a webhook URL first"));
    };
    Ok(Json(json!({
        "ok": delivery.ok,
        "result": delivery.result,
        "webhook": webhooks::get(&state, user.id).await?,
    })))
}
