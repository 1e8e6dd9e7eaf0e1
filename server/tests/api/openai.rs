//! The OpenAI-compatible endpoint under `/v1/`: API tokens only, the API's ownership rules
//! (another user's checkpoint is a 404 naming `model`, like one that does not exist), bad input
//! as a 400 naming the field, completions whose echoed log-probabilities are the model's own
//! (checked against `Generator::logits` here), chat through the template, streamed in OpenAI's
//! chunk shape, and training first: 503 with `Retry-After` while a job trains on the only
//! device, and a running request that stops when a job is queued for its device.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode, header};
use serde_json::{Value, json};
use sluice_engine::generate::{GenerateOptions, Generator};

use crate::common::{Client, Reply, TestApp, tiny_job};
use crate::tokens::{bearer, make_token};

/// `(message, type, param, code)` of an OpenAI-shaped error.
fn openai_error(reply: &Reply) -> (String, String, Value, Value) {
    let body = reply.json().unwrap_or(Value::Null);
    let error = &body["error"];
    assert!(error.is_object(), "not OpenAI's error shape: {} {}", reply.status, reply.text());
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    (text(&error["message"]), text(&error["type"]), error["param"].clone(), error["code"].clone())
}

async fn post(app: &TestApp, token: &str, path: &str, body: Value) -> anyhow::Result<Reply> {
    bearer(app, token, Method::POST, path, Some(body)).await
}

async fn get(app: &TestApp, token: &str, path: &str) -> anyhow::Result<Reply> {
    bearer(app, token, Method::GET, path, None).await
}

/// A tiny CPU job of `client`'s, trained to the end; its id.
async fn trained(client: &Client) -> anyhow::Result<i64> {
    let demo = client.demo_dataset().await?;
    let id = client.submit(tiny_job(demo, 2)).await?;
    client.wait_job(id, 300, |j| j["status"] == "completed").await?;
    Ok(id)
}

fn final_dir(app: &TestApp, id: i64) -> PathBuf {
    app.state.runs_dir().join(id.to_string()).join("final")
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
    row.iter().map(|&x| f64::from(x - max) - sum.ln()).collect()
}

