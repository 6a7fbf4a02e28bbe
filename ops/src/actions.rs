//! The status page's actions (docs/design.md#status-page): pause, resume and trigger a job from
//! the page. Each is a `POST /actions/{action}/{job}` that needs the API's bearer token (the
//! variable `[api] token_env` names; unset: no actions, the page stays read-only) and must come
//! from the page's own origin (`Origin` naming the `Host` asked, and `Sec-Fetch-Site`, when
//! sent, `same-origin`): another site's page cannot make a browser act, even with the token
//! typed in once. Nothing acts on `GET`.

use crate::{adhoc, operate};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use chrono::Utc;
use drumline_shared::config::Config;
use drumline_shared::dlq;
use drumline_shared::names::Names;
use drumline_shared::store::{Store, StoreError};
use std::sync::{Arc, RwLock};
use tokio::sync::OnceCell;

/// What an action needs: the token to expect and how to reach the config and Redis now.
#[derive(Clone)]
pub(crate) struct Actions {
    /// `Bearer T`, as the `Authorization` header must read.
    expected: Arc<str>,
}

impl Actions {
    /// The actions for `config`, when the variable `[api] token_env` names holds a token.
    pub(crate) fn of(config: &Config) -> Option<Self> {
        let token = std::env::var(&config.api.token_env).ok()?;
        (!token.is_empty()).then(|| Actions {
            expected: format!("Bearer {token}").into(),
        })
    }

    /// `Err` with the answer when `headers` lack the token (401) or do not come from the
    /// page's own origin (403).
    fn admit(&self, headers: &HeaderMap) -> Result<(), (StatusCode, &'static str)> {
        let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        if authorization != Some(self.expected.as_bytes()) {
            return Err((StatusCode::UNAUTHORIZED, "the API token is needed"));
        }
        if !same_origin(headers) {
            return Err((StatusCode::FORBIDDEN, "only from the status page itself"));
        }
        Ok(())
    }
}

/// Whether the request comes from a page of the origin it was sent to.
fn same_origin(headers: &HeaderMap) -> bool {
    let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let site_ok = text(header::HeaderName::from_static("sec-fetch-site"))
        .is_none_or(|site| site == "same-origin");
    let origin = text(header::ORIGIN).and_then(|o| o.strip_prefix("http://"));
    site_ok && origin.is_some() && origin == text(header::HOST)
}

fn refuse(code: StatusCode, why: &str) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        why.to_owned(),
    )
        .into_response()
}

/// What the action handlers share with the page: its config (replaced on SIGHUP) and its
/// Redis connection.
#[derive(Clone)]
struct Acting {
    actions: Actions,
    config: Arc<RwLock<Arc<Config>>>,
    store: Arc<OnceCell<Store>>,
}

impl Acting {
    /// The config now, for a request [`Actions::admit`] lets through.
    fn admitted(&self, headers: &HeaderMap) -> Result<Arc<Config>, (StatusCode, &'static str)> {
        self.actions.admit(headers)?;
        Ok(self.config.read().expect("page config lock").clone())
    }
}

/// What an action did, as its answer: 200 with what it says, 503 with why it could not.
fn answer(done: Result<String, String>) -> Response {
    match done {
        Ok(said) => {
            tracing::info!(said, "status page action");
            (StatusCode::OK, said).into_response()
        }
        Err(e) => refuse(StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}

/// The routes `POST /actions/{pause|resume|trigger}/{job}` on the page's `config` and `store`.
pub(crate) fn routes<S>(
    actions: Actions,
    config: Arc<RwLock<Arc<Config>>>,
    store: Arc<OnceCell<Store>>,
) -> Router<S> {
    let acting = Acting {
        actions,
        config,
        store,
    };
    Router::new()
        .route("/actions/dead-letters/{what}", post(dead_letters))
        .route("/actions/{action}/{job}", post(act))
        .with_state(acting)
}

/// The page's Redis connection, made at the first use (and tried again at the next one if
/// that failed).
pub(crate) async fn connected<'s>(
    cell: &'s OnceCell<Store>,
    config: &Config,
) -> Result<&'s Store, StoreError> {
    cell.get_or_try_init(|| {
        let names = Names::new(config.namespace.clone());
        Store::connect(&config.redis_url, config.redis_ca_file.as_deref(), names)
    })
    .await
}

async fn act(
    State(acting): State<Acting>,
    Path((action, job)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let config = match acting.admitted(&headers) {
        Ok(config) => config,
        Err((code, why)) => return refuse(code, why),
    };
    let Some(job) = config.job(&job) else {
        return refuse(StatusCode::NOT_FOUND, "no such job");
    };
    let name = job.name.clone();
    let done = match action.as_str() {
        "pause" | "resume" => {
            let pause = action == "pause";
            let paused = async {
                let store = connected(&acting.store, &config).await?;
                store.set_paused(&[name.as_str()], pause).await
            };
            paused
                .await
                .map(|_| format!("{action}d {name}"))
                .map_err(|e| format!("redis: {e}"))
        }
        "trigger" => {
            let env = operate::trigger(job, None, Utc::now());
            adhoc::publish(&config, &env)
                .await
                .map(|()| format!("triggered {name} key={}", env.key))
                .map_err(|e| e.to_string())
        }
        _ => return refuse(StatusCode::NOT_FOUND, "no such action"),
    };
    answer(done)
}

/// `POST /actions/dead-letters/{replay|purge}`: every dead letter replayed (a fresh copy each,
/// as `dlq replay --all`) or purged (as `dlq purge --yes`).
async fn dead_letters(
    State(acting): State<Acting>,
    Path(what): Path<String>,
    headers: HeaderMap,
) -> Response {
    let config = match acting.admitted(&headers) {
        Ok(config) => config,
        Err((code, why)) => return refuse(code, why),
    };
    let done = match what.as_str() {
        "replay" => replay_all(&config, &acting.store).await,
        "purge" => dlq::purge(&config)
            .await
            .map(|n| format!("purged {n} dead letters"))
            .map_err(|e| e.to_string()),
        _ => return refuse(StatusCode::NOT_FOUND, "no such action"),
    };
    answer(done)
}

/// Replays every dead letter; says how many.
async fn replay_all(config: &Config, store: &OnceCell<Store>) -> Result<String, String> {
    let store = connected(store, config)
        .await
        .map_err(|e| format!("redis: {e}"))?;
    let queue = dlq::DeadQueue::open(config)
        .await
        .map_err(|e| e.to_string())?;
    let replayed = queue.replay(store, &[]).await;
    queue.close().await;
    let (done, refused) = replayed.map_err(|e| e.to_string())?;
    Ok(format!(
        "replayed {} dead letters ({} not replayable)",
        done.len(),
        refused.len()
    ))
}

/// The buttons beside the dead-letter count: replay all, purge (after a confirmation).
pub(crate) const DEAD_LETTER_BUTTONS: &str = " <button data-action=\"dead-letters\" \
data-job=\"replay\">replay all</button> <button data-action=\"dead-letters\" data-job=\"purge\" \
data-confirm=\"Delete every dead letter for good?\">purge</button>";

/// The page's part of the actions: a field for the token (kept for the tab in
/// `sessionStorage`, never in the page or the URL), the outcome of the last action, and the
/// script that sends a button's action.
pub(crate) const CONTROLS: &str = "<p id=\"actions\"><label>API token \
<input type=\"password\" id=\"api-token\" autocomplete=\"off\"></label> \
<span id=\"action-result\"></span></p>\n<script>\n\
const tokenField = document.getElementById('api-token');\n\
tokenField.value = sessionStorage.getItem('drumline-token') || '';\n\
document.addEventListener('click', async (event) => {\n\
  const button = event.target.closest('button[data-action]');\n\
  if (!button) return;\n\
  if (button.dataset.confirm && !confirm(button.dataset.confirm)) return;\n\
  sessionStorage.setItem('drumline-token', tokenField.value);\n\
  const answer = await fetch('/actions/' + button.dataset.action + '/' +\n\
    encodeURIComponent(button.dataset.job),\n\
    {method: 'POST', headers: {Authorization: 'Bearer ' + tokenField.value}});\n\
  const said = await answer.text();\n\
  document.getElementById('action-result').textContent =\n\
    answer.ok ? said : 'refused (' + answer.status + '): ' + said;\n\
});\n</script>\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().expect("a header value"));
        }
        map
    }

    fn actions() -> Actions {
        Actions {
            expected: "Bearer t0k".into(),
        }
    }

    #[test]
    fn an_action_needs_the_token_and_the_pages_own_origin() {
        let ours = [
            ("host", "127.0.0.1:9464"),
            ("origin", "http://127.0.0.1:9464"),
        ];
        let with = |extra: &[(&'static str, &str)]| {
            let mut all = ours.to_vec();
            all.extend_from_slice(extra);
            actions().admit(&headers(&all)).map_err(|(code, _)| code)
        };
        assert_eq!(with(&[("authorization", "Bearer t0k")]), Ok(()));
        let same_site = ("sec-fetch-site", "same-origin");
        assert_eq!(with(&[("authorization", "Bearer t0k"), same_site]), Ok(()));
        assert_eq!(with(&[]), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(
            with(&[("authorization", "Bearer no")]),
            Err(StatusCode::UNAUTHORIZED)
        );
        let cross = ("sec-fetch-site", "cross-site");
        assert_eq!(
            with(&[("authorization", "Bearer t0k"), cross]),
            Err(StatusCode::FORBIDDEN)
        );
        let elsewhere = [
            ("host", "127.0.0.1:9464"),
            ("origin", "http://evil.example"),
            ("authorization", "Bearer t0k"),
        ];
        let refused = actions().admit(&headers(&elsewhere)).map_err(|(c, _)| c);
        assert_eq!(refused, Err(StatusCode::FORBIDDEN));
        let no_origin = [("host", "127.0.0.1:9464"), ("authorization", "Bearer t0k")];
        let refused = actions().admit(&headers(&no_origin)).map_err(|(c, _)| c);
        assert_eq!(refused, Err(StatusCode::FORBIDDEN));
    }
}