/// The `data:` payloads of a server-sent events body, in order.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .flat_map(|frame| frame.lines())
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|data| data.strip_prefix(' ').unwrap_or(data).to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_api_token_opens_v1_and_errors_are_openai_shaped() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let body = json!({"model": "local:nothing", "prompt": "Hi"});

    // No credential at all: 401 in OpenAI's shape (not the CSRF guard's 403).
    let anonymous = app.client();
    for reply in
        [anonymous.get("/v1/models").await?, anonymous.post("/v1/completions", body.clone()).await?]
    {
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
        let (message, kind, _, code) = openai_error(&reply);
        assert!(message.contains("Bearer"), "{message}");
        assert_eq!(kind, "authentication_error");
        assert_eq!(code, "invalid_api_key");
    }
    // A logged-in session cookie (with its CSRF token) is not a credential here.
    for reply in [
        alice.get("/v1/models").await?,
        alice.post("/v1/completions", body.clone()).await?,
        alice.post("/v1/chat/completions", body.clone()).await?,
    ] {
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
        openai_error(&reply);
    }
    // A token that is not one, or a revoked one.
    let (token_id, token) = make_token(&alice, "eval").await?;
    let wrong = format!("sluice_{}", "0".repeat(64));
    for bad in [wrong.as_str(), "sk-not-ours"] {
        let reply = post(&app, bad, "/v1/completions", body.clone()).await?;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{}", reply.text());
        assert_eq!(openai_error(&reply).3, "invalid_api_key");
    }
    let ok = get(&app, &token, "/v1/models").await?;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text());
    assert_eq!(ok.json()?["object"], "list");
    let revoked = alice.delete(&format!("/api/account/tokens/{token_id}")).await?;
    assert!(revoked.status.is_success(), "{}", revoked.text());
    assert_eq!(get(&app, &token, "/v1/models").await?.status, StatusCode::UNAUTHORIZED);

    // Unknown routes and methods answer in the same shape.
    let (_, token) = make_token(&alice, "eval again").await?;
    let reply = get(&app, &token, "/v1/embeddings").await?;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text());
    openai_error(&reply);
    let reply = get(&app, &token, "/v1/completions").await?;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED, "{}", reply.text());
    openai_error(&reply);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_listed_by_owner_and_bad_input_names_the_field() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let bob = app.user(&admin, "bob").await?;
    let id = trained(&alice).await?;
    let model = format!("job-{id}/final");
    let (_, alice_token) = make_token(&alice, "a").await?;
    let (_, bob_token) = make_token(&bob, "b").await?;
    let (_, admin_token) = make_token(&admin, "root").await?;
    // A model folder shared with everyone, as an import leaves one.
    let shared = app.state.models_dir().join("shared-tiny");
    std::fs::create_dir_all(app.state.models_dir())?;
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(final_dir(&app, id))
        .arg(&shared)
        .status()?;
    assert!(status.success());

    let ids = |reply: &Reply| -> Vec<String> {
        let list = reply.json().unwrap_or(Value::Null);
        assert_eq!(list["object"], "list", "{list}");
        list["data"]
            .as_array()
            .map(|d| d.iter().filter_map(|m| m["id"].as_str().map(str::to_string)).collect())
            .unwrap_or_default()
    };
    let for_alice = get(&app, &alice_token, "/v1/models").await?;
    let listed = ids(&for_alice);
    assert!(listed.contains(&model), "{listed:?}");
    assert!(listed.contains(&"local:shared-tiny".to_string()), "{listed:?}");
    assert!(
        !listed.iter().any(|m| m.starts_with("preset:")),
        "presets have no weights: {listed:?}"
    );
    let entry = for_alice.json()?["data"]
        .as_array()
        .and_then(|d| d.iter().find(|m| m["id"] == model.as_str()).cloned())
        .unwrap_or_default();
    assert_eq!(entry["owned_by"], "alice", "{entry}");
    assert_eq!(entry["object"], "model", "{entry}");
    let for_bob = ids(&get(&app, &bob_token, "/v1/models").await?);
    assert!(!for_bob.iter().any(|m| m.starts_with("job-")), "{for_bob:?}");
    assert!(for_bob.contains(&"local:shared-tiny".to_string()), "{for_bob:?}");
    assert!(ids(&get(&app, &admin_token, "/v1/models").await?).contains(&model));
    let one = get(&app, &alice_token, &format!("/v1/models/{model}")).await?;
    assert_eq!(one.status, StatusCode::OK, "{}", one.text());
    assert_eq!(one.json()?["id"], model.as_str());

    // Another user's checkpoint answers exactly like one that does not exist.
    let body = |m: &str| json!({"model": m, "prompt": "Hello", "max_tokens": 2});
    for (token, m) in [
        (&bob_token, model.as_str()),
        (&alice_token, "job-9999/final"),
        (&alice_token, &format!("job-{id}/nope")),
        (&alice_token, &format!("job-{id}/../final")),
        (&alice_token, "local:nope"),
        (&alice_token, "preset:tiny"),
        (&alice_token, "gpt-4o"),
    ] {
        let reply = post(&app, token, "/v1/completions", body(m)).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{m}: {}", reply.text());
        let (message, kind, param, code) = openai_error(&reply);
        assert_eq!(
            (kind.as_str(), &param, &code),
            ("invalid_request_error", &json!("model"), &json!("model_not_found")),
            "{m}"
        );
        assert!(message.contains(m), "{message}");
        let chat = json!({"model": m, "messages": [{"role": "user", "content": "Hi"}]});
        let reply = post(&app, token, "/v1/chat/completions", chat).await?;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{m}: {}", reply.text());
        assert_eq!(openai_error(&reply).2, "model");
    }
    let reply = get(&app, &bob_token, &format!("/v1/models/{model}")).await?;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text());
    let by_admin = post(&app, &admin_token, "/v1/completions", body(&model)).await?;
    assert_eq!(by_admin.status, StatusCode::OK, "{}", by_admin.text());

    // Bad input: a 400 naming the field (most before any model work; the prompt's length and
    // max_tokens against the context once the model is loaded).
    let long_prompt = "lorem ipsum dolor sit amet ".repeat(1500);
    let completion = |extra: Value| {
        let mut body = json!({"model": model, "prompt": "Hello", "max_tokens": 4});
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            if v.is_null() {
                body.as_object_mut().map(|b| b.remove(&k));
            } else {
                body[k] = v;
            }
        }
        body
    };
    for (extra, param, words) in [
        (json!({"n": 2}), "n", "only n=1"),
        (json!({"best_of": 3}), "best_of", "only best_of=1"),
        (json!({"max_tokens": 1_000_000_000u64}), "max_tokens", "0 to 4096"),
        (json!({"max_tokens": -1}), "max_tokens", "max_tokens"),
        (json!({"max_tokens": "ten"}), "max_tokens", "invalid type"),
        (json!({"max_tokens": 4000}), "max_tokens", "at most"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop", "at most 4"),
        (json!({"stop": [""]}), "stop", "empty"),
        (json!({"stop": 7}), "stop", "invalid type"),
        (json!({"temperature": "hot"}), "temperature", "invalid type"),
        (json!({"temperature": 3.0}), "temperature", "0 to 2"),
        (json!({"top_p": 0.0}), "top_p", "more than 0"),
        (json!({"echo": "yes"}), "echo", "invalid type"),
        (json!({"logprobs": 6}), "logprobs", "0 to 5"),
        (json!({"logprobs": true}), "logprobs", "invalid type"),
        (json!({"seed": "x"}), "seed", "invalid type"),
        (json!({"presence_penalty": 0.5}), "presence_penalty", "not supported"),
        (json!({"logit_bias": {"12": 5}}), "logit_bias", "not supported"),
        (json!({"stream": "yes"}), "stream", "invalid type"),
        (json!({"stream": true, "logprobs": 1}), "logprobs", "stream"),
        (json!({"stream": true, "prompt": ["a", "b"]}), "prompt", "one prompt"),
        (json!({"prompt": null}), "prompt", "required"),
        (json!({"prompt": 5}), "prompt", "a string"),
        (json!({"prompt": []}), "prompt", "empty"),
        (json!({"prompt": [[1, 2], [3, -4]]}), "prompt", "token ids"),
        (json!({"prompt": [99999]}), "prompt", "vocabulary"),
        (json!({"prompt": ""}), "prompt", "empty"),
        (json!({"prompt": long_prompt}), "prompt", "reads at most 2048"),
        (json!({"model": null}), "model", "required"),
        (json!({"model": 12}), "model", "invalid type"),
    ] {
        let sent = completion(extra.clone());
        let reply = post(&app, &alice_token, "/v1/completions", sent).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{extra}: {}", reply.text());
        let (message, kind, got, _) = openai_error(&reply);
        assert_eq!(kind, "invalid_request_error", "{extra}");
        assert_eq!(got, param, "{extra}: {message}");
        assert!(message.contains(words), "{extra}: {message}");
    }
    let chat = |extra: Value| {
        let mut body = json!({"model": model, "messages": [{"role": "user", "content": "Hi"}]});
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            body[k] = v;
        }
        body
    };
    for (extra, param) in [
        (json!({"messages": []}), "messages"),
        (json!({"messages": "Hi"}), "messages"),
        (json!({"messages": [{"role": "tool", "content": "x"}]}), "messages[0].role"),
        (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0]",
        ),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_completion_tokens": 100_000}), "max_completion_tokens"),
        (json!({"n": 4}), "n"),
        (json!({"tools": [{"type": "function"}]}), "tools"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"logprobs": true, "stream": true}), "logprobs"),
        (json!({"response_format": {"type": "json_object"}}), "response_format"),
        (json!({"stream_options": {"include_usage": "yes"}}), "stream_options.include_usage"),
    ] {
        let reply = post(&app, &alice_token, "/v1/chat/completions", chat(extra.clone())).await?;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{extra}: {}", reply.text());
        assert_eq!(openai_error(&reply).2, param, "{extra}: {}", reply.text());
    }
    // Not JSON, or not an object: 400 in the same shape.
    let request = axum::http::Request::builder()
        .method(Method::POST)
        .uri("/v1/completions")
        .header(header::AUTHORIZATION, format!("Bearer {alice_token}"))
        .body(axum::body::Body::from("{not json"))?;
    let reply = app.client().send(request).await?;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert!(openai_error(&reply).0.contains("not valid JSON"));

    // Unknown fields are ignored, as OpenAI's clients send many.
    let extra =
        json!({"user": "x", "frequency_penalty": 0, "logit_bias": {}, "some_future_field": [1]});
    let reply = post(&app, &alice_token, "/v1/completions", completion(extra)).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_echo_the_models_own_log_probabilities_and_chat_streams() -> anyhow::Result<()>
{
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let id = trained(&alice).await?;
    let model = format!("job-{id}/final");
    let (_, token) = make_token(&alice, "eval").await?;
    let generator = Generator::load_dir(&final_dir(&app, id))?;
    let tokenizer = generator.tokenizer().expect("the checkpoint has a tokenizer");
    let vocab = generator.spec().vocab;

    // Echo with max_tokens 0: the prompt scored, the first token's log-probability null, every
    // other the log-softmax of the forward's row before it.
    let prompt = "The quick brown fox jumps over the lazy dog.";
    let ids = tokenizer.encode(prompt)?.ids;
    let rows = generator.logits(&mut generator.cache(), &ids)?;
    let body =
        json!({"model": model, "prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2});
    let reply = post(&app, &token, "/v1/completions", body).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let answer = reply.json()?;
    assert_eq!(answer["object"], "text_completion", "{answer}");
    assert!(answer["id"].as_str().is_some_and(|i| i.starts_with("cmpl-")), "{answer}");
    let choice = &answer["choices"][0];
    assert_eq!(choice["text"], prompt);
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": ids.len(), "completion_tokens": 0, "total_tokens": ids.len()})
    );
    let logprobs = &choice["logprobs"];
    let tokens = logprobs["tokens"].as_array().cloned().unwrap_or_default();
    let scored = logprobs["token_logprobs"].as_array().cloned().unwrap_or_default();
    let tops = logprobs["top_logprobs"].as_array().cloned().unwrap_or_default();
    let offsets = logprobs["text_offset"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        (tokens.len(), scored.len(), tops.len(), offsets.len()),
        (ids.len(), ids.len(), ids.len(), ids.len())
    );
    assert!(scored[0].is_null() && tops[0].is_null(), "{logprobs}");
    assert_eq!(offsets[0], 0);
    let joined: String = tokens.iter().filter_map(Value::as_str).collect();
    assert_eq!(joined, prompt, "byte-level tokens of ASCII text join to it");
    for t in 1..ids.len() {
        let expected = log_softmax(&rows[(t - 1) * vocab..t * vocab]);
        let got = scored[t].as_f64().unwrap_or(f64::NAN);
        // The same CPU forward; only the thread count of its reductions may differ.
        assert!(
            (got - expected[ids[t] as usize]).abs() < 1e-4,
            "token {t}: {got} vs {}",
            expected[ids[t] as usize]
        );
        let top = tops[t].as_object().cloned().unwrap_or_default();
        assert!((1..=2).contains(&top.len()), "{top:?}");
        let best = expected.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let top_best = top.values().filter_map(Value::as_f64).fold(f64::NEG_INFINITY, f64::max);
        assert!((top_best - best).abs() < 1e-4, "token {t}: top {top_best} vs {best}");
        assert!(offsets[t].as_u64() > offsets[t - 1].as_u64(), "{offsets:?}");
    }

    // lm-eval's loglikelihood request: token ids, echo, max_tokens 1, logprobs 1; one choice
    // per prompt in order, each the prompt's scores then the one new token.
    let body = json!({
        "model": model, "prompt": [ids.clone(), "Hello there", ids[..3].to_vec()],
        "max_tokens": 1, "echo": true, "logprobs": 1, "temperature": 0, "seed": 1234,
    });
    let reply = post(&app, &token, "/v1/completions", body).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let answer = reply.json()?;
    let choices = answer["choices"].as_array().cloned().unwrap_or_default();
    assert_eq!(choices.len(), 3, "{answer}");
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
    }
    let first = choices[0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap_or_default();
    assert_eq!(first.len(), ids.len() + 1, "{}", choices[0]);
    for t in 1..ids.len() {
        let (a, b) = (first[t].as_f64().unwrap_or(f64::NAN), scored[t].as_f64().unwrap_or(0.0));
        assert!((a - b).abs() < 1e-5, "token {t}: {a} vs {b}");
    }
    let (greedy_lp, greedy_top) =
        (first[ids.len()].as_f64(), choices[0]["logprobs"]["top_logprobs"][ids.len()].clone());
    let greedy_top: Vec<f64> = greedy_top
        .as_object()
        .map(|m| m.values().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    assert_eq!(Some(greedy_top[0]), greedy_lp, "a greedy token is the top one");
    let head = tokenizer.decode(&ids[..3])?;
    assert!(choices[2]["text"].as_str().is_some_and(|t| t.starts_with(&head)), "{}", choices[2]);

    // Greedy continuation: what the engine's own generate gives.
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0});
    let reply = post(&app, &token, "/v1/completions", body).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let answer = reply.json()?;
    let text = answer["choices"][0]["text"].as_str().unwrap_or_default().to_string();
    let made = generator.generate(&ids, &GenerateOptions::greedy(12), &mut |_| true)?;
    assert_eq!(text, tokenizer.decode(&made.ids)?, "{answer}");
    let finish = if made.stopped_at_eos { "stop" } else { "length" };
    assert_eq!(answer["choices"][0]["finish_reason"], finish);
    assert_eq!(answer["usage"]["completion_tokens"], made.ids.len());

    // A stop sequence cuts the text where it first appears, and is not included.
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 6 {
        let stop: String = chars[3..5].iter().collect();
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop.clone(), "\u{1F600}"]});
        let cut = post(&app, &token, "/v1/completions", body).await?.json()?;
        let at = text.find(&stop).unwrap_or(text.len());
        assert_eq!(cut["choices"][0]["text"], &text[..at], "stop {stop:?}: {cut}");
        assert_eq!(cut["choices"][0]["finish_reason"], "stop", "{cut}");
    }

    // A seed reproduces a sampled answer.
    let sampled = json!({"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 7});
    let one = post(&app, &token, "/v1/completions", sampled.clone()).await?.json()?;
    let two = post(&app, &token, "/v1/completions", sampled).await?.json()?;
    assert_eq!(one["choices"][0]["text"], two["choices"][0]["text"]);

    // Chat: the conversation through the checkpoint's chat template, greedy.
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "How are "}, {"type": "text", "text": "you?"}]},
    ]);
    let body = json!({"model": model, "messages": messages, "max_tokens": 10, "temperature": 0});
    let reply = post(&app, &token, "/v1/chat/completions", body.clone()).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let answer = reply.json()?;
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    let message = &answer["choices"][0]["message"];
    assert_eq!(message["role"], "assistant");
    let content = message["content"].as_str().unwrap_or_default().to_string();
    let turns = [
        sluice_engine::data::Message::new(sluice_engine::data::Role::System, "Be brief."),
        sluice_engine::data::Message::new(sluice_engine::data::Role::User, "How are you?"),
    ];
    let chat_ids = generator.chat_ids(&turns)?;
    assert_eq!(answer["usage"]["prompt_tokens"], chat_ids.len(), "{answer}");
    let made = generator.generate(&chat_ids, &GenerateOptions::greedy(10), &mut |_| true)?;
    assert_eq!(content, tokenizer.decode(&made.ids)?);

    // Chat log-probabilities: one entry per new token, with the alternatives asked for.
    let mut with_logprobs = body.clone();
    with_logprobs["logprobs"] = json!(true);
    with_logprobs["top_logprobs"] = json!(3);
    let answer = post(&app, &token, "/v1/chat/completions", with_logprobs).await?.json()?;
    let entries =
        answer["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default();
    assert!(entries.len() >= made.ids.len(), "{answer}");
    for entry in &entries {
        assert!(entry["logprob"].as_f64().is_some_and(|l| l <= 0.0), "{entry}");
        assert_eq!(entry["top_logprobs"].as_array().map(Vec::len), Some(3), "{entry}");
        assert_eq!(
            entry["top_logprobs"][0]["logprob"], entry["logprob"],
            "greedy picks the top: {entry}"
        );
    }

    // Streamed: a role chunk, the content in pieces, the finish, usage when asked, [DONE].
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let reply = post(&app, &token, "/v1/chat/completions", streamed).await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(reply.header(header::CONTENT_TYPE).starts_with("text/event-stream"));
    let data = sse_data(&reply.text());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d)).collect::<Result<_, _>>()?;
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"), "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let joined: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(joined, content);
    let finishes: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finishes, vec![&json!(if made.stopped_at_eos { "stop" } else { "length" })]);
    let usage = &chunks.last().map(|c| c["usage"].clone()).unwrap_or_default();
    assert_eq!(usage["completion_tokens"], made.ids.len(), "{chunks:?}");
    assert_eq!(usage["prompt_tokens"], chat_ids.len());

    // A streamed completion echoes, then continues: the same text as unstreamed.
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "echo": true, "stream": true});
    let reply = post(&app, &token, "/v1/completions", body).await?;
    let data = sse_data(&reply.text());
    let joined: String = data
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(joined, format!("{prompt}{text}"), "{data:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn training_comes_first() -> anyhow::Result<()> {
    let app = TestApp::new().await?;
    let admin = app.admin().await?;
    let alice = app.user(&admin, "alice").await?;
    let id = trained(&alice).await?;
    let model = format!("job-{id}/final");
    let (_, token) = make_token(&alice, "eval").await?;
    let demo = alice.demo_dataset().await?;

    // A long request (many long prompts, scored) is running when a job is queued for its
    // device, the CPU: it stops with 503 at the next forward, and the job starts.
    let ids: Vec<u32> = (0..1900u32).map(|i| 3 + (i * 37) % 2000).collect();
    let heavy = json!({"model": model, "prompt": vec![ids; 64], "max_tokens": 0, "echo": true, "logprobs": 5});
    let request = {
        let app_state = app.state.clone();
        let token = token.clone();
        tokio::spawn(async move {
            let client = Client { state: app_state, cookie: None, csrf: None };
            let request = axum::http::Request::builder()
                .method(Method::POST)
                .uri("/v1/completions")
                .header(header::AUTHORIZATION, format!("Bearer {token}"))
                .header(header::CONTENT_TYPE, "application/json")
                .body(axum::body::Body::from(heavy.to_string()))?;
            let started = Instant::now();
            let reply = client.send(request).await?;
            anyhow::Ok((reply, started.elapsed()))
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let queued_at = Instant::now();
    let long = alice.submit(tiny_job(demo, 100_000)).await?;
    let (reply, took) = request.await??;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "after {took:?}: {}", reply.text());
    let (message, kind, _, code) = openai_error(&reply);
    assert!(message.contains("training job is waiting for cpu"), "{message}");
    assert_eq!((kind.as_str(), code), ("server_error", json!("device_busy")));
    assert!(reply.header(header::RETRY_AFTER).parse::<u64>().is_ok_and(|s| s >= 1));
    alice.wait_job(long, 120, |j| j["status"] == "running").await?;
    assert!(
        queued_at.elapsed() < Duration::from_secs(60),
        "the job waited {:?}",
        queued_at.elapsed()
    );

    // While it trains on the only device, requests are refused at once with Retry-After, and
    // the job goes on.
    let step_before = alice.get(&format!("/api/jobs/{long}")).await?.json()?["step"].as_i64();
    for (path, body) in [
        ("/v1/completions", json!({"model": model, "prompt": "Hello", "max_tokens": 4})),
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": true}),
        ),
    ] {
        let reply = post(&app, &token, path, body).await?;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{path}: {}", reply.text());
        let (message, _, _, code) = openai_error(&reply);
        assert!(message.contains(&format!("training job {long}")), "{message}");
        assert_eq!(code, "device_busy");
        let retry = reply.header(header::RETRY_AFTER).parse::<u64>().unwrap_or(0);
        assert!((10..=600).contains(&retry), "Retry-After {retry}");
    }
    let job = alice
        .wait_job(long, 120, |j| j["status"] == "running" && j["step"].as_i64() > step_before)
        .await?;
    assert_eq!(job["status"], "running");
    let cancel = alice.post(&format!("/api/jobs/{long}/cancel"), json!({})).await?;
    assert!(cancel.status.is_success(), "{}", cancel.text());
    alice.wait_job(long, 120, |j| j["status"] == "cancelled").await?;
    let after = post(
        &app,
        &token,
        "/v1/completions",
        json!({"model": model, "prompt": "Hello", "max_tokens": 2}),
    )
    .await?;
    assert_eq!(after.status, StatusCode::OK, "{}", after.text());
    Ok(())
}
